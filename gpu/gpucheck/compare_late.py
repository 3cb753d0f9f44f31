"""Judges one run of gpu/validate_late_attach.sh (issue 17, late GPU timing): an observer started
with `--pid PID --gpu-timing --gpu-timing-for S` injected its CUPTI library into a training job
already running (workloads/late_torch.py, late_jax.py), timed its GPU work for S seconds and
withdrew, while its uprobes went on observing.

usage:
  python3 -m gpucheck.compare_late check --name NAME --steps STEPS.jsonl --reference REF.jsonl
      --events OBSERVER.jsonl[.gz] [--pid PID] [--workload-rc N] [--observer-rc N]
      [--observer-start-ns NS] [--observer-stop-ns NS] [--gpu-timing-for S]
      [--warmup-share 0.2] [--after-skip-s 1] [--ratio-tol 0.05] [--max-pause-us 20000]
      [--min-steps 20] [--result-out R.json] [--section-out R.md]
  python3 -m gpucheck.compare_late report --out LATE_ATTACH.md [--json-out late-results.json]
      [--env ENV.json] [--status-file STATUS.tsv] [--settings TEXT] [--require-all] RESULT.json...

Inputs: the workload's results of the measured run (a line per step: `step`, `t_ns`
(CLOCK_MONOTONIC at the end of the step, after the device synchronize), `step_ns`; then the final
line: `final_loss`, `steps`, `params_checksum`, `pid`), the same of a reference run with no
observer at all, and the observer's JSON lines. The observer's lines of the workload's pid:

- `gpu_timing` lines: `event` `injected` (or `already_loaded`) gives the attach time (its `ts_ns`),
  `pause_us` and `diverted_us`; `withdrawn` the withdraw time (and `records`); `refused` its
  `reason` and `message`. `cupti` lines with `state` `active` / `idle` tell when CUPTI really ran:
  the GPU-record window is [first `active`, first `idle` after it] when they are there, else
  [attach, withdraw].
- Window of the uprobe checks: [attach, withdraw]; after withdraw: (withdraw, end].

Strict checks (any fails the run): the workload and the observer exited 0 (when their status is
given); an `injected`/`already_loaded` line (a `refused` one fails with its reason); a `withdrawn`
line after it; the hijack pause `pause_us` <= --max-pause-us (`diverted_us` is shown); at least one
`gpu_kernel`/`gpu_memcpy`/`gpu_memset` line, every one joined (`launch_ts_ns` not null); at least one
launch in the window that is not a graph launch (`api` not `cuGraphLaunch*`), every one named
(`kernel` not null); the median step time after withdraw (steps starting --after-skip-s after the
`withdrawn` line) within 1 ± --ratio-tol of the median before attach (steps ending before the
attach, less the first --warmup-share of them), with at least --min-steps steps in each; final
loss, parameter checksum and step count equal to the reference run's, exactly.
Shown, not checked: the share named after withdraw, the summary's `named_launches` /
`unresolved_launches` and `cupti` block, the step time during the window (from `active` to
`withdrawn`) against before, the longest step around the attach, GPU records outside the CUPTI
window, graph launches, launches before the attach, `withdrawn.records` against the lines, dropped
events, the timeline.

`check` prints a console block, writes the result JSON (--result-out; it carries the Markdown
section too) and the section (--section-out); exit 0 pass, 1 fail, 2 unusable input. `report`
builds LATE_ATTACH.md and late-results.json from the results and a status file of runs without
one (NAME<TAB>TEXT, e.g. `jax<TAB>NOT RUN (JAX has no GPU)`); a run not made passes unless
--require-all; nothing run at all fails. Exit 0 when every run made passed.
"""

import argparse
import json
import math
import statistics
import sys

from .common import is_num, percentile, table_lines
from .jsonl import ReadCounts, load_json, read_jsonl

GPU_TYPES = ("gpu_kernel", "gpu_memcpy", "gpu_memset")
# A line of a type read here holds one of these (compact or spaced JSON alike).
WANT = ('"launch"', '"gpu_', '"cupti"', '"summary"', '"process_exit"')
ATTACH_EVENTS = ("injected", "already_loaded")
MAX_PAUSE_US = 20000
RATIO_TOL = 0.05
WARMUP_SHARE = 0.2
AFTER_SKIP_S = 1.0
MIN_STEPS = 20


