#!/usr/bin/env bash
# Diagnosis of the bimodal always-on cost: modes x rounds, rotated; one JSON line per run.
set -u
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/out18}; mkdir -p "$O"
OBS=$PWD/.gpu-bundle/gpu-observer
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-3000}
MODES=(${MODES:-base floor obs_file obs_null base_pin obs_far obs_near})
LIB=$(readlink -f /usr/local/nvidia/lib64/libcuda.so.1)
{ lscpu -e; nproc; uname -r; command -v perf bpftool; cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null; } > "$O/env.txt" 2>&1
python3 .exp18/floor.py off
obs_stats() { # pid -> per-thread cpu ticks and switches
    local p=$1 t
    for t in /proc/$p/task/*; do
        printf '%s %s %s\n' "$(cat $t/comm)" "$(awk '{print $14+$15, $39}' $t/stat)" "$(grep -h ctxt $t/status | awk '{printf "%s ", $2}')"
    done | tr '\n' ';'
}
run_one() { # mode round
    local m=$1 r=$2 pin="" obspin="" dest="" res obsinfo=""
    case $m in base_pin|obs_far|obs_near) pin="taskset -c 2";; esac
    case $m in obs_far) obspin="taskset -c 8-15";; obs_near) obspin="taskset -c 2";; esac
    case $m in obs_file) dest=$O/obs-$r.jsonl;; obs_null|obs_far|obs_near) dest=/dev/null;; esac
    if [[ $m == floor ]]; then python3 .exp18/floor.py on "$LIB" .exp18/probes.txt >"$O/floor-$r.txt" 2>&1; fi
    if [[ -n $dest ]]; then
        $obspin "$OBS" --format jsonl --output "$dest" 2>"$O/$m-$r.err" & OP=$!
        for i in $(seq 100); do grep -q "gpu-observer: ready" "$O/$m-$r.err" && break; sleep 0.1; done
    fi
    res=$(timeout 120 $pin python3 .exp18/mlp.py "$STEPS" 2>"$O/$m-$r.py.err")
    if [[ -n $dest ]]; then obsinfo=$(obs_stats $OP); kill -INT $OP; wait $OP; fi
    [[ $m == floor ]] && python3 .exp18/floor.py off
    echo "{\"mode\":\"$m\",\"round\":$r,\"res\":${res:-null},\"obs\":\"$obsinfo\"}" | tee -a "$O/runs.jsonl"
}
for ((r=0; r<ROUNDS; r++)); do
    n=${#MODES[@]}
    for ((k=0; k<n; k++)); do run_one "${MODES[$(((k + r) % n))]}" "$r"; done
done
rm -f "$O"/obs-*.jsonl
