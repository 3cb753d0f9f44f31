"""Bottleneck verdicts (issue 13) for gpu/validate_verdicts.sh: each workload of
workloads/bottleneck.py, built to have one known bottleneck, against the class the observer
gives it.

usage:
  python3 -m gpucheck.compare_verdicts check --events F.jsonl --name NAME --kind KIND --mode MODE
        [--workload W.json] [--pid PID] [--expect CLASS[:HOST]|none] [--terminal T.txt]
        [--workload-rc N] [--observer-rc N] [--result-out R.json] [--full-s 9]
      One run of one observer (MODE: cupti = `gpu-observer run`, all = all processes,
      pid = `--pid`). Exit 0: PASS (or informational), 1: FAIL, 2: the events file cannot be read.
  python3 -m gpucheck.compare_verdicts report --out VERDICTS.md [--json-out R.json]
        [--env ENV.json] [--status-file S.tsv] [--settings TEXT] RESULT.json...
      The report of all runs (S.tsv: "NAME<TAB>KIND<TAB>MODE<TAB>STATUS" for runs without a
      result). Exit 0 if every row passed (or is informational), else 1.

What is read (through gpucheck.jsonl, lines pre-filtered): the `verdict` lines, the per-process
`summary` (its `verdict` is the whole run's), `process_exit` and `cupti` lines. The observer
writes a process's `verdict` line when its class changes or 10 s after the last one, and none
after the process exited; so the class at any tick is the one of the last line written before
it. The window of a tick is min(10 s, time since the process's first sample), the first sample
being the first line's `ts_ns − window_ns`. The checked span is where the window is full
length: from the first sample + `--full-s` (9 s) to the process's exit (`process_exit`, else its
last line). In that span each line's class holds from its `ts_ns` to the next line (or the
exit); the expected class must be both the majority of the span's time and the class at its end
(the last line); for host_bound with an expected host, every host_bound line in effect there must
carry that `evidence.host`. A process observed for less than `--full-s` has no full-length
window: FAIL. The whole-run verdict of the summary and the terminal summary's verdict line are
shown, not checked. Evidence members the observer does not write yet are shown as absent.
"""

import argparse
import collections
import json
import re
import sys

from .checks import pick_pid
from .common import as_int, eprint, is_num, short, table_lines
from .jsonl import ReadCounts, load_json, read_jsonl

KEEP = ('"verdict"', '"summary"', '"process_exit"', '"cupti"')
TYPES = ("verdict", "summary", "process_exit", "cupti")
FULL_S = 9.0

# The class each workload of workloads/bottleneck.py is built for (None: informational), and the
# host of host_bound (evidence.host).
EXPECTED = {
    "launch": ("launch_bound", None),
    "gemm": ("gpu_bound", None),
    "transfer": ("transfer_bound", None),
    "sync": ("sync_bound", None),
    "cpu": ("host_bound", "cpu_busy"),
    "sleep": ("host_bound", "waiting"),
    "cpu_inline": None,
    "train": None,
}
# The workload options of each kind (shown with its measurements).
PARAMS = {"launch": ("launch_",), "gemm": ("gemm_",), "transfer": ("transfer_",), "sync": ("sync_",),
          "cpu": ("cpu_ms", "step_us"), "cpu_inline": ("cpu_ms", "step_us"),
          "sleep": ("sleep_ms", "step_us"), "train": ("train_",)}
CLASSES = ("idle", "gpu_bound", "launch_bound", "sync_bound", "transfer_bound", "host_bound",
           "mixed")
HOSTS = ("cpu_busy", "waiting")
MODES = {"cupti": "`run` (CUPTI)", "all": "all processes (NVML)", "pid": "`--pid` (NVML)"}
DIRS = {"cpu_to_gpu": "H→D", "gpu_to_cpu": "D→H", "gpu_to_gpu": "D→D", "unknown": "other"}


def parse_expect(text, kind):
    """(class, host) from "CLASS[:HOST]", None from "none"; the EXPECTED entry without text."""
    if text is None:
        return EXPECTED.get(kind)
    text = text.strip()
    if text.lower() in ("", "none", "info"):
        return None
    cls, _, host = text.partition(":")
    if cls not in CLASSES:
        raise ValueError(f"unknown class '{cls}' (one of {', '.join(CLASSES)})")
    if host and host not in HOSTS:
        raise ValueError(f"unknown host '{host}' (one of {', '.join(HOSTS)})")
    return cls, host or None


