"""NVML sampling validation for gpu/validate_nvml.sh: nvidia-smi capture helpers and the
comparison of gpu-observer's NVML output (`devices`, `nvml` lines, summaries) with
nvidia-smi.  Standard library only (Python 3.8+).

usage:
  python3 -m gpucheck.compare_nvml smi-static --out SMI.json [--q-text NVIDIA-SMI-Q.txt]
      nvidia-smi --query-gpu with every device field the observer reports (a field this
      nvidia-smi rejects is queried alone, then left out); "[N/A]" etc. become null.
      The CUDA version comes from `nvidia-smi -q` output (--q-text).

  python3 -m gpucheck.compare_nvml capture --out CAP.jsonl [--duration S] [--interval S] [--stop-file F]
      Until S seconds passed or F exists: `nvidia-smi --query-gpu=index,uuid,memory.used`
      and `--query-compute-apps=pid,gpu_uuid,used_memory` (csv,noheader,nounits), each as
      one JSON line {"seq","query":"gpu"|"apps","t0_ns","t1_ns","rc","csv","err"}, t0/t1
      CLOCK_MONOTONIC (time.monotonic_ns, the observer's clock) just before/after the call.

  python3 -m gpucheck.compare_nvml report --smi-static SMI.json --md-out NVML-VALIDATION.md
                                          --json-out nvml-results.json [inputs, see --help]
      Every check below; exit 0 if all strict checks pass, 1 if one fails, 2 bad input.

The nvidia-smi binary is $NVIDIA_SMI (default nvidia-smi) or --smi.

Checks (strict unless marked info):
  devices    `gpu-observer devices --format json` exits 0 with a JSON array; one entry per
             nvidia-smi GPU (matched by uuid); per field vs nvidia-smi: index, name, uuid,
             vendor "NVIDIA", memory_total_bytes (within --mem-tol-mib of memory.total),
             pci_bus_id (case-insensitive, domain normalised), driver_version,
             compute_capability, cuda_driver_version (`nvidia-smi -q` CUDA Version),
             power_limit_watts (within 1 W of power.limit or enforced.power.limit),
             max_clocks_mhz graphics/sm/memory (clocks.max.*).  A field the observer omits
             while nvidia-smi knows it fails; one nvidia-smi cannot tell is info; sm_count
             is info.  `gpu-observer devices` (table) exits 0.
  run        (workloads running; --active-events, --captures, --workload ...)
             observer output present and nvml.state "active"; nvml.devices = GPUs; a
             device summary per GPU with samples > 0; every nvidia-smi GPU sampled, with its
             index and name; median interval between a device's samples within
             --interval-ms +- --interval-tol; every ratio present within [0, 1];
             device memory usage vs nvidia-smi memory.used (each capture against the
             observer sample nearest in time, only when the observer's values around the
             capture are stable): |bytes/2^20 - MiB| <= --mem-tol-mib for all, at least
             --min-compared compared per GPU; general utilization > 0 in one sample of a
             GPU that ran a workload; per workload pid: scope:"process" lines on its GPU
             (uuid), never on another, memory usage vs nvidia-smi used_memory (same rule),
             >= the bytes torch reserved, general utilization > 0 in one sample;
             sampler_cpu_ratio < --cpu-ratio-max; every query's mean < --query-mean-max-ns.
  idle       (--idle-events) state "active", interval, ratios, sampler cost as above.
A metric key that is absent is never read as 0: comparisons use the nearest sample that has
the key, and a key absent from every sample fails that check as "absent".
"""

import argparse
import bisect
import csv
import datetime as dt
import io
import json
import os
import re
import statistics
import sys
import time
from collections import Counter, defaultdict

from .common import eprint, f1, is_num, median, pctl, run_cmd, table_lines, us
from .jsonl import ReadCounts, load_json, read_jsonl

MIB = 1 << 20
NA_TOKENS = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]",
             "[insufficient permissions]", "[gpu is lost]", "[no data]", "none"}
# Fields for `nvidia-smi --query-gpu` (index first: the key of every row).
STATIC_FIELDS = ["index", "uuid", "name", "memory.total", "memory.used", "memory.reserved",
                 "pci.bus_id", "driver_version", "compute_cap", "power.limit",
                 "enforced.power.limit", "clocks.max.graphics", "clocks.max.sm",
                 "clocks.max.memory"]
RATIO_KEYS = [("hw.gpu.utilization", "general"), ("hw.gpu.utilization", "encoder"),
              ("hw.gpu.utilization", "decoder"), ("hw.gpu.memory.utilization", None),
              ("gpu.memory_controller.utilization", None), ("hw.fan.speed_ratio", None)]
# Device-line metrics listed in the presence table (key, sub-key).
DEVICE_METRICS = [("hw.gpu.utilization", "general"), ("hw.gpu.utilization", "encoder"),
                  ("hw.gpu.utilization", "decoder"), ("hw.gpu.memory.utilization", None),
                  ("gpu.memory_controller.utilization", None), ("hw.gpu.memory.usage", None), ("hw.gpu.memory.free", None),
                  ("hw.gpu.memory.reserved", None), ("hw.gpu.memory.limit", None),
                  ("hw.power", None), ("hw.gpu.power.limit", None), ("hw.temperature", None),
                  ("hw.fan.speed_ratio", None), ("hw.gpu.clock", "graphics"),
                  ("hw.gpu.clock", "sm"), ("hw.gpu.clock", "memory"),
                  ("hw.gpu.pcie.throughput", "transmit"), ("hw.gpu.pcie.throughput", "receive"),
                  ("hw.gpu.pcie.link", "generation"), ("hw.gpu.pcie.link", "width"),
                  ("hw.gpu.throttle_reasons", None), ("hw.errors", "ecc_corrected"),
                  ("hw.errors", "ecc_uncorrected"), ("hw.errors", "xid")]


def smi_bin(a=None):
    return (getattr(a, "smi", None) if a else None) or os.environ.get("NVIDIA_SMI") or "nvidia-smi"


def na(v):
    """A nvidia-smi CSV cell, or None where nvidia-smi cannot tell."""
    if v is None:
        return None
    s = str(v).strip()
    if s.lower() in NA_TOKENS or (s.startswith("[") and s.endswith("]")):
        return None
    return s


def num(v):
    s = na(v)
    if s is None:
        return None
    s = re.sub(r"\s*(MiB|W|MHz|%)$", "", s)
    try:
        return float(s)
    except ValueError:
        return None


def csv_rows(text):
    out = []
    for row in csv.reader(io.StringIO(text or ""), skipinitialspace=True):
        if row and any(c.strip() for c in row):
            out.append([c.strip() for c in row])
    return out


def metric(obj, key, sub=None):
    """A numeric metric of a line, or None when absent (never 0 for a missing key)."""
    v = obj.get(key)
    if sub is not None:
        v = v.get(sub) if isinstance(v, dict) else None
    return v if is_num(v) else None


def present(obj, key, sub=None):
    v = obj.get(key)
    if sub is not None:
        return isinstance(v, dict) and sub in v and v[sub] is not None
    return key in obj and v is not None


def norm_pci(s):
    """'0000:1b:00.0' and '00000000:1B:00.0' -> '00000000:1B:00.0'."""
    if s is None:
        return None
    m = re.match(r"^\s*(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])\s*$", str(s))
    if not m:
        return str(s).strip().upper()
    dom = int(m.group(1) or "0", 16)
    return f"{dom:08X}:{int(m.group(2), 16):02X}:{int(m.group(3), 16):02X}.{int(m.group(4))}"


