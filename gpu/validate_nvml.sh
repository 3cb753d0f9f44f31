#!/usr/bin/env bash
# Real-GPU validation of gpu-observer's NVML sampling: `gpu-observer devices` against
# nvidia-smi, then the observer in all-process mode (--format jsonl --duration,
# --nvml-interval-ms) while gpu/workloads/nvml_alloc.py holds a known allocation and runs
# matmuls on every GPU, with nvidia-smi memory captures in parallel (device and per-process
# memory within 1 MiB, attribution to the right GPU, utilization, sample interval, sampler
# cost); and an idle run (no workload) for the sampler's own cost.  The comparisons are in
# gpu/gpucheck/compare_nvml.py.
#
# usage (as root, from the repo root; ~1 minute, at most BUDGET_S=170 s):
#   OBSERVER=.gpu-bundle/gpu-observer GIT_COMMIT=$(git rev-parse HEAD) gpu/validate_nvml.sh [OUTDIR]
#
# OUTDIR defaults to $OUT if set, else /tmp/gpu-validate-nvml.  It receives three files:
#   NVML-VALIDATION.md         the report
#   nvml-results.json          env + every check + the numbers behind them
#   nvml-artifacts.tar.gz      the work dir: nvidia-smi -q / static query / captures,
#       devices JSON and table, observer JSONL (gzipped) and stderr of both runs,
#       workload ready/result JSON and logs
# The unpacked work dir stays in $WORK_DIR (default /tmp/gpu-validate-nvml-work.*).
# Exit 0 only if every strict check passed (the torch part not run counts as failed).
#
# Environment knobs: OBSERVER, GIT_COMMIT, PYTHON (python3; needs torch with CUDA for the
# workloads), NVIDIA_SMI (nvidia-smi), NVML_INTERVAL_MS (100), ACTIVE_DURATION (8 s),
# IDLE_DURATION (10 s), CAPTURE_INTERVAL (0.5 s between nvidia-smi captures), ALLOC_MIB
# (2048) and ALLOC_STEP_MIB (512): GPU i gets ALLOC_MIB + i*ALLOC_STEP_MIB, MATMUL_N (8192),
# WORKLOADS_PER_GPU (1), NVML_WORKLOAD (the workload script), WL_READY_TIMEOUT (90 s),
# READY_TIMEOUT (observer ready line, 30 s), STOP_TIMEOUT (15 s), BUDGET_S (170),
# NVML_OBS_ARGS (extra observer arguments, word-split), MIN_COMPARED (3), SKIP_TORCH=1,
# KEEP_RAW=1 (do not gzip the JSONL), WORK_DIR.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$HERE/.." && pwd)
READY_TIMEOUT=${READY_TIMEOUT:-30}
STOP_TIMEOUT=${STOP_TIMEOUT:-15}
# shellcheck source=SCRIPTDIR/lib.sh
source "$HERE/lib.sh"

