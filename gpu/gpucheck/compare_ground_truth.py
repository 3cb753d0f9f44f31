"""Compare cuda-ground-truth's record of its own driver calls with what gpu-observer captured.

usage:
  python3 -m gpucheck.compare_ground_truth --workload GT.json --events RUN.jsonl[.gz] --name NAME
             [--title TITLE] [--comm-hint PREFIX] [--api-table api.rs]
             [--section-out RUN.section.md] [--result-out RUN.result.json]

GT.json is written by `cuda-ground-truth --out` (workloads/cuda-ground-truth):
  {"pid", "window_start_ns", "window_end_ns", "calls": {api: n}, "bytes": {api: n},
   "kernels": {ptx entry: n}, "kernel_names": {ptx entry: demangled},
   "launch": {"grid", "block", "shared_mem_bytes"}, "handles": {"stream", "module"},
   "copies": [...], "generic_copies": [{"api", "direction", "host_memory", "bytes_per_copy",
   "count", "bytes"}], "leaks": [{"api", "count", "bytes"}], "hypotheses": {...}}

Observer contract relied on (JSONL, see the top-level README):
  - every probed call is one event with `api` = exact symbol; module loads are type
    "module", name lookups type "symbol"; events are counted by `api` whatever their type
    (ioctl, memory, leak, summary and process_exit lines are not calls, nor are the CUPTI
    lines gpu_kernel, gpu_memcpy, gpu_memset and cupti of a run under `gpu-observer run`);
  - `launch`: `kernel` (demangled name, null when unresolved), `kernel_mangled`, `grid`,
    `block`, `shared_mem_bytes`, `stream`;
  - `memcpy`: `direction` (inferred for generic copies), `host_memory` ("pinned" |
    "pageable" | null), `bytes`; memset/alloc/free: `bytes` (free: of the matching alloc);
  - `leak` lines {"type":"leak","pid","api","memory","count","bytes"} when the process exits
    (or the observer stops); per-process `summary` lines with `named_launches`,
    `unresolved_launches` and `leaks`.

Selection: events of the workload's pid (pid fallback by --comm-hint as in compare.py) with
ts_ns inside [window_start_ns, window_end_ns]; leak lines of that pid at any time.

Strict checks (any failure -> exit 1):
  - per API: the count of every API the workload called, for APIs the observer probes (the
    APIS table in gpu-observer-common/src/api.rs, or any API it reported), and no call of
    an API the workload did not make;
  - bytes per API (copies, memset, allocs, frees);
  - kernel names: every launch named, and the multiset of `kernel` equals the expected
    demangled names (and `kernel_mangled` the PTX entry names, where present);
  - launch geometry and stream of every launch;
  - generic copies (cuMemcpy): count and bytes per direction and host memory;
  - the leak report: exactly the workload's unfreed allocations (api, count, bytes);
  - the workload's own hypotheses (H1, H2, H3, H9) all true.
Informational: APIs the observer does not probe, host_memory of explicit copies, the
per-process summary's named/unresolved launches.

Exit status: 0 all strict checks pass, 1 a strict check failed, 2 bad input.
"""

import argparse
import os
import re
import sys
from collections import Counter, defaultdict

from .checks import Check as BaseCheck, comparer_args, pick_pid, write_outputs
from .common import as_int, eprint, fmt_table, short
from .jsonl import ReadCounts, read_json, read_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_API_TABLE = os.path.join(HERE, "..", "..", "gpu-observer-common", "src", "api.rs")
# Lines that are not probed calls; the CUPTI lines of a run under `gpu-observer run` carry the
# `api` of the call that launched their work, and must not count as calls a second time.
NOT_CALLS = {"ioctl", "memory", "leak", "summary", "process_exit", "gpu_kernel", "gpu_memcpy",
             "gpu_memset", "cupti"}
GENERIC_COPY = re.compile(r"^cuMemcpy(Async|Peer|PeerAsync)?(_ptds|_ptsz)?$")