def norm_cap(s):
    if s is None:
        return None
    s = str(s).strip()
    m = re.match(r"^(\d+)\.(\d+)$", s)
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else s


# ------------------------------------------------------------------ smi-static / capture

def parse_cuda_version(qtext):
    m = re.search(r"CUDA Version\s*:?\s*([0-9]+\.[0-9]+)", qtext or "")
    return m.group(1) if m else None


def cmd_smi_static(a):
    smi = smi_bin(a)
    fields = list(STATIC_FIELDS)
    res = {"smi": smi, "fields": fields, "unsupported": {}, "gpus": [], "errors": []}
    fmt = "--format=csv,noheader,nounits"
    rc, out, err = run_cmd([smi, "--query-gpu=" + ",".join(fields), fmt], a.timeout)
    rows = csv_rows(out) if rc == 0 else []
    by_index = {}
    if rc == 0 and rows and all(len(r) == len(fields) for r in rows):
        for r in rows:
            by_index[r[0]] = dict(zip(fields, r))
    else:
        res["errors"].append(f"full query rc={rc}: {(err or out).strip()[:300]}; querying field by field")
        rc0, out0, err0 = run_cmd([smi, "--query-gpu=index", fmt], a.timeout)
        if rc0 != 0:
            res["errors"].append(f"index query rc={rc0}: {(err0 or out0).strip()[:300]}")
        for r in csv_rows(out0):
            by_index[r[0]] = {"index": r[0]}
        for fld in fields[1:]:
            rc1, out1, err1 = run_cmd([smi, f"--query-gpu=index,{fld}", fmt], a.timeout)
            rws = csv_rows(out1)
            if rc1 != 0 or not rws or any(len(r) != 2 for r in rws):
                res["unsupported"][fld] = (err1 or out1).strip()[:200] or f"rc={rc1}"
                continue
            for r in rws:
                by_index.setdefault(r[0], {"index": r[0]})[fld] = r[1]
    for idx in sorted(by_index, key=lambda s: int(s) if s.isdigit() else 1 << 30):
        raw = by_index[idx]
        res["gpus"].append({f: na(raw.get(f)) for f in fields})
    qtext = ""
    if a.q_text and os.path.exists(a.q_text):
        with open(a.q_text, "r", encoding="utf-8", errors="replace") as f:
            qtext = f.read()
    res["cuda_version"] = parse_cuda_version(qtext)
    m = re.search(r"Driver Version\s*:\s*(\S+)", qtext)
    res["q_driver_version"] = m.group(1) if m else None
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    for g in res["gpus"]:
        print(f"  GPU {g.get('index')}: {g.get('name')} {g.get('uuid')} "
              f"{g.get('memory.total')} MiB, bus {g.get('pci.bus_id')}")
    if res["unsupported"]:
        print(f"  fields this nvidia-smi cannot query: {', '.join(res['unsupported'])}")
    return 0 if res["gpus"] else 1


def cmd_capture(a):
    smi = smi_bin(a)
    fmt = "--format=csv,noheader,nounits"
    queries = [("gpu", [smi, "--query-gpu=index,uuid,memory.used", fmt]),
               ("apps", [smi, "--query-compute-apps=pid,gpu_uuid,used_memory", fmt])]
    t_end = time.monotonic() + a.duration
    seq = 0
    with open(a.out, "a", encoding="utf-8") as f:
        while True:
            t_start = time.monotonic()
            if t_start >= t_end or (a.stop_file and os.path.exists(a.stop_file)):
                break
            seq += 1
            for q, cmd in queries:
                t0 = time.monotonic_ns()
                rc, out, err = run_cmd(cmd, a.timeout)
                t1 = time.monotonic_ns()
                f.write(json.dumps({"seq": seq, "query": q, "t0_ns": t0, "t1_ns": t1, "rc": rc,
                                    "csv": out, "err": (err or "").strip()[-300:]}) + "\n")
                f.flush()
            delay = a.interval - (time.monotonic() - t_start)
            while delay > 0:
                if a.stop_file and os.path.exists(a.stop_file):
                    break
                time.sleep(min(delay, 0.05))
                delay = a.interval - (time.monotonic() - t_start)
    print(f"  {seq} nvidia-smi captures written to {a.out}")
    return 0


# ------------------------------------------------------------------ inputs

class Run:
    """The NVML lines and summaries of one observer JSONL."""

    def __init__(self, path):
        self.path = path
        self.dev = defaultdict(list)      # uuid (or "index:N") -> [line], ts order
        self.proc = defaultdict(list)     # pid -> [line], ts order
        self.dev_summary = {}             # uuid (or "index:N") -> summary line
        self.total = None
        self.lines = 0
        self.bad = 0
        self.nvml_lines = 0
        self.null_keys = Counter()
        self.error = None
        if not path or not os.path.exists(path):
            self.error = f"no observer output ({path or 'not given'})"
            return
        counts = ReadCounts()
        try:
            for o in read_jsonl(path, counts, want=("nvml", "summary")):
                t = o.get("type")
                if t == "nvml":
                    self.nvml_lines += 1
                    for k, v in o.items():
                        if k.startswith("hw.") and v is None:
                            self.null_keys[k] += 1
                    if o.get("scope") == "device":
                        self.dev[dev_key(o)].append(o)
                    elif o.get("scope") == "process":
                        self.proc[o.get("pid")].append(o)
                elif t == "summary":
                    if o.get("scope") == "device":
                        self.dev_summary[dev_key(o)] = o
                    elif o.get("scope") == "total":
                        self.total = o
        except (OSError, EOFError) as exc:
            self.error = f"cannot read {path}: {exc}"
        self.lines, self.bad = counts.read, counts.bad
        for lst in list(self.dev.values()) + list(self.proc.values()):
            lst.sort(key=lambda o: o.get("ts_ns") or 0)

    @property
    def nvml(self):
        t = self.total or {}
        return t.get("nvml") if isinstance(t.get("nvml"), dict) else None

    def span(self):
        ts = [o.get("ts_ns") for lst in self.dev.values() for o in lst if is_num(o.get("ts_ns"))]
        return (min(ts), max(ts)) if ts else (None, None)


def dev_key(o):
    u = o.get("uuid")
    return u if u else f"index:{o.get('device')}"


def read_captures(path):
    """[{query, t0, t1, rc, rows}] from `capture` output; gpu rows (index, uuid, MiB),
    apps rows (pid, uuid, MiB)."""
    caps = []
    if not path or not os.path.exists(path):
        return caps
    for o in read_jsonl(path):
        rows = []
        for r in csv_rows(o.get("csv", "")):
            if len(r) < 3:
                continue
            try:
                k = int(r[0])
            except ValueError:
                continue  # "No running processes found" and the like
            rows.append((k, na(r[1]), num(r[2])))
        caps.append({"seq": o.get("seq"), "query": o.get("query"), "t0": o.get("t0_ns"),
                     "t1": o.get("t1_ns"), "rc": o.get("rc"), "rows": rows,
                     "err": o.get("err")})
    return caps


# ------------------------------------------------------------------ checks