# The rules' thresholds (gpu-observer/src/analyze/verdict.rs `limits`), for the diagnosis of a
# failed row only: the class itself is always the observer's.
LIMITS = {"transfer_copy": 0.50, "gpu_busy": 0.70, "sync_per_s": 100.0, "sync_blocked": 0.30,
          "sync_busy_below": 0.50, "launch_busy_below": 0.50, "launch_thread_cpu": 0.80,
          "host_busy_below": 0.30}


def conditions(cls, ev):
    """The conditions of `cls`'s rule on the evidence: [(text, held)] (held None: unknown)."""
    ev = ev or {}
    busy = ev.get("gpu_busy") if is_num(ev.get("gpu_busy")) else None

    def cond(name, v, op, limit, fmt="{:.0%}"):
        if not is_num(v):
            return (f"{name} unknown (needs {op} {fmt.format(limit)})", None)
        held = v >= limit if op == "≥" else v < limit
        return (f"{name} {fmt.format(v)} {op} {fmt.format(limit)}", held)
    L = LIMITS
    if cls == "transfer_bound":
        return [cond("copy time", ev.get("copy_fraction"), "≥", L["transfer_copy"])]
    if cls == "gpu_bound":
        return [cond("GPU busy", busy, "≥", L["gpu_busy"])]
    if cls == "sync_bound":
        return [cond("syncs/s", ev.get("syncs_per_s"), "≥", L["sync_per_s"], "{:.0f}"),
                cond("blocked in syncs", ev.get("sync_blocked"), "≥", L["sync_blocked"]),
                cond("GPU busy", busy, "<", L["sync_busy_below"])]
    if cls == "launch_bound":
        k, i = ev.get("mean_kernel_ns"), ev.get("mean_launch_interval_ns")
        if is_num(k) and is_num(i):
            ki = (f"mean kernel {k / 1e3:.1f} µs < {i / 1e3:.1f} µs between launches", k < i)
        else:
            ki = ("mean kernel time unknown (only CUPTI gives kernel times: without it launch_bound "
                  "cannot hold)" if not is_num(k) else "no launches", None)
        return [cond("GPU busy", busy, "<", L["launch_busy_below"]),
                cond("launching thread CPU", ev.get("launch_thread_cpu"), "≥", L["launch_thread_cpu"]), ki]
    if cls == "host_bound":
        return [cond("GPU busy", busy, "<", L["host_busy_below"])]
    return []


def diagnosis(expected, got, ev):
    """Why `got` and not `expected`, from the evidence: the expected rule's conditions, and
    that an earlier rule comes first."""
    order = ["transfer_bound", "gpu_bound", "sync_bound", "launch_bound", "host_bound"]
    out = []
    conds = conditions(expected, ev)
    if conds:
        out.append(f"{expected} needs: " + "; ".join(
            t + ("" if h is None else (" (holds)" if h else " (does not hold)")) for t, h in conds))
    if all(h for _, h in conds) and conds and got in order and expected in order \
            and order.index(got) < order.index(expected):
        out.append(f"{got} is tried before {expected} (rules in order: {', '.join(order)})")
    if got == "mixed" and not is_num((ev or {}).get("gpu_busy")):
        out.append("GPU busy unknown: no GPU rule can hold (no CUPTI record, no NVML per-process sample "
                   "in the window; NVML's per-process utilization is read every 10 s)")
    return out


# ---------------------------------------------------------------- reading


def read_events(path):
    """The lines that matter, by pid."""
    counts = ReadCounts()
    data = {"verdicts": collections.defaultdict(list), "summaries": {}, "exits": {},
            "cupti": collections.defaultdict(list), "total": None,
            "comms": collections.defaultdict(collections.Counter), "counts": counts}
    for ev in read_jsonl(path, counts, want=KEEP):
        t = ev.get("type")
        if t not in TYPES:
            continue
        pid = as_int(ev.get("pid"))
        if pid is not None and ev.get("comm"):
            data["comms"][pid][str(ev["comm"])] += 1
        if t == "verdict" and pid is not None:
            data["verdicts"][pid].append(ev)
        elif t == "summary":
            scope = ev.get("scope")
            if scope == "total" or (scope is None and pid is None):
                data["total"] = ev
            elif pid is not None:
                data["summaries"][pid] = ev
        elif t == "process_exit" and pid is not None:
            data["exits"][pid] = as_int(ev.get("ts_ns"))
        elif t == "cupti" and pid is not None:
            data["cupti"][pid].append(ev)
    return data


