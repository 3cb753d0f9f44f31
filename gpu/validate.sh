#!/usr/bin/env bash
# Real-GPU validation of gpu-observer: run known workloads under the observer
# (all-process mode, JSONL) and compare captured vs expected counts, kernel names,
# copy directions and the leak report; then run cuda-ground-truth and torch_loop under
# `gpu-observer run --trace-all` (CUPTI injection library) and check the GPU-side
# records (gpucheck.compare_cupti: joined to their launches, timestamps, counts, names).
#
# usage (as root, from the repo root):
#   OBSERVER=.gpu-bundle/gpu-observer GIT_COMMIT=$(git rev-parse HEAD) gpu/validate.sh [OUTDIR]
#
# OUTDIR defaults to $OUT if set, else /tmp/gpu-validate.  It receives only
# three files (the device runner returns at most 8):
#   VALIDATION.md            the report (commit it as docs/VALIDATION.md)
#   validate-results.json    env + per-run comparison results
#   validate-artifacts.tar.gz  everything else from the work dir: per run
#       NAME.{json,jsonl.gz,err,obs.out,log,result.json,section.md}, build logs,
#       env.json, nvidia-smi.txt (JSONL dropped from the tarball if > 15 MiB)
# The unpacked work dir stays in $WORK_DIR (default /tmp/gpu-validate-work.*).
# Exit 0 only if every strict check passed.
#
# Environment knobs: OBSERVER, GROUND_TRUTH (default: cuda-ground-truth next to the
# observer, i.e. .gpu-bundle/cuda-ground-truth), GIT_COMMIT, NVCC, CUDA_ARCH (e.g. sm_90),
# PYTHON (default python3), N_COPIES (2000), N_TORCH (500), M_TORCH (20), GT_ITERS (200),
# WORKLOAD_TIMEOUT (240 s), READY_TIMEOUT (60 s), STOP_TIMEOUT (30 s),
# KEEP_RAW=1 (do not gzip the JSONL), WORK_DIR, SKIP_TORCH=1,
# CUPTI_LIB (the injection library; default libgpu_observer_cupti.so next to the
# observer, then .gpu-bundle/), SKIP_CUPTI=1 (CUPTI runs reported as skipped: fails),
# CUPTI_TOLERANCE_NS (5000).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=SCRIPTDIR/lib.sh
source "$HERE/lib.sh"

