"""Judges one run of gpu/validate_anomalies.sh (issue 14): the observer's anomaly findings on a
steady loop (false positives) or on a loop with planted outliers (every planted one flagged),
with the findings of the other mode on the same capture (anomaly-replay --mode sigma) beside.

usage: python3 -m gpucheck.compare_anomalies --name NAME --events RUN.jsonl[.gz]
           [--workload W.json] [--sigma SIGMA.findings.jsonl --sigma-summary SIGMA.txt]
           [--replay-summary ROBUST.txt] [--expect-kind kernel|copy] [--max-fp-rate 0.001]
           [--row-out ROW.json]

A finding is *planted* when it lies in a planted window of the workload (W.json `planted`:
[{start_ns, end_ns}], the call and the synchronize after it) — the planted launch or copy, or
the synchronize that waited for it (a consequence, counted apart) — and a *false positive*
otherwise. The false-positive rate is false positives / values checked (the summary's
`anomalies.checked`). Planted runs pass when every planted window holds a finding of the
expected kind (a kernel for a planted launch; a call or bandwidth finding for a planted copy)
and the rate is at most --max-fp-rate; steady runs when the rate is. Exit 0 pass, 1 fail,
2 unusable input.
"""

import argparse
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
    for d in read_jsonl(a.events, counts, want=('"anomaly"', '"scope":"total"')):
        if d.get("type") == "anomaly" and (pid is None or d.get("pid") == pid):
            robust.append((d.get("ts_ns", 0), d.get("what")))
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
    row["pass"] = ok
    why = []
    if row["fp_rate"] > a.max_fp_rate:
        why.append(f"false-positive rate {row['fp_rate'] * 100:.3f} % > {a.max_fp_rate * 100:.3f} %")
    if planted and hit < len(planted):
        why.append(f"{len(planted) - hit} of {len(planted)} planted outliers not flagged")
    row["why"] = "; ".join(why)
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