# ---------------------------------------------------------------- inputs


def read_results(path):
    """(steps [(i, t_ns, step_ns)], final line or None, skipped reason or None, error or None)."""
    steps, final, skipped = [], None, None
    counts = ReadCounts()
    try:
        for ev in read_jsonl(path, counts):
            if "skipped" in ev:
                skipped = str(ev["skipped"])
            elif "final_loss" in ev:
                final = ev
            elif is_num(ev.get("t_ns")) and is_num(ev.get("step_ns")):
                steps.append((ev.get("step"), int(ev["t_ns"]), int(ev["step_ns"])))
    except (OSError, EOFError) as exc:
        return [], None, None, f"{path}: {exc}"
    return steps, final, skipped, None


class Events:
    """The observer's lines that matter, of one pid (or of the pid found, see `pid`)."""

    def __init__(self):
        self.counts = ReadCounts()
        self.timing = []  # gpu_timing lines (all pids)
        self.cupti = []  # cupti lines (all pids)
        self.launches = []  # (pid, ts, api, named, kernel, function)
        self.gpu = []  # (pid, type, ts, joined, graph, named, api)
        self.summaries = {}  # pid -> last process summary
        self.total = None
        self.exits = {}  # pid -> ts of process_exit

    def read(self, path):
        # Lines of other types (symbol, ioctl, memset, nvml, ...: most of a --trace-all capture)
        # are counted, not parsed.
        for ev in read_jsonl(path, self.counts, want=WANT):
            ty = ev.get("type")
            pid = ev.get("pid")
            if ty == "launch":
                self.launches.append((pid, ev.get("ts_ns"), str(ev.get("api") or ""), ev.get("kernel") is not None,
                                      ev.get("kernel"), ev.get("function")))
            elif ty in GPU_TYPES:
                self.gpu.append((pid, ty, ev.get("ts_ns", ev.get("gpu_start_ns")), ev.get("launch_ts_ns") is not None,
                                 ev.get("graph_id") is not None, ev.get("kernel") is not None, ev.get("api")))
            elif ty == "gpu_timing":
                self.timing.append(ev)
            elif ty == "cupti":
                self.cupti.append(ev)
            elif ty == "summary":
                if ev.get("scope") == "total" or (ev.get("scope") is None and pid is None):
                    self.total = ev
                elif ev.get("scope") == "process":
                    self.summaries[pid] = ev
            elif ty == "process_exit":
                self.exits.setdefault(pid, ev.get("ts_ns"))


# ---------------------------------------------------------------- helpers


def med(vals):
    return statistics.median(vals) if vals else None


def p90(vals):
    return percentile(sorted(vals), 90) if vals else None


def ms(ns):
    return "-" if ns is None else f"{ns / 1e6:.3f} ms"


def ratio_txt(r):
    return "-" if r is None else f"{r:.4f}"


def first(seq, pred):
    return next((x for x in seq if pred(x)), None)


class Run:
    """One check: rows of (id, what, expected, got, status), notes, and the numbers behind."""

    def __init__(self, name):
        self.name = name
        self.rows = []
        self.notes = []

    def row(self, cid, what, expected, got, ok, strict=True):
        status = ("PASS" if ok else "FAIL") if strict else "INFO"
        self.rows.append({"id": cid, "what": what, "expected": expected, "got": got, "status": status})
        return ok

    @property
    def failures(self):
        return [r for r in self.rows if r["status"] == "FAIL"]


def step_stats(steps):
    d = [s for _, _, s in steps]
    return {"n": len(d), "median_ns": med(d), "p90_ns": p90(d), "max_ns": max(d) if d else None}


# ---------------------------------------------------------------- check