class Check:
    def __init__(self, cid, group, title, ok, observed, criterion, strict=True):
        self.cid, self.group, self.title = cid, group, title
        self.ok, self.observed, self.criterion, self.strict = ok, observed, criterion, strict

    @property
    def status(self):
        if not self.strict:
            return "INFO"
        if self.ok is None:
            return "NOT RUN"
        return "PASS" if self.ok else "FAIL"

    @property
    def failed(self):
        return self.strict and self.ok is not True

    def as_dict(self):
        return {"id": self.cid, "group": self.group, "title": self.title, "status": self.status,
                "strict": self.strict, "observed": self.observed, "criterion": self.criterion}


def compare_series(samples, getter, caps, interval_ns, tol_mib):
    """Compare nvidia-smi MiB values caps=[(t0, t1, MiB|None)] with the observer samples
    (ts order) nearest in time that have the metric.  A capture is skipped when no sample is
    within (t1-t0)/2 + interval of its midpoint ("outside"), or when the observer's values in
    [t0 - interval, t1 + interval] differ by more than tol ("unstable")."""
    ts, vals = [], []
    for o in samples:
        v = getter(o)
        t = o.get("ts_ns")
        if v is not None and is_num(t):
            ts.append(t)
            vals.append(v)
    res = {"compared": [], "outside": 0, "unstable": [], "smi_na": 0, "no_key": 0,
           "with_key": len(ts), "samples": len(samples)}
    for t0, t1, smi in caps:
        if smi is None:
            res["smi_na"] += 1
            continue
        if not ts:
            res["no_key"] += 1  # nothing to compare with: never read as 0
            continue
        if t0 is None or t1 is None:
            res["outside"] += 1
            continue
        mid = (t0 + t1) // 2
        i = bisect.bisect_left(ts, mid)
        cands = [j for j in (i - 1, i) if 0 <= j < len(ts)]
        j = min(cands, key=lambda k: abs(ts[k] - mid))
        if abs(ts[j] - mid) > (t1 - t0) // 2 + interval_ns:
            res["outside"] += 1
            continue
        lo, hi = bisect.bisect_left(ts, t0 - interval_ns), bisect.bisect_right(ts, t1 + interval_ns)
        near = vals[lo:hi] or [vals[j]]
        if max(near) - min(near) > tol_mib * MIB:
            res["unstable"].append({"t_ns": mid, "spread_mib": (max(near) - min(near)) / MIB})
            continue
        diff = vals[j] / MIB - smi
        res["compared"].append({"t_ns": mid, "smi_mib": smi, "observer_bytes": vals[j],
                                "diff_mib": round(diff, 4), "gap_ms": round(abs(ts[j] - mid) / 1e6, 1),
                                "ok": abs(diff) <= tol_mib})
    d = [c["diff_mib"] for c in res["compared"]]
    res["diff_min"] = min(d) if d else None
    res["diff_median"] = median(d)
    res["diff_max"] = max(d) if d else None
    res["worst_abs"] = max((abs(x) for x in d), default=None)
    res["all_ok"] = bool(d) and all(c["ok"] for c in res["compared"])
    return res


def diff_dist(r):
    """The distribution of observer − nvidia-smi differences (MiB, 2 decimals) of a series."""
    c = Counter(f"{x['diff_mib']:+.2f}" for x in r["compared"])
    txt = ", ".join(f"{k} ×{n}" for k, n in sorted(c.items(), key=lambda kv: float(kv[0])))
    extra = []
    if r["unstable"]:
        extra.append(f"{len(r['unstable'])} skipped as unstable (spread up to "
                     f"{max(u['spread_mib'] for u in r['unstable']):.1f} MiB)")
    if r["outside"]:
        extra.append(f"{r['outside']} outside the sampled span")
    if r["smi_na"]:
        extra.append(f"{r['smi_na']} nvidia-smi N/A")
    gaps = [x["gap_ms"] for x in r["compared"]]
    if gaps:
        extra.append(f"nearest-sample distance median {statistics.median(gaps):.0f} ms, max {max(gaps):.0f} ms")
    return "diffs (MiB): " + (txt or "none") + ("; " + "; ".join(extra) if extra else "")


def series_text(r, tol):
    if not r["compared"]:
        why = []
        if r["samples"] == 0:
            why.append("no observer sample")
        elif r["with_key"] == 0:
            why.append(f"metric absent in all {r['samples']} samples")
        if r["outside"]:
            why.append(f"{r['outside']} captures outside the sampled span")
        if r["unstable"]:
            why.append(f"{len(r['unstable'])} unstable")
        if r["smi_na"]:
            why.append(f"{r['smi_na']} nvidia-smi N/A")
        return "nothing compared (" + (", ".join(why) or "no nvidia-smi capture") + ")"
    bad = sum(1 for c in r["compared"] if not c["ok"])
    return (f"{len(r['compared'])} compared, {bad} over {tol} MiB; diff MiB min/median/max "
            f"{r['diff_min']:+.2f} / {r['diff_median']:+.2f} / {r['diff_max']:+.2f}"
            + (f"; {len(r['unstable'])} unstable skipped" if r["unstable"] else "")
            + (f"; {r['outside']} outside" if r["outside"] else ""))


class Ctx:
    def __init__(self, a):
        self.a = a
        self.checks = []
        self.md = []
        self.result = {}
        self.notes = dict(kv.split("=", 1) for kv in (a.note or []) if "=" in kv)

    def add(self, *args, **kw):
        c = Check(*args, **kw)
        self.checks.append(c)
        return c


def smi_gpus(smi):
    return [g for g in (smi or {}).get("gpus", []) if g.get("uuid") or g.get("index") is not None]