# Used when api.rs is not at hand (a copy of its APIS names, issue 3).
FALLBACK_PROBED = set("""
cuLaunchKernel cuLaunchKernel_ptsz cuLaunchCooperativeKernel cuLaunchCooperativeKernel_ptsz
cuLaunchKernelEx cuLaunchKernelEx_ptsz cuGraphLaunch cuGraphLaunch_ptsz
cuMemcpyHtoD_v2 cuMemcpyHtoD_v2_ptds cuMemcpyDtoH_v2 cuMemcpyDtoH_v2_ptds cuMemcpyDtoD_v2
cuMemcpyDtoD_v2_ptds cuMemcpyHtoDAsync_v2 cuMemcpyHtoDAsync_v2_ptsz cuMemcpyDtoHAsync_v2
cuMemcpyDtoHAsync_v2_ptsz cuMemcpyDtoDAsync_v2 cuMemcpyDtoDAsync_v2_ptsz cuMemcpy cuMemcpy_ptds
cuMemcpyAsync cuMemcpyAsync_ptsz cuMemcpyPeer cuMemcpyPeer_ptds cuMemcpyPeerAsync
cuMemcpyPeerAsync_ptsz cuMemsetD8_v2 cuMemsetD8_v2_ptds cuMemsetD16_v2 cuMemsetD16_v2_ptds
cuMemsetD32_v2 cuMemsetD32_v2_ptds cuMemsetD8Async cuMemsetD8Async_ptsz cuMemsetD16Async
cuMemsetD16Async_ptsz cuMemsetD32Async cuMemsetD32Async_ptsz cuMemsetD2D8_v2
cuMemsetD2D8_v2_ptds cuMemsetD2D16_v2 cuMemsetD2D16_v2_ptds cuMemsetD2D32_v2
cuMemsetD2D32_v2_ptds cuMemsetD2D8Async cuMemsetD2D8Async_ptsz cuMemsetD2D16Async
cuMemsetD2D16Async_ptsz cuMemsetD2D32Async cuMemsetD2D32Async_ptsz cuMemAlloc_v2
cuMemAllocAsync cuMemAllocAsync_ptsz cuMemAllocFromPoolAsync cuMemAllocFromPoolAsync_ptsz
cuMemAllocPitch_v2 cuMemAllocManaged cuMemAllocHost_v2 cuMemHostAlloc cuMemFree_v2
cuMemFreeAsync cuMemFreeAsync_ptsz cuMemFreeHost cuCtxSynchronize cuCtxSynchronize_v2
cuStreamSynchronize cuStreamSynchronize_ptsz cuEventSynchronize cuInit cuDevicePrimaryCtxRetain
cuModuleLoad cuModuleLoadData cuModuleLoadDataEx cuModuleLoadFatBinary cuModuleUnload
cuLibraryLoadData cuLibraryLoadFromFile cuLibraryUnload cuModuleGetFunction cuLibraryGetKernel
cuKernelGetFunction cuFuncGetName cuKernelGetName cuMemHostRegister_v2 cuMemHostUnregister
""".split())


