#!/usr/bin/env python3
"""Fleet-mode overhead on the H100 (docs/BENCHMARKS.md "Fleet mode"), side by side in one run.

Modes, in rotated order each round (round r starts at mode r):
  bare    the workload alone
  floor   gpu-observer --probes-floor: every probe attached, every program off — what the
          uprobe traps alone cost (this kernel has no uprobe_events in tracefs)
  always  gpu-observer, all processes, JSON lines to a file (always-on, exact)
  fleet   the same with --capture-window 1s --capture-period 10s (the DaemonSet's default)
Per run: the workload's time per step (and per-100-step chunk max: stalls), and for the
observer modes its verdicts of the workload. Fleet mode's launch-rate estimate is checked
against the truth, verdict by verdict: launches per step counted exactly by the always-on run
of the same round, times the steps the fleet run's workload itself timed (each step's end,
CLOCK_MONOTONIC, `--step-times`) inside that verdict's window. The estimate before the
correction for the probes' own time (issue 18) is reported beside it.

usage (as root, repo root): python3 gpu/bench_fleet.py --observer .gpu-bundle/gpu-observer \
    --out DIR [--workload mlp|transformer] [--rounds 5] [--steps N] [--fleet WINDOW,PERIOD]
Writes DIR/fleet-<workload>.json and prints a Markdown table. With --series, also each bare and
fleet run's step ends (µs from the first) and the fleet run's window edges, in
DIR/series-<workload>-<mode>-<round>.json: what a different window schedule would have
estimated can be computed from them (docs/BENCHMARKS.md "Fleet mode").
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["bare", "floor", "always", "fleet"]
FLEET = "1s,10s"


def workload_cmd(kind, steps, out_json, step_times):
    if kind == "mlp":
        return [sys.executable, f"{HERE}/workloads/launch_mlp.py", "--steps", str(steps),
                "--step-times", step_times]
    return [sys.executable, f"{HERE}/workloads/train_bench.py", "--steps", str(steps),
            "--warmup", "20", "--out", out_json, "--label", "fleet-bench"]


def start_observer(obs, args, err_path):
    err = open(err_path, "w")
    p = subprocess.Popen([obs] + args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=err)
    deadline = time.time() + 60
    while time.time() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"observer exited: {open(err_path).read()[-2000:]}")
        if "gpu-observer: ready" in open(err_path).read():
            return p
        time.sleep(0.1)
    p.kill()
    raise SystemExit("observer not ready in 60 s")


def stop_observer(p):
    p.send_signal(signal.SIGINT)
    try:
        p.wait(90)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def lines(path):
    out = []
    with open(path, errors="replace") as f:
        for l in f:
            try:
                out.append(json.loads(l))
            except ValueError:
                pass
    return out


def run_one(a, mode, r, work):
    jsonl = f"{work}/{mode}-{r}.jsonl"
    wjson = f"{work}/{mode}-{r}.work.json"
    obs = None
    if mode != "bare":
        args = ["--format", "jsonl", "--output", jsonl]
        if mode == "floor":
            args = ["--format", "jsonl", "--output", "/dev/null", "--probes-floor"]
        elif mode == "fleet":
            w, p = a.fleet.split(",")
            args += ["--capture-window", w, "--capture-period", p]
        obs = start_observer(a.observer, args, f"{work}/{mode}-{r}.err")
    t0 = time.time()
    times = f"{work}/{mode}-{r}.steps"
    w = subprocess.run(workload_cmd(a.workload, a.steps, wjson, times), capture_output=True,
                       text=True, timeout=300)
    wall = time.time() - t0
    if obs:
        stop_observer(obs)
    if w.returncode != 0:
        raise SystemExit(f"{mode} round {r}: workload failed: {w.stderr[-2000:]}")
    if a.workload == "mlp":
        res = json.loads(w.stdout.strip().splitlines()[-1])
    else:
        t = json.load(open(wjson))
        res = {"pid": t["pid"], "us_per_step": t["median_step_ms"] * 1000, "steps": t["steps"],
               "warmup": t["warmup"], "timed_start_ns": t["window_start_ns"],
               "timed_end_ns": t["window_end_ns"], "chunk_max": t["p90_step_ms"] * 1000,
               "loss": t.get("final_loss")}
    res.update(mode=mode, round=r, wall_s=round(wall, 1))
    series_out = {"mode": mode, "round": r, "fleet": a.fleet if mode == "fleet" else None}
    if mode in ("always", "fleet"):
        ls = lines(jsonl)
        pid = res["pid"]
        summ = [l for l in ls if l.get("type") == "summary" and l.get("pid") == pid]
        res["launches"] = summ[0]["launches"] if summ else None
        total = [l for l in ls if l.get("type") == "summary" and l.get("scope") == "total"]
        res["dropped"] = total[0].get("dropped") if total else None
        vs = [l for l in ls if l.get("type") == "verdict" and l.get("pid") == pid]
        # Verdicts whose 10 s window lies in the timed steps, else the last one.
        inside = [v for v in vs if v["ts_ns"] - v["window_ns"] >= res["timed_start_ns"] - 1_000_000_000
                  and v["ts_ns"] <= res["timed_end_ns"] + 1_000_000_000]
        pick = inside or vs[-1:]
        ends = []
        if os.path.exists(times):
            ends = [int(x) for x in open(times).read().split()]
        res["verdicts"] = []
        # The whole run's verdict (the summary's): its window ends at the observer's last
        # tick, after the workload's exit (the last timestamp the observer wrote).
        whole = summ[0].get("verdict") if summ else None
        last = max((l["ts_ns"] for l in ls if isinstance(l.get("ts_ns"), int)), default=None)
        if whole and last:
            pick = pick + [dict(whole, ts_ns=last, whole_run=True)]
        for v in pick:
            e = v["evidence"]
            d = {"class": v["class"], "launches_per_s": e["launches_per_s"],
                 "capture_fraction": v.get("capture_fraction"),
                 "estimate_error": v.get("estimate_error"), "probe_share": v.get("probe_share"),
                 "probe_corrected": v.get("probe_corrected"), "gpu_busy": e.get("gpu_busy"),
                 "launch_thread_cpu": e.get("launch_thread_cpu"), "ts_ns": v["ts_ns"],
                 "window_ns": v["window_ns"], "whole_run": v.get("whole_run", False)}
            a0, b0 = v["ts_ns"] - v["window_ns"], v["ts_ns"]
            # Steps the workload made in the verdict's window, when the window lies inside its
            # steps (warm-up included), or the whole run's.
            if ends and (d["whole_run"] or ends[0] <= a0 < b0 <= ends[-1]):
                d["steps_in_window"] = sum(1 for t in ends if a0 < t <= b0)
            res["verdicts"].append(d)
        caps = [l for l in ls if l.get("type") == "capture"]
        if a.series and ends and mode == "fleet":
            series_out["edges_us"] = [[(c["ts_ns"] - ends[0]) // 1000, c["state"]] for c in caps]
        res["capture"] = {
            "open_us": [c["took_us"] for c in caps if c["state"] == "open"],
            "close_us": [c["took_us"] for c in caps if c["state"] == "closed"],
            "links": max([c["links"] for c in caps], default=0),
        }
    if a.series and mode in ("bare", "fleet") and os.path.exists(times):
        ends = [int(x) for x in open(times).read().split()]
        if ends:
            series_out["ends_us"] = [(t - ends[0]) // 1000 for t in ends]
            json.dump(series_out, open(f"{a.out}/series-{a.workload}-{mode}-{r}.json", "w"))
    for f in (jsonl, times):
        if os.path.exists(f):
            os.remove(f)
    print(json.dumps(res), flush=True)
    return res


def series_analysis(path):
    """From a --series file: the spread of the run's rate over 1 s stretches (coefficient of
    variation of steps per second, warm-up left out) and, for a fleet run, the median step
    inside the capture windows over the median step outside them (what the windows' probes
    cost the steps they watch)."""
    s = json.load(open(path))
    ends = s["ends_us"][300:]
    out = {"mode": s["mode"], "round": s["round"], "fleet": s.get("fleet")}
    if len(ends) < 2:
        return out
    counts, t, j = [], ends[0], 0
    while t + 1_000_000 <= ends[-1]:
        k = j
        while k < len(ends) and ends[k] < t + 1_000_000:
            k += 1
        counts.append(k - j)
        j, t = k, t + 1_000_000
    if len(counts) > 1:
        out["steps_per_s_cv_1s"] = round(statistics.pstdev(counts) / statistics.mean(counts), 4)
    edges = s.get("edges_us") or []
    opens = [e[0] for e in edges if e[1] == "open"]
    closes = [e[0] for e in edges if e[1] == "closed"]
    wins = list(zip(opens, closes))
    if wins:
        inside, outside = [], []
        for a, b in zip(ends, ends[1:]):
            (inside if any(o <= a < c for o, c in wins) else outside).append(b - a)
        if inside and outside:
            out["step_us_inside_windows"] = statistics.median(inside)
            out["step_us_outside_windows"] = statistics.median(outside)
            out["in_window_slowdown"] = round(statistics.median(inside) / statistics.median(outside) - 1, 4)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--observer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workload", choices=["mlp", "transformer"], default="mlp")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--fleet", default=FLEET, help="fleet mode's WINDOW,PERIOD")
    ap.add_argument("--series", action="store_true", help="keep the step ends (see above)")
    a = ap.parse_args()
    a.steps = a.steps or (6000 if a.workload == "mlp" else 150)
    modes = a.modes.split(",")
    os.makedirs(a.out, exist_ok=True)
    work = f"/tmp/bench-fleet-{a.workload}"
    os.makedirs(work, exist_ok=True)
    runs = []
    for r in range(a.rounds):
        for k in range(len(modes)):
            runs.append(run_one(a, modes[(k + r) % len(modes)], r, work))
    by = {m: [x for x in runs if x["mode"] == m] for m in modes}
    med = {m: statistics.median(x["us_per_step"] for x in by[m]) for m in modes if by[m]}
    report = {"workload": a.workload, "steps": a.steps, "rounds": a.rounds, "runs": runs,
              "median_us_per_step": med}
    # Launch-rate truth per verdict: launches per step (always-on, exact) x the steps the fleet
    # run's workload timed in the verdict's window.
    est = []
    for r in range(a.rounds):
        al = [x for x in by.get("always", []) if x["round"] == r]
        fl = [x for x in by.get("fleet", []) if x["round"] == r]
        if not (al and fl and al[0].get("launches")):
            continue
        per_step = al[0]["launches"] / (al[0]["steps"] + al[0]["warmup"])
        for v in fl[0]["verdicts"]:
            if "steps_in_window" not in v or not v.get("capture_fraction"):
                continue
            truth = per_step * v["steps_in_window"] / (v["window_ns"] / 1e9)
            got = v["launches_per_s"]
            raw = got * (1 - v["probe_share"]) if v.get("probe_corrected") else got
            est.append({"round": r, "truth_per_s": round(truth, 1), "estimate_per_s": got,
                        "error": round(got / truth - 1, 4),
                        "uncorrected_error": round(raw / truth - 1, 4),
                        "bound": v.get("estimate_error"), "probe_share": v.get("probe_share"),
                        "corrected": v.get("probe_corrected"), "whole_run": v["whole_run"],
                        "class_fleet": v["class"],
                        "class_always": [x["class"] for x in al[0]["verdicts"]]})
    report["estimates"] = est
    if a.series:
        report["series"] = [series_analysis(f"{a.out}/{f}") for f in sorted(os.listdir(a.out))
                            if f.startswith(f"series-{a.workload}-")]
        for x in report["series"]:
            print("series:", json.dumps(x))
    errs = sorted(abs(e["error"]) for e in est if not e["whole_run"])
    if errs:
        report["estimate_summary"] = {
            "verdicts": len(errs), "median_abs_error": statistics.median(errs),
            "max_abs_error": errs[-1],
            "within_5pct": sum(1 for x in errs if x <= 0.05),
            "within_bound": sum(1 for e in est if not e["whole_run"] and e["bound"]
                                and abs(e["error"]) <= e["bound"]),
            "whole_run_abs_errors": [abs(e["error"]) for e in est if e["whole_run"]]}
    json.dump(report, open(f"{a.out}/fleet-{a.workload}.json", "w"), indent=1)
    base = med.get("bare")
    print(f"\n| mode | µs/step (median of {a.rounds}) | runs | vs bare | vs floor |")
    print("|---|---:|---|---:|---:|")
    for m in modes:
        if m not in med:
            continue
        vals = ", ".join(f"{x['us_per_step']:.0f}" for x in by[m])
        vb = f"{med[m] / base:.3f}×" if base else "-"
        vf = f"{med[m] / med['floor']:.3f}×" if "floor" in med else "-"
        print(f"| {m} | {med[m]:.1f} | {vals} | {vb} | {vf} |")
    for e in est:
        print(f"round {e['round']}{' whole run' if e['whole_run'] else ''}: launches/s truth {e['truth_per_s']}, fleet estimate "
              f"{e['estimate_per_s']} ({e['error']*100:+.2f} %, uncorrected "
              f"{e['uncorrected_error']*100:+.2f} %, bound ±{(e['bound'] or 0)*100:.1f} %, probes "
              f"{(e['probe_share'] or 0)*100:.1f} % of the thread); verdict fleet {e['class_fleet']} "
              f"always {e['class_always']}")
    if "estimate_summary" in report:
        print("estimates:", json.dumps(report["estimate_summary"]))


if __name__ == "__main__":
    main()
