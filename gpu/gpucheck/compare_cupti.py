"""Check gpu-observer's CUPTI records (GPU timestamps) of a workload run under `gpu-observer run`.

usage:
  python3 -m gpucheck.compare_cupti --workload W.json --events RUN.jsonl[.gz] --name NAME
                   [--title TITLE] [--comm-hint PREFIX] [--tolerance-ns 5000]
                   [--section-out RUN.section.md] [--result-out RUN.result.json]

W.json is the workload's own record: torch_loop.py (phaseA / phaseB windows; phase B without
profiler counts when it ran with TORCH_LOOP_NO_PROFILER=1), cuda-ground-truth --out
(window_start_ns/window_end_ns, kernels, kernel_names, calls) or copies_kernels
(loop_start_ns/loop_end_ns).

Observer lines used (run with --trace-all, so every record is written):
  gpu_kernel  {pid, tid, api, cupti_api, correlation_id, gpu_start_ns (= ts_ns), gpu_end_ns,
               gpu_duration_ns, launch_ts_ns, queue_delay_ns, cupti_api_start_ns,
               cupti_api_end_ns, graph_id, kernel, stream, ...}
              (`api`: the probed driver entry point; `cupti_api`: the call CUPTI recorded, that
              driver call or the runtime call such as cudaLaunchKernel it was made from, whose
              CUPTI start then precedes the driver entry by cudart's own work)
  gpu_memcpy  {bytes, copy_kind (htod|dtoh|dtod|htoh|ptop|unknown), ...}   gpu_memset {bytes}
  cupti       {pid, state, cupti_result, message}   (state changes)
  launch / memcpy / memset   the uprobe events of the same calls
  summary     per process (scope "process") with a "cupti" block {state, kernels, memcpys,
              memsets, joined, unjoined, gpu_kernel_ns, cupti_dropped, rate_limited, buffers}

Selection: lines of the workload's pid (if none carry it, the pid whose comm starts with
--comm-hint, with a warning); GPU records by gpu_start_ns (ts_ns), uprobe events by ts_ns,
inside each window.  Every window opens and closes after a device synchronize, so the work
of the calls made inside it also ran inside it.

Strict checks (any failure -> exit 1), per window:
  (i)   every gpu_kernel line joined to its launch (launch_ts_ns not null): 100 %;
  (ii)  the timestamp criterion (decided for issue 4): the uprobe stamp precedes CUPTI's
        API start and lies within 5 us of it, 0 <= cupti_api_start_ns - launch_ts_ns <= 5 us,
        for >= 99 % of the joined lines (the rest is driver work before CUPTI's callback,
        docs/OUTLIERS.md). Where CUPTI timed the runtime call the driver call was made from
        (cupti_api cuda*, e.g. cudaLaunchKernel under PyTorch), that call starts before the
        driver entry the uprobe stamps, so |cupti_api_start_ns - launch_ts_ns| <= 5 us counts;
        shown beside it: the distribution (median, p99, max, per cupti_api), the lines outside
        CUPTI's record of the call +- 5 us, and the driver-timed lines CUPTI started first;
  (iii) gpu_kernel lines (not from a graph) = uprobe launch events (not cuGraphLaunch*);
        and = the launches the workload knows it made (phase A, ground truth, copies_kernels)
        or, where the workload recorded them, torch.profiler's kernels (phase B);
  (iv)  gpu_memcpy lines = uprobe memcpy events (and = the workload's own copies / profiler);
  (vi)  ground truth: the gpu_kernel names, as a multiset, are exactly its kernels
        (write_value, add_one, scale_vec(float*, float, unsigned int)) with the counts it
        launched;
  gpu_end_ns >= gpu_start_ns on every line.
Over the whole run of the pid: every gpu_kernel line joined (i), and the process's CUPTI
state "active" (the per-process summary's cupti.state; the last `cupti` line if the summary
has no cupti block).
Informational: (v) queue delay and GPU duration distributions, (ii) over the whole run,
memsets, bytes and copy kinds, gpu_kernel names vs the uprobe launch names, joined lines
whose launch_ts_ns is a launch event of the same thread, the summary's CUPTI counters
(cupti_dropped and rate_limited are flagged when not 0).

Exit status: 0 all strict checks pass, 1 a strict check failed, 2 bad input.
"""