def devices_checks(ctx, smi):
    a = ctx.a
    md = ctx.md
    md += ["", "## Devices: `gpu-observer devices` vs nvidia-smi", ""]
    res = {"rc": a.devices_rc, "table_rc": a.devices_table_rc, "devices": []}
    ctx.result["devices"] = res
    obs = None
    err = None
    if a.devices_json and os.path.exists(a.devices_json):
        try:
            with open(a.devices_json, "r", encoding="utf-8") as f:
                obs = json.load(f)
        except ValueError as exc:
            err = f"not JSON: {exc}"
    else:
        err = "no output"
    if obs is not None and not isinstance(obs, list):
        err = f"not a JSON array ({type(obs).__name__})"
        obs = None
    ok_cmd = a.devices_rc == 0 and obs is not None
    ctx.add("devices.json", "devices", "`devices --format json` exits 0 with a JSON array",
            None if a.devices_rc is None and obs is None else ok_cmd,
            f"rc={a.devices_rc}, " + (f"{len(obs)} devices" if obs is not None else err),
            "rc 0, JSON array")
    gpus = smi_gpus(smi)
    if obs is None:
        obs = []
    by_uuid = {o.get("uuid"): o for o in obs if isinstance(o, dict) and o.get("uuid")}
    smi_uuids = [g.get("uuid") for g in gpus]
    extra = [o.get("uuid") for o in obs if isinstance(o, dict) and o.get("uuid") not in smi_uuids]
    count_ok = len(obs) == len(gpus) and not extra and all(u in by_uuid for u in smi_uuids)
    ctx.add("devices.count", "devices", "one observer device per nvidia-smi GPU (by uuid)",
            count_ok if gpus else None,
            f"observer {len(obs)}, nvidia-smi {len(gpus)}" + (f"; not in nvidia-smi: {extra}" if extra else ""),
            "same set of uuids")
    all_ok = True
    any_row = False
    failures = []
    for g in gpus:
        o = by_uuid.get(g.get("uuid"))
        if o is None:
            idx = g.get("index")
            o = next((x for x in obs if isinstance(x, dict) and str(x.get("index")) == str(idx)), None)
        rows = []
        drec = {"index": g.get("index"), "uuid": g.get("uuid"), "fields": []}
        res["devices"].append(drec)
        md += [f"### GPU {g.get('index')}: {g.get('name')} (`{g.get('uuid')}`)", ""]
        if o is None:
            all_ok = False
            failures.append(f"GPU {g.get('index')} not listed")
            md += ["**not listed by `gpu-observer devices`**", ""]
            continue

        def row(field, ov, sv, ok, note="", strict=True):
            nonlocal all_ok, any_row
            any_row = True
            if ov is None and sv is not None and strict:
                ok, note = False, note or "absent in the observer's output"
            elif ov is None and sv is None:
                ok, note = True, note or "neither can tell"
            elif sv is None and ov is not None:
                ok, note = True, note or "nvidia-smi cannot tell (info)"
            mark = ("ok" if ok else "**FAIL**") if strict else "info"
            if strict and not ok:
                all_ok = False
                failures.append(f"GPU {g.get('index')} {field}: {f1(ov)} vs {f1(sv)}"
                                + (f" ({note})" if note else ""))
            rows.append([f"`{field}`", f1(ov), f1(sv), mark + (f" ({note})" if note else "")])
            drec["fields"].append({"field": field, "observer": ov, "nvidia_smi": sv,
                                   "ok": bool(ok) if strict else None, "note": note})

        def eq(field, ov, sv, norm=lambda x: None if x is None else str(x).strip()):
            row(field, ov, sv, ov is not None and sv is not None and norm(ov) == norm(sv))

        row("index", o.get("index"), int(g["index"]) if str(g.get("index", "")).isdigit() else g.get("index"),
            str(o.get("index")) == str(g.get("index")))
        eq("name", o.get("name"), g.get("name"))
        eq("uuid", o.get("uuid"), g.get("uuid"))
        eq("vendor", o.get("vendor"), "NVIDIA")
        mt, smt = o.get("memory_total_bytes"), num(g.get("memory.total"))
        row("memory_total_bytes", mt, None if smt is None else f"{smt:.0f} MiB",
            is_num(mt) and smt is not None and abs(mt / MIB - smt) <= a.mem_tol_mib,
            "" if not (is_num(mt) and smt is not None) else f"diff {mt / MIB - smt:+.2f} MiB")
        eq("pci_bus_id", o.get("pci_bus_id"), g.get("pci.bus_id"), norm_pci)
        eq("driver_version", o.get("driver_version"), g.get("driver_version") or (smi or {}).get("q_driver_version"))
        eq("compute_capability", o.get("compute_capability"), g.get("compute_cap"), norm_cap)
        eq("cuda_driver_version", o.get("cuda_driver_version"), (smi or {}).get("cuda_version"), norm_cap)
        pl = o.get("power_limit_watts")
        cands = [(k, num(g.get(k))) for k in ("power.limit", "enforced.power.limit")]
        cands = [(k, v) for k, v in cands if v is not None]
        match = next((k for k, v in cands if is_num(pl) and abs(pl - v) <= 1.0), None)
        row("power_limit_watts", pl, " / ".join(f"{v:g} ({k})" for k, v in cands) or None,
            match is not None, f"= {match}" if match else "")
        mc = o.get("max_clocks_mhz") if isinstance(o.get("max_clocks_mhz"), dict) else {}
        for c in ("graphics", "sm", "memory"):
            ov, sv = mc.get(c), num(g.get(f"clocks.max.{c}"))
            row(f"max_clocks_mhz.{c}", ov, None if sv is None else int(sv),
                is_num(ov) and sv is not None and abs(ov - sv) <= 0.5)
        row("sm_count", o.get("sm_count"), None, True,
            "nvidia-smi does not report it; H100 SXM has 132", strict=False)
        known = {"index", "name", "uuid", "vendor", "memory_total_bytes", "pci_bus_id",
                 "driver_version", "compute_capability", "cuda_driver_version", "sm_count",
                 "max_clocks_mhz", "power_limit_watts"}
        for k in sorted(set(o) - known):
            row(k, o.get(k), None, True, "not compared", strict=False)
        md += table_lines(["field", "gpu-observer", "nvidia-smi", "check"], rows, escape=True)
        md += ["", f"nvidia-smi before the runs: memory.used {g.get('memory.used') or '-'} MiB, "
               f"memory.reserved {g.get('memory.reserved') or '-'} MiB (info).", ""]
    ctx.add("devices.fields", "devices", "every device field = nvidia-smi",
            (all_ok if any_row else False) if gpus else None,
            "all fields match" if all_ok and any_row else ("; ".join(failures[:6]) or "nothing compared")
            + (f"; {len(failures) - 6} more" if len(failures) > 6 else ""),
            "exact; memory ±%g MiB; power ±1 W" % a.mem_tol_mib)
    trc = a.devices_table_rc
    ttext = ""
    if a.devices_table and os.path.exists(a.devices_table):
        with open(a.devices_table, "r", encoding="utf-8", errors="replace") as f:
            ttext = f.read()
    listed = [g.get("uuid") for g in gpus if g.get("uuid") and (g["uuid"] in ttext or (g.get("name") or "\0") in ttext)]
    ctx.add("devices.table", "devices", "`devices` (table) exits 0", None if trc is None else trc == 0,
            f"rc={trc}, {len(ttext.splitlines())} lines", "rc 0")
    ctx.add("devices.table_lists", "devices", "the table names every GPU (uuid or name)", None,
            f"{len(listed)}/{len(gpus)}", "info", strict=False)
    if ttext:
        md += ["`gpu-observer devices`:", "", "```", ttext.rstrip()[:4000], "```", ""]
    if smi and smi.get("unsupported"):
        md += ["nvidia-smi fields it could not query: " +
               ", ".join(f"`{k}`" for k in smi["unsupported"]), ""]


def ratio_check(ctx, run, label, group):
    bad = []
    n = 0
    for lst in list(run.dev.values()) + list(run.proc.values()):
        for o in lst:
            for k, sub in RATIO_KEYS:
                if not present(o, k, sub):
                    continue
                v = metric(o, k, sub)
                n += 1
                if v is None or not 0.0 <= v <= 1.0:
                    bad.append(f"{k}{'.' + sub if sub else ''}={(o.get(k) or {}).get(sub) if sub else o.get(k)!r}")
    ctx.add(f"{group}.ratios", group, f"{label}: every ratio present within [0, 1]",
            None if run.error else (not bad and n > 0),
            f"{n} values, {len(bad)} outside" + (f" (e.g. {', '.join(bad[:3])})" if bad else ""),
            "0 ≤ r ≤ 1 (OTel ratios, not percent)")