def cmd_check(a):
    run = Run(a.name)
    steps, final, skipped, err = read_results(a.steps)
    ref_steps, ref_final, ref_skipped, ref_err = read_results(a.reference)
    ev = Events()
    ev_err = None
    try:
        ev.read(a.events)
    except (OSError, EOFError) as exc:
        ev_err = f"{a.events}: {exc}"
    unusable = [e for e in (err, ev_err) if e]
    pid = a.pid
    if pid is None and final is not None and isinstance(final.get("pid"), int):
        pid = final["pid"]
    if pid is None:
        pid = first([t.get("pid") for t in ev.timing], lambda p: p is not None)
    workload = (final or {}).get("workload") or a.name

    # --- exit statuses
    if a.workload_rc is not None:
        run.row("workload.rc", "workload exit status", 0, a.workload_rc, a.workload_rc == 0)
    if a.observer_rc is not None:
        run.row("observer.rc", "observer exit status", 0, a.observer_rc, a.observer_rc == 0)
    if skipped:
        run.row("workload.ran", "the workload ran", "steps", f"skipped: {skipped}", False)

    # --- attach and withdraw
    mine = [t for t in ev.timing if t.get("pid") == pid]
    others = len(ev.timing) - len(mine)
    if others:
        run.notes.append(f"{others} gpu_timing line(s) of other pids ignored")
    attach = first(mine, lambda t: t.get("event") in ATTACH_EVENTS)
    refused = [t for t in mine if t.get("event") == "refused"]
    attach_ts = attach.get("ts_ns") if attach else None
    if attach:
        run.row("attach", "`gpu_timing` injected / already_loaded", "present",
                f"{attach.get('event')} (tid {attach.get('tid')}, library {attach.get('library')})", True)
        if len([t for t in mine if t.get("event") in ATTACH_EVENTS]) > 1:
            run.notes.append("more than one injected/already_loaded line: the first one counts")
    else:
        why = "; ".join(f"refused: {t.get('reason')} ({t.get('message')})" for t in refused) or "none"
        run.row("attach", "`gpu_timing` injected / already_loaded", "present", why, False)
    for t in refused:
        if attach:
            run.notes.append(f"also refused: {t.get('reason')} ({t.get('message')})")
    withdrawn = first(mine, lambda t: t.get("event") == "withdrawn" and attach_ts is not None
                      and is_num(t.get("ts_ns")) and t["ts_ns"] >= attach_ts)
    withdraw_ts = withdrawn.get("ts_ns") if withdrawn else None
    if attach:
        run.row("withdraw", "`gpu_timing` withdrawn after the attach", "present",
                f"after {(withdraw_ts - attach_ts) / 1e9:.2f} s, records {withdrawn.get('records')}"
                if withdrawn else "none", withdrawn is not None)

    # --- the hijack pause
    pause = attach.get("pause_us") if attach else None
    diverted = attach.get("diverted_us") if attach else None
    if attach and attach.get("event") == "already_loaded":
        run.row("pause", f"hijack pause ≤ {a.max_pause_us} µs", f"≤ {a.max_pause_us} µs",
                "n/a (library already loaded: no hijack)", True)
    elif attach:
        run.row("pause", f"hijack pause (`pause_us`) ≤ {a.max_pause_us} µs", f"≤ {a.max_pause_us} µs",
                f"{pause} µs" if is_num(pause) else f"{pause!r}", is_num(pause) and pause <= a.max_pause_us)
        run.row("diverted", "time the thread ran the loader (`diverted_us`)", "-",
                f"{diverted} µs" if is_num(diverted) else f"{diverted!r}", True, strict=False)

    # --- CUPTI window
    cup = [c for c in ev.cupti if c.get("pid") == pid and is_num(c.get("ts_ns"))]
    active = first(cup, lambda c: c.get("state") == "active"
                   and (withdraw_ts is None or c["ts_ns"] <= withdraw_ts))
    active_ts = active["ts_ns"] if active else None
    idle = first(cup, lambda c: c.get("state") == "idle" and active_ts is not None and c["ts_ns"] >= active_ts)
    idle_ts = idle["ts_ns"] if idle else None
    cupti_states = [f"{c.get('state')}@{(c['ts_ns'] - attach_ts) / 1e9:+.3f}s" if attach_ts else str(c.get("state"))
                    for c in cup]
    g_lo = active_ts if active_ts is not None else attach_ts
    g_hi = idle_ts if idle_ts is not None else withdraw_ts
    if active_ts is None and attach:
        run.notes.append("no `cupti` line with state active for the pid: the GPU-record window starts at the attach")
    if idle_ts is None and attach:
        run.notes.append("no `cupti` line with state idle after active: the GPU-record window ends at the withdraw")

    # --- GPU records: joined
    gl = [g for g in ev.gpu if g[0] == pid]
    joined = sum(1 for g in gl if g[3])
    by_type = {}
    for g in gl:
        t = by_type.setdefault(g[1], [0, 0])
        t[0] += 1
        t[1] += g[3]
    graph = [g for g in gl if g[4]]
    run.row("gpu.records", "GPU records (`gpu_kernel`/`gpu_memcpy`/`gpu_memset`) of the pid", "> 0", len(gl), len(gl) > 0)
    run.row("gpu.joined", "GPU records joined (`launch_ts_ns` not null)", "100 %",
            f"{100.0 * joined / len(gl):.2f} % ({joined}/{len(gl)})" if gl else "- (0/0)", bool(gl) and joined == len(gl))
    outside = [g for g in gl if is_num(g[2]) and g_lo is not None
               and (g[2] < g_lo or (g_hi is not None and g[2] > g_hi))]
    if gl:
        kn = [g for g in gl if g[1] == "gpu_kernel"]
        run.row("gpu.window", "GPU records outside the CUPTI window", "-",
                f"{len(outside)} of {len(gl)}" + (f" (first {(min(g[2] for g in outside) - g_lo) / 1e9:+.3f} s, "
                                                  f"last {(max(g[2] for g in outside) - (g_hi or g_lo)) / 1e9:+.3f} s)"
                                                  if outside else ""), True, strict=False)
        run.row("gpu.graph", "GPU records from graph launches (`graph_id`), joined", "-",
                f"{sum(1 for g in graph if g[3])}/{len(graph)}", True, strict=False)
        run.row("gpu.named", "`gpu_kernel` lines with a kernel name", "-",
                f"{sum(1 for g in kn if g[5])}/{len(kn)}", True, strict=False)

    # --- launches: named in the window, after withdraw
    ll = [x for x in ev.launches if x[0] == pid and is_num(x[1])]
    plain = [x for x in ll if not x[2].startswith("cuGraphLaunch")]
    graphs = len(ll) - len(plain)
    # GPU timing is on from CUPTI's `active` line: launches between the injection and that line
    # (the library's control thread starting CUPTI, ~0.1 s) are shown apart, not checked.
    n_lo = active_ts if active_ts is not None else attach_ts
    before_l = [x for x in plain if attach_ts is not None and x[1] < attach_ts]
    gap_l = [x for x in plain if attach_ts is not None and n_lo is not None and attach_ts <= x[1] < n_lo]
    win_l = [x for x in plain if n_lo is not None and x[1] >= n_lo
             and (withdraw_ts is None or x[1] <= withdraw_ts)]
    after_l = [x for x in plain if withdraw_ts is not None and x[1] > withdraw_ts]

    def named_txt(xs):
        n = sum(1 for x in xs if x[3])
        return f"{100.0 * n / len(xs):.2f} % ({n}/{len(xs)})" if xs else "- (0/0)"

    win_named = sum(1 for x in win_l if x[3])
    run.row("names.window", "launches in the window (CUPTI active → withdrawn; not graph launches) named", "100 %",
            named_txt(win_l), bool(win_l) and win_named == len(win_l))
    run.row("names.gap", "launches between the injection and CUPTI active, named", "-", named_txt(gap_l), True,
            strict=False)
    run.row("names.after", "launches after withdraw (not graph launches) named", "-", named_txt(after_l), True,
            strict=False)
    run.row("names.before", "launches before the attach (not graph launches) named", "-", named_txt(before_l), True,
            strict=False)
    if graphs:
        run.row("launches.graph", "graph launches (`cuGraphLaunch*`, not checked for names)", "-", graphs, True,
                strict=False)
    unnamed = [x for x in win_l if not x[3]][:5]
    for x in unnamed:
        run.notes.append(f"unnamed launch in the window: {x[2]} at {(x[1] - attach_ts) / 1e9:+.4f} s, "
                         f"function {x[5]}")
    summ = ev.summaries.get(pid) or {}
    if summ:
        run.row("summary.names", "per-process summary: `named_launches` / `unresolved_launches`", "-",
                f"{summ.get('named_launches')} / {summ.get('unresolved_launches')}", True, strict=False)
        cb = summ.get("cupti")
        if isinstance(cb, dict):
            run.row("summary.cupti", "per-process summary: `cupti` state, kernels, joined / unjoined", "-",
                    f"{cb.get('state')}, {cb.get('kernels')}, {cb.get('joined')} / {cb.get('unjoined')}", True,
                    strict=False)
    else:
        run.notes.append("no per-process summary line for the pid")
    if withdrawn is not None:
        run.row("withdrawn.records", "`withdrawn.records` / GPU lines of the pid", "-",
                f"{withdrawn.get('records')} / {len(gl)}", True, strict=False)
    if ev.total:
        run.row("observer.dropped", "observer events / dropped (total summary)", "-",
                f"{ev.total.get('events')} / {ev.total.get('dropped')}", True, strict=False)

    # --- step time
    st = sorted(steps, key=lambda s: s[1])
    before = [s for s in st if attach_ts is not None and s[1] < attach_ts]
    before = before[int(len(before) * a.warmup_share):]
    d_lo = active_ts if active_ts is not None else attach_ts
    during = [s for s in st if d_lo is not None and withdraw_ts is not None
              and s[1] - s[2] >= d_lo and s[1] <= withdraw_ts]
    after = [s for s in st if withdraw_ts is not None and s[1] - s[2] >= withdraw_ts + a.after_skip_s * 1e9]
    stop = a.observer_stop_ns
    after_obs = [s for s in after if stop is not None and s[1] <= stop]
    after_gone = [s for s in after if stop is not None and s[1] - s[2] >= stop]
    sb, sd, sa = step_stats(before), step_stats(during), step_stats(after)
    r_after = sa["median_ns"] / sb["median_ns"] if sa["median_ns"] and sb["median_ns"] else None
    r_during = sd["median_ns"] / sb["median_ns"] if sd["median_ns"] and sb["median_ns"] else None
    enough = sb["n"] >= a.min_steps and sa["n"] >= a.min_steps
    run.row("steps.after", f"median step after withdraw / before attach within 1 ± {a.ratio_tol:g}",
            f"{1 - a.ratio_tol:.3f} – {1 + a.ratio_tol:.3f}",
            f"{ratio_txt(r_after)} ({ms(sa['median_ns'])} / {ms(sb['median_ns'])}; {sa['n']} / {sb['n']} steps)",
            enough and r_after is not None and abs(r_after - 1) <= a.ratio_tol)
    if not enough:
        run.notes.append(f"too few steps to compare: {sb['n']} before the attach, {sa['n']} after the withdraw "
                         f"(at least {a.min_steps} each)")
    run.row("steps.during", "median step during the window / before attach", "-",
            f"{ratio_txt(r_during)} ({ms(sd['median_ns'])}; {sd['n']} steps)", True, strict=False)
    around = [s for s in st if attach_ts is not None and s[1] >= attach_ts - 1e9 and s[1] - s[2] <= attach_ts + 1e9]
    worst = max(around, key=lambda s: s[2]) if around else None
    if worst:
        run.row("steps.attach", "longest step within 1 s of the attach", "-",
                f"{ms(worst[2])} (step {worst[0]}, ended {(worst[1] - attach_ts) / 1e9:+.3f} s)", True, strict=False)

    # --- result against the reference
    if final is None or ref_final is None:
        run.row("result", "final loss, checksum, steps = reference run's", "both runs' final lines",
                f"measured: {'present' if final else 'missing'}; reference: "
                f"{'present' if ref_final else (('skipped: ' + ref_skipped) if ref_skipped else 'missing')}", False)
    else:
        for key, what in (("final_loss", "final loss"), ("params_checksum", "parameter checksum"), ("steps", "steps")):
            mv, rv = final.get(key), ref_final.get(key)
            run.row(f"result.{key}", f"{what} = the reference run's", repr(rv), repr(mv),
                    mv is not None and mv == rv and not (isinstance(mv, float) and math.isnan(mv)))
        if final.get("by_time") or ref_final.get("by_time"):
            run.row("result.fixed", "both runs by a fixed step count", "fixed", "by time", False)

    # --- timeline
    t0 = st[0][1] - st[0][2] if st else None

    def rel(ts):
        return None if ts is None or t0 is None else round((ts - t0) / 1e9, 3)

    timeline = {"first_step_start_s": 0.0 if t0 is not None else None,
                "observer_start_s": rel(a.observer_start_ns), "attach_s": rel(attach_ts),
                "cupti_active_s": rel(active_ts), "cupti_idle_s": rel(idle_ts), "withdraw_s": rel(withdraw_ts),
                "observer_stop_s": rel(stop), "process_exit_s": rel(ev.exits.get(pid)),
                "last_step_end_s": rel(st[-1][1]) if st else None,
                "window_s": round((withdraw_ts - attach_ts) / 1e9, 3) if withdraw_ts and attach_ts else None,
                "asked_window_s": a.gpu_timing_for, "cupti_states": cupti_states}
    if unusable:
        status = "FAIL"
        run.notes[:0] = [f"unusable input: {e}" for e in unusable]
    else:
        status = "FAIL" if run.failures else "PASS"
    result = {
        "name": a.name, "workload": workload, "pid": pid, "status": status,
        "reasons": [f"{r['what']}: {r['got']}" for r in run.failures] + [f"unusable input: {e}" for e in unusable],
        "checks": run.rows, "notes": run.notes, "timeline": timeline,
        "attach": {"event": attach.get("event") if attach else None, "tid": attach.get("tid") if attach else None,
                   "pause_us": pause, "diverted_us": diverted, "library": attach.get("library") if attach else None,
                   "refused": [{"reason": t.get("reason"), "message": t.get("message")} for t in refused]},
        "gpu": {"records": len(gl), "joined": joined, "by_type": by_type, "graph_records": len(graph),
                "outside_cupti_window": len(outside)},
        "launches": {"window": len(win_l), "window_named": win_named, "after": len(after_l),
                     "after_named": sum(1 for x in after_l if x[3]), "before": len(before_l),
                     "before_named": sum(1 for x in before_l if x[3]), "graph": graphs},
        "summary": {"named_launches": summ.get("named_launches"), "unresolved_launches": summ.get("unresolved_launches"),
                    "cupti": summ.get("cupti")},
        "steps": {"before": sb, "during": sd, "after": sa, "after_observer_attached": step_stats(after_obs),
                  "after_observer_gone": step_stats(after_gone), "ratio_after": r_after, "ratio_during": r_during,
                  "total": len(st)},
        "final": final, "reference": ref_final,
        "observer_lines": {"lines": ev.counts.lines, "unusable": ev.counts.unusable, "not_parsed": ev.counts.filtered},
    }
    result["section"] = section(result, a)
    print_console(result)
    if a.result_out:
        with open(a.result_out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)
            f.write("\n")
    if a.section_out:
        with open(a.section_out, "w", encoding="utf-8") as f:
            f.write("\n".join(result["section"]) + "\n")
    if unusable:
        return 2
    return 0 if status == "PASS" else 1