import argparse
import os
import sys
from collections import Counter, defaultdict

from .checks import Check, comparer_args, pick_pid, write_outputs
from .common import as_int, dist, eprint, fmt_ns, fmt_table, short
from .jsonl import ReadCounts, read_json, read_jsonl
from .names import match_names, norm_name

TOLERANCE_NS = 5000
# Share of joined lines that must meet the timestamp criterion (ii).
TIMESTAMP_SHARE = 0.99
GPU_TYPES = ("gpu_kernel", "gpu_memcpy", "gpu_memset")
# copy_kind of gpu_memcpy -> direction of the uprobe memcpy event
KIND_DIRECTION = {"htod": "cpu_to_gpu", "dtoh": "gpu_to_cpu", "dtod": "gpu_to_gpu"}


def fmt_dist(d):
    if not d or not d.get("n"):
        return "none"
    return (f"n={d['n']} min {fmt_ns(d['min'])}, median {fmt_ns(d['median'])}, "
            f"p90 {fmt_ns(d['p90'])}, p99 {fmt_ns(d['p99'])}, max {fmt_ns(d['max'])}")


# ---------------------------------------------------------------- windows


class Window:
    def __init__(self, key, label, start, end, kind, exp):
        self.key, self.label, self.start, self.end, self.kind, self.exp = \
            key, label, start, end, kind, exp


def windows_from_workload(w):
    wins = []
    if "loop_start_ns" in w:
        wins.append(Window("loop", "measured loop", as_int(w["loop_start_ns"]),
                           as_int(w["loop_end_ns"]), "exact",
                           {"launches": as_int(w.get("launches")),
                            "copies": (as_int(w.get("htod"), 0) or 0) + (as_int(w.get("dtoh"), 0) or 0)}))
    if "phaseA" in w:
        a = w["phaseA"]
        wins.append(Window("phaseA", "phase A (exact by construction)", as_int(a["start_ns"]),
                           as_int(a["end_ns"]), "exact",
                           {"launches": as_int(a.get("launches")),
                            "copies": (as_int(a.get("htod"), 0) or 0) + (as_int(a.get("dtoh"), 0) or 0)}))
    if "phaseB" in w:
        b = w["phaseB"]
        wins.append(Window("phaseB", "phase B (training steps)", as_int(b["start_ns"]),
                           as_int(b["end_ns"]), "profiler",
                           {"launches": as_int(b.get("profiler_kernels")),
                            "copies": as_int(b.get("profiler_memcpy")),
                            "memsets": as_int(b.get("profiler_memset")),
                            "method": b.get("profiler_count_method")}))
    if "window_start_ns" in w:
        calls = {k: as_int(v, 0) or 0 for k, v in (w.get("calls") or {}).items()}
        names = w.get("kernel_names") or {}
        exp_names = Counter()
        for entry, n in (w.get("kernels") or {}).items():
            exp_names[names.get(entry, entry)] += as_int(n, 0) or 0
        wins.append(Window("window", "ground-truth window", as_int(w["window_start_ns"]),
                           as_int(w["window_end_ns"]), "ground",
                           {"launches": sum(exp_names.values()),
                            "copies": sum(n for a, n in calls.items() if a.startswith("cuMemcpy")),
                            "memsets": sum(n for a, n in calls.items() if a.startswith("cuMemset")),
                            "names": dict(exp_names)}))
    for win in wins:
        if win.start is None or win.end is None or win.end < win.start:
            raise ValueError(f"bad window {win.key}: {win.start}..{win.end}")
    return wins


# ---------------------------------------------------------------- scan


class PidData:
    def __init__(self):
        self.events = 0
        self.comms = Counter()
        self.kernels = []  # dicts (fields below)
        self.gmemcpy = []  # (ts, copy_kind, bytes)
        self.gmemset = []  # (ts, bytes)
        self.launches = []  # (ts, tid, api, kernel)
        self.copies = []  # (ts, direction, bytes)
        self.memsets = []  # ts
        self.cupti = []  # the `cupti` state lines
        self.summary = None  # per-process summary


