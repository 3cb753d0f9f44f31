#!/usr/bin/env bash
# What the NVML sampler costs at several intervals: the observer (all-process mode, no
# workload needed) runs DURATION seconds per interval and its total summary reports the
# sampler thread's CPU time over its wall time and every query's mean/max latency.
#
# usage (root, repo root): OBSERVER=.gpu-bundle/gpu-observer gpu/bench_nvml.sh [OUTDIR]
# Knobs: INTERVALS ("100 250 500 1000"), DURATION (10 s), PYTHON (python3).
# The table (BENCH-NVML.md) is written by gpucheck.bench_nvml_report.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=SCRIPTDIR/lib.sh
source "$HERE/lib.sh"
OBSERVER=${OBSERVER:-.gpu-bundle/gpu-observer}
PYTHON=${PYTHON:-python3}
OUTDIR=${1:-${OUT:-/tmp/gpu-bench-nvml}}
INTERVALS=${INTERVALS:-100 250 500 1000}
DURATION=${DURATION:-10}
mkdir -p "$OUTDIR"
for ms in $INTERVALS; do
    timeout --kill-after=5 $((DURATION + 30)) "$OBSERVER" --format jsonl --duration "$DURATION" \
        --nvml-interval-ms "$ms" --output "$OUTDIR/nvml-$ms.jsonl" 2>"$OUTDIR/nvml-$ms.err" || true
done
# shellcheck disable=SC2086  # one argument per interval
"$PYTHON" -m gpucheck.bench_nvml_report "$OUTDIR" $INTERVALS | tee "$OUTDIR/BENCH-NVML.md"
