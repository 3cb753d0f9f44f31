#!/usr/bin/env bash
# Quick GPU smoke test of the workloads alone (no observer, no root needed):
# builds copies_kernels (both stream modes) and launch_bench, runs each with
# small counts, runs cuda-ground-truth (if GROUND_TRUTH or .gpu-bundle has it) and
# torch_loop with small counts, and prints their JSON; then every bottleneck.py kind for 1 s.
# usage: bash gpu/tests/smoke_workloads.sh [OUTDIR]
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
GPU=$(cd "$HERE/.." && pwd)
# shellcheck source=SCRIPTDIR/../lib.sh
source "$GPU/lib.sh"
OUTDIR=${1:-${OUT:-/tmp/gpu-smoke}}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR"
B=$(mktemp -d /tmp/gpu-smoke-build.XXXXXX)
trap 'rm -rf "$B"' EXIT

require_tools nvidia-smi timeout
NVCC_BIN=$(find_nvcc)
ARCH=$(gpu_sm_arch)
log "nvcc $NVCC_BIN arch $ARCH"
"$NVCC_BIN" -O2 -arch="$ARCH" -cudart static -o "$B/ck" "$GPU/workloads/copies_kernels.cu"
"$NVCC_BIN" -O2 -arch="$ARCH" -cudart static --default-stream per-thread -o "$B/ck_ptds" \
    "$GPU/workloads/copies_kernels.cu"
"$NVCC_BIN" -O2 -arch="$ARCH" -cudart static -o "$B/lb" "$GPU/workloads/launch_bench.cu"
log "built"
if command -v ldd >/dev/null 2>&1; then
    ldd "$B/ck" | sed 's/^/    ldd: /'
fi
timeout 120 "$B/ck" 50 "$OUTDIR/ck.json" && cat "$OUTDIR/ck.json"
timeout 120 "$B/ck_ptds" 50 "$OUTDIR/ck_ptds.json" && cat "$OUTDIR/ck_ptds.json"
timeout 120 "$B/lb" 20000 3 "$OUTDIR/lb.json" && cut -c1-300 "$OUTDIR/lb.json"
log "cuda workloads ok"
GT=$(resolve_exe "${GROUND_TRUTH:-.gpu-bundle/cuda-ground-truth}" "$(cd "$GPU/.." && pwd)")
if [[ -n $GT ]]; then
    timeout 120 "$GT" --iters 5 --out "$OUTDIR/gt.json" && cut -c1-400 "$OUTDIR/gt.json"
    log "cuda-ground-truth ok"
else
    warn "cuda-ground-truth not found (set GROUND_TRUTH); skipped"
fi
timeout 300 "$PYTHON" "$GPU/workloads/torch_loop.py" --n 20 --m 3 "$OUTDIR/torch.json"
cat "$OUTDIR/torch.json"
for k in launch gemm transfer sync cpu cpu_inline sleep train; do
    timeout 120 "$PYTHON" "$GPU/workloads/bottleneck.py" --kind "$k" --seconds 1 --out "$OUTDIR/bottleneck_$k.json"
done
log "bottleneck.py workloads ok"
log "smoke ok"
