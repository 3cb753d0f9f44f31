#!/usr/bin/env python3
"""Stand-in for gpu-observer, for testing the GPU scripts on a machine without
a GPU.  It follows the CLI contract (--format jsonl --output FILE [--pid N]
[--duration S]), prints "gpu-observer: ready" on stderr, writes a few events
and, on SIGINT/SIGTERM, a final summary line, then exits 0.

`run [--format jsonl] [--output FILE] [--trace-all] [--cupti-lib PATH]
[--threshold-us N] [--cuda-buffer-size B] [--no-cupti] -- CMD ARGS...`: prints the
ready line, starts CMD with CUDA_INJECTION64_PATH set (unless --no-cupti), waits for
it, writes a `cupti` line and the per-process summary (with its `cupti` block) for
CMD's pid and a total, and exits with CMD's exit status (128+N for signal N).
SIGINT/SIGTERM are passed on to CMD as SIGTERM.

FAKE_MODE (env): normal | ignore_int (ignores SIGINT and SIGTERM) |
die_early (exits 3 before ready) | never_ready (never prints the ready line).
FAKE_NO_RUN=1: `run` is an unknown subcommand (exit 2), as in an older build.
FAKE_CUPTI_STATE (env, run mode): the state reported (default active).

`--pid N --gpu-timing [--gpu-timing-for S]` (late GPU timing, issue 17): after the ready line, a
`gpu_timing` `injected` line and a `cupti` `active` line for N; every 20 ms a named launch of N
(every 5th a graph launch) and, while CUPTI is on, its joined GPU record; S seconds after the
injection a `cupti` `idle` and a `gpu_timing` `withdrawn` line; launches go on until SIGINT/SIGTERM
or until N exits (then a `process_exit` line), then N's process summary and the total.
FAKE_GPU_TIMING=refused: a `refused` line (ptrace_denied) instead, no CUPTI. FAKE_NO_GPU_TIMING=1:
no --gpu-timing options (an older build).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def run_mode(argv):
    if os.environ.get("FAKE_NO_RUN") == "1":
        print("error: unrecognized subcommand 'run'", file=sys.stderr, flush=True)
        return 2
    if "--" in argv:
        i = argv.index("--")
        opts, cmd = argv[:i], argv[i + 1:]
    else:
        opts, cmd = argv, []
    ap = argparse.ArgumentParser(prog="gpu-observer run")
    ap.add_argument("--format", default="terminal")
    ap.add_argument("--output", default=None)
    ap.add_argument("--trace-all", action="store_true")
    ap.add_argument("--cupti-lib", default=None)
    ap.add_argument("--threshold-us", type=int, default=100)
    ap.add_argument("--cuda-buffer-size", type=int, default=8 << 20)
    ap.add_argument("--no-cupti", action="store_true")
    a = ap.parse_args(opts)
    if not cmd:
        print("gpu-observer: run needs a command after --", file=sys.stderr, flush=True)
        return 2
    mode = os.environ.get("FAKE_MODE", "normal")
    if mode == "die_early":
        print("gpu-observer: error: cannot attach (fake)", file=sys.stderr, flush=True)
        return 3
    out = open(a.output, "w", encoding="utf-8") if a.output else sys.stdout
    time.sleep(0.2)
    print("gpu-observer: ready", file=sys.stderr, flush=True)
    env = dict(os.environ)
    lib = a.cupti_lib or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "libgpu_observer_cupti.so")
    if not a.no_cupti:
        env["CUDA_INJECTION64_PATH"] = lib
    try:
        child = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        print(f"gpu-observer: cannot start {cmd[0]}: {exc}", file=sys.stderr, flush=True)
        return 127

    def on_sig(_signum, _frame):
        try:
            child.send_signal(signal.SIGTERM)
        except OSError:
            pass

    signal.signal(signal.SIGINT, on_sig)
    signal.signal(signal.SIGTERM, on_sig)
    rc = child.wait()
    rc = 128 - rc if rc < 0 else rc
    state = "no_cupti" if a.no_cupti else os.environ.get("FAKE_CUPTI_STATE", "active")
    now = time.monotonic_ns()
    out.write(json.dumps({"type": "cupti", "ts_ns": now, "pid": child.pid, "tid": child.pid,
                          "comm": os.path.basename(cmd[0])[:15], "state": state,
                          "cupti_result": 0, "message": f"fake ({lib})"}) + "\n")
    block = None if a.no_cupti else {
        "state": state, "kernels": 0, "memcpys": 0, "memsets": 0, "joined": 0, "unjoined": 0,
        "gpu_kernel_ns": 0, "cupti_dropped": 0, "rate_limited": 0, "buffers": 0}
    out.write(json.dumps({"type": "summary", "scope": "process", "pid": child.pid,
                          "comm": os.path.basename(cmd[0])[:15], "events": 1, "dropped": 0,
                          "cupti": block}) + "\n")
    out.write(json.dumps({"type": "summary", "scope": "total", "pid": None, "ts_ns": now,
                          "events": 2, "dropped": 0, "trace_all": a.trace_all}) + "\n")
    out.flush()
    if out is not sys.stdout:
        out.close()
    print(f"gpu-observer: {cmd[0]} exited with {rc} (fake)", file=sys.stderr, flush=True)
    return rc


def alive(pid):
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def gpu_timing_mode(a, out, stop):
    """--pid N --gpu-timing (see the module doc)."""
    pid = a.pid
    print(f"gpu-observer: GPU_OBSERVER_CUPTI_PATH={os.environ.get('GPU_OBSERVER_CUPTI_PATH', '(unset)')} (fake)",
          file=sys.stderr, flush=True)
    print("gpu-observer: ready", file=sys.stderr, flush=True)
    common = {"pid": pid, "tid": pid, "comm": "python3"}

    def line(ty, ts, **kw):
        out.write(json.dumps({"type": ty, "ts_ns": ts, **common, **kw}) + "\n")

    t_inj = time.monotonic_ns()
    refused = os.environ.get("FAKE_GPU_TIMING") == "refused"
    if refused:
        line("gpu_timing", t_inj, event="refused", reason="ptrace_denied",
             message="ptrace(PTRACE_SEIZE): Operation not permitted (fake)")
        print(f"gpu-observer: pid {pid}: GPU timing refused: ptrace_denied (fake)", file=sys.stderr, flush=True)
    else:
        line("gpu_timing", t_inj, event="injected", pause_us=850, diverted_us=120,
             library="memfd:gpu-observer-cupti")
        line("cupti", t_inj + 1000, state="active", cupti_result=0, message="CUPTI active (fake)")
        print(f"gpu-observer: pid {pid}: CUPTI injected (fake)", file=sys.stderr, flush=True)
    active = not refused
    window_ns = int((a.gpu_timing_for or 0) * 1e9) or None
    n = records = named = unresolved = 0
    exited = False
    while not stop["flag"]:
        if not alive(pid):
            exited = True
            break
        ts = time.monotonic_ns()
        if active and window_ns is not None and ts - t_inj >= window_ns:
            line("cupti", ts, state="idle", cupti_result=0, message="CUPTI withdrawn (fake)")
            line("gpu_timing", ts + 1000, event="withdrawn", records=records)
            print(f"gpu-observer: pid {pid}: GPU timing withdrawn after {records} records (fake)",
                  file=sys.stderr, flush=True)
            active = False
            ts += 2000
        if n % 5 == 4:
            line("launch", ts, api="cuGraphLaunch", kernel=None, kernel_mangled=None, function="0x7f0000001000")
            unresolved += 1
            if active:
                line("gpu_kernel", ts + 1000, api="cuGraphLaunch", launch_ts_ns=ts, gpu_start_ns=ts + 1000,
                     graph_id=3, kernel="graph_kernel")
                records += 1
        else:
            line("launch", ts, api="cuLaunchKernel", kernel="fake_kernel(float*)", kernel_mangled="_Z11fake_kernelPf",
                 function="0x7f0000002000")
            named += 1
            if active:
                line("gpu_kernel", ts + 1000, api="cuLaunchKernel", launch_ts_ns=ts, gpu_start_ns=ts + 1000,
                     graph_id=None, kernel="fake_kernel(float*)")
                records += 1
        n += 1
        out.flush()
        time.sleep(0.02)
    now = time.monotonic_ns()
    if exited:
        line("process_exit", now)
    out.write(json.dumps({"type": "summary", "scope": "process", "ts_ns": now, **common, "events": n,
                          "dropped": 0, "named_launches": named, "unresolved_launches": unresolved,
                          "cupti": None if refused else {"state": "active" if active else "idle",
                                                         "kernels": records, "joined": records,
                                                         "unjoined": 0}}) + "\n")
    out.write(json.dumps({"type": "summary", "scope": "total", "pid": None, "ts_ns": now, "events": n,
                          "dropped": 0}) + "\n")
    out.close()
    print(f"gpu-observer: {'process exited' if exited else 'stopped'}, {n} events, 0 dropped (fake)",
          file=sys.stderr, flush=True)
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        return run_mode(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="jsonl")
    ap.add_argument("--output", required=True)
    ap.add_argument("--pid", type=int, default=None)
    ap.add_argument("--trace-all", action="store_true")
    ap.add_argument("--duration", type=float, default=None)
    if os.environ.get("FAKE_NO_GPU_TIMING") != "1":
        ap.add_argument("--gpu-timing", action="store_true")
        ap.add_argument("--gpu-timing-for", type=float, default=None)
    a = ap.parse_args()
    mode = os.environ.get("FAKE_MODE", "normal")
    if mode == "die_early":
        print("gpu-observer: error: cannot attach (fake)", file=sys.stderr, flush=True)
        sys.exit(3)
    stop = {"flag": False}

    def on_sig(_signum, _frame):
        stop["flag"] = True

    if mode == "ignore_int":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, on_sig)
        signal.signal(signal.SIGTERM, on_sig)
    out = open(a.output, "w", encoding="utf-8")
    time.sleep(0.3)
    if getattr(a, "gpu_timing", False) and a.pid is not None and mode == "normal":
        return gpu_timing_mode(a, out, stop)
    if mode != "never_ready":
        print("gpu-observer: attached 42 probes (fake)", file=sys.stderr, flush=True)
        print("gpu-observer: ready", file=sys.stderr, flush=True)
    n = 0
    t_end = time.monotonic() + a.duration if a.duration else None
    while not stop["flag"]:
        ev = {"type": "init", "ts_ns": time.monotonic_ns(), "pid": os.getpid(),
              "tid": os.getpid(), "comm": "fake", "api": "cuInit"}
        out.write(json.dumps(ev) + "\n")
        out.flush()
        n += 1
        if t_end is not None and time.monotonic() >= t_end:
            break
        time.sleep(0.05)
    out.write(json.dumps({"type": "summary", "ts_ns": time.monotonic_ns(), "events": n,
                          "dropped": 0}) + "\n")
    out.close()
    print(f"gpu-observer: stopped, {n} events, 0 dropped (fake)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