KERNEL_FIELDS = ("tid", "api", "cupti_api", "correlation_id", "gpu_start_ns", "gpu_end_ns", "gpu_duration_ns",
                 "launch_ts_ns", "queue_delay_ns", "cupti_api_start_ns", "cupti_api_end_ns",
                 "graph_id", "kernel", "stream", "device")
INT_FIELDS = ("tid", "gpu_start_ns", "gpu_end_ns", "gpu_duration_ns", "launch_ts_ns",
              "queue_delay_ns", "cupti_api_start_ns", "cupti_api_end_ns")


def gpu_ts(ev):
    ts = as_int(ev.get("gpu_start_ns"))
    return as_int(ev.get("ts_ns")) if ts is None else ts


def scan(path):
    pids = defaultdict(PidData)
    total = None
    counts = ReadCounts()
    for ev in read_jsonl(path, counts):
        typ = ev.get("type")
        pid = as_int(ev.get("pid"))
        if typ == "summary":
            if ev.get("scope") == "process" and pid is not None:
                pids[pid].summary = ev
            elif pid is None or ev.get("scope") == "total":
                total = ev
            continue
        if pid is None:
            continue
        d = pids[pid]
        d.events += 1
        if ev.get("comm") is not None:
            d.comms[str(ev["comm"])] += 1
        if typ == "gpu_kernel":
            k = {f: ev.get(f) for f in KERNEL_FIELDS}
            for f in INT_FIELDS:
                k[f] = as_int(k[f])
            k["ts"] = gpu_ts(ev)
            d.kernels.append(k)
        elif typ == "gpu_memcpy":
            d.gmemcpy.append((gpu_ts(ev), str(ev.get("copy_kind")), as_int(ev.get("bytes"), 0) or 0))
        elif typ == "gpu_memset":
            d.gmemset.append((gpu_ts(ev), as_int(ev.get("bytes"), 0) or 0))
        elif typ == "launch":
            d.launches.append((as_int(ev.get("ts_ns")), as_int(ev.get("tid")),
                               str(ev.get("api") or ""), ev.get("kernel")))
        elif typ == "memcpy":
            d.copies.append((as_int(ev.get("ts_ns")), str(ev.get("direction")),
                             as_int(ev.get("bytes"), 0) or 0))
        elif typ == "memset":
            d.memsets.append(as_int(ev.get("ts_ns")))
        elif typ == "cupti":
            d.cupti.append(ev)
    return {"pids": pids, "total": total, "lines": counts.lines, "bad": counts.unusable}


def resolve_pid(want, hint, sc, notes):
    pids = sc["pids"]
    return pick_pid(want, hint, {p: d.events for p, d in pids.items()},
                    {p: d.comms for p, d in pids.items()},
                    lambda p: (len(pids[p].kernels), pids[p].events), notes, unit="line")


# ---------------------------------------------------------------- checks


def is_graph_api(api):
    return str(api or "").startswith("cuGraphLaunch")


def driver_timed(k):
    """Whether CUPTI's API record is the probed driver call itself (not a cuda* runtime call)."""
    return not str(k.get("cupti_api") or k.get("api") or "").startswith("cuda")


def timestamp_ok(k, tol):
    """The timestamp criterion (ii) for one joined line."""
    start, ts = k.get("cupti_api_start_ns"), k.get("launch_ts_ns")
    if start is None or ts is None:
        return False
    d = start - ts
    return 0 <= d <= tol if driver_timed(k) else abs(d) <= tol


def in_range(ts, s, e):
    return ts is not None and s <= ts <= e


