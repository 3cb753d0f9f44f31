"""Compare a workload's own counts with what gpu-observer captured.

usage:
  python3 -m gpucheck.compare --workload W.json --events RUN.jsonl[.gz] --name NAME
             [--title TITLE] [--comm-hint PREFIX]
             [--section-out RUN.section.md] [--result-out RUN.result.json]

W.json is written by one of the workloads in gpu/workloads/:
  copies_kernels: {"pid","loop_start_ns","loop_end_ns","launches","htod","dtoh",
                   "htod_bytes","dtoh_bytes","stream_syncs","kernel_name",...}
  torch_loop:     {"pid","phaseA":{"start_ns","end_ns","launches","htod","dtoh",...},
                   "phaseB":{"start_ns","end_ns","profiler_kernels",
                             "profiler_memcpy","profiler_memset",
                             "profiler_kernel_names",...}}
(cuda-ground-truth's JSON has its own comparer: compare_ground_truth.py.)

Selection: events whose "pid" equals the workload's pid (if none carry that pid,
e.g. because of a PID namespace, the pid with the most events among those whose
"comm" starts with --comm-hint is used, with a warning) and whose ts_ns lies in
[start_ns, end_ns] of the window.

Strict checks (any mismatch -> exit 1): kernel launches, HtoD and DtoH copy
counts and bytes (exact windows), and for the profiler window launches vs
CUPTI kernels and copies vs CUPTI memcpys.  Stream syncs, memsets and the
per-thread-default-stream (_ptsz) API check are reported but not fatal.

Kernel names (observer `kernel`: demangled, null when unresolved):
  copies_kernels  every launch named, and named W.json's "kernel_name" (strict);
  phase A         named share and names vs the profiler self-check's (informational);
  phase B         >= 99% of launches named, and >= 99% of launches whose name equals a
                  profiler kernel name ("profiler_kernel_names", a multiset), compared
                  after whitespace normalisation (both strict).  Unmatched names are
                  listed with the point where each departs from the nearest profiler
                  name, and an informational match blind to known demangler-style
                  differences (integer literals, nested return types) is shown.

Exit status: 0 all strict checks pass, 1 a strict check failed, 2 bad input.
"""

import argparse
import os
import sys
from collections import Counter, defaultdict

from .checks import Check, comparer_args, pick_pid, write_outputs
from .common import as_int, eprint, fmt_table, share, short
from .jsonl import ReadCounts, read_json, read_jsonl
from .names import common_prefix, divergence, match_names, norm_name, style_name

LAUNCH_APIS = {
    "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cuGraphLaunch",
    "cuLaunchKernel_ptsz", "cuLaunchKernelEx_ptsz", "cuLaunchCooperativeKernel_ptsz",
    "cuGraphLaunch_ptsz",
}
HTOD = "cpu_to_gpu"
DTOH = "gpu_to_cpu"
# Kernel-name coverage target (percent of launches) for the profiler window.
NAME_TARGET = 99.0


# ---------------------------------------------------------------- windows


class Window:
    def __init__(self, key, label, start, end, expected, kind):
        self.key = key
        self.label = label
        self.start = start
        self.end = end
        self.expected = expected  # dict
        self.kind = kind  # "exact" | "profiler"