def choose_pid(data, want, notes):
    """The workload's pid: the given one, else (a PID namespace between them) a python process
    with lines, else the process whose summary has the most events."""
    totals = collections.Counter()
    for pid, ls in data["verdicts"].items():
        totals[pid] += len(ls)
    for pid in data["summaries"]:
        totals[pid] += 1

    def events(pid):
        s = data["summaries"].get(pid) or {}
        return as_int(s.get("events"), 0), len(data["verdicts"].get(pid, ()))

    if want is not None:
        return pick_pid(want, "python", totals, data["comms"], events, notes, unit="verdict/summary line")
    if not totals:
        notes.append("no verdict or summary line of any process")
        return None
    best = max(totals, key=events)
    notes.append(f"workload pid unknown: the process with the most events, pid {best}")
    return best


# ---------------------------------------------------------------- analysis


def ns(v):
    return as_int(v, 0) or 0


def line_view(line, t0):
    ev = line.get("evidence") if isinstance(line.get("evidence"), dict) else {}
    return {"t_s": round((ns(line.get("ts_ns")) - t0) / 1e9, 3),
            "window_s": round(ns(line.get("window_ns")) / 1e9, 3),
            "class": line.get("class"), "secondary": line.get("secondary"),
            "host": ev.get("host"), "evidence": ev, "hint": line.get("hint")}


def analyze(lines, exit_ns, full_ns, whole_ns=None):
    """The verdict lines of one process: timeline, and the classes over the full-length span.
    The span ends at the process's exit (`exit_ns`); without it, where the whole run's window
    (`whole_ns`, from the first sample) ends, else at the last line."""
    lines = sorted(lines, key=lambda l: ns(l.get("ts_ns")))
    res = {"lines": len(lines), "timeline": [], "full": None}
    if not lines:
        return res
    t_first = ns(lines[0].get("ts_ns")) - ns(lines[0].get("window_ns"))
    t_last = ns(lines[-1].get("ts_ns"))
    if exit_ns is not None:
        t_end, end_from = max(exit_ns, t_last), "process_exit"
    elif whole_ns:
        t_end, end_from = max(t_first + whole_ns, t_last), "whole-run window (no process_exit line)"
    else:
        t_end, end_from = t_last, "last verdict line (no process_exit line, no whole-run verdict)"
    res.update({"t_first_ns": t_first, "t_end_ns": t_end, "observed_s": round((t_end - t_first) / 1e9, 3),
                "exit_seen": exit_ns is not None, "end_from": end_from,
                "timeline": [line_view(l, t_first) for l in lines]})
    full_from = t_first + full_ns
    if t_end < full_from:
        return res
    # The line in effect when the span opens, and every line written inside it.
    start = max(i for i, l in enumerate(lines) if ns(l.get("ts_ns")) <= full_from) \
        if ns(lines[0].get("ts_ns")) <= full_from else 0
    span = lines[start:]
    time_by = collections.Counter()
    order = {}
    for j, l in enumerate(span):
        s = max(ns(l.get("ts_ns")), full_from)
        e = ns(span[j + 1].get("ts_ns")) if j + 1 < len(span) else t_end
        time_by[l.get("class")] += max(0, min(e, t_end) - s)
        order[l.get("class")] = j
    total = sum(time_by.values())
    last = span[-1].get("class")
    if total > 0:
        majority = max(time_by, key=lambda c: (time_by[c], order[c]))
        share = time_by[majority] / total
    else:
        majority, share = last, 1.0
    res["full"] = {
        "from_s": round(full_ns / 1e9, 3), "span_s": round(total / 1e9, 3),
        "time_by_class_s": {c: round(v / 1e9, 3) for c, v in time_by.items()},
        "majority": majority, "majority_share": round(share, 4), "last": last,
        "lines_in_effect": [line_view(l, t_first) for l in span],
        "explicit_full_lines": [l.get("class") for l in lines if ns(l.get("window_ns")) >= full_ns],
        "deciding": line_view(span[-1], t_first),
    }
    return res


def whole_run(summary):
    if summary is None:
        return None
    v = summary.get("verdict")
    if not isinstance(v, dict):
        return {"absent": "verdict" not in summary}
    ev = v.get("evidence") if isinstance(v.get("evidence"), dict) else {}
    return {"class": v.get("class"), "secondary": v.get("secondary"),
            "window_s": round(ns(v.get("window_ns")) / 1e9, 3), "evidence": ev, "hint": v.get("hint")}


