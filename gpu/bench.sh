#!/usr/bin/env bash
# Launch-overhead benchmark for gpu-observer, in one invocation:
#   1. baseline: launch_bench without the observer
#   2. with the observer tracing all processes (JSONL to a file in /tmp)
#   3. baseline again
# then writes BENCH.md (ns/launch, ratio, overhead, observer events/dropped).
#
# usage (as root, from the repo root):
#   OBSERVER=.gpu-bundle/gpu-observer GIT_COMMIT=$(git rev-parse HEAD) gpu/bench.sh [OUTDIR]
#
# OUTDIR defaults to $OUT if set, else /tmp/gpu-bench.  Knobs: L (launches per
# round, 200000), R (rounds, 5), NVCC, CUDA_ARCH, PYTHON, KEEP_JSONL=1 (keep the
# observer's JSONL, it is ~L*R lines), BENCH_TIMEOUT (180 s per run).
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
STOP_TIMEOUT=${STOP_TIMEOUT:-60}   # the observer may have ~1M events to flush

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
TMPD=$(mktemp -d /tmp/gpu-bench.XXXXXX)
install_traps

log "gpu-observer launch benchmark -> $OUTDIR (L=$L R=$R)"
require_root
require_tools nvidia-smi timeout grep sed "$PYTHON"
resolve_observer "$REPO_ROOT"
NVCC_BIN=$(find_nvcc)
ARCH=$(gpu_sm_arch)
log "observer: $OBSERVER"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader || warn "nvidia-smi query failed"
"$PYTHON" "$HERE/make_report.py" env --out "$OUTDIR/bench_env.json" \
    --observer "$OBSERVER" --nvcc "$NVCC_BIN"

log "build launch_bench ($ARCH)"
if ! "$NVCC_BIN" -O2 -arch="$ARCH" -cudart static -o "$TMPD/launch_bench" \
    "$HERE/workloads/launch_bench.cu" >"$OUTDIR/build_launch_bench.log" 2>&1; then
    cat "$OUTDIR/build_launch_bench.log"
    die "nvcc build of launch_bench failed"
fi

bench() { # name
    local rc=0
    timeout --signal=TERM --kill-after=10 "$BENCH_TIMEOUT" \
        "$TMPD/launch_bench" "$L" "$R" "$OUTDIR/$1.json" >"$OUTDIR/$1.log" 2>&1 || rc=$?
    sed 's/^/    /' "$OUTDIR/$1.log" | tail -n 5
    ((rc == 0)) || die "launch_bench ($1) failed with rc=$rc"
}

log "=== 1/3 baseline (no observer)"
bench bench_base1

log "=== 2/3 with observer (all processes, jsonl -> $TMPD/bench.jsonl)"
start_observer "$TMPD/bench.jsonl" "$OUTDIR/bench_observer.err" || die "observer did not start"
bench_rc=0
(bench bench_with) || bench_rc=$?
sleep 1
stop_observer
log "observer rc=$OBS_RC; jsonl $(du -h "$TMPD/bench.jsonl" 2>/dev/null | cut -f1) ($(wc -l 2>/dev/null <"$TMPD/bench.jsonl" || echo 0) lines)"
tail -n 3 "$OUTDIR/bench_observer.err" 2>/dev/null | sed 's/^/    observer: /' || true
((bench_rc == 0)) || die "launch_bench under the observer failed"

log "=== 3/3 baseline again"
bench bench_base2

"$PYTHON" "$HERE/bench_report.py" --env "$OUTDIR/bench_env.json" \
    --base1 "$OUTDIR/bench_base1.json" --with "$OUTDIR/bench_with.json" \
    --base2 "$OUTDIR/bench_base2.json" --events "$TMPD/bench.jsonl" \
    --out "$OUTDIR/BENCH.md" --summary-json "$OUTDIR/bench_summary.json"

if [[ ${KEEP_JSONL:-0} == 1 ]]; then
    log "observer JSONL kept at $TMPD/bench.jsonl"
else
    rm -rf "$TMPD"
fi
log "done in ${SECONDS}s: $OUTDIR/BENCH.md"