def windows_from_workload(w):
    wins = []
    if "loop_start_ns" in w:
        exp = {k: w.get(k) for k in ("launches", "htod", "dtoh", "htod_bytes", "dtoh_bytes",
                                     "stream_syncs", "device_syncs")}
        exp["ptds"] = bool(w.get("per_thread_default_stream", False))
        # The kernel's demangled name: every launch must carry it (strict).
        exp["kernel_name"] = w.get("kernel_name")
        exp["names_strict"] = True
        wins.append(Window("loop", "measured loop", as_int(w["loop_start_ns"]),
                           as_int(w["loop_end_ns"]), exp, "exact"))
    if "phaseA" in w:
        a = w["phaseA"]
        exp = {k: a.get(k) for k in ("launches", "htod", "dtoh", "htod_bytes", "dtoh_bytes",
                                     "stream_syncs")}
        exp["ptds"] = False
        exp["selfcheck"] = a.get("profiler_selfcheck")
        sc_ = a.get("profiler_selfcheck")
        if isinstance(sc_, dict) and isinstance(sc_.get("kernel_names"), dict):
            # Names the profiler gave the same per-iteration kernel (outside the window).
            exp["name_set"] = sorted(sc_["kernel_names"])
        exp["names_strict"] = False
        wins.append(Window("phaseA", "phase A (exact by construction)", as_int(a["start_ns"]),
                           as_int(a["end_ns"]), exp, "exact"))
    if "phaseB" in w:
        b = w["phaseB"]
        exp = {"launches": b.get("profiler_kernels"), "copies": b.get("profiler_memcpy"),
               "memsets": b.get("profiler_memset"),
               "method": b.get("profiler_count_method", "?"),
               "kernel_names": b.get("profiler_kernel_names")}
        wins.append(Window("phaseB", "phase B (training loop vs torch.profiler/CUPTI)",
                           as_int(b["start_ns"]), as_int(b["end_ns"]), exp, "profiler"))
    for win in wins:
        if win.start is None or win.end is None or win.end < win.start:
            raise ValueError(f"bad window {win.key}: {win.start}..{win.end}")
    return wins


# ---------------------------------------------------------------- scan


class Stats:
    def __init__(self):
        self.by_type_api = Counter()
        self.launches = 0
        self.launch_apis = Counter()
        self.launch_kernels = Counter()
        self.kernel_names = Counter()  # non-null `kernel` of kernel launches
        self.named = 0
        self.graph_launches = 0
        self.launch_streams = Counter()
        self.memcpy_dir = Counter()
        self.memcpy_bytes = Counter()
        self.memcpy_dir_api = Counter()
        self.memcpy_async = Counter()
        self.memsets = 0
        self.memset_bytes = 0
        self.sync_apis = Counter()
        self.ioctls = 0
        self.ioctl_parent = Counter()

    def add(self, ev):
        typ = str(ev.get("type", "?"))
        api = str(ev.get("api", "") or "")
        self.by_type_api[(typ, api or "-")] += 1
        if typ == "launch":
            self.launches += 1
            self.launch_apis[api] += 1
            kernel = ev.get("kernel")
            if api.startswith("cuGraphLaunch"):
                self.graph_launches += 1  # graphs carry no kernel name
            elif kernel is not None:
                self.named += 1
                self.kernel_names[str(kernel)] += 1
            name = kernel if kernel is not None else ev.get("function")
            self.launch_kernels[str(name) if name is not None else "?"] += 1
            self.launch_streams[str(ev.get("stream"))] += 1
        elif typ == "memcpy":
            d = str(ev.get("direction", "unknown"))
            self.memcpy_dir[d] += 1
            self.memcpy_bytes[d] += as_int(ev.get("bytes"), 0) or 0
            self.memcpy_dir_api[(d, api)] += 1
            self.memcpy_async[(d, bool(ev.get("async", False)))] += 1
        elif typ == "memset":
            self.memsets += 1
            self.memset_bytes += as_int(ev.get("bytes"), 0) or 0
        elif typ == "sync":
            self.sync_apis[api] += 1
        elif typ == "ioctl":
            self.ioctls += 1
            self.ioctl_parent[str(ev.get("parent_api"))] += 1

    @property
    def copies(self):
        return sum(self.memcpy_dir.values())