def section(r, a):
    md = [f"### {r['name']} (`{r['workload']}`, pid {r['pid']}): {r['status']}", ""]
    md += table_lines(["check", "expected", "measured", "result"],
                      [[c["what"], c["expected"], c["got"], f"**{c['status']}**" if c["status"] == "FAIL" else c["status"]]
                       for c in r["checks"]], escape=True)
    s = r["steps"]
    md += ["", "Step time (the workload's own `step_ns`, a device synchronize per step):", ""]
    rows = []
    for key, label in (("before", f"before attach (less the first {a.warmup_share:.0%})"),
                       ("during", "CUPTI active → withdrawn"),
                       ("after", f"after withdraw (+{a.after_skip_s:g} s) to the end"),
                       ("after_observer_attached", "… of which the observer still attached"),
                       ("after_observer_gone", "… of which the observer gone")):
        v = s[key]
        if key.startswith("after_observer") and not v["n"]:
            continue
        ratio = (v["median_ns"] / s["before"]["median_ns"]) if v["median_ns"] and s["before"]["median_ns"] else None
        rows.append([label, v["n"], ms(v["median_ns"]), ms(v["p90_ns"]), ms(v["max_ns"]), ratio_txt(ratio)])
    md += table_lines(["steps", "n", "median", "p90", "max", "median / before"], rows)
    t = r["timeline"]
    md += ["", "Timeline (s from the first step's start): " + ", ".join(
        f"{k[:-2].replace('_', ' ')} {v:.3f}" for k, v in t.items() if k.endswith("_s") and is_num(v)
        and k not in ("window_s", "asked_window_s"))
        + (f"; window {t['window_s']:.3f} s" if is_num(t.get("window_s")) else "")
        + (f" (asked {t['asked_window_s']:g} s)" if is_num(t.get("asked_window_s")) else "")
        + (f"; CUPTI states: {', '.join(t['cupti_states'])}" if t.get("cupti_states") else "")]
    fin = r.get("final") or {}
    if fin:
        info = ", ".join(f"{k} {fin[k]}" for k in ("torch", "jax", "device", "batch", "width", "hidden", "seed")
                         if fin.get(k) is not None)
        el = fin.get("elapsed_ns")
        md.append(f"Job: `{fin.get('workload')}`, {fin.get('steps')} steps"
                  + (f" in {el / 1e9:.1f} s" if is_num(el) else "") + (f"; {info}" if info else ""))
    for n in r["notes"]:
        md.append(f"- note: {n}")
    md.append("")
    return md