def kernel_checks(kernels, launches, tol, strict_delta=True):
    """Join and timestamp checks over a set of gpu_kernel lines; returns (checks, metrics)."""
    checks = []
    n = len(kernels)
    joined = [k for k in kernels if k["launch_ts_ns"] is not None]
    checks.append(Check("gpu_kernel lines joined to their launch (launch_ts_ns set)", n,
                        len(joined), True, ok=n > 0 and len(joined) == n))
    deltas = [k["cupti_api_start_ns"] - k["launch_ts_ns"] for k in joined
              if k["cupti_api_start_ns"] is not None]
    no_api = len(joined) - len(deltas)
    # The criterion (ii): the uprobe fires at the driver entry, before CUPTI's callback stamps a
    # driver call; a runtime call (cudaLaunchKernel) starts before the driver entry it makes.
    meets = sum(1 for k in joined if timestamp_ok(k, tol))
    need = -(-len(joined) * round(TIMESTAMP_SHARE * 100) // 100)  # ceil(99 % of n)
    checks.append(Check(f"joined lines whose uprobe stamp precedes CUPTI's API start by ≤ {tol} ns "
                        f"(runtime-timed: |Δ| ≤ {tol} ns), at least {TIMESTAMP_SHARE:.0%}",
                        f"≥ {need} of {len(joined)}", meets, strict_delta,
                        ok=len(joined) > 0 and meets >= need))
    inside = sum(1 for k in joined if k["cupti_api_start_ns"] is not None
                 and k["cupti_api_end_ns"] is not None
                 and k["cupti_api_start_ns"] - tol <= k["launch_ts_ns"] <= k["cupti_api_end_ns"] + tol)
    checks.append(Check(f"joined lines whose launch_ts_ns lies in CUPTI's API record ± {tol} ns",
                        len(joined), inside, False))
    early = sum(1 for k in joined if driver_timed(k) and k["cupti_api_start_ns"] is not None
                and k["cupti_api_start_ns"] < k["launch_ts_ns"])
    checks.append(Check("driver-timed joined lines whose CUPTI API start precedes the uprobe stamp",
                        0, early, False))
    within = sum(1 for x in deltas if abs(x) <= tol)
    if no_api:
        checks.append(Check("joined lines without cupti_api_start_ns", 0, no_api, False))
    bad_order = sum(1 for k in kernels if k["gpu_start_ns"] is not None and k["gpu_end_ns"] is not None
                    and k["gpu_end_ns"] < k["gpu_start_ns"])
    checks.append(Check("gpu_kernel lines with gpu_end_ns ≥ gpu_start_ns", n, n - bad_order, True))
    # joined lines whose launch_ts_ns is one of the uprobe launch events of the same thread
    by_key = {(ts, tid): (api, kern) for ts, tid, api, kern in launches}
    hit = same_name = 0
    for k in joined:
        m = by_key.get((k["launch_ts_ns"], k["tid"]))
        if m is None:
            continue
        hit += 1
        if m[1] is not None and k["kernel"] is not None and norm_name(m[1]) == norm_name(k["kernel"]):
            same_name += 1
    queue = [k["queue_delay_ns"] if k["queue_delay_ns"] is not None
             else (k["gpu_start_ns"] - k["launch_ts_ns"]
                   if k["gpu_start_ns"] is not None else None) for k in joined]
    queue = [q for q in queue if q is not None]
    durs = [k["gpu_duration_ns"] if k["gpu_duration_ns"] is not None
            else (k["gpu_end_ns"] - k["gpu_start_ns"]
                  if k["gpu_end_ns"] is not None and k["gpu_start_ns"] is not None else None)
            for k in kernels]
    durs = [x for x in durs if x is not None]
    with_api = [k for k in joined if k["cupti_api_start_ns"] is not None]
    worst = sorted(with_api, key=lambda k: -abs(k["cupti_api_start_ns"] - k["launch_ts_ns"]))[:3]
    by_capi = defaultdict(list)
    for k in with_api:
        by_capi[str(k["cupti_api"] or k["api"])].append(abs(k["cupti_api_start_ns"] - k["launch_ts_ns"]))
    metrics = {
        "gpu_kernels": n, "joined": len(joined),
        "delta_abs_ns_by_cupti_api": {a: dist(v) for a, v in
                                      sorted(by_capi.items(), key=lambda kv: -len(kv[1]))[:4]},
        "joined_pct": round(100.0 * len(joined) / n, 3) if n else 0.0,
        "delta_within_tol": within, "tolerance_ns": tol,
        "delta_abs_ns": dist([abs(x) for x in deltas]), "delta_signed_ns": dist(deltas),
        "queue_delay_ns": dist(queue), "negative_queue_delay": sum(1 for q in queue if q < 0),
        "gpu_duration_ns": dist(durs),
        "joined_at_a_launch_event": hit, "joined_same_name_as_launch": same_name,
        "joined_api": dict(Counter(str(k["api"]) for k in joined).most_common(8)),
        "worst_delta": [{"kernel": short(k["kernel"], 60), "launch_ts_ns": k["launch_ts_ns"],
                         "cupti_api_start_ns": k["cupti_api_start_ns"], "api": k["api"],
                         "cupti_api": k["cupti_api"]}
                        for k in worst if abs(k["cupti_api_start_ns"] - k["launch_ts_ns"]) > tol],
    }
    return checks, metrics


def window_checks(win, d, tol):
    s, e = win.start, win.end
    K = [k for k in d.kernels if in_range(k["ts"], s, e)]
    L = [x for x in d.launches if in_range(x[0], s, e)]
    M = [x for x in d.gmemcpy if in_range(x[0], s, e)]
    S = [x for x in d.gmemset if in_range(x[0], s, e)]
    C = [x for x in d.copies if in_range(x[0], s, e)]
    MS = [t for t in d.memsets if in_range(t, s, e)]
    checks, metrics = kernel_checks(K, L, tol)
    exp = win.exp
    k_plain = [k for k in K if k["graph_id"] in (None, 0)]
    l_plain = [x for x in L if not is_graph_api(x[2])]
    checks.append(Check("gpu_kernel (not in a graph) = uprobe launch events (not cuGraphLaunch*)",
                        len(l_plain), len(k_plain), True))
    graph_k = len(K) - len(k_plain)
    graph_l = len(L) - len(l_plain)
    if graph_k or graph_l:
        checks.append(Check("graph kernels (gpu_kernel with graph_id) / cuGraphLaunch* events",
                            graph_l, graph_k, False, ok=True, label="info", show_pct=False))
    if win.kind in ("exact", "ground"):
        checks.append(Check("gpu_kernel = launches the workload made", exp.get("launches"),
                            len(K), True))
    elif exp.get("launches") is not None:
        checks.append(Check("gpu_kernel = torch.profiler kernels (recorded by the workload)",
                            exp["launches"], len(K), True))
    else:
        checks.append(Check("gpu_kernel = torch.profiler kernels", "not recorded", len(K), False,
                            ok=True, label=f"profiler not run ({short(exp.get('method') or '?', 60)})",
                            show_pct=False))
    checks.append(Check("gpu_memcpy = uprobe memcpy events", len(C), len(M), True))
    if win.kind in ("exact", "ground") and exp.get("copies") is not None:
        checks.append(Check("gpu_memcpy = copies the workload made", exp["copies"], len(M), True))
    elif win.kind == "profiler" and exp.get("copies") is not None:
        checks.append(Check("gpu_memcpy = torch.profiler memcpys", exp["copies"], len(M), True))
    checks.append(Check("gpu_memset = uprobe memset events", len(MS), len(S), False))
    if exp.get("memsets") is not None:
        what = "torch.profiler memsets" if win.kind == "profiler" else "memsets the workload made"
        checks.append(Check(f"gpu_memset = {what}", exp["memsets"], len(S), False))
    cb = sum(b for _, _, b in C)
    mb = sum(b for _, _, b in M)
    checks.append(Check("gpu_memcpy bytes = uprobe memcpy bytes", cb, mb, False))
    kinds = Counter(k for _, k, _ in M)
    dirs = Counter(dr for _, dr, _ in C)
    for kind, dr in KIND_DIRECTION.items():
        if kinds.get(kind) or dirs.get(dr):
            checks.append(Check(f"gpu_memcpy copy_kind {kind} = memcpy events {dr}",
                                dirs.get(dr, 0), kinds.get(kind, 0), False))
    # kernel names
    got_names = Counter(str(k["kernel"]) for k in K if k["kernel"] is not None)
    metrics["names"] = dict(got_names.most_common(8))
    if win.kind == "ground":
        want = Counter(exp.get("names") or {})
        want_n = Counter()
        shown = {}
        for name, n in want.items():
            want_n[norm_name(name)] += n
            shown[norm_name(name)] = name
        got_n = Counter()
        for name, n in got_names.items():
            got_n[norm_name(name)] += n
        for key in sorted(want_n):
            checks.append(Check(f"gpu_kernel named `{short(shown[key], 60)}`", want_n[key],
                                got_n.get(key, 0), True))
        other = sum(n for key, n in got_n.items() if key not in want_n)
        unnamed = len(K) - sum(got_names.values())
        checks.append(Check("gpu_kernel with another name, or none", 0, other + unnamed, True))
        if other:
            metrics["unexpected_names"] = {k: v for k, v in got_names.items()
                                          if norm_name(k) not in want_n}
    else:
        # graph kernels have no launch of their own to compare names with
        plain_names = Counter(str(k["kernel"]) for k in k_plain if k["kernel"] is not None)
        ref = Counter(str(x[3]) for x in l_plain if x[3] is not None)
        matched, un_obs, un_ref = match_names(plain_names, ref)
        metrics["names_matched_uprobe"] = matched
        checks.append(Check("gpu_kernel names = uprobe launch names (multiset, graphs aside)",
                            len(k_plain), matched, False))
        if un_obs:
            metrics["names_unmatched_cupti"] = dict(un_obs.most_common(5))
            metrics["names_unmatched_uprobe"] = dict(un_ref.most_common(5))
    checks.append(Check("joined lines whose launch_ts_ns is a launch event of the same thread",
                        metrics["joined"], metrics["joined_at_a_launch_event"], False))
    metrics.update({"launch_events": len(L), "gpu_memcpy": len(M), "memcpy_events": len(C),
                    "gpu_memset": len(S), "memset_events": len(MS),
                    "copy_kinds": dict(kinds)})
    return checks, metrics


def cupti_state(d):
    """(state, source, block): the per-process summary's cupti block, else the last cupti line."""
    block = d.summary.get("cupti") if isinstance(d.summary, dict) else None
    if isinstance(block, dict) and block.get("state") is not None:
        return str(block["state"]), "per-process summary", block
    if d.cupti:
        last = max(d.cupti, key=lambda e: as_int(e.get("ts_ns"), 0) or 0)
        return str(last.get("state")), "last `cupti` line (no cupti block in the summary)", block
    return None, "no cupti block and no `cupti` line for the pid", block


def run_checks(d, tol):
    """Whole-run checks for the pid."""
    checks, metrics = kernel_checks(d.kernels, d.launches, tol, strict_delta=False)
    # (ii) is strict per window; over the whole run (warm-up included) it is informational
    state, src, block = cupti_state(d)
    checks.append(Check(f"CUPTI state ({src})", "active", state, True))
    n_plain_l = sum(1 for x in d.launches if not is_graph_api(x[2]))
    n_plain_k = sum(1 for k in d.kernels if k["graph_id"] in (None, 0))
    checks.append(Check("gpu_kernel (not in a graph) = uprobe launch events, whole run", n_plain_l,
                        n_plain_k, False))
    checks.append(Check("gpu_memcpy = uprobe memcpy events, whole run", len(d.copies),
                        len(d.gmemcpy), False))
    if isinstance(block, dict):
        for key in ("cupti_dropped", "rate_limited"):
            if key in block:
                checks.append(Check(f"summary cupti.{key}", 0, as_int(block.get(key)), False))
        if "kernels" in block:
            checks.append(Check("summary cupti.kernels = gpu_kernel lines", len(d.kernels),
                                as_int(block.get("kernels")), False))
        if "unjoined" in block:
            checks.append(Check("summary cupti.unjoined = unjoined gpu_kernel lines",
                                len(d.kernels) - metrics["joined"], as_int(block.get("unjoined")),
                                False))
    metrics["cupti_state"] = state
    metrics["cupti_state_source"] = src
    metrics["cupti_block"] = block
    metrics["cupti_lines"] = [{k: e.get(k) for k in ("ts_ns", "state", "cupti_result", "message")}
                              for e in d.cupti[-6:]]
    return checks, metrics


# ---------------------------------------------------------------- output


def metric_lines(m):
    out = [f"abs(launch_ts_ns − cupti_api_start_ns): {fmt_dist(m['delta_abs_ns'])}",
           f"cupti_api_start_ns − launch_ts_ns (signed): {fmt_dist(m['delta_signed_ns'])}",
           f"queue delay (gpu_start_ns − launch_ts_ns): {fmt_dist(m['queue_delay_ns'])}"
           + (f"; {m['negative_queue_delay']} negative" if m.get("negative_queue_delay") else ""),
           f"GPU duration: {fmt_dist(m['gpu_duration_ns'])}"]
    by_capi = m.get("delta_abs_ns_by_cupti_api") or {}
    if by_capi:
        out.append("abs(launch_ts_ns − cupti_api_start_ns) by the API record CUPTI timed: " + "; ".join(
            f"`{a}` median {fmt_ns(d['median'])}, p99 {fmt_ns(d['p99'])}, max {fmt_ns(d['max'])} "
            f"(n={d['n']})" for a, d in by_capi.items()))
    if m.get("joined_api"):
        out.append("launch API of joined lines: " + ", ".join(
            f"`{k}` ({v})" for k, v in m["joined_api"].items()))
    if m.get("joined"):
        out.append(f"joined lines at a uprobe launch event of the same thread: "
                   f"{m['joined_at_a_launch_event']}/{m['joined']}, with the same kernel name: "
                   f"{m['joined_same_name_as_launch']}")
    if m.get("names"):
        out.append("kernel names (gpu_kernel): " + ", ".join(
            f"`{short(k, 80)}` ({v})" for k, v in list(m["names"].items())[:4]))
    for key, label in (("unexpected_names", "unexpected names"),
                       ("names_unmatched_cupti", "gpu_kernel names not among the launches'"),
                       ("names_unmatched_uprobe", "launch names left unmatched")):
        if m.get(key):
            out.append(f"{label}: " + "; ".join(f"`{short(k, 100)}` ({v})"
                                                for k, v in list(m[key].items())[:5]))
    for w in m.get("worst_delta") or []:
        out.append(f"over tolerance: `{w['kernel']}` via {w['api']} (CUPTI record "
                   f"{w.get('cupti_api')}): launch_ts_ns {w['launch_ts_ns']}, cupti_api_start_ns "
                   f"{w['cupti_api_start_ns']}")
    return out


def main():
    ap = argparse.ArgumentParser(prog="python3 -m gpucheck.compare_cupti",
                                 description="check gpu-observer CUPTI records against uprobes "
                                             "and the workload")
    comparer_args(ap)
    ap.add_argument("--tolerance-ns", type=int, default=TOLERANCE_NS)
    a = ap.parse_args()

    try:
        w = read_json(a.workload)
        wins = windows_from_workload(w)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        eprint(f"compare_cupti: cannot use workload JSON {a.workload}: {exc}")
        return 2
    if not wins:
        eprint(f"compare_cupti: no window found in {a.workload}")
        return 2
    if not os.path.exists(a.events):
        eprint(f"compare_cupti: events file {a.events} does not exist")
        return 2

    sc = scan(a.events)
    notes = []
    pid = resolve_pid(as_int(w.get("pid")), a.comm_hint, sc, notes)
    d = sc["pids"].get(pid) or PidData()
    total = sc["total"]
    if total is None:
        notes.append("WARN: no total `summary` line in the observer output (not stopped cleanly?)")
    elif as_int(total.get("dropped"), 0):
        notes.append(f"WARN: observer reports dropped={total.get('dropped')} (ring buffer)")
    if total is not None and total.get("trace_all") is False:
        notes.append("WARN: the observer ran without --trace-all: not every record is written")
    if d.summary is None:
        notes.append("WARN: no per-process `summary` line for the pid")
    if sc["bad"]:
        notes.append(f"WARN: {sc['bad']} unparsable JSONL lines")
    if not d.kernels:
        notes.append("WARN: no gpu_kernel line for the pid: is the injection library loaded "
                     "(CUDA_INJECTION64_PATH) and CUPTI active? See the `cupti` lines and the "
                     "observer's stderr")
    for e in d.cupti:
        if str(e.get("state")) != "active":
            notes.append(f"cupti line: state={e.get('state')} cupti_result={e.get('cupti_result')} "
                         f"message={e.get('message')!r}")

    title = a.title or a.name
    result = {"name": a.name, "title": title, "kind": "cupti", "pid": pid, "notes": notes,
              "summary": total, "process_summary": d.summary, "tolerance_ns": a.tolerance_ns,
              "windows": []}
    overall = True
    md = [f"### {title}", ""]
    comms = ", ".join(f"`{c}`" for c, _ in d.comms.most_common(3)) or "?"
    md.append(f"Workload pid {pid} (comm: {comms}); {d.events} observer lines for this pid: "
              f"{len(d.kernels)} `gpu_kernel`, {len(d.gmemcpy)} `gpu_memcpy`, {len(d.gmemset)} "
              f"`gpu_memset`, {len(d.launches)} `launch`, {len(d.copies)} `memcpy`.")
    md.append("")
    con = [f"== compare_cupti {a.name}: pid {pid}, {sc['lines']} JSONL lines, "
           f"{len(d.kernels)} gpu_kernel lines for the pid"]

    parts = [(win.key, win.label, win.end - win.start) + window_checks(win, d, a.tolerance_ns)
             for win in wins]
    rc_, rm_ = run_checks(d, a.tolerance_ns)
    parts.append(("run", "whole run of the pid (warm-up included)", None, rc_, rm_))
    for key, label, dur, checks, metrics in parts:
        ok = all(c.ok for c in checks if c.strict)
        overall = overall and ok
        status = "PASS" if ok else "FAIL"
        dur_txt = f"window {dur / 1e6:.1f} ms" if dur is not None else "whole run"
        md.append(f"#### {label}: **{status}**")
        md.append("")
        md.append(f"{dur_txt}; {metrics['gpu_kernels']} gpu_kernel lines, "
                  f"{metrics['joined']} joined ({metrics['joined_pct']}%).")
        md.append("")
        md.append(fmt_table(["check", "expected", "captured", "%", "result"],
                            [(c.metric, "?" if c.expected is None else c.expected,
                              "?" if c.captured is None else c.captured, c.pct(), c.mark())
                             for c in checks], ["---", "---:", "---:", "---:", "---"]))
        md.append("")
        mls = metric_lines(metrics)
        md.extend(f"- {x}" for x in mls)
        if key == "run":
            blk = metrics.get("cupti_block")
            if isinstance(blk, dict):
                md.append("- summary cupti block: " + ", ".join(
                    f"{k}={v}" for k, v in blk.items() if not isinstance(v, (list, dict))))
                top = blk.get("top_kernels")
                if isinstance(top, list) and top:
                    md.append("- top kernels by GPU time: " + "; ".join(
                        ", ".join(f"{k}={short(v, 70)}" for k, v in t.items())
                        if isinstance(t, dict) else short(t, 80) for t in top[:5]))
            for cl in metrics.get("cupti_lines") or []:
                md.append(f"- `cupti` line: state={cl.get('state')} "
                          f"cupti_result={cl.get('cupti_result')} message={cl.get('message')!r}")
        md.append("")
        con.append(f"-- {key} [{status}] {dur_txt}")
        for c in checks:
            flag = "" if c.ok else ("  <-- MISMATCH" if c.strict else "  (info)")
            con.append(f"   {c.metric:<72} expected {str(c.expected):>9}  captured "
                       f"{str(c.captured):>9}{flag}")
        con.extend(f"   {x}" for x in mls[:3])
        result["windows"].append({"key": key, "label": label, "status": status,
                                  "duration_ms": dur / 1e6 if dur is not None else None,
                                  "checks": [c.as_dict() for c in checks], "metrics": metrics})
    if total is not None:
        fields = ", ".join(f"{k}={v}" for k, v in total.items()
                           if k not in ("type", "ts_ns", "pid", "tid", "comm", "scope")
                           and not isinstance(v, (dict, list)))
        md.append(f"Observer summary (total): {fields}.")
        md.append("")
    for n in notes:
        md.append(f"> {n}")
        md.append("")
    result["status"] = "PASS" if overall else "FAIL"
    con.extend("   " + n for n in notes)
    con.append(f"== {a.name}: {result['status']}")
    print("\n".join(con), flush=True)
    write_outputs(a, md, result)
    return 0 if overall else 1


if __name__ == "__main__":
    sys.exit(main())