def scan(path, wins):
    """One pass over the JSONL. Keep in-window events of every pid (windows
    are short) plus per-pid totals, so the pid can be resolved afterwards."""
    in_win = [defaultdict(list) for _ in wins]  # per window: pid -> [events]
    pid_total = Counter()
    pid_comms = defaultdict(Counter)
    pid_apis = defaultdict(Counter)
    summary = None
    no_ts = 0
    lo = min(w.start for w in wins)
    hi = max(w.end for w in wins)
    counts = ReadCounts()
    for ev in read_jsonl(path, counts):
        if ev.get("type") == "summary":
            summary = ev
            continue
        pid = as_int(ev.get("pid"))
        pid_total[pid] += 1
        comm = ev.get("comm")
        if comm is not None:
            pid_comms[pid][str(comm)] += 1
        api = ev.get("api")
        if api:
            pid_apis[pid][(str(ev.get("type", "?")), str(api))] += 1
        ts = as_int(ev.get("ts_ns"))
        if ts is None:
            no_ts += 1
            continue
        if ts < lo or ts > hi:
            continue
        for i, w in enumerate(wins):
            if w.start <= ts <= w.end:
                in_win[i][pid].append(ev)
    return {"in_win": in_win, "pid_total": pid_total, "pid_comms": pid_comms,
            "pid_apis": pid_apis, "summary": summary, "lines": counts.lines, "bad": counts.unusable,
            "no_ts": no_ts}


def resolve_pid(want_pid, comm_hint, sc, notes):
    def score(p):
        # prefer the candidate with the most in-window events
        return (sum(len(d.get(p, [])) for d in sc["in_win"]), sc["pid_total"][p])
    return pick_pid(want_pid, comm_hint, sc["pid_total"], sc["pid_comms"], score, notes)


# ---------------------------------------------------------------- checks


def name_rows(win, st, info):
    """Kernel-name coverage rows; `info` collects the details for the report."""
    e = win.expected
    rows = []
    nameable = st.launches - st.graph_launches
    named_pct = share(st.named, nameable)
    info["named"] = st.named
    info["nameable_launches"] = nameable
    info["named_pct"] = round(named_pct, 2)
    info["names"] = dict(st.kernel_names.most_common(12))
    if win.kind == "profiler":
        ref = e.get("kernel_names")
        rows.append(Check(f"launches with a kernel name (target >= {NAME_TARGET:g}%)",
                        f">= {NAME_TARGET:g}%", f"{named_pct:.2f}% ({st.named}/{nameable})",
                        True, ok=nameable > 0 and named_pct >= NAME_TARGET, show_pct=False))
        if isinstance(ref, dict) and ref:
            matched, un_obs, un_ref = match_names(st.kernel_names, ref)
            m_pct = share(matched, nameable)
            info.update(matched=matched, match_pct=round(m_pct, 2),
                        unmatched_observer=dict(un_obs.most_common(8)),
                        unmatched_profiler=dict(un_ref.most_common(8)))
            info["divergences"] = [
                (o, divergence(o, max(un_ref, key=lambda p: common_prefix(o, p))))
                for o, _ in un_obs.most_common(5) if un_ref]
            rows.append(Check(f"launch names = profiler kernel names (target >= {NAME_TARGET:g}%)",
                            f">= {NAME_TARGET:g}%", f"{m_pct:.2f}% ({matched}/{nameable})",
                            True, ok=nameable > 0 and m_pct >= NAME_TARGET, show_pct=False))
            s_matched, _, _ = match_names(st.kernel_names, ref, key=style_name)
            s_pct = share(s_matched, nameable)
            info["style_match_pct"] = round(s_pct, 2)
            rows.append(Check("  same, blind to demangler style (literals, nested return types)",
                            f">= {NAME_TARGET:g}%", f"{s_pct:.2f}% ({s_matched}/{nameable})",
                            False, ok=nameable > 0 and s_pct >= NAME_TARGET, show_pct=False))
        else:
            info["match_pct"] = None
            rows.append(Check("launch names = profiler kernel names", "profiler names",
                            "not recorded by the workload", False, ok=False, show_pct=False))
        return rows
    strict = bool(e.get("names_strict"))
    rows.append(Check("launches with a kernel name", nameable, st.named, strict))
    want = e.get("kernel_name")
    if want:
        same = sum(n for k, n in st.kernel_names.items() if norm_name(k) == norm_name(want))
        info["expected_name"] = want
        rows.append(Check(f"launches named `{want}`", nameable, same, strict))
    elif e.get("name_set"):
        info["profiler_names"] = e["name_set"]
        for label, key in (("launch names seen by the profiler self-check", norm_name),
                           ("  same, blind to demangler style", style_name)):
            ref = {key(k) for k in e["name_set"]}
            same = sum(n for k, n in st.kernel_names.items() if key(k) in ref)
            rows.append(Check(label, nameable, same, False))
    return rows


