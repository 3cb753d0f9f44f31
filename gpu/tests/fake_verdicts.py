#!/usr/bin/env python3
"""Fakes for testing gpu/validate_verdicts.sh and gpu/gpucheck/compare_verdicts.py without a GPU.
One file, chosen by the name it is called by (symlink it) or its first argument:

  fake_verdicts.py synth DIR NAME --kind K --mode cupti|all|pid [--fault F ...] [--pid P]
      an offline scenario: DIR/NAME.jsonl (the observer's lines: another process's, then the
      workload's verdict lines, process_exit, summaries), DIR/NAME.json (the workload's JSON),
      DIR/NAME.term.txt (the terminal final summary)
  fake_verdicts.py [--format jsonl|terminal] [--output F] [--pid N] [other observer options]
      the observer: prints "gpu-observer: ready"; with --pid, ends when that process has exited;
      without, watches for processes running a *bottleneck*.py --kind K until SIGINT/SIGTERM;
      then writes each one's lines (or terminal summary) as the scenario does
  fake_verdicts.py run [options] -- CMD...   (`run --help` exits 0)
      prints the ready line, runs CMD with CUDA_INJECTION64_PATH set, writes its lines (mode
      cupti), exits with CMD's status
  *bottleneck*.py (a symlink)   workloads/bottleneck.py's CLI: prints its pid line, waits for
      --wait-start, sleeps --seconds (at most 2 s), writes --out

The scenario of a workload of kind K: its designed class (compare_verdicts.EXPECTED; cpu_inline:
launch_bound, train: gpu_bound) from the second line on; without CUPTI (modes all, pid)
host_bound instead of launch_bound, as the rules decide without kernel times. Mode cupti:
lines at 1 s (mixed), 2 s and 12 s (a full 10 s window); modes all and pid (NVML's per-process
utilization is read every 10 s): lines at 1 s (mixed, GPU busy unknown) and 8.5 s; the
process exits at 15 s.

Faults (synth --fault, or FAKE_VERDICT_FAULTS="kind/mode=fault+fault,..." for the online fakes):
wrong_class (the designed class never comes: mixed), flip_end (a line at 14 s says mixed),
short (the process exits at 8 s: no full-length window), no_lines (no verdict line),
wrong_host, no_host (evidence without host), old_fields (evidence without host and gpu_idle
... top_kernels, as before they were added), pid_offset (the lines carry another pid), no_exit
(no process_exit line), torn (a torn last line), no_verdict_summary (the summary without
`verdict`). FAKE_WORKLOAD_FAIL=KIND: that workload exits 1 without its JSON.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

S = 1_000_000_000
DESIGNED = {"launch": "launch_bound", "gemm": "gpu_bound", "transfer": "transfer_bound",
            "sync": "sync_bound", "cpu": "host_bound", "sleep": "host_bound",
            "cpu_inline": "launch_bound", "train": "gpu_bound"}
SECONDARY = {"launch_bound": "host_bound", "transfer_bound": "gpu_bound", "sync_bound": "launch_bound"}
HINTS = {"launch_bound": "one thread cannot issue work fast enough for short kernels: CUDA graphs, kernel fusion, torch.compile",
         "gpu_bound": "the kernels are the limit: optimize the top kernels by GPU time",
         "sync_bound": "remove host synchronizations from the loop (.item(), .cpu(), cudaDeviceSynchronize)",
         "transfer_bound": "pinned host memory, fewer or larger copies, overlap copies with compute",
         "host_bound": "the GPU waits for the CPU: speed up or overlap the host work (data loading, Python)",
         "mixed": "no single bottleneck", "idle": "no CUDA work in the window"}


def evidence(kind, cls, window_ns, source, faults, known_busy=True):
    """Plausible evidence of a window of a workload of this kind."""
    busy = {"launch": 0.22, "gemm": 0.98, "transfer": 0.8, "sync": 0.41, "cpu": 0.04,
            "sleep": 0.09, "cpu_inline": 0.04, "train": 0.85}[kind]
    w = window_ns / S
    launches = {"launch": 140000.0, "gemm": 560.0, "transfer": 0.0, "sync": 400.0, "cpu": 19.0,
                "sleep": 45.0, "cpu_inline": 19.0, "train": 17000.0}[kind]
    syncs = {"launch": 10.0, "gemm": 56.0, "transfer": 60.0, "sync": 400.0, "cpu": 38.0,
             "sleep": 45.0, "cpu_inline": 38.0, "train": 47.0}[kind]
    ev = {"gpu_busy": round(busy, 4) if known_busy else None,
          "gpu_busy_source": source if known_busy else None,
          "calls": int((launches + syncs) * w) + 1, "launches_per_s": launches,
          "mean_kernel_ns": (1800 if kind == "launch" else 900000) if source == "cupti" else None,
          "mean_launch_interval_ns": int(1e9 / launches) if launches else None,
          "launch_thread_cpu": 0.99 if kind in ("launch", "sync", "cpu_inline") else 0.06,
          "process_cpu": 1.02 if kind in ("launch", "sync", "cpu", "cpu_inline", "train") else 0.1,
          "syncs_per_s": syncs, "sync_blocked": 0.42 if kind == "sync" else 0.02,
          "copy_fraction": 0.93 if kind == "transfer" else 0.0}
    ev["host"] = "cpu_busy" if ev["process_cpu"] >= 0.5 else "waiting"
    if "wrong_host" in faults:
        ev["host"] = "waiting" if ev["host"] == "cpu_busy" else "cpu_busy"
    if "no_host" in faults or "old_fields" in faults:
        del ev["host"]
    if "old_fields" not in faults:
        ev["gpu_idle"] = None if ev["gpu_busy"] is None else round(1 - ev["gpu_busy"], 4)
        tb = 268435456 * 30 * w if kind == "transfer" else 65536 * 19 * w if kind == "cpu" else 0
        ev["copies"] = {"cpu_to_gpu": {"bytes": int(tb), "gb_per_s": 12.5 if tb else None},
                        "gpu_to_cpu": {"bytes": int(tb), "gb_per_s": 9.8 if tb else None}}
        ev["pageable_share"] = 1.0 if tb else None
        ev["link_gb_per_s"] = 63.0
        ev["top_kernels"] = [] if source != "cupti" else [
            {"name": "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<int> >(int)"
             if kind == "launch" else "sm90_xmma_gemm_bf16bf16_bf16f32", "count": 1000, "gpu_ns": 123456789}]
    return ev


def verdict_line(pid, ts, window_ns, kind, cls, source, faults, known_busy=True):
    return {"type": "verdict", "ts_ns": ts, "pid": pid, "tid": pid, "comm": "python3", "class": cls,
            "secondary": SECONDARY.get(cls), "window_ns": window_ns,
            "evidence": evidence(kind, cls, window_ns, source, faults, known_busy), "hint": HINTS[cls]}


def scenario(kind, mode, pid, t0, faults):
    """(lines, whole-run verdict, lifetime ns) of one workload process seen by one observer."""
    cls = "mixed" if "wrong_class" in faults else DESIGNED[kind]
    if cls == "launch_bound" and mode != "cupti":
        cls = "host_bound"  # launch_bound needs kernel times, which only CUPTI gives
    life = 8 * S if "short" in faults else 15 * S
    source = "cupti" if mode == "cupti" else "nvml"
    first = t0 + S // 2
    lines = [verdict_line(pid, first + S, S, kind, "mixed", source, faults, known_busy=mode == "cupti")]
    ticks = [2, 12] if mode == "cupti" else [8.5]
    for t in ticks:
        ts = first + int(t * S)
        if ts - t0 < life:
            lines.append(verdict_line(pid, ts, min(int(t * S), 10 * S), kind, cls, source, faults))
    if "flip_end" in faults:
        lines.append(verdict_line(pid, first + 14 * S, 10 * S, kind, "mixed", source, faults))
    if "no_lines" in faults:
        lines = []
    end = t0 + life
    whole = verdict_line(pid, end, life - S // 2, kind, cls, source, faults)
    return lines, whole, end


def summary(pid, kind, mode, whole, faults):
    s = {"type": "summary", "ts_ns": whole["ts_ns"] + S, "scope": "process", "pid": pid, "comm": "python3",
         "events": 50000, "dropped": 0,
         "cupti": {"state": "active", "kernels": 1000} if mode == "cupti" else None,
         "nvml": {"devices": [0], "sm_utilization_mean": 0.5}}
    if "no_verdict_summary" not in faults:
        s["verdict"] = {k: whole[k] for k in ("class", "secondary", "window_ns", "evidence", "hint")}
    return s


def observer_lines(procs, mode, faults_of, t_stop):
    """JSON lines of an observer that saw `procs` [(pid, kind)]; another process too."""
    out = []
    other = 999999
    t0 = t_stop - 16 * S
    for k in range(3):
        out.append(verdict_line(other, t0 + (k + 1) * S, S, "gemm", "gpu_bound", "nvml", set()))
    for pid, kind in procs:
        faults = faults_of(kind, mode)
        lpid = pid + 7 if "pid_offset" in faults else pid
        lines, whole, end = scenario(kind, mode, lpid, t0, faults)
        out += lines
        if "no_exit" not in faults:
            out.append({"type": "process_exit", "ts_ns": end, "pid": lpid, "tid": lpid, "comm": "python3"})
        out.append(summary(lpid, kind, mode, whole, faults))
    out.append({"type": "summary", "ts_ns": t_stop, "scope": "total", "pid": None, "events": 1, "dropped": 0})
    return out


def terminal_text(procs, mode, faults_of, t_stop):
    """The terminal final summary of an observer that saw `procs`."""
    out = [f"gpu-observer summary: 16.0 s, 50000 events, 0 dropped, {len(procs)} processes"]
    for pid, kind in procs:
        faults = faults_of(kind, mode)
        _, whole, _ = scenario(kind, mode, pid, t_stop - 16 * S, faults)
        sec = f" (then {whole['secondary']})" if whole["secondary"] else ""
        out += ["", f"pid {pid} (python3), exited: 50000 events, 0 dropped",
                "  launches            1000   cuLaunchKernel 1000",
                "  syncs                 10   12.000 ms blocked, summed over threads (1.0% of its active wall time)",
                f"  verdict       {whole['class']}{sec} over 14.5 s: GPU busy "
                f"{whole['evidence']['gpu_busy'] * 100:.1f}% (nvml) — {whole['hint']}",
                "  NVML          GPU 0, 1.2 GiB, SM 50%"]
    out += ["", "GPU 0 NVIDIA H100 80GB HBM3: 160 samples"]
    return "\n".join(out) + "\n"


def write_lines(path, lines, faults_any=()):
    with open(path, "w", encoding="utf-8") as f:
        for ln in lines:
            f.write(json.dumps(ln, separators=(",", ":")) + "\n")
        if "torn" in faults_any:
            f.write('{"type":"verdict","ts_ns":1,"pid":')


def env_faults():
    """FAKE_VERDICT_FAULTS="kind/mode=f+g,kind=f" -> function (kind, mode) -> set of faults."""
    table = {}
    for item in os.environ.get("FAKE_VERDICT_FAULTS", "").split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            table[k.strip()] = set(x for x in v.strip().split("+") if x)

    def of(kind, mode):
        return table.get(f"{kind}/{mode}", set()) | table.get(kind, set())
    return of


# ---------------------------------------------------------------- offline scenario


def synth_main(argv):
    ap = argparse.ArgumentParser(prog="fake_verdicts.py synth")
    ap.add_argument("dir")
    ap.add_argument("name")
    ap.add_argument("--kind", required=True, choices=sorted(DESIGNED))
    ap.add_argument("--mode", required=True, choices=["cupti", "all", "pid"])
    ap.add_argument("--fault", action="append", default=[])
    ap.add_argument("--pid", type=int, default=4242)
    a = ap.parse_args(argv)
    faults = set(a.fault)
    os.makedirs(a.dir, exist_ok=True)
    base = os.path.join(a.dir, a.name)
    t_stop = 1000 * S

    def faults_of(_k, _m):
        return faults
    write_lines(base + ".jsonl", observer_lines([(a.pid, a.kind)], a.mode, faults_of, t_stop), faults)
    with open(base + ".term.txt", "w", encoding="utf-8") as f:
        f.write(terminal_text([(a.pid, a.kind)], a.mode, faults_of, t_stop))
    with open(base + ".json", "w", encoding="utf-8") as f:
        json.dump(workload_json(a.pid, a.kind, 14.0), f)
    return 0


def workload_json(pid, kind, seconds):
    return {"workload": "bottleneck", "kind": kind, "pid": pid, "designed": DESIGNED[kind],
            "params": {"kind": kind, "seconds": seconds, "sync_kernel_us": 1000.0, "step_us": 2000.0},
            "headline": f"fake {kind} workload", "setup_s": 0.4, "steady_s": seconds,
            "iterations": 10, "stats": {"fake": True}, "device": "fake"}


# ---------------------------------------------------------------- online fakes


def kind_of_cmd(cmd):
    for i, x in enumerate(cmd):
        if x == "--kind" and i + 1 < len(cmd):
            return cmd[i + 1]
        if x.startswith("--kind="):
            return x.split("=", 1)[1]
    return None


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [x.decode(errors="replace") for x in f.read().split(b"\0") if x]
    except OSError:
        return []


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            st = f.read().rsplit(")", 1)[1].split()[0]
        return st not in ("Z", "X")
    except (OSError, IndexError):
        return False


def emit(a, procs, mode):
    faults_of = env_faults()
    t_stop = time.monotonic_ns()
    out = open(a.output, "w", encoding="utf-8") if a.output else sys.stdout
    if a.format == "terminal":
        out.write(terminal_text(procs, mode, faults_of, t_stop))
    else:
        lines = observer_lines(procs, mode, faults_of, t_stop)
        fa = set().union(*[faults_of(k, mode) for _, k in procs]) if procs else set()
        for ln in lines:
            out.write(json.dumps(ln, separators=(",", ":")) + "\n")
        if "torn" in fa:
            out.write('{"type":"verdict","ts_ns":1,"pid":')
    if out is not sys.stdout:
        out.close()


def observer_args(argv):
    ap = argparse.ArgumentParser(prog="gpu-observer")
    ap.add_argument("--format", default="terminal")
    ap.add_argument("--output", default=None)
    ap.add_argument("--pid", type=int, default=None)
    ap.add_argument("--cupti-lib", default=None)
    a, _ = ap.parse_known_args(argv)
    return a


def run_main(argv):
    opts = argv[: argv.index("--")] if "--" in argv else argv
    if "--help" in opts:
        print("Usage: gpu-observer run [OPTIONS] -- CMD... (fake)")
        return 0
    if "--" not in argv:
        print("gpu-observer: run needs -- CMD", file=sys.stderr)
        return 2
    i = argv.index("--")
    a = observer_args(argv[:i])
    cmd = argv[i + 1:]
    print("gpu-observer: ready", file=sys.stderr, flush=True)
    env = dict(os.environ, CUDA_INJECTION64_PATH=a.cupti_lib or "/fake/libgpu_observer_cupti.so")
    child = subprocess.Popen(cmd, env=env)
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda *_: child.send_signal(signal.SIGTERM))
    rc = child.wait()
    rc = 128 - rc if rc < 0 else rc
    emit(a, [(child.pid, kind_of_cmd(cmd) or "gemm")], "cupti")
    return rc


def observer_main(argv):
    a = observer_args(argv)
    stop = {"flag": False}

    def on_sig(*_):
        stop["flag"] = True
    signal.signal(signal.SIGINT, on_sig)
    signal.signal(signal.SIGTERM, on_sig)
    time.sleep(0.2)
    print("gpu-observer: attached /fake/libcuda.so.1 (42 entry points, 84 probes)", file=sys.stderr, flush=True)
    print("gpu-observer: ready", file=sys.stderr, flush=True)
    me = os.getpid()
    seen = {}
    if a.pid is not None:
        k = kind_of_cmd(cmdline(a.pid)) or "gemm"
        while alive(a.pid) and not stop["flag"]:
            time.sleep(0.05)
        emit(a, [(a.pid, k)], "pid")
        return 0
    while not stop["flag"]:
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) not in seen and int(d) != me:
                c = cmdline(int(d))
                if len(c) > 1 and "bottleneck" in os.path.basename(c[1]) and kind_of_cmd(c):
                    seen[int(d)] = kind_of_cmd(c)
        time.sleep(0.05)
    emit(a, sorted(seen.items()), "all")
    return 0


def workload_main(argv):
    ap = argparse.ArgumentParser(prog="bottleneck.py (fake)")
    ap.add_argument("--kind", required=True)
    ap.add_argument("--seconds", type=float, default=14.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--wait-start", default=None)
    ap.add_argument("--wait-timeout-s", type=float, default=60.0)
    a, _ = ap.parse_known_args(argv)
    print(f"bottleneck: pid={os.getpid()} kind={a.kind} seconds={a.seconds:g} (fake)", flush=True)
    if a.wait_start:
        print(f"bottleneck: waiting for {a.wait_start}", flush=True)
        deadline = time.monotonic() + a.wait_timeout_s
        while not os.path.exists(a.wait_start):
            if time.monotonic() > deadline:
                return 4
            time.sleep(0.02)
    time.sleep(min(a.seconds, 2.0))
    if os.environ.get("FAKE_WORKLOAD_FAIL") == a.kind:
        print("bottleneck: ERROR: fake failure", file=sys.stderr, flush=True)
        return 1
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(workload_json(os.getpid(), a.kind, a.seconds), f)
    print(f"bottleneck: {a.kind}: fake workload done", flush=True)
    return 0


def main():
    argv = sys.argv[1:]
    if "bottleneck" in os.path.basename(sys.argv[0]):
        return workload_main(argv)
    if argv and argv[0] == "synth":
        return synth_main(argv[1:])
    if argv and argv[0] == "run":
        return run_main(argv[1:])
    return observer_main(argv)


if __name__ == "__main__":
    sys.exit(main())