def interval_check(ctx, run, gpus, label, group):
    a = ctx.a
    want = a.interval_ms
    rows = []
    ok_all = True
    res = {}
    for g in gpus:
        lst = run.dev.get(g.get("uuid")) or run.dev.get(f"index:{g.get('index')}") or []
        ts = [o["ts_ns"] for o in lst if is_num(o.get("ts_ns"))]
        d = [(b - c) / 1e6 for c, b in zip(ts, ts[1:])]
        med = median(d)
        ok = med is not None and abs(med - want) <= want * a.interval_tol
        ok_all = ok_all and ok
        gaps = sum(1 for x in d if x > 2 * want)
        res[g.get("uuid")] = {"samples": len(ts), "median_ms": med, "p10_ms": pctl(d, 10),
                              "p90_ms": pctl(d, 90), "min_ms": min(d) if d else None,
                              "max_ms": max(d) if d else None, "gaps_over_2x": gaps}
        rows.append([g.get("index"), len(ts), f1(med), f1(pctl(d, 10)), f1(pctl(d, 90)),
                     f1(min(d) if d else None), f1(max(d) if d else None), gaps,
                     "ok" if ok else "**FAIL**"])
    lo, hi = want * (1 - a.interval_tol), want * (1 + a.interval_tol)
    meds = [r["median_ms"] for r in res.values() if r["median_ms"] is not None]
    ctx.add(f"{group}.interval", group, f"{label}: median interval between a GPU's samples",
            None if run.error else (ok_all and bool(gpus)),
            "median " + (", ".join(f"{m:.1f}" for m in meds) or "-") + " ms",
            f"{lo:g}–{hi:g} ms")
    return rows, res


def cost_check(ctx, run, label, group):
    a = ctx.a
    nv = run.nvml or {}
    ratio = nv.get("sampler_cpu_ratio")
    cpu, wall = nv.get("sampler_cpu_ns"), nv.get("sampler_wall_ns")
    q = nv.get("query_ns") if isinstance(nv.get("query_ns"), dict) else {}
    ctx.add(f"{group}.cpu", group, f"{label}: sampler CPU (summary nvml.sampler_cpu_ratio)",
            None if run.error else (is_num(ratio) and ratio < a.cpu_ratio_max),
            ("absent" if not is_num(ratio) else f"{ratio:.6f} ({ratio * 100:.4f}% of a core)")
            + (f"; cpu {cpu / 1e6:.2f} ms over wall {wall / 1e9:.2f} s" if is_num(cpu) and is_num(wall) and wall else ""),
            f"< {a.cpu_ratio_max:g} (budget: < 0.1% of a core)")
    means = {k: v.get("mean") for k, v in q.items() if isinstance(v, dict)}
    slow = [k for k, m in means.items() if not is_num(m) or m >= a.query_mean_max_ns]
    worst = max(((m, k) for k, m in means.items() if is_num(m)), default=None)
    ctx.add(f"{group}.query_mean", group, f"{label}: every NVML query's mean time",
            None if run.error else (bool(means) and not slow),
            (f"{len(means)} queries; slowest mean {us(worst[0])} (`{worst[1]}`)" if worst else "no query_ns")
            + (f"; over: {', '.join(slow)}" if slow else ""),
            f"< {a.query_mean_max_ns / 1e6:g} ms (budget)")
    rows = []
    for k, v in sorted(q.items(), key=lambda kv: -(kv[1].get("mean") or 0) if isinstance(kv[1], dict) else 0):
        if not isinstance(v, dict):
            continue
        m = v.get("mean")
        rows.append([f"`{k}`", v.get("count", "-"), v.get("errors", "-"), us(m), us(v.get("max")),
                     us(v.get("cpu_mean")) if is_num(v.get("cpu_mean")) else "-",
                     "ok" if is_num(m) and m < a.query_mean_max_ns else "**FAIL**"])
    return {"sampler_cpu_ratio": ratio, "sampler_cpu_ns": cpu, "sampler_wall_ns": wall,
            "query_ns": q}, rows


def state_checks(ctx, run, gpus, label, group):
    nv = run.nvml
    st = (nv or {}).get("state")
    ctx.add(f"{group}.output", group, f"{label}: observer output with NVML lines and a total summary",
            None if run.error and "not given" in run.error else (not run.error and run.total is not None and run.nvml_lines > 0),
            (run.error or f"{run.lines} lines, {run.nvml_lines} nvml, total summary "
             + ("present" if run.total is not None else "**missing**"))
            + (f"; observer {ctx.notes[group + '_observer']}" if ctx.notes.get(group + "_observer") else ""),
            "JSONL with nvml lines and a summary")
    ctx.add(f"{group}.state", group, f"{label}: total summary nvml.state", None if run.error else st == "active",
            repr(st) if nv is not None else "no nvml block", '"active"')
    nd = (nv or {}).get("devices")
    ctx.add(f"{group}.nvml_devices", group, f"{label}: nvml.devices = nvidia-smi GPUs",
            None if run.error else nd == len(gpus), f"{f1(nd)} / {len(gpus)}", "equal")
    miss = []
    for g in gpus:
        s = run.dev_summary.get(g.get("uuid")) or run.dev_summary.get(f"index:{g.get('index')}")
        if not s or not is_num(s.get("samples")) or s.get("samples") <= 0:
            miss.append(str(g.get("index")))
    ctx.add(f"{group}.dev_summary", group, f"{label}: a device summary per GPU with samples > 0",
            None if run.error else (not miss and bool(gpus)),
            "all present" if not miss else f"missing/empty for GPU {', '.join(miss)}",
            "summary scope:device, samples > 0")
    bad = []
    for g in gpus:
        lst = run.dev.get(g.get("uuid")) or []
        if not lst:
            bad.append(f"GPU {g.get('index')}: no samples")
            continue
        idx = {o.get("device") for o in lst}
        names = {o.get("name") for o in lst if o.get("name") is not None}
        want = int(g["index"]) if str(g.get("index", "")).isdigit() else g.get("index")
        if idx != {want}:
            bad.append(f"GPU {g.get('index')}: device {sorted(idx, key=str)}")
        if g.get("name") and names and names != {g.get("name")}:
            bad.append(f"GPU {g.get('index')}: name {sorted(names)}")
    unknown = [k for k in run.dev if k not in {g.get("uuid") for g in gpus}]
    if unknown:
        bad.append(f"samples of unknown devices {unknown}")
    ctx.add(f"{group}.sampled", group, f"{label}: every GPU sampled, with nvidia-smi's index and name",
            None if run.error else (not bad and bool(gpus)),
            "; ".join(bad) or ", ".join(f"GPU {g.get('index')}: {len(run.dev.get(g.get('uuid')) or [])}" for g in gpus),
            "scope:device lines per uuid, index and name as nvidia-smi")


def presence_rows(run, gpus):
    rows = []
    for k, sub in DEVICE_METRICS:
        cells = []
        for g in gpus:
            lst = run.dev.get(g.get("uuid")) or []
            vals = [metric(o, k, sub) for o in lst]
            vals = [v for v in vals if v is not None]
            if k == "hw.gpu.throttle_reasons":
                seen = Counter(r for o in lst if isinstance(o.get(k), list) for r in o[k])
                have = sum(1 for o in lst if isinstance(o.get(k), list))
                cells.append(f"{have}/{len(lst)}" + (f": {', '.join(f'{r}({n})' for r, n in seen.most_common(4))}" if seen else ""))
                continue
            if vals:
                if k.startswith("hw.gpu.memory.") and k != "hw.gpu.memory.utilization":
                    fm = lambda v: f"{v / MIB:.1f} MiB"  # noqa: E731
                else:
                    fm = lambda v: f"{v:g}" if isinstance(v, float) else str(v)  # noqa: E731
                cells.append(f"{len(vals)}/{len(lst)}: {fm(min(vals))} / {fm(statistics.median(vals))} / {fm(max(vals))}")
            else:
                cells.append(f"0/{len(lst)} (absent)")
        rows.append([f"`{k}{'.' + sub if sub else ''}`"] + cells)
    return rows


