"""Judges one run of gpu/validate_anomalies.sh (issue 14): the observer's anomaly findings on a
steady loop (false positives) or on a loop with planted outliers (every planted one flagged),
with the findings of the other mode on the same capture (anomaly-replay --mode sigma) beside.

usage: python3 -m gpucheck.compare_anomalies --name NAME --events RUN.jsonl[.gz]
           [--workload W.json] [--sigma SIGMA.findings.jsonl --sigma-summary SIGMA.txt]
           [--replay-summary ROBUST.txt] [--expect-kind kernel|copy] [--max-fp-rate 0.001]
           [--otlp SINK.json] [--row-out ROW.json]

A finding is *planted* when it lies in a planted window of the workload (W.json `planted`:
[{start_ns, end_ns}], the call and the synchronize after it) — the planted launch or copy, or
the synchronize that waited for it (a consequence, counted apart) — and a *false positive*
otherwise. The false-positive rate is false positives / values checked (the summary's
`anomalies.checked`). Planted runs pass when every planted window holds a finding of the
expected kind (a kernel for a planted launch; a call or bandwidth finding for a planted copy)
and the rate is at most --max-fp-rate; steady runs when the rate is. Exit 0 pass, 1 fail,
2 unusable input.

With --otlp (what otlp-sink decoded from the same run's OTLP export), also: every `anomaly`
line is a `gpu.anomaly` span event with the same what and observed value (and no event is
extra), the `gpu.anomalies` counter adds up to the lines by `what`, and each planted kernel's
`gpu_kernel` line was written although duration sampling was on (a planted kernel under the
100 µs threshold is kept only because it is anomalous).
"""

import argparse
import collections
import json
import re
import sys

from .common import eprint
from .jsonl import ReadCounts, read_jsonl

SUMMARY_RE = re.compile(r"checked (\d+) flagged (\d+)")


def replay_summary(path):
    """(checked, flagged) from anomaly-replay's first line, or None."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            m = SUMMARY_RE.search(f.readline())
    except OSError:
        return None
    return (int(m.group(1)), int(m.group(2))) if m else None


def load_findings(path):
    """anomaly-replay's findings: [{ts_ns, pid, series, ...}]."""
    return list(read_jsonl(path))


def matches_kind(what, expect):
    if expect == "kernel":
        return what == "kernel"
    if expect == "copy":
        return what in ("call", "bandwidth")
    return True


def classify(findings, planted, expect, pid):
    """(planted windows flagged, findings in windows, of the expected kind in windows, false
    positives). `findings`: (ts_ns, what) of the workload's process."""
    hit = [False] * len(planted)
    in_window = expected = fp = 0
    for ts, what in findings:
        w = next((i for i, p in enumerate(planted) if p["start_ns"] <= ts <= p["end_ns"]), None)
        if w is None:
            fp += 1
            continue
        in_window += 1
        if matches_kind(what, expect):
            expected += 1
            hit[w] = True
    return sum(hit), in_window, expected, fp