OUTDIR=${1:-${OUT:-/tmp/gpu-validate}}
PYTHON=${PYTHON:-python3}
N_COPIES=${N_COPIES:-2000}
N_TORCH=${N_TORCH:-500}
M_TORCH=${M_TORCH:-20}
GT_ITERS=${GT_ITERS:-200}
GT_ATTACH_DELAY=${GT_ATTACH_DELAY:-0.5} # s between the observer's ready line and the start file
GT_PID=""
WORKLOAD_TIMEOUT=${WORKLOAD_TIMEOUT:-240}
CUPTI_TOLERANCE_NS=${CUPTI_TOLERANCE_NS:-5000}
BUDGET_S=480
OBS_ENV=()

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
rm -f "$OUTDIR/VALIDATION.md" "$OUTDIR/validate-results.json" "$OUTDIR/validate-artifacts.tar.gz"
WORK=${WORK_DIR:-$(mktemp -d /tmp/gpu-validate-work.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
[[ $WORK != "$OUTDIR" ]] || die "WORK_DIR must differ from the output dir"
on_exit_hook() {
    # The ground-truth workload, if an early exit left it waiting for its start file.
    if [[ -n ${GT_PID:-} ]] && proc_alive "$GT_PID"; then
        kill -TERM "$GT_PID" 2>/dev/null || true
    fi
    if [[ -f $WORK/VALIDATION.md ]]; then
        cp -f "$WORK/VALIDATION.md" "$OUTDIR/VALIDATION.md"
    fi
    if [[ -f $WORK/validate-results.json ]]; then
        cp -f "$WORK/validate-results.json" "$OUTDIR/validate-results.json"
    fi
    pack_dir "$WORK" "$OUTDIR/validate-artifacts.tar.gz"
    local f have=""
    for f in VALIDATION.md validate-results.json validate-artifacts.tar.gz; do
        [[ -e $OUTDIR/$f ]] && have+="$f "
    done
    log "outputs in $OUTDIR: ${have:-none} (work dir $WORK)"
}
install_traps

# ------------------------------------------------------------ preflight
log "gpu-observer validation -> $OUTDIR (work dir $WORK)"
require_root
require_tools nvidia-smi timeout grep sed tail "$PYTHON"
resolve_observer "$REPO_ROOT"
NVCC_BIN=$(find_nvcc)
ARCH=$(gpu_sm_arch)
log "observer: $OBSERVER"
GT_BIN=$(resolve_exe "${GROUND_TRUTH:-$(dirname "$OBSERVER")/cuda-ground-truth}" "$REPO_ROOT")
if [[ -z $GT_BIN && -z ${GROUND_TRUTH:-} ]]; then
    GT_BIN=$(resolve_exe .gpu-bundle/cuda-ground-truth "$REPO_ROOT")
fi
log "ground truth: ${GT_BIN:-not found (set GROUND_TRUTH=/path/to/cuda-ground-truth)}"
log "nvcc: $NVCC_BIN  arch: $ARCH"

# CUPTI runs: the injection library and the observer's `run` subcommand.
if [[ ${SKIP_CUPTI:-0} == 1 ]]; then
    CUPTI_SKIP="SKIP_CUPTI=1"
    CUPTI_LIB_PATH=""
    CUPTI_ARGS=()
    OBS_RUN_HELP="not checked (SKIP_CUPTI=1)"
else
    resolve_cupti "$REPO_ROOT" "$WORK/observer_run_help.txt"
fi
log "CUPTI injection library: ${CUPTI_LIB_PATH:-not found}; observer run subcommand: $OBS_RUN_HELP"
[[ -z $CUPTI_SKIP ]] || warn "CUPTI runs will be skipped: $CUPTI_SKIP"

nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1 || die "nvidia-smi failed: $(tail -n 3 "$WORK/nvidia-smi.txt")"
sed -n '1,12p' "$WORK/nvidia-smi.txt"
"$NVCC_BIN" --version | sed -n '$p'
"$PYTHON" -m gpucheck.make_report env --out "$WORK/env.json" \
    --observer "$OBSERVER" --nvcc "$NVCC_BIN" --python "$PYTHON" \
    --cupti-lib "$CUPTI_LIB_PATH" --observer-run "$OBS_RUN_HELP"

RUN_TORCH=1
if [[ ${SKIP_TORCH:-0} == 1 ]]; then
    RUN_TORCH=0
    warn "SKIP_TORCH=1: torch workload skipped"
elif ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' \
    >"$WORK/torch_check.log" 2>&1; then
    RUN_TORCH=0
    warn "PyTorch with CUDA not usable from $PYTHON; torch workload skipped:"
    tail -n 5 "$WORK/torch_check.log" | sed 's/^/    /'
fi

# ------------------------------------------------------------ build
BUILD_DIR=$WORK.bin
mkdir -p "$BUILD_DIR"
build() { # out-name extra-flags...
    local out=$1
    shift
    log "build $out ($*)"
    if ! "$NVCC_BIN" -O2 -arch="$ARCH" -cudart static "$@" \
        -o "$BUILD_DIR/$out" "$HERE/workloads/copies_kernels.cu" >"$WORK/build_$out.log" 2>&1; then
        cat "$WORK/build_$out.log"
        die "nvcc build of $out failed"
    fi
}
build copies_kernels
build copies_kernels_ptds --default-stream per-thread
if command -v ldd >/dev/null 2>&1 && ldd "$BUILD_DIR/copies_kernels" 2>/dev/null | grep -q libcudart; then
    warn "copies_kernels links libcudart dynamically (expected static)"
fi

# ------------------------------------------------------------ runs
declare -a NAMES=()
declare -A STATUS=()

# run_one NAME TITLE COMM_HINT cmd...   (cmd gets NAME.json as last argument)
run_one() {
    local name=$1 title=$2 hint=$3
    shift 3
    local jsonl="$WORK/$name.jsonl" err="$WORK/$name.err" wjson="$WORK/$name.json"
    local wlog="$WORK/$name.log" rc=0
    NAMES+=("$name")
    rm -f "$wjson" "$jsonl.gz" "$WORK/$name.result.json" "$WORK/$name.section.md"
    log "=== $name: $title"
    if ((SECONDS - _T0 > BUDGET_S)); then
        warn "time budget (${BUDGET_S} s) exhausted; skipping $name"
        STATUS[$name]="SKIPPED (time budget)"
        return 0
    fi
    if ! start_observer "$jsonl" "$err"; then
        STATUS[$name]="FAIL (observer did not start)"
        return 0
    fi
    timeout --signal=TERM --kill-after=10 "$WORKLOAD_TIMEOUT" "$@" "$wjson" >"$wlog" 2>&1 || rc=$?
    sleep 1
    stop_observer
    finish_run "$name" "$rc"
    if ((rc != 0)); then
        STATUS[$name]="FAIL (workload rc=$rc)"
        return 0
    fi
    [[ -z ${STATUS[$name]:-} ]] || return 0
    local crc=0
    "$PYTHON" -m gpucheck.compare --workload "$wjson" --events "$EVENTS" --name "$name" \
        --title "$title" --comm-hint "$hint" \
        --section-out "$WORK/$name.section.md" --result-out "$WORK/$name.result.json" || crc=$?
    case $crc in
    0) STATUS[$name]=PASS ;;
    1) STATUS[$name]="FAIL (count mismatch)" ;;
    *) STATUS[$name]="FAIL (compare error rc=$crc)" ;;
    esac
    if [[ ${OBS_RC:-0} != 0 ]]; then
        warn "observer exit status $OBS_RC (expected 0 after SIGINT)"
        if [[ ${STATUS[$name]} == PASS ]]; then STATUS[$name]="PASS (observer rc=$OBS_RC)"; fi
    fi
    return 0
}