def memory_consistency(run, gpus, devices_obs):
    """Info: usage + free + reserved vs limit, limit vs devices memory_total_bytes."""
    out = []
    for g in gpus:
        lst = run.dev.get(g.get("uuid")) or []
        d = []
        lim = set()
        for o in lst:
            u, fr, rs, li = (metric(o, "hw.gpu.memory.usage"), metric(o, "hw.gpu.memory.free"),
                             metric(o, "hw.gpu.memory.reserved"), metric(o, "hw.gpu.memory.limit"))
            if li is not None:
                lim.add(li)
            if None not in (u, fr, rs, li):
                d.append((u + fr + rs - li) / MIB)
        tot = next((x.get("memory_total_bytes") for x in devices_obs
                    if isinstance(x, dict) and x.get("uuid") == g.get("uuid")), None)
        out.append(f"GPU {g.get('index')}: usage+free+reserved−limit "
                   + (f"{min(d):+.2f}..{max(d):+.2f} MiB over {len(d)} samples" if d else "not computable (a key absent)")
                   + f"; limit {sorted(lim)[:3]} vs devices memory_total_bytes {tot}")
    return out


def smi_caps(caps, query, match):
    """[(t0, t1, MiB|None)] of the nvidia-smi rows for which match(row) holds."""
    out = []
    for c in caps:
        if c["query"] != query or c["rc"] != 0:
            continue
        for r in c["rows"]:
            if match(r):
                out.append((c["t0"], c["t1"], r[2]))
    return out