def probed_apis(path):
    """Names in the APIS table of api.rs; (names, source)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return set(FALLBACK_PROBED), "built-in list (api.rs not found)"
    start = text.find("pub const APIS")
    end = text.find("];", start)
    body = text[start:end] if start >= 0 and end > start else ""
    names = set(re.findall(r'\(\s*"(cu[A-Za-z0-9_]+)"', body))
    if len(names) < 20:
        return set(FALLBACK_PROBED), f"built-in list ({path} not parsable)"
    return names, os.path.normpath(path)


def is_generic_copy(api):
    return bool(GENERIC_COPY.match(api or ""))


def hexint(v):
    if v is None:
        return None
    return as_int(v)


class Check(BaseCheck):
    """A check in a group of the report (calls, kernels, copies, ...)."""

    def __init__(self, group, metric, expected, captured, strict, ok=None, label=None):
        super().__init__(metric, expected, captured, strict, ok=ok, label=label, group=group)


def scan(path, start, end):
    per_pid = defaultdict(list)  # in-window events
    leaks = defaultdict(list)
    summaries = {}
    comms = defaultdict(Counter)
    totals = Counter()
    total_summary = None
    counts = ReadCounts()
    for ev in read_jsonl(path, counts):
        typ = ev.get("type")
        pid = as_int(ev.get("pid"))
        if typ == "summary":
            if ev.get("scope") == "process" and pid is not None:
                summaries[pid] = ev
            elif pid is None:
                total_summary = ev
            continue
        if typ == "leak":
            leaks[pid].append(ev)
            continue
        totals[pid] += 1
        if ev.get("comm") is not None:
            comms[pid][str(ev["comm"])] += 1
        ts = as_int(ev.get("ts_ns"))
        if ts is not None and start <= ts <= end:
            per_pid[pid].append(ev)
    return {"in_win": per_pid, "leaks": leaks, "summaries": summaries, "comms": comms,
            "totals": totals, "summary": total_summary, "lines": counts.lines, "bad": counts.unusable}


def resolve_pid(want, hint, sc, notes):
    return pick_pid(want, hint, sc["totals"], sc["comms"],
                    lambda p: (len(sc["in_win"].get(p, [])), sc["totals"][p]), notes, list_seen=False)


def latest_leaks(evs):
    """Leak lines may be written more than once (process exit, observer stop): keep the
    latest report per (api, memory)."""
    by = {}
    for e in evs:
        key = (str(e.get("api")), str(e.get("memory")))
        ts = as_int(e.get("ts_ns"), 0) or 0
        if key not in by or ts >= by[key][0]:
            by[key] = (ts, e)
    out = Counter()
    cnt = Counter()
    for (api, _mem), (_ts, e) in by.items():
        cnt[api] += as_int(e.get("count"), 0) or 0
        out[api] += as_int(e.get("bytes"), 0) or 0
    return cnt, out


def compare(w, sc, pid, probed):
    checks = []
    evs = sc["in_win"].get(pid, [])
    calls = [e for e in evs if e.get("type") not in NOT_CALLS and e.get("api")]
    by_api = Counter(str(e["api"]) for e in calls)
    by_type_api = Counter((str(e.get("type")), str(e["api"])) for e in calls)
    exp_calls = {k: as_int(v, 0) for k, v in (w.get("calls") or {}).items()}

    # -- per-API counts
    for api in sorted(set(exp_calls) | set(by_api)):
        e, c = exp_calls.get(api, 0), by_api.get(api, 0)
        if api in exp_calls and api not in probed and c == 0:
            checks.append(Check("calls", f"`{api}`", e, c, False, ok=True,
                                label="not probed by the observer (info)"))
            continue
        checks.append(Check("calls", f"`{api}`", e, c, True))

    # -- failed calls (the invalid PTX load): api and CUresult
    exp_f = Counter()
    for row in w.get("failed_calls") or []:
        exp_f[(row.get("api"), as_int(row.get("result")))] += as_int(row.get("count"), 0)
    if "failed_calls" not in w and as_int(w.get("invalid_ptx_result"), 0):
        exp_f[("cuModuleLoadData", as_int(w["invalid_ptx_result"]))] += 1
    got_f = Counter((str(e["api"]), as_int(e.get("result"))) for e in calls
                    if as_int(e.get("result"), 0) not in (0, None))
    for k in sorted(set(exp_f) | set(got_f), key=str):
        checks.append(Check("calls", f"`{k[0]}` returning {k[1]}", exp_f.get(k, 0), got_f.get(k, 0), True))

    # -- bytes per API
    got_bytes = Counter()
    for e in calls:
        got_bytes[str(e["api"])] += as_int(e.get("bytes"), 0) or 0
    for api, b in sorted((w.get("bytes") or {}).items()):
        strict = api in probed or by_api.get(api, 0) > 0
        checks.append(Check("bytes", f"`{api}` bytes", as_int(b, 0), got_bytes.get(api, 0), strict))

    # -- launches: names, geometry, stream
    launches = [e for e in evs if e.get("type") == "launch"]
    names = {k: v for k, v in (w.get("kernel_names") or {}).items()}
    exp_names = Counter()
    exp_mangled = Counter()
    for entry, n in (w.get("kernels") or {}).items():
        exp_names[names.get(entry, entry)] += as_int(n, 0)
        exp_mangled[entry] += as_int(n, 0)
    got_names = Counter(str(e["kernel"]) for e in launches if e.get("kernel") is not None)
    named = sum(got_names.values())
    n_launch = len(launches)
    checks.append(Check("kernels", "kernel launches", sum(exp_names.values()), n_launch, True))
    pct_named = 100.0 * named / n_launch if n_launch else 0.0
    checks.append(Check("kernels", "launches with a kernel name", "100.0%",
                        f"{pct_named:.1f}% ({named}/{n_launch})", True,
                        ok=n_launch > 0 and named == n_launch))
    for name in sorted(set(exp_names) | set(got_names)):
        checks.append(Check("kernels", f"kernel `{short(name, 70)}`", exp_names.get(name, 0),
                            got_names.get(name, 0), True))
    if any("kernel_mangled" in e for e in launches):
        got_m = Counter(str(e.get("kernel_mangled")) for e in launches)
        checks.append(Check("kernels", "kernel_mangled multiset = PTX entry names",
                            dict(sorted(exp_mangled.items())), dict(sorted(got_m.items())), True))
    else:
        checks.append(Check("kernels", "kernel_mangled field", "present", "absent", False,
                            ok=not launches))
    lc = w.get("launch") or {}
    if lc:
        want = (list(lc.get("grid", [])), list(lc.get("block", [])), as_int(lc.get("shared_mem_bytes"), 0))
        good = sum(1 for e in launches
                   if (list(e.get("grid") or []), list(e.get("block") or []),
                       as_int(e.get("shared_mem_bytes"), 0)) == want)
        checks.append(Check("kernels", f"launches with grid {want[0]} block {want[1]} shmem {want[2]}",
                            n_launch, good, True))
    stream = hexint((w.get("handles") or {}).get("stream"))
    if stream is not None:
        on = sum(1 for e in launches if hexint(e.get("stream")) == stream)
        checks.append(Check("kernels", f"launches on the created stream {stream:#x}", n_launch, on, True))

    # -- copies: totals by direction, generic copies by (direction, host memory)
    copies = [e for e in evs if e.get("type") == "memcpy"]
    exp_dir = Counter()
    for row in w.get("copies") or []:
        exp_dir[row.get("direction")] += as_int(row.get("count"), 0)
    got_dir = Counter(str(e.get("direction")) for e in copies)
    for d, label in (("cpu_to_gpu", "HtoD copies"), ("gpu_to_cpu", "DtoH copies"),
                     ("gpu_to_gpu", "DtoD copies"), ("unknown", "copies of unknown direction")):
        if exp_dir.get(d, 0) or got_dir.get(d, 0) or d != "unknown":
            checks.append(Check("copies", f"{label} (all APIs)", exp_dir.get(d, 0), got_dir.get(d, 0), True))
    exp_g = Counter()
    exp_gb = Counter()
    for row in w.get("generic_copies") or []:
        k = (row.get("direction"), row.get("host_memory"))
        exp_g[k] += as_int(row.get("count"), 0)
        exp_gb[k] += as_int(row.get("bytes"), 0)
    got_g = Counter()
    got_gb = Counter()
    for e in copies:
        if is_generic_copy(e.get("api")):
            k = (e.get("direction"), e.get("host_memory"))
            got_g[k] += 1
            got_gb[k] += as_int(e.get("bytes"), 0) or 0
    for k in sorted(set(exp_g) | set(got_g), key=lambda x: (str(x[0]), str(x[1]))):
        label = f"generic copies {k[0]} host_memory={k[1] if k[1] is not None else 'null'}"
        checks.append(Check("generic", label, exp_g.get(k, 0), got_g.get(k, 0), True))
        checks.append(Check("generic", label + " bytes", exp_gb.get(k, 0), got_gb.get(k, 0), True))
    for row in w.get("copies") or []:
        api = row.get("api")
        if is_generic_copy(api):
            continue
        hm = row.get("host_memory")
        n = sum(1 for e in copies if e.get("api") == api and e.get("host_memory") == hm)
        checks.append(Check("explicit", f"`{api}` with host_memory={hm}", as_int(row.get("count"), 0),
                            n, False))

    # -- leaks (any time: they are written when the process exits)
    exp_lc = Counter()
    exp_lb = Counter()
    for row in w.get("leaks") or []:
        exp_lc[row.get("api")] += as_int(row.get("count"), 0)
        exp_lb[row.get("api")] += as_int(row.get("bytes"), 0)
    got_lc, got_lb = latest_leaks(sc["leaks"].get(pid, []))
    if not sc["leaks"].get(pid) and exp_lc:
        checks.append(Check("leaks", "leak lines for the pid", "present", "none", True))
    for api in sorted(set(exp_lc) | set(got_lc)):
        checks.append(Check("leaks", f"leak `{api}` count", exp_lc.get(api, 0), got_lc.get(api, 0), True))
        checks.append(Check("leaks", f"leak `{api}` bytes", exp_lb.get(api, 0), got_lb.get(api, 0), True))

    # -- the per-process summary (whole run of the pid: every launch is in the window)
    summ = sc["summaries"].get(pid)
    if summ is not None:
        for key, want in (("named_launches", n_launch), ("unresolved_launches", 0)):
            if key in summ:
                checks.append(Check("summary", f"summary `{key}`", want, as_int(summ.get(key)), key == "unresolved_launches"))
            else:
                checks.append(Check("summary", f"summary `{key}`", want, "absent", False, ok=False))
        sl = summ.get("leaks")
        if isinstance(sl, list):
            c = Counter()
            for r in sl:
                c[r.get("api")] += as_int(r.get("count"), 0) or 0
            checks.append(Check("summary", "summary `leaks` (count per api)", dict(exp_lc), dict(c), False))
    else:
        checks.append(Check("summary", "per-process summary line", "present", "absent", False, ok=False))

    # -- the workload's own hypotheses
    for h, v in sorted((w.get("hypotheses") or {}).items()):
        checks.append(Check("workload", f"workload hypothesis {h}", True, bool(v), True))
    return checks, by_type_api, launches, copies


def main():
    ap = argparse.ArgumentParser(prog="python3 -m gpucheck.compare_ground_truth",
                                 description="compare cuda-ground-truth JSON with observer JSONL")
    comparer_args(ap, comm_hint="cuda-ground-tru")
    ap.add_argument("--api-table", default=DEFAULT_API_TABLE)
    a = ap.parse_args()

    try:
        w = read_json(a.workload)
        start, end = as_int(w["window_start_ns"]), as_int(w["window_end_ns"])
        if start is None or end is None or end < start or not isinstance(w.get("calls"), dict):
            raise ValueError(f"bad window {start}..{end} or no calls")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        eprint(f"compare_ground_truth: cannot use workload JSON {a.workload}: {exc}")
        return 2
    if not os.path.exists(a.events):
        eprint(f"compare_ground_truth: events file {a.events} does not exist")
        return 2

    probed, table_src = probed_apis(a.api_table)
    sc = scan(a.events, start, end)
    notes = []
    pid = resolve_pid(as_int(w.get("pid")), a.comm_hint, sc, notes)
    if sc["summary"] is None:
        notes.append("WARN: no total `summary` line in the observer output (not stopped cleanly?)")
    elif as_int(sc["summary"].get("dropped"), 0):
        notes.append(f"WARN: observer reports dropped={sc['summary'].get('dropped')}")
    if sc["bad"]:
        notes.append(f"WARN: {sc['bad']} unparsable JSONL lines")
    if w.get("error"):
        notes.append(f"WARN: the workload stopped early: {w['error']}")

    checks, by_type_api, launches, copies = compare(w, sc, pid, probed)
    ok = all(c.ok for c in checks if c.strict)
    status = "PASS" if ok else "FAIL"
    dur_ms = (end - start) / 1e6
    title = a.title or a.name

    con = [f"== compare {a.name}: pid {pid}, {sc['lines']} JSONL lines, "
           f"{len(sc['in_win'].get(pid, []))} events in the {dur_ms:.1f} ms window; "
           f"probed APIs from {table_src}"]
    for c in checks:
        if c.ok and not c.label:
            continue  # every row is in the section; the console shows what needs a look
        flag = "  (info)" if c.ok or not c.strict else "  <-- MISMATCH"
        con.append(f"   {c.metric:<56} expected {str(c.expected):>10}  captured {str(c.captured):>10}{flag}")
    tally = []
    for g in ("calls", "bytes", "kernels", "copies", "generic", "leaks", "summary", "workload"):
        st = [c for c in checks if c.group == g and c.strict]
        if st:
            tally.append(f"{g} {sum(c.ok for c in st)}/{len(st)}")
    con.append("   strict checks ok: " + ", ".join(tally))
    names = Counter(str(e.get("kernel")) for e in launches)
    con.append("   kernel names seen: " + ", ".join(f"{k!r} ({v})" for k, v in names.most_common(6)))
    con.extend("   " + n for n in notes)
    con.append(f"== {a.name}: {status}")
    print("\n".join(con), flush=True)

    md = [f"### {title}", "",
          f"Workload pid {pid}; window {dur_ms:.1f} ms ({w.get('iters')} iterations of "
          f"{w.get('buffer_bytes')}-byte buffers); {len(sc['in_win'].get(pid, []))} observer "
          f"events in the window. Probed APIs from {table_src}.", "",
          f"#### ground truth vs observer: **{status}**", ""]
    groups = [("calls", "Calls per API (exact symbol)"), ("bytes", "Bytes per API"),
              ("kernels", "Launches and kernel names"), ("copies", "Copies by direction"),
              ("generic", "Generic copies (`cuMemcpy`): inferred direction and host memory"),
              ("explicit", "Explicit copies: host memory (informational)"),
              ("leaks", "Leak report"), ("summary", "Per-process summary"),
              ("workload", "The workload's own checks (H1-H3, H9)")]
    for g, label in groups:
        rows = [(c.metric, c.expected, c.captured, c.mark()) for c in checks if c.group == g]
        if not rows:
            continue
        md.append(f"{label}:")
        md.append("")
        md.append(fmt_table(["metric", "expected", "captured", "check"], rows,
                            ["---", "---:", "---:", "---"]))
        md.append("")
    hyp = w.get("hypothesis_details") or {}
    for h in sorted(hyp):
        md.append(f"- {h}: {hyp[h]}")
    md.append("- events by type/api in the window: " + ", ".join(
        f"{t}/`{api}` ({n})" for (t, api), n in sorted(by_type_api.items())))
    md.append("")
    for n in notes:
        md.append(f"> {n}")
        md.append("")

    result = {"name": a.name, "title": title, "pid": pid, "status": status, "notes": notes,
              "summary": sc["summary"], "probed_from": table_src,
              "windows": [{"key": "window", "status": status, "duration_ms": dur_ms,
                           "checks": [{"metric": c.metric, "expected": c.expected,
                                       "captured": c.captured, "strict": c.strict, "ok": c.ok,
                                       "group": c.group} for c in checks],
                           "per_api": {f"{t}/{api}": n for (t, api), n in by_type_api.items()}}]}
    write_outputs(a, md, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