def parse_terminal(path, pid):
    """The block of pid `pid` in the terminal final summary, and its verdict line's class."""
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            text = f.read().splitlines()
    except OSError as exc:
        return {"error": f"cannot read {path}: {exc}"}
    head = re.compile(rf"^pid {pid} \(")
    block = []
    for i, line in enumerate(text):
        if head.match(line):
            block.append(line)
            for nxt in text[i + 1:]:
                if not nxt.strip() or not nxt.startswith(" "):
                    break
                block.append(nxt)
            break
    res = {"header": text[0] if text else None, "block": block[:40], "verdict_line": None, "class": None}
    for line in block:
        m = re.match(r"^\s+verdict\s+(\S+)(.*)$", line)
        if m:
            res["verdict_line"] = line.strip()
            res["class"] = m.group(1)
            m2 = re.search(r"\(then (\w+)\)", m.group(2))
            res["secondary"] = m2.group(1) if m2 else None
            break
    if not block:
        res["error"] = f"no block for pid {pid} in the terminal summary"
    return res


# ---------------------------------------------------------------- formats


def pct(v, nd=1):
    return f"{v * 100:.{nd}f}%" if is_num(v) else "-"


def us(v):
    return f"{v / 1e3:.1f}" if is_num(v) else "-"


def absent(ev, key):
    return "(absent)" if key not in ev else "-"


def evidence_cells(ev):
    """Display strings of the evidence members (absent ones said so)."""
    ev = ev or {}
    c = {}
    b = ev.get("gpu_busy")
    c["busy"] = f"{pct(b)} ({ev.get('gpu_busy_source') or '?'})" if is_num(b) else \
        ("unknown" if "gpu_busy" in ev else "(absent)")
    lps = ev.get("launches_per_s")
    c["launches"] = f"{lps:,.0f}" if is_num(lps) else absent(ev, "launches_per_s")
    c["kernel_vs_interval"] = f"{us(ev.get('mean_kernel_ns'))} / {us(ev.get('mean_launch_interval_ns'))}"
    c["thread_cpu"] = pct(ev.get("launch_thread_cpu"), 0) if "launch_thread_cpu" in ev else "(absent)"
    c["process_cpu"] = pct(ev.get("process_cpu"), 0) if "process_cpu" in ev else "(absent)"
    c["host"] = str(ev["host"]) if ev.get("host") is not None else absent(ev, "host")
    s = ev.get("syncs_per_s")
    c["syncs"] = f"{s:.0f}" if is_num(s) else absent(ev, "syncs_per_s")
    c["blocked"] = pct(ev.get("sync_blocked"), 0) if "sync_blocked" in ev else "(absent)"
    c["copy"] = pct(ev.get("copy_fraction"), 0) if "copy_fraction" in ev else "(absent)"
    copies = ev.get("copies")
    if isinstance(copies, dict):
        parts = []
        for d, v in copies.items():
            if not isinstance(v, dict) or not as_int(v.get("bytes"), 0):
                continue
            g = v.get("gb_per_s")
            parts.append(f"{DIRS.get(d, d)} {g:.1f}" if is_num(g) else f"{DIRS.get(d, d)} -")
        link = ev.get("link_gb_per_s")
        c["copies"] = (", ".join(parts) or "none") + (f" (link {link:.0f})" if is_num(link) else "")
    else:
        c["copies"] = "(absent)"
    c["pageable"] = pct(ev.get("pageable_share"), 0) if "pageable_share" in ev else "(absent)"
    tk = ev.get("top_kernels")
    if isinstance(tk, list) and tk and isinstance(tk[0], dict):
        k = tk[0]
        gpu = as_int(k.get("gpu_ns"))
        c["top_kernel"] = (f"{short(k.get('name'), 48)} ×{k.get('count')}"
                           + (f", {gpu / 1e6:.1f} ms" if gpu is not None else ""))
    elif isinstance(tk, list):
        c["top_kernel"] = "none"
    else:
        c["top_kernel"] = "(absent)"
    return c


def cls_txt(c, sec=None):
    if not c:
        return "-"
    return f"{c} (then {sec})" if sec else str(c)


def expect_txt(exp):
    if exp is None:
        return "— (informational)"
    return exp[0] + (f", host {exp[1]}" if exp[1] else "")


# ---------------------------------------------------------------- check