# finish_run NAME WORKLOAD-RC: the observer's output after a run; sets STATUS on failure.
# Prints the workload log tail; returns 1 if there is nothing to compare.
finish_run() {
    local name=$1 rc=$2
    local jsonl="$WORK/$name.jsonl" err="$WORK/$name.err" wlog="$WORK/$name.log"
    log "workload rc=$rc, observer rc=$OBS_RC, jsonl $(wc -l 2>/dev/null <"$jsonl" || echo 0) lines"
    tail -n 3 "$err" 2>/dev/null | sed 's/^/    observer: /' || true
    EVENTS=$jsonl
    if [[ ! -s $jsonl ]]; then
        STATUS[$name]="FAIL (no observer output)"
    elif [[ ${KEEP_RAW:-0} != 1 ]] && command -v gzip >/dev/null 2>&1; then
        gzip -f -1 "$jsonl" && EVENTS=$jsonl.gz
    fi
    if ((rc != 0)); then
        sed 's/^/    workload: /' "$wlog" | tail -n 25
    else
        sed 's/^/    workload: /' "$wlog" | tail -n 4
    fi
}

# run_ground_truth: cuda-ground-truth creates its CUDA context, then waits for a start
# file; the observer (all processes) is started only then, so it attaches to a process
# that is already running CUDA; once it is ready the start file is created and the
# workload makes its known calls; then the observer is stopped and
# gpucheck.compare_ground_truth checks every API count, bytes, kernel names, generic copy
# directions and the leak report.
run_ground_truth() {
    local name=ground_truth
    local title="cuda-ground-truth (own driver FFI via dlopen, PTX JIT; every call known)"
    local jsonl="$WORK/$name.jsonl" err="$WORK/$name.err" wjson="$WORK/$name.json"
    local wlog="$WORK/$name.log" go="$WORK/$name.start" rc=0
    NAMES+=("$name")
    rm -f "$wjson" "$jsonl.gz" "$go" "$WORK/$name.result.json" "$WORK/$name.section.md"
    log "=== $name: $title"
    if [[ -z $GT_BIN ]]; then
        STATUS[$name]="SKIPPED (no cuda-ground-truth binary; set GROUND_TRUTH)"
        return 0
    fi
    if ((SECONDS - _T0 > BUDGET_S)); then
        STATUS[$name]="SKIPPED (time budget)"
        return 0
    fi
    timeout --signal=TERM --kill-after=10 "$WORKLOAD_TIMEOUT" "$GT_BIN" --out "$wjson" \
        --wait-start "$go" --wait-timeout-s "$((READY_TIMEOUT + 60))" --iters "$GT_ITERS" \
        </dev/null >"$wlog" 2>&1 &
    GT_PID=$!
    if ! wait_for_line "$wlog" "cuda-ground-truth: waiting for" 60 "$GT_PID"; then
        wait "$GT_PID" 2>/dev/null || rc=$?
        GT_PID=""
        sed 's/^/    workload: /' "$wlog" | tail -n 10
        STATUS[$name]="FAIL (workload did not reach its start point, rc=$rc)"
        return 0
    fi
    log "workload waiting with its context created: $(sed -n 1p "$wlog")"
    if ! start_observer "$jsonl" "$err"; then
        kill -TERM "$GT_PID" 2>/dev/null || true
        wait "$GT_PID" 2>/dev/null || true
        GT_PID=""
        STATUS[$name]="FAIL (observer did not start)"
        return 0
    fi
    sleep "$GT_ATTACH_DELAY"
    : >"$go"
    wait "$GT_PID" || rc=$?
    GT_PID=""
    sleep 1
    stop_observer
    finish_run "$name" "$rc"
    case $rc in
    0) ;;
    1) STATUS[$name]="FAIL (workload rc=1: one of its checks (H1-H3, H9) or a driver call failed)" ;;
    2) STATUS[$name]="FAIL (workload rc=2: no libcuda or no usable GPU)" ;;
    3) STATUS[$name]="FAIL (workload rc=3: start file never came)" ;;
    *) STATUS[$name]="FAIL (workload rc=$rc)" ;;
    esac
    # Compare whenever there is something to compare, also after a failed hypothesis.
    [[ -s $wjson && -s $EVENTS ]] || return 0
    local crc=0
    "$PYTHON" -m gpucheck.compare_ground_truth --workload "$wjson" --events "$EVENTS" \
        --name "$name" --title "$title" --comm-hint cuda-ground-tru \
        --api-table "$REPO_ROOT/gpu-observer-common/src/api.rs" \
        --section-out "$WORK/$name.section.md" --result-out "$WORK/$name.result.json" || crc=$?
    if [[ -z ${STATUS[$name]:-} ]]; then
        case $crc in
        0) STATUS[$name]=PASS ;;
        1) STATUS[$name]="FAIL (ground-truth mismatch)" ;;
        *) STATUS[$name]="FAIL (compare error rc=$crc)" ;;
        esac
    fi
    if [[ ${OBS_RC:-0} != 0 && ${STATUS[$name]} == PASS ]]; then
        STATUS[$name]="PASS (observer rc=$OBS_RC)"
    fi
    return 0
}

