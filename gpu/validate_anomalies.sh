#!/usr/bin/env bash
# Anomaly detection on a real GPU (issue 14). Each loop runs under `gpu-observer run` (CUPTI:
# kernels and copies have GPU times) with every event written (--trace-all), in the default
# robust mode; the same capture is then judged again in the design documents' 2-sigma mode
# (anomaly-replay, in .gpu-bundle) so that both modes see exactly the same values.
#   steady loops  (false positives, at most 0.1 % of values checked): PyTorch training step,
#                 GEMM, launch-bound, sync-bound, pageable transfer; CuPy loop; pinned copy loop
#   planted       one launch in 1 000 spinning 10× longer (a kernel finding every time); one
#                 copy in 1 000 from pageable memory among pinned ones, under `run` and under an
#                 all-process observer without CUPTI (the call's own time then)
#   OTLP          planted 50 µs kernels among 5 µs ones with duration sampling on, exported to
#                 otlp-sink: every anomaly line is a gpu.anomaly span event, the gpu.anomalies
#                 counter adds up, the planted kernels are written and exported
# gpucheck.compare_anomalies judges each run; ANOMALIES.md holds the table.
#
# usage (root, repo root): OBSERVER=.gpu-bundle/gpu-observer gpu/validate_anomalies.sh [OUTDIR]
# KINDS="train copy ..." runs a subset (names below).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUTDIR=${1:-${OUT:-/tmp/gpu-anomalies}}
OBS=${OBSERVER:-.gpu-bundle/gpu-observer}
REPLAY=${REPLAY:-$(dirname "$OBS")/anomaly-replay}
SINK=${SINK:-$(dirname "$OBS")/otlp-sink}
PY=${PYTHON:-python3}
W=$(mktemp -d /tmp/gpu-anomalies.XXXXXX)
mkdir -p "$OUTDIR"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
REPORT="$OUTDIR/ANOMALIES.md"
: >"$REPORT"
note() { echo "$*" | tee -a "$REPORT"; }
B="$HERE/workloads/bottleneck.py"
A="$HERE/workloads/anomaly_loops.py"
RING=(--ring-buffer-size 67108864) # --trace-all at ~60 000 launches/s
fail=0

judge() { # NAME EXPECT-KIND (kernel|copy|-)
    local name=$1 kind=$2 extra=()
    [[ $kind != - ]] && extra=(--expect-kind "$kind")
    [[ -f $W/$name.json ]] && extra+=(--workload "$W/$name.json")
    "$REPLAY" "$W/$name.jsonl" --mode sigma --findings "$W/$name.sigma.jsonl" --top 8 >"$W/$name.sigma.txt" 2>&1
    "$REPLAY" "$W/$name.jsonl" --mode robust --top 8 >"$W/$name.robust.txt" 2>&1
    "$PY" -m gpucheck.compare_anomalies --name "$name" --events "$W/$name.jsonl" "${extra[@]}" \
        --sigma "$W/$name.sigma.jsonl" --sigma-summary "$W/$name.sigma.txt" \
        --replay-summary "$W/$name.robust.txt" --row-out "$W/$name.row.json" 2>&1 | tee -a "$REPORT"
    ((PIPESTATUS[0] == 0)) || fail=1
    sed -n 2,12p "$W/$name.robust.txt" | sed 's/^/   robust: /' | tee -a "$REPORT"
    sed -n 2,12p "$W/$name.sigma.txt" | sed 's/^/   sigma:  /' | tee -a "$REPORT"
}

under_run() { # NAME EXPECT-KIND CMD... (the workload writes $W/NAME.json)
    local name=$1 kind=$2
    shift 2
    timeout --kill-after=10 240 "$OBS" --format jsonl --trace-all "${RING[@]}" --output "$W/$name.jsonl" \
        run -- "$@" --out "$W/$name.json" >"$W/$name.out" 2>"$W/$name.err"
    note "== $name (gpu-observer run, CUPTI): rc=$? — $(tail -n 1 "$W/$name.out")"
    judge "$name" "$kind"
}

observed() { # NAME EXPECT-KIND CMD...: an all-process observer without CUPTI
    local name=$1 kind=$2 t=0
    shift 2
    "$OBS" --format jsonl --trace-all "${RING[@]}" --no-nvml --output "$W/$name.jsonl" 2>"$W/$name.err" &
    local op=$!
    while ! grep -q "gpu-observer: ready" "$W/$name.err" 2>/dev/null && ((t < 300)); do sleep 0.1; t=$((t + 1)); done
    "$@" --out "$W/$name.json" >"$W/$name.out" 2>&1
    local rc=$?
    sleep 1
    kill -INT "$op"; wait "$op"
    note "== $name (all-process observer, no CUPTI): rc=$rc, observer rc=$? — $(tail -n 1 "$W/$name.out")"
    judge "$name" "$kind"
}

