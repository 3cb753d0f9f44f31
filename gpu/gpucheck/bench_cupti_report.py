"""Observer-output extraction and BENCH_CUPTI.md for gpu/bench_cupti.sh.

usage:
  python3 -m gpucheck.bench_cupti_report extract --events RUN.jsonl[.gz] [--workload W.json] --out NAME.obs.json
      After each observer run: the total and the workload pid's per-process `summary`
      (events, dropped, the `cupti` block), the pid's `cupti` state lines, and the pid's
      `launch` events and `gpu_kernel` lines inside the timed window, so the big JSONL
      need not be kept.

  python3 -m gpucheck.bench_cupti_report report --dir WORKDIR --plan plan.tsv --out BENCH_CUPTI.md
                                             [--env ENV.json] [--summary-json S.json] [--target-pct 5]
      plan.tsv: "ROUND<TAB>MODE<TAB>NAME[<TAB>RC<TAB>WALL_S]" per run, in the order run;
      WORKDIR/NAME.json (train_bench.py) and, for observer modes, WORKDIR/NAME.obs.json.
      Per mode: the median over its runs of each run's median step time, steps/s, the
      ratio to mode `base` (and the median of the per-round ratios), the observer's
      events/dropped and the CUPTI block; the verdict for the target (CUPTI mode within
      --target-pct of no observer).

Modes: base (no observer), uprobes (gpu-observer, all processes, --trace-all), cupti
(gpu-observer run, CUPTI injection, default sampling), profiler (torch.profiler with CUDA
activities, no observer).  Exit: 0 report written, 2 bad input.
"""

import argparse
import json
import os
import sys

from .common import as_int, f3, median
from .jsonl import ReadCounts, load_json, read_jsonl

MODES = ["base", "uprobes", "cupti", "profiler"]
MODE_TEXT = {
    "base": "(a) no observer",
    "uprobes": "(b) gpu-observer, uprobes only (all processes, `--trace-all`, JSONL to a file)",
    "cupti": "(c) `gpu-observer run` with the CUPTI injection library (default sampling)",
    "profiler": "(d) torch.profiler, CUDA activities, every step (no observer)",
}


# ---------------------------------------------------------------- extract

SUMMARY_KEYS = ("events", "dropped", "dropped_by_kind", "decode_errors", "trace_all",
                "threshold_us", "sampled_out", "launches", "named_launches")


def cmd_extract(a):
    w = load_json(a.workload) if a.workload else None
    pid = as_int(w.get("pid")) if isinstance(w, dict) else None
    s = as_int(w.get("window_start_ns")) if isinstance(w, dict) else None
    e = as_int(w.get("window_end_ns")) if isinstance(w, dict) else None
    res = {"pid": pid, "found_pid": False, "lines": 0, "bad": 0, "total": None,
           "process": None, "cupti": None, "cupti_lines": [], "launches_in_window": None,
           "gpu_kernels_in_window": None, "gpu_kernels": 0, "launches": 0}
    if s is not None and e is not None:
        res["launches_in_window"] = 0
        res["gpu_kernels_in_window"] = 0
    if not os.path.exists(a.events):
        res["error"] = f"no observer output {a.events}"
    else:
        counts = ReadCounts()
        # cheap pre-filter: only these lines matter here
        for ev in read_jsonl(a.events, counts,
                             want=('"summary"', '"launch"', '"gpu_kernel"', '"cupti"')):
            typ = ev.get("type")
            epid = as_int(ev.get("pid"))
            if typ == "summary":
                keep = {k: ev.get(k) for k in SUMMARY_KEYS if k in ev}
                if ev.get("scope") == "process":
                    if epid == pid:
                        keep["cupti"] = ev.get("cupti")
                        res["process"] = keep
                        res["cupti"] = ev.get("cupti")
                else:
                    res["total"] = keep
                continue
            if pid is None or epid != pid:
                continue
            res["found_pid"] = True
            ts = as_int(ev.get("ts_ns"))
            inwin = s is not None and e is not None and ts is not None and s <= ts <= e
            if typ == "launch":
                res["launches"] += 1
                if inwin:
                    res["launches_in_window"] += 1
            elif typ == "gpu_kernel":
                res["gpu_kernels"] += 1
                if inwin:
                    res["gpu_kernels_in_window"] += 1
            elif typ == "cupti":
                res["cupti_lines"].append({k: ev.get(k) for k in
                                           ("ts_ns", "state", "cupti_result", "message")})
        res["lines"], res["bad"] = counts.read, counts.bad
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    cb = res["cupti"] or {}
    print(f"extract: {res['lines']} lines; pid {pid} {'seen' if res['found_pid'] else 'NOT seen'}; "
          f"total events={(res['total'] or {}).get('events')} "
          f"dropped={(res['total'] or {}).get('dropped')}; launches in window "
          f"{res['launches_in_window']}; cupti state={cb.get('state')} kernels={cb.get('kernels')}")
    return 0


