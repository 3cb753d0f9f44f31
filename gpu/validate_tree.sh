#!/usr/bin/env bash
# Process trees on a real GPU (issue 12): torchrun and a multiprocessing `spawn` worker, each
# under `gpu-observer run` (CUPTI: every worker kernel joined) and under `--pid LAUNCHER`
# (uprobes: phase A exact, phase B against torch.profiler); then what following a tree costs
# an unrelated process (launch_bench) when a tree member maps the same libcuda.
#
# usage (root, repo root): OBSERVER=.gpu-bundle/gpu-observer gpu/validate_tree.sh OUTDIR
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUTDIR=${1:-/tmp/gpu-tree}
OBS=${OBSERVER:-.gpu-bundle/gpu-observer}
PY=${PYTHON:-python3}
W=$(mktemp -d /tmp/gpu-tree-work.XXXXXX)
mkdir -p "$OUTDIR"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
REPORT="$OUTDIR/TREE.md"
: >"$REPORT"
note() { echo "$*" | tee -a "$REPORT"; }
fail=0
TL=(--n 300 --m 10)

run_mode() { # NAME CMD...  (CUPTI joins)
    local name=$1; shift
    "$OBS" --format jsonl --trace-all --no-nvml --output "$W/$name.jsonl" run -- "$@" "$W/$name.json" \
        >"$W/$name.out" 2>"$W/$name.err"
    local rc=$?
    "$PY" -m gpucheck.compare_cupti --workload "$W/$name.json" --events "$W/$name.jsonl" --name "$name" \
        --tolerance-ns 5000 --section-out "$W/$name.md" >"$W/$name.cmp" 2>&1
    local crc=$?
    note "== $name: observer rc=$rc, compare_cupti rc=$crc"
    grep -E "^   (gpu_kernel|joined|summary cupti.kernels|gpu_memcpy = )" "$W/$name.cmp" | head -8 | tee -a "$REPORT"
    grep -c '"type":"summary","scope":"process"' "$W/$name.jsonl" | sed 's/^/   process summaries: /' | tee -a "$REPORT"
    ((rc == 0 && crc == 0)) || fail=1
}

pid_mode() { # NAME CMD...  (uprobes, --pid of the launcher attached as it starts)
    local name=$1; shift
    "$@" "$W/$name.json" >"$W/$name.out" 2>&1 &
    local lp=$!
    "$OBS" --format jsonl --trace-all --no-nvml --output "$W/$name.jsonl" --pid "$lp" 2>"$W/$name.err" &
    local op=$!
    wait "$lp"; local rc=$?
    # The observer ends by itself with the tree's last process.
    local t=0; while kill -0 "$op" 2>/dev/null && ((t < 60)); do sleep 1; t=$((t + 1)); done
    kill -INT "$op" 2>/dev/null; wait "$op"; local orc=$?
    "$PY" -m gpucheck.compare --workload "$W/$name.json" --events "$W/$name.jsonl" --name "$name" \
        --section-out "$W/$name.md" >"$W/$name.cmp" 2>&1
    local crc=$?
    note "== $name: workload rc=$rc, observer rc=$orc (ended by itself after ${t}s), compare rc=$crc"
    grep -E "launches|htod|dtoh|phase" "$W/$name.cmp" | head -10 | tee -a "$REPORT"
    grep -E "following|exited|descendants" "$W/$name.err" | head -4 | sed 's/^/   /' | tee -a "$REPORT"
    ((rc == 0 && crc == 0)) || fail=1
}

# torchrun's own parser would take torch_loop's options: they go through the environment.
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1 "$HERE/workloads/env_args.py")
TORCH_LOOP_ARGS="${TL[*]} --no-profiler" run_mode torchrun_run "${TORCHRUN[@]}"
TORCH_LOOP_ARGS="${TL[*]}" pid_mode torchrun_pid "${TORCHRUN[@]}"
run_mode mpspawn_run "$PY" "$HERE/workloads/mp_spawn.py" "${TL[@]}" --no-profiler
pid_mode mpspawn_pid "$PY" "$HERE/workloads/mp_spawn.py" "${TL[@]}"

# Cost on an unrelated process: launch_bench alone; beside a followed tree whose member maps
# the same libcuda (links for every process); beside --no-children (pid-scoped links).
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
"$NVCC" -O2 -arch=sm_90 -cudart static -o "$W/launch_bench" "$HERE/workloads/launch_bench.cu" >"$W/nvcc.log" 2>&1 || {
    note "launch_bench build failed"; exit 1; }
holder() { "$PY" -c 'import ctypes,time; c=ctypes.CDLL("libcuda.so.1"); c.cuInit(0); print("ok", flush=True); time.sleep(600)' ; }
bench() { taskset -c 2 "$W/launch_bench" 200000 5 "$W/$1.json" >"$W/$1.log" 2>&1; "$PY" -c "import json;d=json.load(open('$W/$1.json'));print('$1', d['ns_per_launch_median'])" | tee -a "$REPORT"; }
note "== cost on an unrelated process (launch_bench, ns per launch, median of 5 rounds of 200000)"
bench base1
for mode in tree one tree one; do
    holder >"$W/holder.$mode" 2>&1 & hp=$!
    sleep 2
    extra=(); [[ $mode == one ]] && extra=(--no-children)
    "$OBS" --format jsonl --output "$W/obs.$mode.jsonl" --no-nvml --pid "$hp" "${extra[@]}" 2>"$W/obs.$mode.err" &
    op=$!
    sleep 4
    bench "with_$mode"
    kill -INT "$op"; wait "$op"; kill "$hp"; wait "$hp" 2>/dev/null
    grep -E "attached" "$W/obs.$mode.err" | head -2 | sed 's/^/   /' | tee -a "$REPORT"
done
bench base2
tar czf "$OUTDIR/tree-artifacts.tar.gz" -C "$W" . 2>/dev/null
((fail)) && note "TREE VALIDATION FAILED" || note "TREE VALIDATION PASSED"