def cmd_check(a):
    try:
        expect = parse_expect(a.expect, a.kind)
    except ValueError as exc:
        eprint(f"compare_verdicts: --expect: {exc}")
        return 2
    notes, reasons = [], []
    wl = load_json(a.workload) if a.workload else None
    want = a.pid if a.pid is not None else (as_int(wl.get("pid")) if isinstance(wl, dict) else None)
    try:
        data = read_events(a.events)
    except (OSError, EOFError) as exc:
        eprint(f"compare_verdicts: cannot read {a.events}: {exc}")
        data = None
    res = {"name": a.name, "kind": a.kind, "mode": a.mode, "mode_title": MODES.get(a.mode, a.mode),
           "expected": None if expect is None else {"class": expect[0], "host": expect[1]},
           "strict": expect is not None, "workload_rc": a.workload_rc, "observer_rc": a.observer_rc,
           "notes": notes, "reasons": reasons}
    if isinstance(wl, dict):
        res["workload"] = {k: wl.get(k) for k in ("pid", "designed", "headline", "setup_s", "steady_s",
                                                   "iterations", "stats", "device", "cuda_injection")}
        res["workload"]["params"] = {k: v for k, v in (wl.get("params") or {}).items()
                                     if k == "seconds" or k.startswith(PARAMS.get(a.kind, ("-",)))}
    if a.workload_rc not in (None, 0):
        reasons.append(f"workload exit status {a.workload_rc}")
    if a.observer_rc not in (None, 0):
        notes.append(f"observer exit status {a.observer_rc}")
    if data is None:
        reasons.append("the observer's output could not be read")
        return finish(a, res, unreadable=True)
    c = data["counts"]
    res["read"] = {"lines": c.lines, "unusable": c.unusable, "filtered": c.filtered}
    if c.unusable:
        notes.append(f"{c.unusable} unusable JSONL line(s) skipped (torn or not JSON)")
    pid = choose_pid(data, want, notes)
    res["pid"] = pid
    summ = data["summaries"].get(pid)
    wr = whole_run(summ)
    whole_ns = int(wr["window_s"] * 1e9) if wr and wr.get("window_s") else None
    an = analyze(data["verdicts"].get(pid, []), data["exits"].get(pid), int(a.full_s * 1e9), whole_ns)
    res.update({"lines": an["lines"], "observed_s": an.get("observed_s"), "exit_seen": an.get("exit_seen"),
                "end_from": an.get("end_from"), "timeline": an["timeline"], "full": an["full"],
                "whole_run": wr})
    if an["lines"] and not an.get("exit_seen"):
        notes.append(f"the process's end taken from the {an['end_from']}")
    if summ is not None:
        cu = summ.get("cupti") if isinstance(summ.get("cupti"), dict) else None
        cstate = cu.get("state") if cu else None
        if cstate is None and data["cupti"].get(pid):
            cstate = data["cupti"][pid][-1].get("state")
        nv = summ.get("nvml") if isinstance(summ.get("nvml"), dict) else {}
        res["observer"] = {"events": summ.get("events"), "dropped": summ.get("dropped"),
                           "cupti_state": cstate, "nvml_sm_mean": nv.get("sm_utilization_mean")}
    else:
        notes.append(f"no per-process summary for pid {pid}")
    if an["lines"] == 0:
        reasons.append(f"no verdict line for pid {pid}")
    elif an["full"] is None:
        reasons.append(f"no full-length window: pid {pid} observed {an['observed_s']:.1f} s "
                       f"(needs ≥ {a.full_s:g} s; run the workload longer)")
    full = an["full"]
    if full and expect is not None:
        cls, host = expect
        if full["majority"] != cls:
            reasons.append(f"majority of the full-length span is {full['majority']} "
                           f"({full['majority_share'] * 100:.0f}%), expected {cls}")
        if full["last"] != cls:
            reasons.append(f"class at the end is {full['last']}, expected {cls}")
        if host:
            for lv in full["lines_in_effect"]:
                if lv["class"] != "host_bound":
                    continue
                got = lv["evidence"].get("host") if "host" in lv["evidence"] else "(absent)"
                if got != host:
                    reasons.append(f"evidence.host {got} at t={lv['t_s']:.1f} s, expected {host}")
    if full and expect is not None and full["last"] != expect[0]:
        res["diagnosis"] = diagnosis(expect[0], full["last"], full["deciding"]["evidence"])
    if full:
        src = full["deciding"]["evidence"].get("gpu_busy_source")
        if a.mode == "cupti" and src != "cupti":
            notes.append(f"GPU busy source under run is {src}, not cupti (CUPTI state "
                         f"{(res.get('observer') or {}).get('cupti_state')})")
        if a.mode in ("all", "pid") and src is None:
            notes.append("GPU busy unknown (no NVML per-process sample in the window)")
    if a.terminal:
        term = parse_terminal(a.terminal, pid)
        res["terminal"] = term
        wr = res["whole_run"] or {}
        if term.get("class") and wr.get("class") and term["class"] != wr["class"]:
            notes.append(f"terminal summary says {term['class']}, the JSON summary {wr['class']} "
                         f"(separate observers)")
        if term.get("error"):
            notes.append(term["error"])
    return finish(a, res)