# run_cupti NAME TITLE COMM_HINT KIND cmd...
# The workload under `gpu-observer run --trace-all` (CUPTI injection library), then
# gpucheck.compare_cupti.  KIND torch: cmd gets NAME.json as last argument and runs with
# TORCH_LOOP_NO_PROFILER=1; KIND ground: cmd gets `--out NAME.json`, and
# gpucheck.compare_ground_truth also checks the uprobe side of the same run (NAME_uprobes).
run_cupti() {
    local name=$1 title=$2 hint=$3 kind=$4
    shift 4
    local jsonl="$WORK/$name.jsonl" err="$WORK/$name.err" wjson="$WORK/$name.json"
    local wlog="$WORK/$name.log" rc=0 up=""
    NAMES+=("$name")
    if [[ $kind == ground ]]; then
        up=${name}_uprobes
        NAMES+=("$up")
        rm -f "$WORK/$up.result.json" "$WORK/$up.section.md"
    fi
    rm -f "$wjson" "$jsonl.gz" "$WORK/$name.result.json" "$WORK/$name.section.md"
    log "=== $name: $title"
    local skip=""
    if [[ -n $CUPTI_SKIP ]]; then
        skip="SKIPPED ($CUPTI_SKIP)"
    elif ((SECONDS - _T0 > BUDGET_S)); then
        skip="SKIPPED (time budget)"
    fi
    if [[ -n $skip ]]; then
        STATUS[$name]=$skip
        [[ -z $up ]] || STATUS[$up]=$skip
        return 0
    fi
    local -a cmd=("$@")
    OBS_ENV=()
    if [[ $kind == ground ]]; then
        cmd+=(--out "$wjson")
    else
        cmd+=("$wjson")
        OBS_ENV=(TORCH_LOOP_NO_PROFILER=1)
    fi
    if ! start_observer_run "$jsonl" "$err" "$wlog" --trace-all "${CUPTI_ARGS[@]}" -- "${cmd[@]}"; then
        OBS_ENV=()
        STATUS[$name]="FAIL (gpu-observer run did not start)"
        [[ -z $up ]] || STATUS[$up]=${STATUS[$name]}
        return 0
    fi
    OBS_ENV=()
    if wait_observer_run "$WORKLOAD_TIMEOUT"; then
        rc=${OBS_RC:-0} # the workload's exit status, passed on by the observer
    else
        rc=124
        STATUS[$name]="FAIL (workload still running after ${WORKLOAD_TIMEOUT} s)"
    fi
    finish_run "$name" "$rc"
    if ((rc != 0)); then
        tail -n 15 "$err" 2>/dev/null | sed 's/^/    observer+workload stderr: /' || true
    fi
    if [[ -z ${STATUS[$name]:-} ]]; then
        case $kind:$rc in
        *:0) ;;
        ground:1) STATUS[$name]="FAIL (workload rc=1: one of its checks (H1-H3, H9) or a driver call failed)" ;;
        ground:2) STATUS[$name]="FAIL (workload rc=2: no libcuda or no usable GPU)" ;;
        *) STATUS[$name]="FAIL (workload or observer rc=$rc)" ;;
        esac
    fi
    [[ -z $up || -z ${STATUS[$name]:-} ]] || STATUS[$up]=${STATUS[$name]}
    [[ -s $wjson && -s $EVENTS ]] || return 0
    local crc=0
    "$PYTHON" -m gpucheck.compare_cupti --workload "$wjson" --events "$EVENTS" --name "$name" \
        --title "$title" --comm-hint "$hint" --tolerance-ns "$CUPTI_TOLERANCE_NS" \
        --section-out "$WORK/$name.section.md" --result-out "$WORK/$name.result.json" || crc=$?
    if [[ -z ${STATUS[$name]:-} ]]; then
        case $crc in
        0) STATUS[$name]=PASS ;;
        1) STATUS[$name]="FAIL (CUPTI check failed)" ;;
        *) STATUS[$name]="FAIL (compare_cupti error rc=$crc)" ;;
        esac
    fi
    [[ -n $up ]] || return 0
    crc=0
    "$PYTHON" -m gpucheck.compare_ground_truth --workload "$wjson" --events "$EVENTS" \
        --name "$up" --title "cuda-ground-truth under gpu-observer run (CUPTI injected): uprobe checks" \
        --comm-hint "$hint" --api-table "$REPO_ROOT/gpu-observer-common/src/api.rs" \
        --section-out "$WORK/$up.section.md" --result-out "$WORK/$up.result.json" || crc=$?
    if [[ -z ${STATUS[$up]:-} ]]; then
        case $crc in
        0) STATUS[$up]=PASS ;;
        1) STATUS[$up]="FAIL (ground-truth mismatch under CUPTI)" ;;
        *) STATUS[$up]="FAIL (compare error rc=$crc)" ;;
        esac
    fi
    return 0
}