def print_console(r):
    print(f"{r['name']}: {r['status']}  pid {r['pid']}")
    for c in r["checks"]:
        print(f"  {c['status']:<4} {c['what']}: {c['got']} (expected {c['expected']})")
    for n in r["notes"]:
        print(f"  note: {n}")


# ---------------------------------------------------------------- report


def cmd_report(a):
    results = []
    for p in a.results:
        r = load_json(p)
        if isinstance(r, dict) and "status" in r:
            results.append(r)
        else:
            results.append({"name": p, "status": "FAIL", "reasons": ["unreadable result file"], "checks": []})
    not_run = []
    if a.status_file:
        try:
            with open(a.status_file, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        name, _, text = line.rstrip("\n").partition("\t")
                        not_run.append({"name": name, "status": text or "NOT RUN"})
        except OSError:
            pass
    env = load_json(a.env)
    made = [r for r in results]
    failed = [r for r in made if r.get("status") != "PASS"]
    bad_not_run = [r for r in not_run if a.require_all or not r["status"].startswith("NOT RUN")]
    overall = "PASS" if made and not failed and not bad_not_run else "FAIL"
    md = ["# Late GPU timing (issue 17): CUPTI injected into running training jobs", ""]
    md.append(f"Overall: **{overall}** — {len(made)} run(s) made: {len(made) - len(failed)} pass, {len(failed)} fail; "
              f"{len(not_run)} without a result" + (" (" + "; ".join(f"{r['name']}: {r['status']}" for r in not_run) + ")"
                                                   if not_run else "") + ".")
    md.append("")
    if isinstance(env, dict):
        md += ["| | |", "|---|---|"]
        for k in ("date_utc", "gpu", "driver", "cuda_driver_api", "torch", "torch_cuda", "python", "kernel",
                  "observer_commit", "observer_sha256", "cupti_lib", "libcupti"):
            if k in env:
                v = env[k]
                v = ", ".join(v) if isinstance(v, list) else v
                md.append(f"| {k} | `{v}` |")
        md.append("")
    md += ["Each job (`gpu/workloads/late_torch.py`, `late_jax.py`: a fixed number of deterministic training "
           "steps, a device synchronize per step) runs twice: once with no observer (the reference), once "
           "with `gpu-observer --pid PID --gpu-timing --gpu-timing-for S` started some seconds into it: the "
           "observer injects its CUPTI library into the running process, times its GPU work for S seconds, "
           "withdraws (CUPTI flushed and disabled, the library stays loaded idle) and goes on with its "
           "uprobes until it is stopped. Checked: every GPU record joined to its launch; every launch in the "
           "window named (graph launches aside); the hijack pause; the step time after the withdraw against "
           "before the attach; the final loss and parameters equal to the reference run's, bit for bit.", ""]
    if a.settings:
        md += [f"Settings: {a.settings}", ""]
    rows = []
    for r in made:
        if not r.get("checks"):
            rows.append([r.get("name"), "-", "-", "-", "-", "-", "-", "-", f"**{r.get('status')}**"])
            continue
        at, g, la, s = r.get("attach") or {}, r.get("gpu") or {}, r.get("launches") or {}, r.get("steps") or {}
        pause = f"{at.get('pause_us')} / {at.get('diverted_us')} µs" if at.get("event") == "injected" else (at.get("event") or "none")
        join = f"{g.get('joined')}/{g.get('records')}"
        nw = f"{la.get('window_named')}/{la.get('window')}"
        na = f"{la.get('after_named')}/{la.get('after')}"
        med_txt = " / ".join(ms((s.get(k) or {}).get("median_ns")) for k in ("before", "during", "after"))
        fin = r.get("final") or {}
        same = all(c["status"] == "PASS" for c in r["checks"] if c["id"].startswith("result"))
        res = f"{fin.get('final_loss')!r} {'=' if same else '≠'} ref" if fin else "-"
        why = "; ".join(r.get("reasons") or []) if r.get("status") != "PASS" else ""
        rows.append([r.get("name"), pause, join, nw, na, med_txt, ratio_txt(s.get("ratio_after")), res,
                     f"**{r.get('status')}**" + (f" ({why})" if why else "")])
    for r in not_run:
        rows.append([r["name"], "-", "-", "-", "-", "-", "-", "-", f"**{r['status']}**"])
    md += table_lines(["job", "pause / diverted", "GPU records joined", "named in window", "named after withdraw",
                       "median step before / during / after", "after / before", "final loss", "result"], rows,
                      escape=True)
    md.append("")
    for r in made:
        md += r.get("section") or [f"### {r.get('name')}: {r.get('status')}", ""] + \
            [f"- {x}" for x in r.get("reasons") or []] + [""]
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as f:
            json.dump({"overall": overall, "env": env, "results": made, "not_run": not_run}, f, indent=1, default=str)
            f.write("\n")
    print(f"late attach: {overall} ({len(made)} run(s), {len(failed)} failed, {len(not_run)} without a result) -> {a.out}")
    for r in made + not_run:
        print(f"  {r.get('name'):<10} {r.get('status')}")
    return 0 if overall == "PASS" else 1


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m gpucheck.compare_late")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--name", required=True)
    c.add_argument("--steps", required=True)
    c.add_argument("--reference", required=True)
    c.add_argument("--events", required=True)
    c.add_argument("--pid", type=int, default=None)
    c.add_argument("--workload-rc", type=int, default=None)
    c.add_argument("--observer-rc", type=int, default=None)
    c.add_argument("--observer-start-ns", type=int, default=None)
    c.add_argument("--observer-stop-ns", type=int, default=None)
    c.add_argument("--gpu-timing-for", type=float, default=None)
    c.add_argument("--warmup-share", type=float, default=WARMUP_SHARE)
    c.add_argument("--after-skip-s", type=float, default=AFTER_SKIP_S)
    c.add_argument("--ratio-tol", type=float, default=RATIO_TOL)
    c.add_argument("--max-pause-us", type=int, default=MAX_PAUSE_US)
    c.add_argument("--min-steps", type=int, default=MIN_STEPS)
    c.add_argument("--result-out", default=None)
    c.add_argument("--section-out", default=None)
    r = sub.add_parser("report")
    r.add_argument("--out", required=True)
    r.add_argument("--json-out", default=None)
    r.add_argument("--env", default=None)
    r.add_argument("--status-file", default=None)
    r.add_argument("--settings", default=None)
    r.add_argument("--require-all", action="store_true")
    r.add_argument("results", nargs="*")
    a = ap.parse_args(argv)
    return cmd_check(a) if a.cmd == "check" else cmd_report(a)


if __name__ == "__main__":
    sys.exit(main())