def build_checks(win, st, info=None):
    """Return list of Check (metric, expected, captured, strict, ok)."""
    info = {} if info is None else info
    e = win.expected
    rows = []
    if win.kind == "exact":
        rows.append(Check("kernel launches", as_int(e.get("launches")), st.launches, True))
        rows.append(Check("HtoD copies", as_int(e.get("htod")), st.memcpy_dir[HTOD], True))
        rows.append(Check("DtoH copies", as_int(e.get("dtoh")), st.memcpy_dir[DTOH], True))
        if e.get("htod_bytes") is not None:
            rows.append(Check("HtoD bytes", as_int(e["htod_bytes"]), st.memcpy_bytes[HTOD], True))
        if e.get("dtoh_bytes") is not None:
            rows.append(Check("DtoH bytes", as_int(e["dtoh_bytes"]), st.memcpy_bytes[DTOH], True))
        other = st.copies - st.memcpy_dir[HTOD] - st.memcpy_dir[DTOH]
        rows.append(Check("other copies (DtoD/unknown)", 0, other, False))
        if e.get("stream_syncs") is not None:
            ss = sum(n for a, n in st.sync_apis.items() if a.startswith("cuStreamSynchronize"))
            rows.append(Check("cuStreamSynchronize*", as_int(e["stream_syncs"]), ss, False))
        if e.get("device_syncs") is not None:
            ds = sum(n for a, n in st.sync_apis.items() if a.startswith("cuCtxSynchronize"))
            rows.append(Check("cuCtxSynchronize*", as_int(e["device_syncs"]), ds, False))
        if e.get("ptds"):
            pt = sum(n for a, n in st.launch_apis.items() if a.endswith("_ptsz"))
            rows.append(Check("launches via *_ptsz API", as_int(e.get("launches")), pt, False))
    else:
        rows.append(Check("kernel launches vs CUPTI kernels", as_int(e.get("launches")),
                        st.launches, True))
        rows.append(Check("memcpy (all directions) vs CUPTI memcpy", as_int(e.get("copies")),
                        st.copies, True))
        rows.append(Check("memset vs CUPTI memset", as_int(e.get("memsets")), st.memsets, False))
    rows.extend(name_rows(win, st, info))
    return rows


def top_items(counter, n=6):
    return ", ".join(f"`{short(k)}` ({v})" for k, v in counter.most_common(n)) or "none"


def describe_names(info):
    """Human lines about kernel names: what was seen, and what did not match."""
    out = []
    if info.get("expected_name"):
        out.append(f"expected kernel name: `{info['expected_name']}`")
    if info.get("names"):
        out.append("kernel names (observer): " + ", ".join(
            f"`{short(k, 100)}` ({v})" for k, v in list(info["names"].items())[:4]))
    if info.get("match_pct") is not None:
        out.append(f"names matching the profiler: {info.get('matched')}/"
                   f"{info.get('nameable_launches')} ({info['match_pct']}%); blind to "
                   f"demangler style: {info.get('style_match_pct')}%")
        for o, d in info.get("divergences") or []:
            out.append(f"differs: `{short(o, 60)}`: {d}")
        for label, key in (("observer names not among the profiler's", "unmatched_observer"),
                           ("profiler names left unmatched", "unmatched_profiler")):
            items = info.get(key) or {}
            if items:
                out.append(f"{label}: " + "; ".join(
                    f"`{short(k, 160)}` ({v})" for k, v in list(items.items())[:5]))
    return out


