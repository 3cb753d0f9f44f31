#!/usr/bin/env bash
# CUPTI-mode overhead of gpu-observer on a realistic PyTorch training loop, in one
# invocation: ROUNDS rounds, each running train_bench.py once in every mode, in a
# rotated order (round 1: a b c d, round 2: b c d a, ...) to cancel drift:
#   base      (a) no observer
#   uprobes   (b) gpu-observer --format jsonl --trace-all --output F (all processes),
#                 started and ready before the workload
#   cupti     (c) gpu-observer run --format jsonl --output F -- python3 train_bench.py
#                 (CUPTI injection library, default sampling: how a user runs it)
#   profiler  (d) train_bench.py --profiler: torch.profiler with CUDA activities on
#                 every step (PROFILER_ACTIVITIES, default cuda), no observer
# then writes BENCH_CUPTI.md: median step time per mode, ratio to (a), the observer's
# events/dropped and CUPTI block; target: (c) within 5 % of (a).
#
# usage (as root, from the repo root):
#   OBSERVER=.gpu-bundle/gpu-observer GIT_COMMIT=$(git rev-parse HEAD) gpu/bench_cupti.sh [OUTDIR]
#
# OUTDIR defaults to $OUT if set, else /tmp/gpu-bench-cupti; it receives BENCH_CUPTI.md,
# bench-cupti-summary.json and bench-cupti-artifacts.tar.gz (per-run JSON, logs,
# observer stderr, the extracted observer summaries; not the JSONL).  Work files stay
# in $WORK_DIR (default /tmp/gpu-bench-cupti-work.*).  Exit 0 if every run completed
# and the report was written (the 5 % target is reported, not enforced).
#
# Knobs: ROUNDS (3), STEPS (200), WARMUP (30), TRAIN_ARGS (extra train_bench.py
# arguments, e.g. "--layers 2 --batch 8"), MODES ("base uprobes cupti profiler"),
# PYTHON, CUPTI_LIB, TARGET_PCT (5), PROFILER_ACTIVITIES (cuda: the same CUPTI
# activity collection as mode c, ~7 s of profiler post-processing per run; cpu,cuda:
# the CPU ops too, as in a typical profiling session, ~80 s per run: the default
# 3 rounds then take ~7.5 minutes instead of ~5),
# BENCH_TIMEOUT (300 s per run), STOP_TIMEOUT
# (60 s), READY_TIMEOUT (60 s), BENCH_BUDGET_S (480: no new run starts later),
# BENCH_CPUS (taskset CPU list for the workload in every mode, default none),
# KEEP_JSONL=1 (keep the observer JSONL in the work dir).
# Self-test hooks: BENCH_WORKLOAD (script run instead of workloads/train_bench.py),
# ALLOW_NO_GPU=1 (no nvidia-smi / torch checks), ALLOW_NONROOT=1.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=SCRIPTDIR/lib.sh
source "$HERE/lib.sh"