OUTDIR=${1:-${OUT:-/tmp/gpu-validate-nvml}}
PYTHON=${PYTHON:-python3}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
export NVIDIA_SMI
NVML_INTERVAL_MS=${NVML_INTERVAL_MS:-100}
ACTIVE_DURATION=${ACTIVE_DURATION:-8}
IDLE_DURATION=${IDLE_DURATION:-10}
CAPTURE_INTERVAL=${CAPTURE_INTERVAL:-0.5}
ALLOC_MIB=${ALLOC_MIB:-2048}
ALLOC_STEP_MIB=${ALLOC_STEP_MIB:-512}
MATMUL_N=${MATMUL_N:-8192}
WORKLOADS_PER_GPU=${WORKLOADS_PER_GPU:-1}
NVML_WORKLOAD=${NVML_WORKLOAD:-$HERE/workloads/nvml_alloc.py}
WL_READY_TIMEOUT=${WL_READY_TIMEOUT:-90}
BUDGET_S=${BUDGET_S:-170}
MIN_COMPARED=${MIN_COMPARED:-3}
read -r -a OBS_EXTRA <<<"${NVML_OBS_ARGS:-}"

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
rm -f "$OUTDIR/NVML-VALIDATION.md" "$OUTDIR/nvml-results.json" "$OUTDIR/nvml-artifacts.tar.gz"
WORK=${WORK_DIR:-$(mktemp -d /tmp/gpu-validate-nvml-work.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
[[ $WORK != "$OUTDIR" ]] || die "WORK_DIR must differ from the output dir"

WL_PIDS=()    # the `timeout` wrappers of the workloads
CAP_PID=""    # the nvidia-smi capture loop
NOTES=()      # --note KEY=TEXT for the report

# shellcheck disable=SC2317  # run by lib.sh's EXIT trap
on_exit_hook() {
    local p i
    : >"$WORK/wl.stop" 2>/dev/null || true
    if [[ -n $CAP_PID ]] && proc_alive "$CAP_PID"; then
        kill -TERM "$CAP_PID" 2>/dev/null || true
    fi
    for ((i = 0; i < 50; i++)); do
        any_alive ${WL_PIDS[@]+"${WL_PIDS[@]}"} || break
        sleep 0.1
    done
    for p in ${WL_PIDS[@]+"${WL_PIDS[@]}"}; do
        if proc_alive "$p"; then
            warn "workload wrapper $p still running; SIGTERM"
            kill -TERM "$p" 2>/dev/null || true
        fi
    done
    [[ -f $WORK/NVML-VALIDATION.md ]] && cp -f "$WORK/NVML-VALIDATION.md" "$OUTDIR/NVML-VALIDATION.md"
    [[ -f $WORK/nvml-results.json ]] && cp -f "$WORK/nvml-results.json" "$OUTDIR/nvml-results.json"
    pack_dir "$WORK" "$OUTDIR/nvml-artifacts.tar.gz"
    local f have=""
    for f in NVML-VALIDATION.md nvml-results.json nvml-artifacts.tar.gz; do
        [[ -e $OUTDIR/$f ]] && have+="$f "
    done
    log "outputs in $OUTDIR: ${have:-none} (work dir $WORK)"
}
install_traps

# left: seconds left of BUDGET_S; tmo WANT: WANT capped by what is left (at least 1).
left() { echo $((BUDGET_S - (SECONDS - _T0))); }
tmo() {
    local want=$1 l
    l=$(left)
    ((l < want)) && want=$l
    ((want < 1)) && want=1
    echo "$want"
}

# start_nvml_observer JSONL ERRFILE DURATION: the observer in all-process mode with NVML
# sampling, in the background (OBS_PID, stopped by the EXIT trap); waits for its ready line.
start_nvml_observer() {
    local jsonl=$1 err=$2 dur=$3 rt
    rm -f "$jsonl" "$err"
    rt=$(tmo "$READY_TIMEOUT")
    set -m
    "$OBSERVER" --format jsonl --output "$jsonl" --duration "$dur" \
        --nvml-interval-ms "$NVML_INTERVAL_MS" ${OBS_EXTRA[@]+"${OBS_EXTRA[@]}"} \
        </dev/null >"${err%.err}.obs.out" 2>"$err" &
    OBS_PID=$!
    set +m
    await_ready observer "$err" "$rt" rc
}

# wait_nvml_observer TIMEOUT_S: wait for the observer to end by itself (--duration);
# after TIMEOUT_S it is stopped (SIGINT ...). Sets OBS_RC. Returns 1 if it had to be stopped.
wait_nvml_observer() {
    await_exit "$1" "observer still running $1 s after its --duration; stopping it"
}

# observe NAME DURATION [capture]: one observer run; with `capture`, nvidia-smi captures in
# parallel while it runs. Echo-free; adds a note NAME_observer=... for the report.
observe() {
    local name=$1 dur=$2 cap=${3:-} jsonl="$WORK/$1.jsonl" err="$WORK/$1.err" note w
    if (($(left) < dur + 15)); then
        NOTES+=("${name}_observer=SKIPPED (time budget)")
        warn "time budget: skipping the $name run"
        return 0
    fi
    log "=== $name: observer --duration $dur --nvml-interval-ms $NVML_INTERVAL_MS${cap:+ (nvidia-smi captures in parallel)}"
    if ! start_nvml_observer "$jsonl" "$err" "$dur"; then
        NOTES+=("${name}_observer=did not start (rc ${OBS_RC:-?}): $(tail -n 2 "$err" 2>/dev/null | tr '\n' ' ' | cut -c1-300)")
        return 0
    fi
    if [[ -n $cap ]]; then
        rm -f "$WORK/$name.capstop"
        timeout --kill-after=5 "$(tmo $((dur + 20)))" "$PYTHON" -m gpucheck.compare_nvml capture \
            --out "$WORK/$name.captures.jsonl" --duration "$((dur + 5))" --interval "$CAPTURE_INTERVAL" \
            --stop-file "$WORK/$name.capstop" >"$WORK/$name.capture.log" 2>&1 &
        CAP_PID=$!
    fi
    w=$(tmo $((dur + STOP_TIMEOUT)))
    note="ran"
    wait_nvml_observer "$w" || note="stopped by the script after $w s (did not end after --duration)"
    if [[ -n $cap ]]; then
        : >"$WORK/$name.capstop"
        wait "$CAP_PID" 2>/dev/null || warn "nvidia-smi capture loop exit status $?"
        CAP_PID=""
        cat "$WORK/$name.capture.log" 2>/dev/null || true
    fi
    note+=", exit status ${OBS_RC:-?}"
    [[ ${OBS_RC:-0} == 0 ]] || warn "observer exit status $OBS_RC"
    NOTES+=("${name}_observer=$note")
    log "$name: $(wc -l <"$jsonl" 2>/dev/null || echo 0) JSONL lines; observer: $(tail -n 1 "$err" 2>/dev/null)"
}

# ------------------------------------------------------------ preflight
log "gpu-observer NVML validation -> $OUTDIR (work dir $WORK)"
require_root
require_tools timeout grep sed tail "$PYTHON" "$NVIDIA_SMI"
resolve_observer "$REPO_ROOT"
log "observer: $OBSERVER"
"$PYTHON" -m gpucheck.make_report env --out "$WORK/env.json" --observer "$OBSERVER" \
    >"$WORK/env.log" 2>&1 || warn "environment capture failed (see env.log)"

# ------------------------------------------------------------ 1. nvidia-smi
log "=== nvidia-smi -q and --query-gpu"
timeout --kill-after=5 "$(tmo 30)" "$NVIDIA_SMI" -q >"$WORK/nvidia-smi-q.txt" 2>&1 ||
    warn "nvidia-smi -q failed (rc $?): $(tail -n 2 "$WORK/nvidia-smi-q.txt")"
timeout --kill-after=5 "$(tmo 60)" "$PYTHON" -m gpucheck.compare_nvml smi-static \
    --out "$WORK/smi_static.json" --q-text "$WORK/nvidia-smi-q.txt" ||
    warn "nvidia-smi --query-gpu gave no GPU"
GPU_LIST=()   # "index uuid" per GPU
if [[ -s $WORK/smi_static.json ]]; then
    mapfile -t GPU_LIST < <("$PYTHON" -c '
import json, sys
for g in json.load(open(sys.argv[1])).get("gpus", []):
    if g.get("index") is not None and g.get("uuid"):
        print(g["index"], g["uuid"])' "$WORK/smi_static.json")
fi
log "${#GPU_LIST[@]} GPU(s)"

# ------------------------------------------------------------ 2. devices
log "=== gpu-observer devices"
DEV_RC=0
timeout --kill-after=5 "$(tmo 30)" "$OBSERVER" devices --format json >"$WORK/devices.json" \
    2>"$WORK/devices.err" || DEV_RC=$?
DEV_TABLE_RC=0
timeout --kill-after=5 "$(tmo 30)" "$OBSERVER" devices >"$WORK/devices.txt" 2>"$WORK/devices_table.err" ||
    DEV_TABLE_RC=$?
log "devices --format json rc=$DEV_RC, devices (table) rc=$DEV_TABLE_RC"
sed 's/^/    /' "$WORK/devices.txt" 2>/dev/null | head -n 20 || true

# ------------------------------------------------------------ 4. idle run (first: no workload yet)
observe idle "$IDLE_DURATION"

# ------------------------------------------------------------ 3. workloads + run
WL_FILES=()
WL_NOTE=""
if [[ ${SKIP_TORCH:-0} == 1 ]]; then
    WL_NOTE="not run (SKIP_TORCH=1)"
elif ((${#GPU_LIST[@]} == 0)); then
    WL_NOTE="not run (nvidia-smi lists no GPU)"
else
    log "=== workloads: $WORKLOADS_PER_GPU per GPU, ${ALLOC_MIB} MiB + index*${ALLOC_STEP_MIB} MiB each, matmul $MATMUL_N"
    rm -f "$WORK/wl.stop"
    declare -a WL_READY=()
    k=0
    for g in "${GPU_LIST[@]}"; do
        idx=${g%% *}
        uuid=${g#* }
        for ((j = 0; j < WORKLOADS_PER_GPU; j++)); do
            tag="wl$k"
            k=$((k + 1))
            rm -f "$WORK/$tag.ready.json" "$WORK/$tag.result.json"
            CUDA_VISIBLE_DEVICES=$uuid CUDA_DEVICE_ORDER=PCI_BUS_ID \
                timeout --signal=TERM --kill-after=10 "$((BUDGET_S + 30))" \
                "$PYTHON" "$NVML_WORKLOAD" --device 0 --smi-index "$idx" --expect-uuid "$uuid" \
                --alloc-mib "$((ALLOC_MIB + idx * ALLOC_STEP_MIB + j * 256))" --matmul-n "$MATMUL_N" \
                --ready "$WORK/$tag.ready.json" --result "$WORK/$tag.result.json" \
                --stop-file "$WORK/wl.stop" --max-seconds "$BUDGET_S" \
                </dev/null >"$WORK/$tag.log" 2>&1 &
            WL_PIDS+=($!)
            WL_READY+=("$tag")
        done
    done
    # wait until every workload is ready (or one of them gave up)
    deadline=$((SECONDS + $(tmo "$WL_READY_TIMEOUT")))
    while :; do
        n_ready=0
        n_dead=0
        for i in "${!WL_READY[@]}"; do
            if [[ -s $WORK/${WL_READY[$i]}.ready.json ]]; then
                n_ready=$((n_ready + 1))
            elif ! proc_alive "${WL_PIDS[$i]}"; then
                n_dead=$((n_dead + 1))
            fi
        done
        ((n_ready + n_dead < ${#WL_READY[@]})) || break
        ((SECONDS < deadline)) || break
        sleep 0.2
    done
    log "workloads ready: $n_ready/${#WL_READY[@]}, exited early: $n_dead"
    for i in "${!WL_READY[@]}"; do
        tag=${WL_READY[$i]}
        if [[ -s $WORK/$tag.ready.json ]]; then
            sed -n '1p' "$WORK/$tag.log" | sed 's/^/    /'
        else
            rc=0
            if ! proc_alive "${WL_PIDS[$i]}"; then
                wait "${WL_PIDS[$i]}" 2>/dev/null || rc=$?
            fi
            case $rc in
            3) why="PyTorch with CUDA not usable from $PYTHON" ;;
            0) why="not ready after ${WL_READY_TIMEOUT} s" ;;
            *) why="exited with $rc" ;;
            esac
            WL_NOTE+="${WL_NOTE:+; }$tag not ready: $why ($(tail -n 1 "$WORK/$tag.log" | cut -c1-200))"
            warn "$tag: $why"
            tail -n 5 "$WORK/$tag.log" | sed 's/^/    workload: /'
        fi
    done
    ((n_ready > 0)) || WL_NOTE="not run: ${WL_NOTE}"
fi

# the run with workloads (without one when none is ready: device checks still run)
observe run "$ACTIVE_DURATION" capture

if ((${#WL_PIDS[@]})); then
    : >"$WORK/wl.stop"
    deadline=$((SECONDS + $(tmo 30)))
    for i in "${!WL_PIDS[@]}"; do
        rc=0
        while proc_alive "${WL_PIDS[$i]}" && ((SECONDS < deadline)); do
            sleep 0.1
        done
        proc_alive "${WL_PIDS[$i]}" && kill -TERM "${WL_PIDS[$i]}" 2>/dev/null
        wait "${WL_PIDS[$i]}" 2>/dev/null || rc=$?
        tag=wl$i
        if [[ -s $WORK/$tag.result.json ]]; then
            WL_FILES+=("$WORK/$tag.result.json")
        elif [[ -s $WORK/$tag.ready.json ]]; then
            WL_FILES+=("$WORK/$tag.ready.json")
            WL_NOTE+="${WL_NOTE:+; }$tag ended with rc $rc without its result file"
        fi
    done
    WL_PIDS=()
    log "workloads stopped"
fi

# ------------------------------------------------------------ 5. report
for f in run.jsonl idle.jsonl; do
    if [[ -s $WORK/$f && ${KEEP_RAW:-0} != 1 ]] && command -v gzip >/dev/null 2>&1; then
        gzip -f -1 "$WORK/$f"
    fi
done
ev() { # the JSONL of a run, gzipped or not
    if [[ -e $WORK/$1.jsonl.gz ]]; then echo "$WORK/$1.jsonl.gz"; else echo "$WORK/$1.jsonl"; fi
}
declare -a RARGS=(--smi-static "$WORK/smi_static.json" --env "$WORK/env.json"
    --devices-json "$WORK/devices.json" --devices-rc "$DEV_RC"
    --devices-table "$WORK/devices.txt" --devices-table-rc "$DEV_TABLE_RC"
    --active-events "$(ev run)" --captures "$WORK/run.captures.jsonl" --idle-events "$(ev idle)"
    --interval-ms "$NVML_INTERVAL_MS" --min-compared "$MIN_COMPARED"
    --expected-workloads "$((${#GPU_LIST[@]} * WORKLOADS_PER_GPU))"
    --md-out "$WORK/NVML-VALIDATION.md" --json-out "$WORK/nvml-results.json")
for f in ${WL_FILES[@]+"${WL_FILES[@]}"}; do
    RARGS+=(--workload "$f")
done
[[ -z $WL_NOTE ]] || RARGS+=(--note "workloads=$WL_NOTE")
for n in ${NOTES[@]+"${NOTES[@]}"}; do
    RARGS+=(--note "$n")
done
log "=== report"
crc=0
timeout --kill-after=5 60 "$PYTHON" -m gpucheck.compare_nvml report "${RARGS[@]}" || crc=$?
log "=== ${SECONDS}s total"
case $crc in
0) log "NVML VALIDATION PASSED" ;;
1) log "NVML VALIDATION FAILED" ;;
*) log "NVML VALIDATION FAILED (gpucheck.compare_nvml error rc=$crc)" ;;
esac
exit "$((crc == 0 ? 0 : 1))"