# OTLP, with duration sampling on (no --trace-all): 5 µs spin kernels, every 1 000th 50 µs —
# under the 100 µs threshold, written and exported only because it is anomalous.
otlp_run() { # NAME
    local name=$1 port=${PORT:-4317} rc=0
    "$SINK" grpc "$port" 200 "$W/$name.sink.json" 2>"$W/$name.sink.err" &
    local sp=$!
    sleep 0.5
    timeout --kill-after=10 180 "$OBS" --format jsonl --output "$W/$name.jsonl" \
        --otlp-endpoint "http://127.0.0.1:$port" --otlp-interval-ms 1000 \
        run -- "$PY" "$A" --kind spin --spin-us 5 --iterations 10000 --plant-every 1000 --out "$W/$name.json" \
        >"$W/$name.out" 2>"$W/$name.err" || rc=$?
    kill -TERM "$sp" 2>/dev/null
    wait "$sp"
    note "== $name (gpu-observer run, CUPTI, sampled, OTLP to otlp-sink): rc=$rc — $(tail -n 1 "$W/$name.out")"
    "$PY" -m gpucheck.compare_anomalies --name "$name" --events "$W/$name.jsonl" --workload "$W/$name.json" \
        --expect-kind kernel --otlp "$W/$name.sink.json" --row-out "$W/$name.row.json" 2>&1 | tee -a "$REPORT"
    ((PIPESTATUS[0] == 0)) || fail=1
}

# The terminal view of the same loop: the final summary's anomaly count for the process (at
# least the planted kernels) and its most severe finding.
term_run() { # NAME
    local name=$1 rc=0
    timeout --kill-after=10 180 "$OBS" --format terminal --output "$W/$name.txt" \
        run -- "$PY" "$A" --kind spin --spin-us 5 --iterations 10000 --plant-every 1000 --out "$W/$name.json" \
        >"$W/$name.out" 2>"$W/$name.err" || rc=$?
    note "== $name (gpu-observer run, CUPTI, terminal view to a file): rc=$rc — $(tail -n 1 "$W/$name.out")"
    "$PY" - "$W/$name.txt" "$W/$name.json" <<'EOF2' 2>&1 | tee -a "$REPORT"
import json, re, sys
text, w = open(sys.argv[1], encoding="utf-8", errors="replace").read(), json.load(open(sys.argv[2]))
planted = len(w["planted"])
# The process's block of the final summary: its `pid N (comm)` line, then the indented lines.
lines = text.splitlines()
at = max((i for i, l in enumerate(lines) if l.startswith(f"pid {w['pid']} (")), default=None)
block = ""
if at is not None:
    for l in lines[at + 1:]:
        if not l.startswith("  "):
            break
        block += l + "\n"
count = re.search(r"^  anomalies\s+(\d+)$", block, re.M)
worst = re.search(r"^    most severe (.*)$", block, re.M)
n = int(count.group(1)) if count else -1
ok = n >= planted and worst is not None
print(f"terminal: anomalies {n} (planted {planted}); most severe: {worst.group(1) if worst else None} -> {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
EOF2
    ((PIPESTATUS[0] == 0)) || fail=1
}

want() { [[ -z ${KINDS:-} || " $KINDS " == *" $1 "* ]]; }
note "# Anomaly detection on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) ($(cat "$(dirname "$OBS")/COMMIT" 2>/dev/null || echo '?'))"
want train && under_run train - "$PY" "$B" --kind train --seconds 8
want gemm && under_run gemm - "$PY" "$B" --kind gemm --seconds 6
want launch && under_run launch - "$PY" "$B" --kind launch --seconds 4
want sync && under_run sync - "$PY" "$B" --kind sync --seconds 6
want transfer && under_run transfer - "$PY" "$B" --kind transfer --seconds 6
want cupy && under_run cupy - "$PY" "$A" --kind cupy --iterations 8000
want copy && under_run copy - "$PY" "$A" --kind copy --iterations 15000
want spin_plant && under_run spin_plant kernel "$PY" "$A" --kind spin --iterations 20000 --plant-every 1000
want copy_plant && under_run copy_plant copy "$PY" "$A" --kind copy --iterations 15000 --plant-every 1000
want otlp_spin && otlp_run otlp_spin
want term_spin && term_run term_spin
want copy_plant_observed && observed copy_plant_observed copy "$PY" "$A" --kind copy --iterations 15000 --plant-every 1000

# The table (docs/VALIDATION.md, "Anomalies").
"$PY" - "$W" <<'EOF' | tee -a "$REPORT"
import glob, json, os, sys
rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(sys.argv[1], "*.row.json")))]
pct = lambda v: "-" if v is None else f"{v * 100:.3f} %"
print("\n| run | values checked | robust: flagged | robust: false positives | planted flagged (robust) | sigma: flagged | sigma: false positives | planted flagged (sigma) | result |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
for r in rows:
    pl = f"{r['planted_flagged']}/{r['planted']}" if r["planted"] else "-"
    spl = f"{r['sigma_planted_flagged']}/{r['planted']}" if r["planted"] and "sigma_planted_flagged" in r else "-"
    print(f"| {r['name']} | {r['checked']} | {r['flagged_lines']} | {r['false_positives']} ({pct(r['fp_rate'])}) | {pl} "
          f"| {r.get('sigma_flagged', '-')} | {r.get('sigma_false_positives', '-')} ({pct(r.get('sigma_fp_rate'))}) | {spl} "
          f"| {'PASS' if r['pass'] else 'FAIL: ' + r['why']} |")
EOF
# Every run's findings and summaries; the whole capture of the smaller runs.
for f in "$W"/*.jsonl; do
    grep -h '"type":"anomaly"\|"scope":"total"' "$f" >"${f%.jsonl}.findings.txt"
    gzip -q "$f"
done
tar czf "$OUTDIR/anomaly-artifacts.tar.gz" -C "$W" --exclude='*sigma.jsonl.gz' --exclude='train.jsonl.gz' \
    --exclude='launch.jsonl.gz' --exclude='gemm.jsonl.gz' --exclude='sync.jsonl.gz' . 2>/dev/null
((fail)) && note "ANOMALY VALIDATION FAILED" || note "ANOMALY VALIDATION PASSED"
exit "$fail"