def finish(a, res, unreadable=False):
    """Status, result file, console lines; the exit status (2: unreadable output)."""
    if res["reasons"]:
        res["status"] = "FAIL"
    else:
        res["status"] = "PASS" if res["strict"] else "INFO"
    if a.result_out:
        with open(a.result_out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1, default=str)
            f.write("\n")
    full = res.get("full") or {}
    wr = res.get("whole_run") or {}
    print(f"{res['name']}: {res['status']}  expected {expect_txt(parse_tuple(res['expected']))}; "
          f"pid {res.get('pid')}, {res.get('lines', 0)} verdict lines, observed "
          f"{'-' if res.get('observed_s') is None else res['observed_s']} s")
    if full:
        print(f"   full-length windows ({full['span_s']:.1f} s): majority {full['majority']} "
              f"({full['majority_share'] * 100:.0f}%), at the end {full['last']}; "
              f"whole run {cls_txt(wr.get('class'), wr.get('secondary'))}")
        c = evidence_cells(full["deciding"]["evidence"])
        print(f"   evidence (t={full['deciding']['t_s']:.1f} s, window {full['deciding']['window_s']:.1f} s): "
              f"busy {c['busy']}, launches/s {c['launches']}, kernel/interval µs {c['kernel_vs_interval']}, "
              f"thread CPU {c['thread_cpu']}, process CPU {c['process_cpu']}, host {c['host']}, "
              f"syncs/s {c['syncs']}, blocked {c['blocked']}, copies {c['copy']} [{c['copies']}]")
    for r in res["reasons"]:
        print(f"   FAIL: {r}")
    for d in res.get("diagnosis") or []:
        print(f"   why: {d}")
    for n in res["notes"]:
        print(f"   note: {n}")
    if unreadable:
        return 2
    return 1 if res["status"] == "FAIL" else 0


def parse_tuple(e):
    return None if not e else (e.get("class"), e.get("host"))


# ---------------------------------------------------------------- report


