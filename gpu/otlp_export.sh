#!/usr/bin/env bash
# Issue 6 on a real GPU: a PyTorch run (gpu/workloads/torch_loop.py) under
# `gpu-observer run` (CUPTI) exporting OTLP over gRPC to otlp-sink, a stand-alone receiver
# (tests/src/bin/otlp-sink.rs, in .gpu-bundle) that decodes every request; then the decoded
# spans and metrics are compared with the observer's own JSON lines of the same run
# (gpucheck.otlp_report).
#
# usage (root, repo root): OBSERVER=.gpu-bundle/gpu-observer gpu/otlp_export.sh [OUTDIR]
# Writes OUTDIR/OTLP-EXPORT.md, sink.json (what was decoded) and run.jsonl.gz.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=SCRIPTDIR/lib.sh
source "$HERE/lib.sh"
OBSERVER=${OBSERVER:-.gpu-bundle/gpu-observer}
SINK=${SINK:-$(dirname "$OBSERVER")/otlp-sink}
OUTDIR=${1:-${OUT:-/tmp/gpu-otlp}}
PYTHON=${PYTHON:-python3}
PORT=${PORT:-4317}
mkdir -p "$OUTDIR"
WORK=$(mktemp -d /tmp/gpu-otlp.XXXXXX)
"$SINK" grpc "$PORT" 240 "$OUTDIR/sink.json" 2>"$WORK/sink.err" &
SINK_PID=$!
sleep 0.5
rc=0
timeout --kill-after=10 200 "$OBSERVER" --format jsonl --output "$WORK/run.jsonl" --trace-all \
    --otlp-endpoint "http://127.0.0.1:$PORT" --otlp-interval-ms 2000 --otlp-max-spans-per-sec 0 \
    run -- "$PYTHON" gpu/workloads/torch_loop.py --n 200 --m 10 --no-profiler "$WORK/torch.json" \
    2>"$WORK/observer.err" || rc=$?
kill -TERM "$SINK_PID" 2>/dev/null || true
wait "$SINK_PID" || true
cat "$WORK/observer.err" "$WORK/sink.err" >&2
"$PYTHON" -m gpucheck.otlp_report "$OUTDIR/sink.json" "$WORK/run.jsonl" "$rc" | tee "$OUTDIR/OTLP-EXPORT.md"
gzip -c "$WORK/run.jsonl" >"$OUTDIR/run.jsonl.gz"
