"""What the three comparers (compare, compare_ground_truth, compare_cupti) share: their common
arguments, the Check row, the pid fallback and the writing of the Markdown section and JSON
result that make_report.py assembles."""

import json


def comparer_args(ap, comm_hint=None, helps=False):
    """The arguments every comparer takes (`helps`: with help texts)."""
    h = (lambda s: s) if helps else (lambda s: None)
    ap.add_argument("--workload", required=True, help=h("workload JSON"))
    ap.add_argument("--events", required=True, help=h("observer JSONL (.gz ok)"))
    ap.add_argument("--name", required=True, help=h("short run name"))
    ap.add_argument("--title", default=None, help=h("section title"))
    ap.add_argument("--comm-hint", default=comm_hint, help=h("comm prefix for pid fallback"))
    ap.add_argument("--section-out", default=None, help=h("write Markdown section here"))
    ap.add_argument("--result-out", default=None, help=h("write JSON result here"))
    return ap


class Check:
    """One compared metric: expected vs captured; strict ones decide the result."""

    def __init__(self, metric, expected, captured, strict, ok=None, label=None, show_pct=True,
                 group=None):
        self.metric = metric
        self.expected = expected
        self.captured = captured
        self.strict = strict
        self.ok = (expected == captured) if ok is None else bool(ok)
        self.label = label
        self.show_pct = show_pct
        self.group = group

    def mark(self):
        if self.label:
            return self.label
        if self.ok:
            return "ok"
        return "**MISMATCH**" if self.strict else "differs (info)"

    def pct(self):
        e, c = self.expected, self.captured
        if not self.show_pct or not isinstance(e, int) or not isinstance(c, int) \
                or isinstance(e, bool) or isinstance(c, bool):
            return "n/a"
        if e == 0:
            return "100.0%" if c == 0 else "n/a"
        return f"{100.0 * c / e:.1f}%"

    def as_dict(self):
        return {"metric": self.metric, "expected": self.expected, "captured": self.captured,
                "strict": self.strict, "ok": self.ok}


def pick_pid(want, hint, totals, comms, score, notes, unit="event", list_seen=True):
    """The workload's pid, or (a PID namespace between observer and workload) the pid whose comm
    starts with `hint`, best by `score`. totals: pid -> lines seen; comms: pid -> Counter."""
    if totals.get(want, 0) > 0:
        return want
    notes.append(f"WARN: no {unit} carries the workload's pid {want}")
    if hint:
        h = hint[:15].lower()
        cands = [p for p, cs in comms.items() if any(c.lower().startswith(h) for c in cs)]
        if cands:
            best = max(cands, key=score)
            notes.append(f"WARN: falling back to pid {best} (comm starts with '{h}'; "
                         f"PID namespace mismatch?)")
            return best
    if list_seen:
        top = ", ".join(f"{p}:{n}({'/'.join(c for c, _ in comms[p].most_common(2))})"
                        for p, n in sorted(totals.items(), key=lambda kv: -kv[1])[:8])
        notes.append(f"pids seen (pid:{unit}s(comm)): {top or 'none'}")
    return want


def write_outputs(a, md, result):
    """The Markdown section (--section-out) and the JSON result (--result-out), if asked for."""
    if a.section_out:
        with open(a.section_out, "w", encoding="utf-8") as f:
            f.write("\n".join(md) + "\n")
    if a.result_out:
        with open(a.result_out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)
            f.write("\n")