def read_status(path):
    rows = []
    if not path:
        return rows
    try:
        with open(path, "r", encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 4 and parts[0]:
                    rows.append({"name": parts[0], "kind": parts[1], "mode": parts[2], "status": parts[3]})
    except OSError:
        pass
    return rows


def cmd_report(a):
    results = []
    for p in a.results:
        r = load_json(p)
        if isinstance(r, dict) and r.get("name"):
            results.append(r)
        else:
            eprint(f"compare_verdicts: no result in {p}")
    have = {r["name"] for r in results}
    for s in read_status(a.status_file):
        if s["name"] in have:
            continue
        exp = parse_expect(None, s["kind"])
        results.append({"name": s["name"], "kind": s["kind"], "mode": s["mode"],
                        "mode_title": MODES.get(s["mode"], s["mode"]), "status": s["status"],
                        "strict": exp is not None,
                        "expected": None if exp is None else {"class": exp[0], "host": exp[1]},
                        "reasons": [], "notes": []})
    order_k = {k: i for i, k in enumerate(EXPECTED)}
    order_m = {m: i for i, m in enumerate(MODES)}
    results.sort(key=lambda r: (order_k.get(r.get("kind"), 99), r.get("kind") or "",
                                order_m.get(r.get("mode"), 9)))
    env = load_json(a.env) if a.env else None
    # A strict row must pass; an informational one fails the run only if it failed (not when the
    # time budget left it out).
    failed = [r for r in results if r.get("status") not in ("PASS", "INFO")
              and (r.get("strict") or str(r.get("status")).startswith("FAIL"))]
    overall = "FAIL" if failed or not results else "PASS"
    md = ["# Bottleneck verdicts on a real GPU (issue 13)", ""]
    npass = sum(r.get("status") == "PASS" for r in results)
    ninfo = sum(r.get("status") == "INFO" for r in results)
    nother = len(results) - npass - ninfo - len(failed)
    md.append(f"Overall: **{overall}** — {len(results)} runs: {npass} pass, {len(failed)} fail or not run, "
              f"{ninfo} informational" + (f", {nother} informational not run." if nother else "."))
    md.append("")
    if isinstance(env, dict):
        md += ["| | |", "|---|---|"]
        for k in ("date_utc", "gpu", "driver", "cuda_driver_api", "torch", "torch_cuda", "python",
                  "kernel", "observer_commit", "observer_sha256", "cupti_lib", "libcupti"):
            if k in env:
                v = env[k]
                v = ", ".join(v) if isinstance(v, list) else v
                md.append(f"| {k} | `{v}` |" if k in ("observer_sha256", "cupti_lib", "libcupti") else f"| {k} | {v} |")
        md.append("")
    md += [
        "Each workload of `gpu/workloads/bottleneck.py` is built to have one bottleneck and runs twice: "
        "under `gpu-observer run --format jsonl --interval-ms 1000 -- …` (CUPTI: exact GPU busy time), "
        "and once more with three observers started before it creates its CUDA context: all processes "
        "(`--format jsonl`), `--pid PID` (`--format jsonl`) and `--pid PID --format terminal --output FILE` "
        "(what a person reads); the last two without CUPTI take the GPU busy time from NVML's per-process "
        "SM utilization. A process's `verdict` line is written when its class changes or 10 s after the "
        "last one, so the class at any tick is that of the last line; the checked span is where the window "
        f"is full length (≥ {a.full_s:g} s after the process's first sample, to its exit): the expected "
        "class must hold for the majority of that span's time and at its end; for host_bound, "
        "`evidence.host` too. The whole-run verdict (the process summary) and the terminal summary are "
        "shown, not checked.",
        ""]
    if a.settings:
        md += [f"Settings: {a.settings}", ""]
    md += ["## Verdicts", ""]
    rows = []
    for r in results:
        full = r.get("full") or {}
        wr = r.get("whole_run") or {}
        span = (f"{full.get('majority')} ({full.get('majority_share', 0) * 100:.0f}% of "
                f"{full.get('span_s', 0):.1f} s) / {full.get('last')}") if full else "-"
        why = "; ".join(r.get("reasons") or []) if r.get("status") not in ("PASS", "INFO") else ""
        rows.append([r.get("kind"), r.get("mode_title"), expect_txt(parse_tuple(r.get("expected"))),
                     span, cls_txt(wr.get("class"), wr.get("secondary")),
                     f"**{r.get('status')}**" + (f" ({why})" if why else "")])
    md += table_lines(["workload", "observer", "expected", "full-length windows: majority / at the end",
                       "whole run", "status"], rows, escape=True)
    md += ["", "## Evidence", "",
           "Of the line in effect at the end of the run (its window in the second column); GPU busy "
           "with its source; kernel / launch interval: mean kernel GPU time and mean time between "
           "launches (µs); CPU: the busiest launching thread and the whole process, as a share of the "
           "window; copy GB/s by direction (the link's in parentheses).", ""]
    rows = []
    for r in results:
        full = r.get("full") or {}
        d = full.get("deciding")
        if not d:
            continue
        c = evidence_cells(d.get("evidence"))
        rows.append([r.get("kind"), r.get("mode"), f"t={d['t_s']:.1f} s, {d['window_s']:.1f} s",
                     cls_txt(d.get("class"), d.get("secondary")), c["busy"], c["launches"],
                     c["kernel_vs_interval"], f"{c['thread_cpu']} / {c['process_cpu']}", c["host"],
                     c["syncs"], c["blocked"], c["copy"], c["copies"], c["pageable"], c["top_kernel"]])
    md += table_lines(["workload", "mode", "line", "class", "GPU busy", "launches/s",
                       "kernel / interval µs", "CPU thread / process", "host", "syncs/s", "blocked",
                       "copies", "copy GB/s", "pageable", "top kernel"], rows, escape=True)
    wl_rows = []
    seen = set()
    for r in results:
        w = r.get("workload") or {}
        if w.get("headline") and (r.get("kind"), w.get("pid")) not in seen:
            seen.add((r.get("kind"), w.get("pid")))
            st = w.get("setup_s")
            params = " ".join(f"{k}={v}" for k, v in (w.get("params") or {}).items())
            run = "`run` (CUPTI)" if r.get("mode") == "cupti" else "observed (all processes, `--pid`)"
            wl_rows.append([r.get("kind"), run, w.get("pid"), w["headline"],
                            f"{st:.1f} s" if is_num(st) else "-", params or "-"])
    if wl_rows:
        md += ["", "## The workloads' own measurements", ""]
        md += table_lines(["workload", "run", "pid", "measured by the workload", "set-up", "options"],
                          wl_rows, escape=True)
    terms = [r for r in results if r.get("terminal")]
    if terms:
        md += ["", "## What a person sees: the terminal summary", "",
               "`gpu-observer --pid PID --format terminal --output FILE`, started with the other two "
               "observers; the workload's block of the final summary:", ""]
        for r in terms:
            t = r["terminal"]
            md.append(f"**{r.get('kind')}** (pid {r.get('pid')}): verdict `{t.get('class') or 'none'}`")
            md.append("")
            md.append("```text")
            md += (t.get("block") or [t.get("error") or "(no block)"])
            md.append("```")
            md.append("")
    md += ["", "## Verdict lines", "",
           "Per run: seconds since the process's first sample, window, class (secondary), host; then the "
           "process's exit.", ""]
    for r in results:
        if "lines" not in r:  # a run without a result (status file)
            md += [f"**{r.get('name')}** — {r.get('status')}", ""]
            continue
        tl = r.get("timeline") or []
        ob = r.get("observer") or {}
        extra = ""
        if ob:
            extra = f"; observer: {ob.get('events')} events, {ob.get('dropped')} dropped"
            if ob.get("cupti_state"):
                extra += f", CUPTI {ob['cupti_state']}"
            if is_num(ob.get("nvml_sm_mean")):
                extra += f", NVML SM mean {ob['nvml_sm_mean'] * 100:.0f}%"
        md.append(f"**{r.get('name')}** ({r.get('status')}) — pid {r.get('pid')}, {r.get('lines', 0)} lines, "
                  f"observed {'-' if r.get('observed_s') is None else r['observed_s']} s"
                  + ("" if r.get("exit_seen") or not r.get("lines") else " (no process_exit line)") + extra)
        for why in (r.get("reasons") or []) if r.get("status") not in ("PASS", "INFO") else []:
            md.append(f"- FAIL: {why}")
        for d in r.get("diagnosis") or []:
            md.append(f"- why: {d}")
        for n in r.get("notes") or []:
            md.append(f"- note: {n}")
        if tl:
            md.append("")
            md.append("```text")
            for v in tl[:40]:
                md.append(f"t={v['t_s']:6.1f} s  window {v['window_s']:5.1f} s  "
                          f"{cls_txt(v['class'], v['secondary'])}" + (f"  host={v['host']}" if v.get("host") else ""))
            if len(tl) > 40:
                md.append(f"... {len(tl) - 40} more")
            md.append("```")
        md.append("")
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as f:
            json.dump({"overall": overall, "env": env, "results": results}, f, indent=1, default=str)
            f.write("\n")
    print(f"verdicts: {overall} ({len(results)} runs, {len(failed)} failed or not run) -> {a.out}")
    for r in results:
        print(f"  {r.get('name'):<22} {r.get('status')}")
    return 0 if overall == "PASS" else 1


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m gpucheck.compare_verdicts")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--events", required=True)
    c.add_argument("--name", required=True)
    c.add_argument("--kind", required=True)
    c.add_argument("--mode", required=True, choices=sorted(MODES))
    c.add_argument("--workload", default=None)
    c.add_argument("--pid", type=int, default=None)
    c.add_argument("--expect", default=None)
    c.add_argument("--terminal", default=None)
    c.add_argument("--workload-rc", type=int, default=None)
    c.add_argument("--observer-rc", type=int, default=None)
    c.add_argument("--result-out", default=None)
    c.add_argument("--full-s", type=float, default=FULL_S)
    r = sub.add_parser("report")
    r.add_argument("--out", required=True)
    r.add_argument("--json-out", default=None)
    r.add_argument("--env", default=None)
    r.add_argument("--status-file", default=None)
    r.add_argument("--settings", default=None)
    r.add_argument("--full-s", type=float, default=FULL_S)
    r.add_argument("results", nargs="*")
    a = ap.parse_args(argv)
    return cmd_check(a) if a.cmd == "check" else cmd_report(a)


if __name__ == "__main__":
    sys.exit(main())