def main():
    ap = argparse.ArgumentParser(prog="python3 -m gpucheck.compare",
                                 description="compare workload counts with observer JSONL")
    a = comparer_args(ap, helps=True).parse_args()

    try:
        w = read_json(a.workload)
        wins = windows_from_workload(w)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        eprint(f"compare: cannot use workload JSON {a.workload}: {exc}")
        return 2
    if not wins:
        eprint(f"compare: no window found in {a.workload}")
        return 2
    if not os.path.exists(a.events):
        eprint(f"compare: events file {a.events} does not exist")
        return 2

    sc = scan(a.events, wins)
    notes = []
    pid = resolve_pid(as_int(w.get("pid")), a.comm_hint, sc, notes)
    summ = sc["summary"]
    if summ is None:
        notes.append("WARN: no `summary` line in the observer output (not stopped cleanly?)")
    else:
        dropped = as_int(summ.get("dropped"), 0) or 0
        if dropped:
            notes.append(f"WARN: observer reports dropped={dropped}")
    if sc["bad"]:
        notes.append(f"WARN: {sc['bad']} unparsable JSONL lines")
    if sc["no_ts"]:
        notes.append(f"WARN: {sc['no_ts']} events without ts_ns")

    title = a.title or a.name
    overall_ok = True
    md = [f"### {title}", ""]
    con = [f"== compare {a.name}: pid {pid}, {sc['lines']} JSONL lines, "
           f"{sc['pid_total'].get(pid, 0)} events for pid"]
    result = {"name": a.name, "title": title, "pid": pid, "windows": [],
              "summary": summ, "notes": notes}

    comms = sc["pid_comms"].get(pid, Counter())
    md.append(f"Workload pid {pid} (comm: {', '.join(f'`{c}`' for c, _ in comms.most_common(4)) or '?'}); "
              f"{sc['pid_total'].get(pid, 0)} observer events for this pid over the whole run.")
    md.append("")

    for i, win in enumerate(wins):
        st = Stats()
        for ev in sc["in_win"][i].get(pid, []):
            st.add(ev)
        names_info = {}
        rows = build_checks(win, st, names_info)
        ok = all(r.ok for r in rows if r.strict)
        overall_ok = overall_ok and ok
        dur_ms = (win.end - win.start) / 1e6
        status = "PASS" if ok else "FAIL"
        table_rows = []
        for r in rows:
            mark = "ok" if r.ok else ("**MISMATCH**" if r.strict else "differs (info)")
            table_rows.append((r.metric, "?" if r.expected is None else r.expected, r.captured,
                               r.pct(), mark))
        md.append(f"#### {win.label}: **{status}**")
        md.append("")
        extra = f"; expected counts from `{win.expected.get('method')}`" if win.kind == "profiler" else ""
        md.append(f"Window {dur_ms:.1f} ms{extra}.")
        md.append("")
        md.append(fmt_table(["metric", "expected", "captured", "%", "check"], table_rows,
                            ["---", "---:", "---:", "---:", "---"]))
        md.append("")
        hist = sorted(st.by_type_api.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1]))
        md.append("Per-API events inside the window:")
        md.append("")
        md.append(fmt_table(["type", "api", "count"],
                            [(t, f"`{api}`", n) for (t, api), n in hist],
                            ["---", "---", "---:"]) if hist else "_no events in window_")
        md.append("")
        md.append(f"- launch APIs: {top_items(st.launch_apis)}")
        md.append(f"- launch streams: {top_items(st.launch_streams, 4)}")
        md.append(f"- kernels: {top_items(st.launch_kernels, 5)}")
        name_lines = describe_names(names_info)
        md.extend(f"- {x}" for x in name_lines)
        if st.memcpy_dir_api:
            md.append("- memcpy (direction/api): " + ", ".join(
                f"{d} `{api}` ({n})" for (d, api), n in st.memcpy_dir_api.most_common(8)))
        if st.ioctls:
            md.append(f"- ioctls: {st.ioctls}, by parent_api: {top_items(st.ioctl_parent, 6)}")
        selfcheck_line = None
        sc_ = win.expected.get("selfcheck")
        if isinstance(sc_, dict) and "consistent" in sc_:
            line = (f"workload self-check under torch.profiler ({sc_.get('iterations')} extra "
                    f"iterations outside the window): kernels={sc_.get('kernels')} "
                    f"memcpy={sc_.get('memcpy')} memset={sc_.get('memset')} -> "
                    f"{'consistent with the expected counts' if sc_['consistent'] else 'NOT consistent: expected counts may be wrong'}")
            md.append(f"- {line}")
            selfcheck_line = line
            if not sc_["consistent"]:
                notes.append("WARN: phase A self-check under the profiler disagrees with the "
                             "expected per-iteration counts")
        md.append("")

        con.append(f"-- {win.key} [{status}] window {dur_ms:.1f} ms")
        for r in rows:
            flag = "" if r.ok else ("  <-- MISMATCH" if r.strict else "  (info)")
            con.append(f"   {r.metric:<42} expected {str(r.expected):>9}  captured "
                       f"{str(r.captured):>9}  {r.pct():>7}{flag}")
        con.extend(f"   {x}" for x in name_lines)
        con.append("   per-API in window: " + ", ".join(
            f"{t}/{api}={n}" for (t, api), n in st.by_type_api.most_common(12)))
        if selfcheck_line:
            con.append(f"   {selfcheck_line}")
        result["windows"].append({
            "key": win.key, "status": status, "duration_ms": dur_ms,
            "checks": [{"metric": r.metric, "expected": r.expected, "captured": r.captured,
                        "strict": r.strict, "ok": r.ok} for r in rows],
            "kernel_names": names_info,
            "per_api": {f"{t}/{api}": n for (t, api), n in st.by_type_api.items()},
            "launch_apis": dict(st.launch_apis),
        })

    all_apis = sc["pid_apis"].get(pid, Counter())
    launch_names = sorted({api for (t, api) in all_apis if t == "launch"})
    md.append("APIs seen for this pid over the whole run (type/api: count): " + (", ".join(
        f"{t}/`{api}` ({n})" for (t, api), n in sorted(all_apis.items())) or "none") + ".")
    md.append("")
    md.append("Launch API names seen: " + (", ".join(f"`{n}`" for n in launch_names) or "none") + ".")
    md.append("")
    if summ is not None:
        fields = ", ".join(f"{k}={v}" for k, v in summ.items()
                           if k not in ("type", "ts_ns", "pid", "tid", "comm")
                           and not isinstance(v, (dict, list)))
        md.append(f"Observer summary (all processes): {fields}.")
        md.append("")
    for n in notes:
        md.append(f"> {n}")
        md.append("")
    result["status"] = "PASS" if overall_ok else "FAIL"
    result["launch_api_names"] = launch_names

    con.append(f"   launch API names seen (whole run): {', '.join(launch_names) or 'none'}")
    if summ is not None:
        con.append(f"   observer summary: events={summ.get('events')} dropped={summ.get('dropped')}")
    con.extend("   " + n for n in notes)
    con.append(f"== {a.name}: {result['status']}")
    print("\n".join(con), flush=True)

    write_outputs(a, md, result)
    return 0 if overall_ok else 1


if __name__ == "__main__":
    sys.exit(main())