def active_checks(ctx, run, gpus, caps, workloads):
    a = ctx.a
    md = ctx.md
    interval_ns = int(a.interval_ms * 1e6)
    res = {"observer": run.path, "lines": run.lines, "nvml_lines": run.nvml_lines}
    ctx.result["active"] = res
    md += ["", "## Sampling run with workloads", ""]
    if ctx.notes.get("active_observer"):
        md += [f"Observer: {ctx.notes['active_observer']}.", ""]
    state_checks(ctx, run, gpus, "run", "run")
    irows, ires = interval_check(ctx, run, gpus, "run", "run")
    res["interval"] = ires
    ratio_check(ctx, run, "run", "run")
    ncap = {q: sum(1 for c in caps if c["query"] == q) for q in ("gpu", "apps")}
    capfail = [c for c in caps if c["rc"] != 0]
    md += [f"nvidia-smi captures: {ncap['gpu']} `--query-gpu=index,uuid,memory.used`, "
           f"{ncap['apps']} `--query-compute-apps=pid,gpu_uuid,used_memory`"
           + (f"; {len(capfail)} failed (rc {capfail[0]['rc']}: {capfail[0]['err']})" if capfail else "")
           + ". Each is compared with the observer sample nearest in time to the middle of the "
           "nvidia-smi call; captures are skipped when the observer's values within one interval "
           f"of the call differ by more than {a.mem_tol_mib:g} MiB (memory not stable).", ""]

    # device memory
    rows = []
    res["device_memory"] = {}
    dm_ok = True
    for g in gpus:
        u = g.get("uuid")
        cs = smi_caps(caps, "gpu", lambda r, u=u: r[1] == u)
        r = compare_series(run.dev.get(u) or [], lambda o: metric(o, "hw.gpu.memory.usage"),
                           cs, interval_ns, a.mem_tol_mib)
        res["device_memory"][u] = r
        ok = r["all_ok"] and len(r["compared"]) >= a.min_compared
        dm_ok = dm_ok and ok
        rows.append([g.get("index"), f"{r['with_key']}/{r['samples']}", len(cs), len(r["compared"]),
                     len(r["unstable"]), r["outside"], f1(r["diff_min"]), f1(r["diff_median"]),
                     f1(r["diff_max"]), "ok" if ok else "**FAIL**"])
    ctx.add("run.dev_memory", "run", "run: device memory usage vs nvidia-smi memory.used",
            None if run.error or not caps else (dm_ok and bool(gpus)),
            "; ".join(f"GPU {g.get('index')}: {series_text(res['device_memory'][g.get('uuid')], a.mem_tol_mib)}" for g in gpus)
            or "no GPU", f"|bytes/2^20 − MiB| ≤ {a.mem_tol_mib:g} for every compared capture, ≥ {a.min_compared} per GPU")
    md += ["### Device memory usage vs nvidia-smi (MiB, observer − nvidia-smi)", ""]
    md += table_lines(["GPU", "samples with key", "captures", "compared", "unstable", "outside",
                     "diff min", "median", "max", "check"], rows,
                    ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---"], escape=True)
    md.append("")
    for g in gpus:
        md.append(f"- GPU {g.get('index')}: " + diff_dist(res["device_memory"][g.get("uuid")]))
    md.append("")

    # utilization of GPUs with a workload
    wl_uuids = {w.get("expect_uuid") for w in workloads if w.get("expect_uuid")}
    ubad = []
    for g in gpus:
        if g.get("uuid") not in wl_uuids:
            continue
        vals = [metric(o, "hw.gpu.utilization", "general") for o in run.dev.get(g.get("uuid")) or []]
        vals = [v for v in vals if v is not None]
        if not vals or max(vals) <= 0:
            ubad.append(f"GPU {g.get('index')}: " + ("absent in every sample" if not vals else "always 0"))
    ctx.add("run.dev_util", "run", "run: device general utilization > 0 in a sample (GPUs with a workload)",
            None if run.error or not wl_uuids else not ubad,
            "; ".join(ubad) or ", ".join(
                f"GPU {g.get('index')}: max {f1(max([v for v in (metric(o, 'hw.gpu.utilization', 'general') for o in run.dev.get(g.get('uuid')) or []) if v is not None], default=None))}"
                for g in gpus if g.get("uuid") in wl_uuids) or "no workload",
            "> 0")

    # workloads
    wnote = ctx.notes.get("workloads")
    md += ["### Per-process samples of the workloads", ""]
    if wnote:
        md += [f"Workloads: {wnote}.", ""]
    uuid_index = {g.get("uuid"): g.get("index") for g in gpus}
    wrows = []
    res["workloads"] = []
    checks = {"present": [], "device": [], "memory": [], "reserved": [], "util": []}
    for w in workloads:
        pid = w.get("pid")
        exp = w.get("expect_uuid")
        lst = run.proc.get(pid, [])
        uu = Counter(o.get("uuid") for o in lst)
        wrong = {u: n for u, n in uu.items() if u != exp}
        idx_bad = [o for o in lst if o.get("uuid") in uuid_index and str(o.get("device")) != str(uuid_index[o.get("uuid")])]
        on_dev = [o for o in lst if o.get("uuid") == exp]
        cs = smi_caps(caps, "apps", lambda r, p=pid, e=exp: r[0] == p and r[1] == e)
        smi_other = sorted({r[1] for c in caps if c["query"] == "apps" for r in c["rows"] if r[0] == pid and r[1] != exp})
        # Process lines come every 500 ms (the sampler's medium tier), not every interval.
        proc_interval_ns = max(interval_ns, int(a.process_interval_ms * 1e6))
        mem = compare_series(on_dev, lambda o: metric(o, "hw.gpu.memory.usage"), cs, proc_interval_ns,
                             a.mem_tol_mib)
        usage = [metric(o, "hw.gpu.memory.usage") for o in on_dev]
        usage = [x for x in usage if x is not None]
        utl = [metric(o, "hw.gpu.utilization", "general") for o in on_dev]
        utl_p = [x for x in utl if x is not None]
        reserved = w.get("torch_reserved_bytes")
        rec = {"pid": pid, "expect_uuid": exp, "lines": len(lst), "on_device": len(on_dev),
               "wrong_device": wrong, "index_mismatch": len(idx_bad), "memory": mem,
               "util_samples": len(utl_p), "util_absent": len(utl) - len(utl_p),
               "util_max": max(utl_p) if utl_p else None, "usage_min": min(usage) if usage else None,
               "usage_max": max(usage) if usage else None, "torch_reserved_bytes": reserved,
               "alloc_bytes": w.get("alloc_bytes"), "smi_other_uuid": smi_other}
        res["workloads"].append(rec)
        lbl = f"pid {pid} (GPU {w.get('smi_index')})"
        checks["present"].append((lbl, bool(on_dev), f"{len(on_dev)} lines"))
        checks["device"].append((lbl, not wrong and not idx_bad,
                                 ((f"lines on other GPUs {wrong}" if wrong else "")
                                  + (f" {len(idx_bad)} lines with device index ≠ uuid's" if idx_bad else ""))
                                 or f"only on {exp}"))
        checks["memory"].append((lbl, mem["all_ok"] and len(mem["compared"]) >= a.min_compared,
                                 series_text(mem, a.mem_tol_mib)))
        rok = bool(usage) and is_num(reserved) and min(usage) >= reserved
        checks["reserved"].append((lbl, rok, f"min usage {f1(min(usage) / MIB if usage else None)} MiB vs reserved "
                                   f"{f1(reserved / MIB if is_num(reserved) else None)} MiB"))
        checks["util"].append((lbl, bool(utl_p) and max(utl_p) > 0,
                               f"max {f1(max(utl_p) if utl_p else None)} in {len(utl_p)} samples, absent in {len(utl) - len(utl_p)}"))
        wrows.append([pid, w.get("smi_index"), f"`{exp}`", len(lst), f1(w.get("alloc_bytes", 0) / MIB if is_num(w.get("alloc_bytes")) else None),
                      f1(reserved / MIB if is_num(reserved) else None),
                      f1(statistics.median(usage) / MIB if usage else None),
                      f1(statistics.median([c["smi_mib"] for c in mem["compared"]]) if mem["compared"] else None),
                      f1(mem["worst_abs"]), f"{f1(max(utl_p) if utl_p else None)} ({len(utl_p)}/{len(utl)})",
                      ", ".join(f"`{u}`×{n}" for u, n in wrong.items()) or "none"])
    have = bool(workloads)

    def agg(key, cid, title, crit):
        items = checks[key]
        ok = None if (not have or run.error) else all(i[1] for i in items)
        ctx.add(cid, "run", title, ok, "; ".join(f"{i[0]}: {i[2]}" for i in items) or wnote or "no workload",
                crit)

    exp_n = a.expected_workloads
    if exp_n is not None:
        ctx.add("run.workloads_ready", "run", "run: every workload started and became ready",
                len(workloads) == exp_n and exp_n > 0,
                f"{len(workloads)} / {exp_n}" + (f" ({wnote})" if wnote else ""),
                "one per GPU (WORKLOADS_PER_GPU), all ready")
    agg("present", "run.proc_present", "run: each workload pid has scope:process lines on its GPU", "≥ 1 line")
    agg("device", "run.proc_device", "run: no workload pid attributed to another GPU", "only its uuid; device index = uuid's")
    agg("memory", "run.proc_memory", "run: process memory usage vs nvidia-smi used_memory",
        f"|bytes/2^20 − MiB| ≤ {a.mem_tol_mib:g}, ≥ {a.min_compared} compared")
    agg("reserved", "run.proc_reserved", "run: process memory usage ≥ what torch reserved", "usage ≥ torch.cuda.memory_reserved")
    agg("util", "run.proc_util", "run: process general utilization > 0 in a sample", "> 0 in ≥ 1 sample")
    if wrows:
        md += table_lines(["pid", "GPU", "uuid", "lines", "allocated MiB", "torch reserved MiB",
                         "observer usage MiB (median)", "nvidia-smi MiB (median)", "max |diff| MiB",
                         "util max (samples)", "other GPUs"], wrows,
                        ["---:", "---:", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---", "---"], escape=True)
        md.append("")
    for rec in res["workloads"]:
        md.append(f"- pid {rec['pid']}: " + diff_dist(rec["memory"]))
        if rec["smi_other_uuid"]:
            md.append(f"- nvidia-smi lists pid {rec['pid']} on {rec['smi_other_uuid']} too (workload placement?)")
    others = sorted((p for p in run.proc if p not in {w.get("pid") for w in workloads}), key=str)
    res["other_pids"] = {str(p): len(run.proc[p]) for p in others}
    if others:
        md.append("- other processes in scope:process lines: " + ", ".join(
            f"{p} (`{run.proc[p][0].get('comm')}`, {len(run.proc[p])})" for p in others[:10]))
    comms = Counter(o.get("comm") for w in workloads for o in run.proc.get(w.get("pid"), []))
    if comms:
        md.append("- workload comm: " + ", ".join(f"`{c}`×{n}" for c, n in comms.items()))
    md.append("")
    cost, qrows = cost_check(ctx, run, "run", "run")
    res["cost"] = cost
    md += ["### Sample interval", ""]
    md += table_lines(["GPU", "samples", "median ms", "p10", "p90", "min", "max", "gaps > 2×", "check"], irows, escape=True)
    md += ["", "### Metrics in the device samples (samples with the key / all: min / median / max)", ""]
    md += table_lines(["metric"] + [f"GPU {g.get('index')}" for g in gpus], presence_rows(run, gpus), escape=True)
    md.append("")
    for line in memory_consistency(run, gpus, ctx.devices_obs):
        md.append(f"- {line} (info)")
    if run.null_keys:
        md.append("- keys written as null (should be absent): " + ", ".join(f"`{k}`×{n}" for k, n in run.null_keys.items()))
    md += ["", "### Sampler cost (workload run)", ""]
    md += cost_md(cost, qrows)


def cost_md(cost, qrows):
    r = cost["sampler_cpu_ratio"]
    out = [f"sampler_cpu_ratio {r:.6f} ({r * 100:.4f}% of a core)" if is_num(r) else "sampler_cpu_ratio absent"]
    if is_num(cost["sampler_cpu_ns"]) and is_num(cost["sampler_wall_ns"]):
        out[0] += f"; sampler_cpu_ns {cost['sampler_cpu_ns']}, sampler_wall_ns {cost['sampler_wall_ns']}"
    out.append("")
    out += table_lines(["NVML query", "count", "errors", "mean", "max", "CPU mean", "mean < limit"], qrows,
                     ["---", "---:", "---:", "---:", "---:", "---:", "---"], escape=True)
    out.append("")
    return out


def idle_checks(ctx, run, gpus):
    md = ctx.md
    res = {"observer": run.path, "lines": run.lines, "nvml_lines": run.nvml_lines}
    ctx.result["idle"] = res
    md += ["", "## Idle run (no workload): sampler cost on its own", ""]
    if ctx.notes.get("idle_observer"):
        md += [f"Observer: {ctx.notes['idle_observer']}.", ""]
    state_checks(ctx, run, gpus, "idle", "idle")
    irows, res["interval"] = interval_check(ctx, run, gpus, "idle", "idle")
    ratio_check(ctx, run, "idle", "idle")
    cost, qrows = cost_check(ctx, run, "idle", "idle")
    res["cost"] = cost
    md += cost_md(cost, qrows)
    md += ["### Sample interval (idle)", ""]
    md += table_lines(["GPU", "samples", "median ms", "p10", "p90", "min", "max", "gaps > 2×", "check"], irows, escape=True)
    md.append("")


def cmd_report(a):
    smi = load_json(a.smi_static)
    if smi is None:
        eprint(f"compare_nvml: cannot read --smi-static {a.smi_static}")
        smi = {"gpus": [], "errors": ["no nvidia-smi static data"]}
    gpus = smi_gpus(smi)
    env = load_json(a.env) or {}
    ctx = Ctx(a)
    ctx.devices_obs = load_json(a.devices_json) if a.devices_json else None
    if not isinstance(ctx.devices_obs, list):
        ctx.devices_obs = []
    workloads = []
    for p in a.workload or []:
        w = load_json(p)
        if isinstance(w, dict) and is_num(w.get("pid")):
            workloads.append(w)
        else:
            ctx.notes.setdefault("workloads", "")
            ctx.notes["workloads"] = (ctx.notes["workloads"] + f"; {os.path.basename(p)} unreadable").lstrip("; ")
    ctx.add("smi.gpus", "setup", "nvidia-smi lists the GPUs", bool(gpus),
            f"{len(gpus)} GPUs" + (f"; {smi.get('errors')}" if not gpus and smi.get("errors") else ""), "≥ 1")
    devices_checks(ctx, smi)
    if a.active_events is not None or a.captures is not None:
        active_checks(ctx, Run(a.active_events), gpus, read_captures(a.captures), workloads)
    if a.idle_events is not None:
        idle_checks(ctx, Run(a.idle_events), gpus)

    fails = [c for c in ctx.checks if c.failed]
    overall = "PASS" if not fails else "FAIL"
    head = ["# gpu-observer NVML sampling: validation on a real GPU", "",
            "Generated by `gpu/validate_nvml.sh`: `gpu-observer devices` against nvidia-smi, then "
            f"the observer in all-process mode (`--format jsonl --nvml-interval-ms {a.interval_ms:g}`) while "
            "`gpu/workloads/nvml_alloc.py` holds a known allocation and runs matmuls on every GPU "
            "(nvidia-smi captured in parallel), and once with no workload for the sampler's own cost; "
            "`gpu/gpucheck/compare_nvml.py` compares them. Memory: nvidia-smi prints MiB, the observer bytes: "
            f"|bytes/2^20 − MiB| ≤ {a.mem_tol_mib:g}.", "", "| | |", "|---|---|"]
    wl_torch = next((w for w in workloads if w.get("torch_version")), {})
    for label, val in (("Date", env.get("date_utc") or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")),
                       ("GPUs", ", ".join(f"{g.get('index')}: {g.get('name')}" for g in gpus) or "none"),
                       ("Driver", (gpus[0].get("driver_version") if gpus else None) or env.get("driver")),
                       ("CUDA (driver API)", smi.get("cuda_version") or env.get("cuda_driver_api")),
                       ("PyTorch", wl_torch.get("torch_version") or "not run"),
                       ("Linux kernel", env.get("kernel")),
                       ("Observer commit", env.get("observer_commit")),
                       ("Observer sha256", (f"`{env['observer_sha256'][:16]}…`" if env.get("observer_sha256") and env["observer_sha256"] != "unavailable" else env.get("observer_sha256")))):
        head.append(f"| {label} | {val if val is not None else '-'} |")
    head += ["", "## Summary", ""]
    head += table_lines(["check", "result", "observed", "criterion"],
                      [[c.title, c.status if c.status in ("PASS", "INFO") else f"**{c.status}**",
                        c.observed, c.criterion] for c in ctx.checks], escape=True)
    head += ["", f"Overall: **{overall}**" + (f" ({len(fails)} strict checks not passed: "
                                              + ", ".join(c.cid for c in fails) + ")" if fails else ""), ""]
    md = head + ctx.md
    if ctx.notes:
        md += ["", "## Notes from the run", ""] + [f"- {k}: {v}" for k, v in ctx.notes.items()]
    with open(a.md_out, "w", encoding="utf-8") as f:
        f.write("\n".join(md) + "\n")
    out = {"overall": overall, "env": env, "smi": smi, "checks": [c.as_dict() for c in ctx.checks],
           "notes": ctx.notes, **ctx.result}
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, default=str)
            f.write("\n")
    w = max(len(c.cid) for c in ctx.checks)
    for c in ctx.checks:
        print(f"  {c.cid:<{w}}  {c.status:<7}  {c.observed}")
    print(f"  overall: {overall}")
    return 0 if overall == "PASS" else 1


def main():
    ap = argparse.ArgumentParser(prog="python3 -m gpucheck.compare_nvml",
                                 description="NVML sampling validation helpers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("smi-static", help="nvidia-smi device fields as JSON")
    s.add_argument("--out", required=True)
    s.add_argument("--q-text", default=None, help="saved `nvidia-smi -q` output")
    s.add_argument("--smi", default=None)
    s.add_argument("--timeout", type=float, default=15)
    c = sub.add_parser("capture", help="nvidia-smi memory captures with CLOCK_MONOTONIC times")
    c.add_argument("--out", required=True)
    c.add_argument("--duration", type=float, default=10)
    c.add_argument("--interval", type=float, default=0.5)
    c.add_argument("--stop-file", default=None)
    c.add_argument("--smi", default=None)
    c.add_argument("--timeout", type=float, default=10)
    r = sub.add_parser("report", help="compare and write the report")
    r.add_argument("--smi-static", required=True)
    r.add_argument("--env", default=None, help="gpucheck.make_report env output")
    r.add_argument("--devices-json", default=None)
    r.add_argument("--devices-rc", type=int, default=None)
    r.add_argument("--devices-table", default=None)
    r.add_argument("--devices-table-rc", type=int, default=None)
    r.add_argument("--active-events", default=None, help="observer JSONL of the workload run")
    r.add_argument("--captures", default=None, help="`capture` output of the workload run")
    r.add_argument("--workload", action="append", help="nvml_alloc.py ready/result JSON (repeat)")
    r.add_argument("--expected-workloads", type=int, default=None,
                   help="how many workloads were started (a missing one fails)")
    r.add_argument("--idle-events", default=None, help="observer JSONL of the idle run")
    r.add_argument("--interval-ms", type=float, default=100)
    r.add_argument("--process-interval-ms", type=float, default=500,
                   help="how often the observer writes per-process lines (its 500 ms tier)")
    r.add_argument("--interval-tol", type=float, default=0.2, help="relative (0.2: ±20%%)")
    r.add_argument("--mem-tol-mib", type=float, default=1.0)
    r.add_argument("--min-compared", type=int, default=3)
    r.add_argument("--cpu-ratio-max", type=float, default=0.001)
    r.add_argument("--query-mean-max-ns", type=float, default=1e6)
    r.add_argument("--note", action="append", help="KEY=TEXT shown in the report "
                   "(active_observer, idle_observer, workloads: why not run)")
    r.add_argument("--md-out", required=True)
    r.add_argument("--json-out", default=None)
    a = ap.parse_args()
    try:
        if a.cmd == "smi-static":
            return cmd_smi_static(a)
        if a.cmd == "capture":
            return cmd_capture(a)
        return cmd_report(a)
    except (OSError, ValueError) as exc:
        eprint(f"compare_nvml {a.cmd}: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
