#!/usr/bin/env bash
# The timeline and the flamegraph on a real GPU (issue 16). A PyTorch training loop annotated
# with NVTX (gpu/workloads/train_nvtx.py: nested push/pop ranges in the spec's shape, a
# process-wide start/end range, one step under emit_nvtx) runs under `gpu-observer run` with
# --perfetto, --flamegraph and every event written as JSON lines (--trace-all). The trace is
# decoded with Perfetto's own protos (tests/perfetto/decode.py; PyPI `perfetto`, on PYTHONPATH)
# and gpucheck.compare_timeline checks it against the JSON lines: per thread the calls, ioctls,
# launches and NVTX ranges; per stream the GPU records; a flow from each launch to its GPU work;
# the flamegraph's GPU time. Then the same loop runs without --perfetto (and with an SVG
# flamegraph) for the cost: the loop's step time and the trace's size. ~1 minute on an H100.
#
# usage (root, repo root): OBSERVER=.gpu-bundle/gpu-observer gpu/validate_timeline.sh [OUTDIR]
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
OUTDIR=${1:-${OUT:-/tmp/gpu-timeline}}
OBS=${OBSERVER:-.gpu-bundle/gpu-observer}
PY=${PYTHON:-python3}
STEPS=${STEPS:-40}
W=$(mktemp -d /tmp/gpu-timeline.XXXXXX)
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
REPORT="$OUTDIR/TIMELINE.md"
: >"$REPORT"
note() { echo "$*" | tee -a "$REPORT"; }
T="$HERE/workloads/train_nvtx.py"
COMMON=(run --format jsonl --trace-all --ring-buffer-size 67108864)
fail=0

note "# Timeline on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), observer $("$OBS" --version)"
"$OBS" "${COMMON[@]}" --output "$W/trace.jsonl" --perfetto "$W/step.pftrace" --flamegraph "$W/k.folded" \
    -- "$PY" "$T" --steps "$STEPS" "$W/with.json" 2>"$W/trace.err" || { note "FAIL: the traced run failed"; fail=1; }
"$OBS" "${COMMON[@]}" --output "$W/plain.jsonl" --flamegraph "$OUTDIR/k.svg" \
    -- "$PY" "$T" --steps "$STEPS" "$W/plain.json" 2>"$W/plain.err" || { note "FAIL: the plain run failed"; fail=1; }
grep -h "perfetto\|flamegraph\|dropped\|NVTX" "$W/trace.err" "$W/plain.err" | tee -a "$REPORT"

if PYTHONPATH="${DECODE_PYTHONPATH:-}" "$PY" -c "import perfetto.protos" 2>/dev/null; then
    PYTHONPATH="${DECODE_PYTHONPATH:-}" "$PY" "$ROOT/tests/perfetto/decode.py" "$W/step.pftrace" >"$W/decoded.json" \
        || { note "FAIL: the trace does not decode"; fail=1; }
    (cd "$HERE" && "$PY" -m gpucheck.compare_timeline "$W/decoded.json" "$W/trace.jsonl" "$W/k.folded") \
        >"$OUTDIR/compare.json" || { note "FAIL: gpucheck.compare_timeline (compare.json)"; fail=1; }
else
    note "SKIPPED: Python's perfetto package is not importable (set DECODE_PYTHONPATH): the trace was not decoded"
    fail=1
fi
"$PY" - "$W" "$STEPS" <<'PY' | tee -a "$REPORT"
import json, os, sys
w, steps = sys.argv[1], int(sys.argv[2])
a, b = json.load(open(f"{w}/with.json")), json.load(open(f"{w}/plain.json"))
size = os.path.getsize(f"{w}/step.pftrace")
events = sum(1 for _ in open(f"{w}/trace.jsonl"))
print(f"- trace: {size} bytes ({size / 2**20:.1f} MiB) for {events} JSON lines ({size / max(events, 1):.1f} bytes a line)")
print(f"- step time: {a['step_ms']:.3f} ms with --perfetto, {b['step_ms']:.3f} ms without ({a['step_ms'] / b['step_ms']:.3f}x), {steps} steps, torch {a['torch']}")
PY
cp "$W/k.folded" "$W/trace.err" "$OUTDIR/" 2>/dev/null
gzip -c "$W/step.pftrace" >"$OUTDIR/step.pftrace.gz"
[[ $(stat -c %s "$OUTDIR/step.pftrace.gz") -gt 15000000 ]] && rm -f "$OUTDIR/step.pftrace.gz"
gzip -c "$W/trace.jsonl" >"$OUTDIR/trace.jsonl.gz"
[[ $(stat -c %s "$OUTDIR/trace.jsonl.gz") -gt 15000000 ]] && rm -f "$OUTDIR/trace.jsonl.gz"
note "result: $([[ $fail == 0 ]] && echo PASS || echo FAIL)"
exit $fail