OUTDIR=${1:-${OUT:-/tmp/gpu-bench-cupti}}
PYTHON=${PYTHON:-python3}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-200}
WARMUP=${WARMUP:-30}
TRAIN_ARGS=${TRAIN_ARGS:-}
MODES=${MODES:-base uprobes cupti profiler}
TARGET_PCT=${TARGET_PCT:-5}
PROFILER_ACTIVITIES=${PROFILER_ACTIVITIES:-cuda}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
BENCH_BUDGET_S=${BENCH_BUDGET_S:-480}
BENCH_CPUS=${BENCH_CPUS:-}
BENCH_WORKLOAD=${BENCH_WORKLOAD:-$HERE/workloads/train_bench.py}
STOP_TIMEOUT=${STOP_TIMEOUT:-60} # a --trace-all JSONL of ~100k lines to flush
OBS_ENV=()

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
rm -f "$OUTDIR/BENCH_CUPTI.md" "$OUTDIR/bench-cupti-summary.json" "$OUTDIR/bench-cupti-artifacts.tar.gz"
WORK=${WORK_DIR:-$(mktemp -d /tmp/gpu-bench-cupti-work.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
[[ $WORK != "$OUTDIR" ]] || die "WORK_DIR must differ from the output dir"
PLAN=$WORK/plan.tsv
on_exit_hook() {
    if [[ ${KEEP_JSONL:-0} != 1 ]]; then
        rm -f "$WORK"/*.jsonl
    fi
    [[ -f $WORK/BENCH_CUPTI.md ]] && cp -f "$WORK/BENCH_CUPTI.md" "$OUTDIR/BENCH_CUPTI.md"
    [[ -f $WORK/bench-cupti-summary.json ]] &&
        cp -f "$WORK/bench-cupti-summary.json" "$OUTDIR/bench-cupti-summary.json"
    pack_dir "$WORK" "$OUTDIR/bench-cupti-artifacts.tar.gz"
    log "outputs in $OUTDIR (work dir $WORK)"
}
install_traps

read -r -a MODE_LIST <<<"$MODES"
read -r -a EXTRA <<<"$TRAIN_ARGS"
for m in "${MODE_LIST[@]}"; do
    case $m in
    base | uprobes | cupti | profiler) ;;
    *) die "unknown mode '$m' in MODES (base uprobes cupti profiler)" ;;
    esac
done
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer"

log "gpu-observer CUPTI overhead benchmark -> $OUTDIR (rounds $ROUNDS, modes: $MODES, work dir $WORK)"
require_root
require_tools timeout grep sed "$PYTHON"
[[ ${ALLOW_NO_GPU:-0} == 1 ]] || require_tools nvidia-smi
resolve_observer "$REPO_ROOT"
[[ -f $BENCH_WORKLOAD ]] || die "workload not found: $BENCH_WORKLOAD"
log "observer: $OBSERVER"
NEED_CUPTI=0
[[ " $MODES " == *" cupti "* ]] && NEED_CUPTI=1
CUPTI_LIB_PATH=""
OBS_RUN_HELP="not needed"
CUPTI_ARGS=()
if ((NEED_CUPTI)); then
    resolve_cupti "$REPO_ROOT" "$WORK/observer_run_help.txt"
    log "CUPTI injection library: ${CUPTI_LIB_PATH:-not found}; observer run subcommand: $OBS_RUN_HELP"
    [[ -z $CUPTI_SKIP ]] || die "cannot run the CUPTI mode: $CUPTI_SKIP"
fi
"$PYTHON" -m gpucheck.make_report env --out "$WORK/bench_env.json" --observer "$OBSERVER" \
    --python "$PYTHON" --cupti-lib "$CUPTI_LIB_PATH" --observer-run "$OBS_RUN_HELP"
if [[ ${ALLOW_NO_GPU:-0} != 1 ]]; then
    nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1 || die "nvidia-smi failed: $(tail -n 3 "$WORK/nvidia-smi.txt")"
    "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' \
        >"$WORK/torch_check.log" 2>&1 ||
        die "PyTorch with CUDA not usable from $PYTHON: $(tail -n 3 "$WORK/torch_check.log")"
fi

PIN=()
if [[ -n $BENCH_CPUS ]]; then
    command -v taskset >/dev/null 2>&1 || die "BENCH_CPUS set but taskset not found"
    PIN=(taskset -c "$BENCH_CPUS")
    log "workload pinned to CPUs $BENCH_CPUS in every mode"
fi

: >"$PLAN"
FAILED=0

# run_mode ROUND MODE NAME: one train_bench.py run; appends to plan.tsv.
run_mode() {
    local round=$1 mode=$2 name=$3 rc=0 t0=$SECONDS
    local wjson="$WORK/$name.json" wlog="$WORK/$name.log" jsonl="$WORK/$name.jsonl"
    local err="$WORK/$name.err"
    local -a cmd=("${PIN[@]}" "$PYTHON" "$BENCH_WORKLOAD" --out "$wjson" --label "$mode"
        --steps "$STEPS" --warmup "$WARMUP" "${EXTRA[@]}")
    rm -f "$wjson" "$jsonl" "$WORK/$name.obs.json"
    log "=== round $round: $mode ($name)"
    case $mode in
    base | profiler)
        [[ $mode == base ]] || cmd+=(--profiler --profiler-activities "$PROFILER_ACTIVITIES")
        env -u CUDA_INJECTION64_PATH timeout --signal=TERM --kill-after=10 "$BENCH_TIMEOUT" \
            "${cmd[@]}" </dev/null >"$wlog" 2>&1 || rc=$?
        ;;
    uprobes)
        if start_observer "$jsonl" "$err"; then
            env -u CUDA_INJECTION64_PATH timeout --signal=TERM --kill-after=10 "$BENCH_TIMEOUT" \
                "${cmd[@]}" </dev/null >"$wlog" 2>&1 || rc=$?
            sleep 1
            stop_observer
            log "observer rc=$OBS_RC; jsonl $(wc -l 2>/dev/null <"$jsonl" || echo 0) lines"
        else
            rc=98
            warn "observer did not start"
        fi
        ;;
    cupti)
        if start_observer_run "$jsonl" "$err" "$wlog" "${CUPTI_ARGS[@]}" -- "${cmd[@]}"; then
            if wait_observer_run "$BENCH_TIMEOUT"; then
                rc=${OBS_RC:-0}
            else
                rc=124
            fi
            log "observer (run) rc=$rc; jsonl $(wc -l 2>/dev/null <"$jsonl" || echo 0) lines"
        else
            rc=98
            warn "gpu-observer run did not start"
        fi
        ;;
    esac
    if [[ $mode == uprobes || $mode == cupti ]]; then
        tail -n 2 "$err" 2>/dev/null | sed 's/^/    observer: /' || true
        "$PYTHON" -m gpucheck.bench_cupti_report extract --events "$jsonl" --workload "$wjson" \
            --out "$WORK/$name.obs.json" 2>&1 | sed 's/^/    /' || warn "extract failed for $name"
        [[ ${KEEP_JSONL:-0} == 1 ]] || rm -f "$jsonl"
    fi
    if ((rc != 0)); then
        FAILED=1
        warn "$name failed (rc=$rc); last lines:"
        tail -n 15 "$wlog" 2>/dev/null | sed 's/^/    workload: /' || true
        tail -n 10 "$err" 2>/dev/null | sed 's/^/    stderr: /' || true
    else
        tail -n 1 "$wlog" 2>/dev/null | sed 's/^/    /' || true
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$round" "$mode" "$name" "$rc" "$((SECONDS - t0))" >>"$PLAN"
    return 0
}

n_modes=${#MODE_LIST[@]}
for ((r = 1; r <= ROUNDS; r++)); do
    for ((i = 0; i < n_modes; i++)); do
        mode=${MODE_LIST[$(((i + r - 1) % n_modes))]}
        name="r${r}_$mode"
        if ((SECONDS - _T0 > BENCH_BUDGET_S)); then
            warn "time budget (${BENCH_BUDGET_S} s) exhausted; skipping $name"
            printf '%s\t%s\t%s\t%s\t%s\n' "$r" "$mode" "$name" skipped 0 >>"$PLAN"
            FAILED=1
            continue
        fi
        run_mode "$r" "$mode" "$name"
    done
done

"$PYTHON" -m gpucheck.bench_cupti_report report --dir "$WORK" --plan "$PLAN" \
    --env "$WORK/bench_env.json" --out "$WORK/BENCH_CUPTI.md" \
    --summary-json "$WORK/bench-cupti-summary.json" --target-pct "$TARGET_PCT" ||
    die "report failed"
log "done in ${SECONDS}s"
if ((FAILED)); then
    log "some runs failed or were skipped (see BENCH_CUPTI.md)"
    exit 1
fi
