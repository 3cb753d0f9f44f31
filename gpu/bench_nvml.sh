#!/usr/bin/env bash
# What the NVML sampler costs at several intervals: the observer (all-process mode, no
# workload needed) runs DURATION seconds per interval and its total summary reports the
# sampler thread's CPU time over its wall time and every query's mean/max latency.
#
# usage (root, repo root): OBSERVER=.gpu-bundle/gpu-observer gpu/bench_nvml.sh [OUTDIR]
# Knobs: INTERVALS ("100 250 500 1000"), DURATION (10 s).
set -euo pipefail
OBSERVER=${OBSERVER:-.gpu-bundle/gpu-observer}
OUTDIR=${1:-${OUT:-/tmp/gpu-bench-nvml}}
INTERVALS=${INTERVALS:-100 250 500 1000}
DURATION=${DURATION:-10}
mkdir -p "$OUTDIR"
for ms in $INTERVALS; do
    timeout --kill-after=5 $((DURATION + 30)) "$OBSERVER" --format jsonl --duration "$DURATION" \
        --nvml-interval-ms "$ms" --output "$OUTDIR/nvml-$ms.jsonl" 2>"$OUTDIR/nvml-$ms.err" || true
done
python3 - "$OUTDIR" $INTERVALS <<'PY' | tee "$OUTDIR/BENCH-NVML.md"
import json, sys
out, intervals = sys.argv[1], sys.argv[2:]
print("| interval | rounds | sampler CPU (% of a core) | CPU per round | slowest query (mean) |")
print("|---:|---:|---:|---:|---|")
for ms in intervals:
    total = None
    with open(f"{out}/nvml-{ms}.jsonl") as f:
        for line in f:
            o = json.loads(line)
            if o.get("type") == "summary" and o.get("scope") == "total":
                total = o
    if not total or "nvml" not in total:
        print(f"| {ms} ms | - | no summary | - | - |")
        continue
    n = total["nvml"]
    q = n.get("query_ns", {})
    worst = max(q.items(), key=lambda kv: kv[1]["mean"], default=("-", {"mean": 0}))
    per_round = n["sampler_cpu_ns"] / max(n["samples"], 1)
    print(f"| {ms} ms | {n['samples']} | {n['sampler_cpu_ratio'] * 100:.3f} % | {per_round / 1e3:.0f} µs | "
          f"`{worst[0]}` {worst[1]['mean'] / 1e3:.0f} µs |")
PY
