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
against the truth: launches per step counted exactly by the always-on run of the same round,
times the fleet run's own steps per second.

usage (as root, repo root): python3 gpu/bench_fleet.py --observer .gpu-bundle/gpu-observer \
    --out DIR [--workload mlp|transformer] [--rounds 5] [--steps N]
Writes DIR/fleet-<workload>.json and prints a Markdown table.
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
FLEET = ["--capture-window", "1s", "--capture-period", "10s"]


def workload_cmd(kind, steps, out_json):
    if kind == "mlp":
        return [sys.executable, f"{HERE}/workloads/launch_mlp.py", "--steps", str(steps)]
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
            args += FLEET
        obs = start_observer(a.observer, args, f"{work}/{mode}-{r}.err")
    t0 = time.time()
    w = subprocess.run(workload_cmd(a.workload, a.steps, wjson), capture_output=True, text=True,
                       timeout=300)
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
        res["verdicts"] = [{"class": v["class"], "launches_per_s": v["evidence"]["launches_per_s"],
                            "capture_fraction": v.get("capture_fraction"),
                            "estimate_error": v.get("estimate_error"), "ts_ns": v["ts_ns"]}
                           for v in pick]
        caps = [l for l in ls if l.get("type") == "capture"]
        res["capture"] = {
            "open_us": [c["took_us"] for c in caps if c["state"] == "open"],
            "close_us": [c["took_us"] for c in caps if c["state"] == "closed"],
            "links": max([c["links"] for c in caps], default=0),
        }
    if obs:
        os.remove(jsonl) if os.path.exists(jsonl) else None
    print(json.dumps(res), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--observer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workload", choices=["mlp", "transformer"], default="mlp")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--modes", default=",".join(MODES))
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
    # Launch-rate truth per round: launches per step (always-on, exact) x the fleet run's rate.
    est = []
    for r in range(a.rounds):
        al = [x for x in by.get("always", []) if x["round"] == r]
        fl = [x for x in by.get("fleet", []) if x["round"] == r]
        if not (al and fl and al[0].get("launches") and fl[0]["verdicts"]):
            continue
        per_step = al[0]["launches"] / (al[0]["steps"] + al[0]["warmup"])
        truth = per_step * 1e6 / fl[0]["us_per_step"]
        got = statistics.median(v["launches_per_s"] for v in fl[0]["verdicts"])
        est.append({"round": r, "truth_per_s": round(truth, 1), "estimate_per_s": got,
                    "error": round(got / truth - 1, 4),
                    "bound": fl[0]["verdicts"][-1].get("estimate_error"),
                    "class_fleet": [v["class"] for v in fl[0]["verdicts"]],
                    "class_always": [v["class"] for v in al[0]["verdicts"]]})
    report["estimates"] = est
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
        print(f"round {e['round']}: launches/s truth {e['truth_per_s']}, fleet estimate "
              f"{e['estimate_per_s']} ({e['error']*100:+.2f} %, bound ±{(e['bound'] or 0)*100:.1f} %); "
              f"verdict fleet {e['class_fleet']} always {e['class_always']}")


if __name__ == "__main__":
    main()