# ---------------------------------------------------------------- report


def read_plan(path):
    runs = []
    with open(path, "r", encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3 or not parts[0].strip():
                continue
            runs.append({"round": as_int(parts[0]), "mode": parts[1], "name": parts[2],
                         "rc": parts[3] if len(parts) > 3 else "?",
                         "wall_s": parts[4] if len(parts) > 4 else None})
    return runs


def cmd_report(a):
    try:
        runs = read_plan(a.plan)
    except OSError as exc:
        print(f"bench_cupti_report: cannot read plan {a.plan}: {exc}", file=sys.stderr)
        return 2
    env = load_json(a.env) if a.env else None
    env = env or {}
    for r in runs:
        r["bench"] = load_json(os.path.join(a.dir, r["name"] + ".json"))
        r["obs"] = load_json(os.path.join(a.dir, r["name"] + ".obs.json"))
        b = r["bench"]
        r["ok"] = isinstance(b, dict) and b.get("median_step_ms") is not None and r["rc"] in ("0", "?")
        r["median_ms"] = float(b["median_step_ms"]) if r["ok"] else None
        r["steps_per_s"] = float(b["steps_per_s"]) if r["ok"] and b.get("steps_per_s") else None
        r["issue_ms"] = (float(b["median_issue_ms"]) if r["ok"] and b.get("median_issue_ms")
                         is not None else None)
    modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    modes += sorted({r["mode"] for r in runs} - set(modes))
    stats = {}
    for m in modes:
        rs = [r for r in runs if r["mode"] == m]
        ok = [r for r in rs if r["ok"]]
        stats[m] = {"runs": len(rs), "ok": len(ok),
                    "median_step_ms": median([r["median_ms"] for r in ok]),
                    "steps_per_s": median([r["steps_per_s"] for r in ok]),
                    "issue_ms": median([r["issue_ms"] for r in ok]),
                    "per_round": {r["round"]: r["median_ms"] for r in ok}}
    base = stats.get("base", {}).get("median_step_ms")
    for m, st in stats.items():
        v = st["median_step_ms"]
        st["ratio"] = v / base if v is not None and base else None
        st["overhead_pct"] = (st["ratio"] - 1.0) * 100.0 if st["ratio"] is not None else None
        # the same, round by round (each round has every mode, in a rotated order)
        rr = []
        for rnd, val in st["per_round"].items():
            b = stats.get("base", {}).get("per_round", {}).get(rnd)
            if val is not None and b:
                rr.append(val / b)
        st["ratio_per_round_median"] = median(rr)
    base_rounds = [v for v in stats.get("base", {}).get("per_round", {}).values() if v]
    spread = ((max(base_rounds) - min(base_rounds)) / base * 100.0
              if base and len(base_rounds) > 1 else None)

    # kernels per step: uprobe launches in the timed window (exact), profiler (approximate)
    kps = {}
    for r in runs:
        b, o = r["bench"], r["obs"]
        if not r["ok"]:
            continue
        steps = as_int(b.get("steps"))
        if o and o.get("launches_in_window") and steps:
            kps.setdefault(f"uprobe launch events per timed step ({r['mode']} runs)", []).append(
                o["launches_in_window"] / steps)
        if b.get("kernels_per_step"):
            kps.setdefault("CUDA kernels per step (torch.profiler, warm-up included)", []).append(
                float(b["kernels_per_step"]))
    kps = {k: median(v) for k, v in kps.items()}

    cupti = stats.get("cupti", {})
    target_met = (cupti.get("overhead_pct") is not None
                  and cupti["overhead_pct"] <= a.target_pct)
    cupti_states = sorted({str(((r["obs"] or {}).get("cupti") or {}).get("state")
                               or "none (no cupti block)")
                           for r in runs if r["mode"] == "cupti" and r["ok"]})

    model = next((r["bench"].get("model") for r in runs if r["ok"] and r["bench"].get("model")), {})
    pacts = next((r["bench"].get("profiler_activities") for r in runs
                  if r["ok"] and r["bench"].get("profiler_activities")), None)
    mode_text = dict(MODE_TEXT)
    if pacts and "cpu" in pacts:
        mode_text["profiler"] = "(d) torch.profiler, CPU + CUDA activities, every step (no observer)"
    elif pacts:
        mode_text["profiler"] = "(d) torch.profiler, CUDA activities only, every step (no observer)"
    first = next((r["bench"] for r in runs if r["ok"]), {}) or {}
    md = ["# gpu-observer CUPTI-mode overhead on a PyTorch training loop", ""]
    md.append(f"Date: {env.get('date_utc', '?')}; GPU: {env.get('gpu', '?')}; driver "
              f"{env.get('driver', '?')}; CUDA {env.get('cuda_driver_api', '?')}; PyTorch "
              f"{first.get('torch', env.get('torch', '?'))}; kernel {env.get('kernel', '?')}; "
              f"observer commit {env.get('observer_commit', '?')}.")
    md.append("")
    params = model.get("params")
    md.append(f"Workload: `gpu/workloads/train_bench.py`: {model.get('kind', '?')} "
              f"(d_model {model.get('d_model', '?')}, {model.get('layers', '?')} layers, batch "
              f"{model.get('batch', '?')} × seq {model.get('seq', '?')}, "
              f"{model.get('dtype', '?')}, {model.get('optimizer', 'AdamW')}"
              + (f", {params / 1e6:.1f} M parameters" if isinstance(params, (int, float)) else "")
              + f"); {first.get('warmup', '?')} warm-up steps, then {first.get('steps', '?')} "
              "timed steps, each forward + backward + optimizer step + `torch.cuda.synchronize()`. "
              "Value per run: the median step time; per mode: the median over its runs. One "
              "invocation runs every mode in each round, in a rotated order, to cancel drift.")
    md.append("")
    md.append("| mode | runs ok | median step (ms) | CPU issue (ms) | steps/s | ratio vs (a) | "
              "overhead | per-round ratio (median) | per-round median step (ms) |")
    md.append("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for m in modes:
        st = stats[m]
        ov = st["overhead_pct"]
        pr = ", ".join(f"r{k}: {f3(v)}" for k, v in sorted(st["per_round"].items()))
        bold = "**" if m == "cupti" else ""
        md.append(f"| {bold}{mode_text.get(m, m)}{bold} | {st['ok']}/{st['runs']} | "
                  f"{bold}{f3(st['median_step_ms'])}{bold} | {f3(st['issue_ms'])} | "
                  f"{f3(st['steps_per_s'], 1)} | "
                  f"{f3(st['ratio'])}x | {'-' if ov is None else f'{ov:+.2f}%'} | "
                  f"{f3(st['ratio_per_round_median'])}x | {pr or '-'} |")
    md.append("")
    ov = cupti.get("overhead_pct")
    if ov is None:
        verdict = "not measured (no successful CUPTI-mode or baseline run)"
    else:
        verdict = (f"{ov:+.2f}% ({'MET' if target_met else 'NOT MET'}: target ≤ "
                   f"{a.target_pct:g}% over no observer)")
    md.append(f"**CUPTI mode overhead: {verdict}.**")
    md.append("")
    b_issue, b_step = stats.get("base", {}).get("issue_ms"), base
    if b_issue is not None and b_step:
        frac = 100.0 * b_issue / b_step
        kind = ("launch-bound: the CPU issues work for nearly the whole step, so per-launch costs "
                "show in full" if frac >= 85 else
                "GPU-bound: the CPU finishes issuing before the GPU finishes, so CPU-side costs "
                "up to the difference hide behind the GPU")
        md.append(f"CPU issue time without observer: {b_issue:.3f} ms of {b_step:.3f} ms per step "
                  f"({frac:.0f}%): {kind}.")
        md.append("")
    if spread is not None:
        md.append(f"Baseline spread across rounds: {spread:.2f}% of the median (overheads "
                  "smaller than this are within run-to-run noise).")
        md.append("")
    if kps:
        md.append("Kernels per step: " + "; ".join(f"{k}: {v:.1f}" for k, v in kps.items()) + ".")
        md.append("")
    if any(s_ not in ("active",) for s_ in cupti_states) and "cupti" in stats:
        md.append(f"> WARN: CUPTI state in the CUPTI-mode runs: {', '.join(cupti_states) or 'none'} "
                  "(expected `active`): those runs measured the uprobes and an idle injection "
                  "library, not CUPTI.")
        md.append("")

    md.append("Per run (in the order run):")
    md.append("")
    md.append("| round | mode | run | rc | median step (ms) | CPU issue (ms) | steps/s | observer "
              "events / dropped (all) | pid events / dropped | launches in window | CUPTI state | "
              "CUPTI kernels / joined / unjoined | cupti_dropped / rate_limited / buffers |")
    md.append("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    per_run = []
    for r in runs:
        o = r["obs"] or {}
        tot = o.get("total") or {}
        pro = o.get("process") or {}
        cb = o.get("cupti") or {}
        obs_txt = f"{tot.get('events', '?')} / {tot.get('dropped', '?')}" if o else "-"
        pid_txt = f"{pro.get('events', '?')} / {pro.get('dropped', '?')}" if pro else "-"
        cb_txt = (f"{cb.get('kernels', '?')} / {cb.get('joined', '?')} / {cb.get('unjoined', '?')}"
                  if cb else "-")
        cd_txt = (f"{cb.get('cupti_dropped', '?')} / {cb.get('rate_limited', '?')} / "
                  f"{cb.get('buffers', '?')}" if cb else "-")
        state = cb.get("state") if cb else ("-" if r["mode"] != "cupti" else "no cupti block")
        md.append(f"| {r['round']} | {r['mode']} | `{r['name']}` | {r['rc']} | {f3(r['median_ms'])} | "
                  f"{f3(r['issue_ms'])} | {f3(r['steps_per_s'], 1)} | {obs_txt} | {pid_txt} | "
                  f"{o.get('launches_in_window', '-') if o else '-'} | {state} | {cb_txt} | {cd_txt} |")
        per_run.append({"round": r["round"], "mode": r["mode"], "name": r["name"], "rc": r["rc"],
                        "wall_s": r["wall_s"], "median_step_ms": r["median_ms"],
                        "steps_per_s": r["steps_per_s"], "median_issue_ms": r["issue_ms"],
                        "observer_total": tot or None, "observer_pid": pro or None,
                        "launches_in_window": o.get("launches_in_window") if o else None,
                        "cupti": cb or None,
                        "profiler_post_s": (r["bench"] or {}).get("profiler_post_s")})
        for cl in o.get("cupti_lines") or []:
            if cl.get("state") != "active":
                md.append(f"|  |  | ↳ `cupti` line | | | | | | | | {cl.get('state')} | "
                          f"result {cl.get('cupti_result')} | {cl.get('message')} |")
    md.append("")
    failed = [r["name"] for r in runs if not r["ok"]]
    if failed:
        md.append(f"> WARN: runs without a result: {', '.join(failed)} (see their `.log` / `.err` "
                  "in the artifacts).")
        md.append("")
    md.append("Modes: (a) the training loop alone; (b) `gpu-observer --format jsonl --trace-all "
              "--output FILE` tracing all processes, started and ready before the workload (every "
              "launch probed); (c) `gpu-observer run --format jsonl --output FILE -- python3 "
              "train_bench.py ...`: the observer starts the workload with "
              "`CUDA_INJECTION64_PATH` set, CUPTI activity records (kernels, copies, memsets) "
              "flow to the observer and are joined to the uprobe launches, written with the "
              "default sampling (how a user runs it); (d) torch.profiler ("
              + ("CPU + CUDA activities" if pacts and "cpu" in pacts else "CUDA activities")
              + ") around every step, for comparison with the usual in-process tool (with CUDA "
              "activities only it collects the same CUPTI activity records as (c)). "
              "Observer output goes to a file in the work directory under /tmp.")
    md.append("")
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    summ = {"target_pct": a.target_pct, "cupti_overhead_pct": ov, "target_met": target_met,
            "baseline_spread_pct": spread, "kernels_per_step": kps,
            "modes": {m: {k: v for k, v in st.items() if k != "per_round"} |
                      {"per_round_median_step_ms": {str(k): v for k, v in st["per_round"].items()}}
                      for m, st in stats.items()},
            "cupti_states": cupti_states, "runs": per_run, "model": model,
            "env": {k: env.get(k) for k in ("date_utc", "gpu", "driver", "cuda_driver_api",
                                            "torch", "observer_commit", "observer_sha256",
                                            "cupti_lib_sha256")}}
    if a.summary_json:
        with open(a.summary_json, "w", encoding="utf-8") as f:
            json.dump(summ, f, indent=1, default=str)
            f.write("\n")
    for m in modes:
        st = stats[m]
        print(f"bench_cupti: {m:<9} {st['ok']}/{st['runs']} runs  median {f3(st['median_step_ms'])} "
              f"ms/step  ratio {f3(st['ratio'])}x")
    print(f"bench_cupti: CUPTI mode overhead {verdict}")
    print(f"bench_cupti: wrote {a.out}")
    return 0


def main():
    ap = argparse.ArgumentParser(prog="python3 -m gpucheck.bench_cupti_report",
                                 description="CUPTI benchmark report helper")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract")
    e.add_argument("--events", required=True)
    e.add_argument("--workload", default=None)
    e.add_argument("--out", required=True)
    r = sub.add_parser("report")
    r.add_argument("--dir", required=True)
    r.add_argument("--plan", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--env", default=None)
    r.add_argument("--summary-json", default=None)
    r.add_argument("--target-pct", type=float, default=5.0)
    a = ap.parse_args()
    return cmd_extract(a) if a.cmd == "extract" else cmd_report(a)


if __name__ == "__main__":
    sys.exit(main())