run_ground_truth
run_one copies_kernels "copies_kernels (nvcc, cudart static, legacy default stream)" \
    copies_kernels "$BUILD_DIR/copies_kernels" "$N_COPIES"
run_one copies_kernels_ptds "copies_kernels (nvcc, cudart static, --default-stream per-thread)" \
    copies_kernels "$BUILD_DIR/copies_kernels_ptds" "$N_COPIES"
if ((RUN_TORCH)); then
    run_one torch_loop "torch_loop (PyTorch eager; phase A exact, phase B vs profiler)" \
        python "$PYTHON" "$HERE/workloads/torch_loop.py" --n "$N_TORCH" --m "$M_TORCH"
else
    NAMES+=(torch_loop)
    STATUS[torch_loop]="SKIPPED (no usable PyTorch)"
fi
if [[ -n $GT_BIN ]]; then
    run_cupti cupti_ground_truth "cuda-ground-truth under gpu-observer run (CUPTI): GPU records" \
        cuda-ground-tru ground "$GT_BIN" --iters "$GT_ITERS"
else
    NAMES+=(cupti_ground_truth cupti_ground_truth_uprobes)
    STATUS[cupti_ground_truth]="SKIPPED (no cuda-ground-truth binary; set GROUND_TRUTH)"
    STATUS[cupti_ground_truth_uprobes]=${STATUS[cupti_ground_truth]}
fi
if ((RUN_TORCH)); then
    run_cupti cupti_torch_loop "torch_loop under gpu-observer run (CUPTI, no torch.profiler): GPU records" \
        python torch "$PYTHON" "$HERE/workloads/torch_loop.py" --n "$N_TORCH" --m "$M_TORCH"
else
    NAMES+=(cupti_torch_loop)
    STATUS[cupti_torch_loop]="SKIPPED (no usable PyTorch)"
fi

# ------------------------------------------------------------ report
: >"$WORK/status.tsv"
for n in "${NAMES[@]}"; do
    printf '%s\t%s\n' "$n" "${STATUS[$n]}" >>"$WORK/status.tsv"
done
"$PYTHON" -m gpucheck.make_report assemble --env "$WORK/env.json" \
    --out "$WORK/VALIDATION.md" --results-json "$WORK/validate-results.json" \
    --status-file "$WORK/status.tsv" --dir "$WORK" "${NAMES[@]}" || warn "report assembly failed"

log "=== results (${SECONDS}s total)"
fail=0
for n in "${NAMES[@]}"; do
    printf '  %-28s %s\n' "$n" "${STATUS[$n]}"
    [[ ${STATUS[$n]} == PASS* ]] || fail=1
done
if ((fail)); then
    log "VALIDATION FAILED"
    exit 1
fi
log "VALIDATION PASSED"