def check_otlp(path, lines, planted, kernels, expect, row):
    """What --otlp checks (module doc); the reasons it failed, empty when it did not."""
    try:
        with open(path, encoding="utf-8") as f:
            sink = json.load(f)
    except (OSError, ValueError) as exc:
        return [f"OTLP result unreadable: {exc}"]
    why = []
    events = sink.get("anomaly_events") or []
    row["otlp_events"] = len(events)

    def obs(v):
        try:
            return round(float(v), 1)
        except (TypeError, ValueError):
            return None

    want = collections.Counter((d.get("what"), obs(d.get("observed"))) for d in lines)
    got = collections.Counter((e["attributes"].get("gpu.anomaly.what"), obs(e["attributes"].get("gpu.anomaly.observed")))
                              for e in events)
    if want != got:
        missing, extra = want - got, got - want
        why.append(f"OTLP events differ from the anomaly lines: {sum(missing.values())} missing, "
                   f"{sum(extra.values())} extra (e.g. {list((missing or extra).items())[:2]})")
    by_what = collections.Counter(d.get("what") for d in lines)
    points = (sink.get("metrics", {}).get("gpu.anomalies") or {}).get("points", [])
    counter = collections.Counter()
    for p in points:
        counter[p["attributes"].get("gpu.anomaly.what")] += int(p.get("value", 0))
    row["otlp_counter"] = dict(counter)
    if counter != by_what:
        why.append(f"gpu.anomalies counter {dict(counter)} != anomaly lines by what {dict(by_what)}")
    if expect == "kernel" and planted:
        written = sum(1 for p in planted if any(p["start_ns"] <= t <= p["end_ns"] for t, _ in kernels))
        row["planted_kernels_written"] = f"{written}/{len(planted)}"
        if written < len(planted):
            why.append(f"{len(planted) - written} planted kernels' gpu_kernel lines not written")
    return why


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--workload")
    ap.add_argument("--sigma")
    ap.add_argument("--sigma-summary")
    ap.add_argument("--replay-summary")
    ap.add_argument("--expect-kind", choices=("kernel", "copy"))
    ap.add_argument("--max-fp-rate", type=float, default=0.001)
    ap.add_argument("--otlp")
    ap.add_argument("--row-out")
    a = ap.parse_args(argv)

    workload = {}
    if a.workload:
        try:
            with open(a.workload, encoding="utf-8") as f:
                workload = json.load(f)
        except (OSError, ValueError) as exc:
            eprint(f"{a.name}: workload result unreadable: {exc}")
            return 2
    pid = workload.get("pid")
    planted = workload.get("planted") or []
    counts = ReadCounts()
    total = None
    robust = []
    lines = []  # every process's anomaly lines (the OTLP export has them all)
    kernels = []  # the workload's gpu_kernel lines: (gpu start, duration)
    for d in read_jsonl(a.events, counts, want=('"anomaly"', '"scope":"total"', '"gpu_kernel"')):
        if d.get("type") == "anomaly":
            lines.append(d)
            if pid is None or d.get("pid") == pid:
                robust.append((d.get("ts_ns", 0), d.get("what")))
        elif d.get("type") == "gpu_kernel" and d.get("pid") == pid:
            kernels.append((d.get("gpu_start_ns", 0), d.get("gpu_duration_ns", 0)))
        elif d.get("type") == "summary" and d.get("scope") == "total":
            total = d.get("anomalies")
    if not total or not total.get("checked"):
        eprint(f"{a.name}: no total summary with anomaly counts in {a.events}")
        return 2
    checked = total["checked"]
    hit, in_win, expected, fp = classify(robust, planted, a.expect_kind, pid)
    row = {
        "name": a.name,
        "checked": checked,
        "flagged": total.get("flagged"),
        "flagged_lines": len(robust),
        "planted": len(planted),
        "planted_flagged": hit,
        "in_planted_windows": in_win,
        "expected_kind_in_windows": expected,
        "false_positives": fp,
        "fp_rate": fp / checked,
        "bad_lines": counts.bad,
    }
    if a.sigma:
        sigma = [(f.get("ts_ns", 0), f.get("series", "").split(" ", 1)[0]) for f in load_findings(a.sigma)
                 if pid is None or f.get("pid") == pid]
        s_hit, _, _, s_fp = classify(sigma, planted, a.expect_kind, pid)
        s_sum = replay_summary(a.sigma_summary) if a.sigma_summary else None
        s_checked = s_sum[0] if s_sum else checked
        row.update(sigma_flagged=len(sigma), sigma_planted_flagged=s_hit, sigma_false_positives=s_fp,
                   sigma_fp_rate=s_fp / s_checked if s_checked else None)
    if a.replay_summary:
        r = replay_summary(a.replay_summary)
        row["replay_robust"] = list(r) if r else None
    ok = row["fp_rate"] <= a.max_fp_rate and (not planted or hit == len(planted))
    why = []
    if a.otlp:
        otlp_why = check_otlp(a.otlp, lines, planted, kernels, a.expect_kind, row)
        why += otlp_why
        ok &= not otlp_why
    row["pass"] = ok
    if row["fp_rate"] > a.max_fp_rate:
        why.append(f"false-positive rate {row['fp_rate'] * 100:.3f} % > {a.max_fp_rate * 100:.3f} %")
    if planted and hit < len(planted):
        why.append(f"{len(planted) - hit} of {len(planted)} planted outliers not flagged")
    row["why"] = "; ".join(why)
    if a.otlp:
        print(f"{a.name}: OTLP: {row['otlp_events']} gpu.anomaly span events for {len(lines)} anomaly lines, "
              f"gpu.anomalies counter {row['otlp_counter']}, planted kernels written {row.get('planted_kernels_written')}")
    print(f"{a.name}: checked {checked}, flagged {row['flagged']} ({len(robust)} lines), planted "
          f"{hit}/{len(planted)} flagged, {in_win} findings in planted windows, false positives "
          f"{fp} ({row['fp_rate'] * 100:.3f} %)"
          + (f"; sigma: flagged {row['sigma_flagged']}, planted {row['sigma_planted_flagged']}/"
             f"{len(planted)}, false positives {row['sigma_false_positives']} "
             f"({(row['sigma_fp_rate'] or 0) * 100:.3f} %)" if a.sigma else "")
          + f" -> {'PASS' if ok else 'FAIL: ' + row['why']}")
    if a.row_out:
        with open(a.row_out, "w", encoding="utf-8") as f:
            json.dump(row, f)
            f.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
