#!/usr/bin/env bash
# Launch-overhead benchmark for gpu-observer, in one invocation:
#   1. baseline: launch_bench without the observer
#   2. with the observer tracing all processes (JSONL to a file in /tmp)
#   3. baseline again
# then writes BENCH.md (ns/launch, ratio, overhead, observer events/dropped;
# also the batched "submit-only" cost per launch call, see launch_bench.cu).
#
# usage (as root, from the repo root):
#   OBSERVER=.gpu-bundle/gpu-observer GIT_COMMIT=$(git rev-parse HEAD) gpu/bench.sh [OUTDIR]
#
# OUTDIR defaults to $OUT if set, else /tmp/gpu-bench; it receives BENCH.md,
# bench-summary.json and bench-artifacts.tar.gz (per-run JSON/logs, observer
# stderr; not the JSONL).  Work files stay in $WORK_DIR (default
# /tmp/gpu-bench-work.*).  Knobs: L (launches per round, 200000), R (rounds,
# 5), NVCC, CUDA_ARCH, PYTHON, KEEP_JSONL=1 (keep the observer's JSONL, about
# L*R lines, in the work dir), BENCH_TIMEOUT (180 s per run), STOP_TIMEOUT (60 s),
# BENCH_CPU (CPU to pin launch_bench to with taskset; default 2, empty = no pin).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=SCRIPTDIR/lib.sh
source "$HERE/lib.sh"

OUTDIR=${1:-${OUT:-/tmp/gpu-bench}}
PYTHON=${PYTHON:-python3}
L=${L:-200000}
R=${R:-5}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-180}
# Pin the benchmark process to one CPU to reduce run-to-run noise
# (BENCH_CPU= to disable). The observer itself is not pinned.
if [[ -z ${BENCH_CPU+x} ]]; then
    BENCH_CPU=""
    if command -v taskset >/dev/null 2>&1 && (($(nproc 2>/dev/null || echo 1) >= 4)); then
        BENCH_CPU=2
    fi
fi
STOP_TIMEOUT=${STOP_TIMEOUT:-60} # the observer may have ~1M events to flush

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
rm -f "$OUTDIR/BENCH.md" "$OUTDIR/bench-summary.json" "$OUTDIR/bench-artifacts.tar.gz"
WORK=${WORK_DIR:-$(mktemp -d /tmp/gpu-bench-work.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
[[ $WORK != "$OUTDIR" ]] || die "WORK_DIR must differ from the output dir"
JSONL=$WORK/bench.jsonl
on_exit_hook() {
    if [[ ${KEEP_JSONL:-0} != 1 ]]; then
        rm -f "$JSONL"
    fi
    [[ -f $WORK/BENCH.md ]] && cp -f "$WORK/BENCH.md" "$OUTDIR/BENCH.md"
    [[ -f $WORK/bench-summary.json ]] && cp -f "$WORK/bench-summary.json" "$OUTDIR/bench-summary.json"
    pack_dir "$WORK" "$OUTDIR/bench-artifacts.tar.gz"
    log "outputs in $OUTDIR (work dir $WORK)"
}
install_traps

log "gpu-observer launch benchmark -> $OUTDIR (L=$L R=$R, work dir $WORK)"
require_root
require_tools nvidia-smi timeout grep sed "$PYTHON"
resolve_observer "$REPO_ROOT"
NVCC_BIN=$(find_nvcc)
ARCH=$(gpu_sm_arch)
log "observer: $OBSERVER"
"$PYTHON" -m gpucheck.make_report env --out "$WORK/bench_env.json" \
    --observer "$OBSERVER" --nvcc "$NVCC_BIN"

log "build launch_bench ($ARCH)"
mkdir -p "$WORK.bin"
if ! "$NVCC_BIN" -O2 -arch="$ARCH" -cudart static -o "$WORK.bin/launch_bench" \
    "$HERE/workloads/launch_bench.cu" >"$WORK/build_launch_bench.log" 2>&1; then
    cat "$WORK/build_launch_bench.log"
    die "nvcc build of launch_bench failed"
fi

PIN=()
if [[ -n $BENCH_CPU ]]; then
    PIN=(taskset -c "$BENCH_CPU")
    log "benchmark pinned to CPU $BENCH_CPU"
fi

bench() { # name
    local rc=0
    timeout --signal=TERM --kill-after=10 "$BENCH_TIMEOUT" \
        "${PIN[@]}" "$WORK.bin/launch_bench" "$L" "$R" "$WORK/$1.json" >"$WORK/$1.log" 2>&1 || rc=$?
    sed 's/^/    /' "$WORK/$1.log" | tail -n 5
    ((rc == 0)) || die "launch_bench ($1) failed with rc=$rc"
}

log "=== 1/3 baseline (no observer)"
bench bench_base1

log "=== 2/3 with observer (all processes, jsonl -> $JSONL)"
start_observer "$JSONL" "$WORK/bench_observer.err" || die "observer did not start"
bench_rc=0
(bench bench_with) || bench_rc=$?
sleep 1
stop_observer
log "observer rc=$OBS_RC; jsonl $(du -h "$JSONL" 2>/dev/null | cut -f1) ($(wc -l 2>/dev/null <"$JSONL" || echo 0) lines)"
tail -n 3 "$WORK/bench_observer.err" 2>/dev/null | sed 's/^/    observer: /' || true
((bench_rc == 0)) || die "launch_bench under the observer failed"

log "=== 3/3 baseline again"
bench bench_base2

"$PYTHON" -m gpucheck.bench_report --env "$WORK/bench_env.json" \
    --base1 "$WORK/bench_base1.json" --with "$WORK/bench_with.json" \
    --base2 "$WORK/bench_base2.json" --events "$JSONL" \
    --out "$WORK/BENCH.md" --summary-json "$WORK/bench-summary.json"
log "done in ${SECONDS}s"
