#!/usr/bin/env python3
"""What attaching and detaching fleet mode's capture windows costs other work on the node
(docs/BENCHMARKS.md "Window edges: stalls"), side by side in one run.

Registering a uprobe writes a breakpoint into every process that maps the library, under
that process's mmap lock, and blocks fork() system-wide while it does (the kernel's
dup_mmap_sem); unregistering does the reverse. Three victims time the operations that could
wait on that, each in its own process, for --seconds with no observer and then --seconds with
the observer in fleet mode at a short period (many edges):
  fork    fork() + the child's _exit, timed in the parent (dup_mmap_sem)
  mmap    in a process that maps LIB: map 1 MiB, touch each page, unmap (its own mmap lock,
          which breakpoint installation into it takes)
  uprobe  another uprobe user: perf_event_open of a uprobe on libc's getpid, then close
          (uprobe registration while the observer registers and unregisters its own)
Each reports, per phase, operations, p50, p99 and max in µs, and in the observer phase the
worst operation that overlapped a window edge (from the observer's `capture` lines).

usage (as root): python3 gpu/stall_probe.py --observer PATH --lib LIBCUDA --out DIR
    [--seconds 20] [--window 100ms] [--period 1s] [--victims fork,mmap,uprobe]
Writes DIR/stalls.json and prints a Markdown table; exits 1 when a victim failed.
"""
import argparse
import ctypes
import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import time

NS = time.monotonic_ns


def pct(v, q):
    if not v:
        return None
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def victim_fork(until):
    out = []
    while NS() < until:
        t0 = NS()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        out.append((t0, NS() - t0))
        os.waitpid(pid, 0)
        time.sleep(0.001)
    return out


def victim_mmap(until, lib):
    ctypes.CDLL(lib)  # the library mapped: the observer's breakpoints go into this process
    page = mmap.PAGESIZE
    out = []
    while NS() < until:
        t0 = NS()
        m = mmap.mmap(-1, 1 << 20)
        for off in range(0, 1 << 20, page):
            m[off] = 1
        m.close()
        out.append((t0, NS() - t0))
        time.sleep(0.001)
    return out


def file_offset(addr):
    """The ELF file offset of a code address of this process (what a uprobe names)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) >= 6:
                return parts[5], addr - lo + int(parts[2], 16)
    raise SystemExit(f"no mapping holds {addr:#x}")


def victim_uprobe(until):
    libc = ctypes.CDLL(None, use_errno=True)
    path, off = file_offset(ctypes.cast(libc.getpid, ctypes.c_void_p).value)
    ptype = int(open("/sys/bus/event_source/devices/uprobe/type").read())
    cpath = ctypes.create_string_buffer(path.encode())
    # perf_event_attr (PERF_ATTR_SIZE_VER5, 112 bytes): type, size, config, sample_period,
    # sample_type, read_format, flags, wakeup_events, bp_type, config1 (path), config2 (offset).
    attr = bytearray(128)
    struct.pack_into("IIQ", attr, 0, ptype, 112, 0)
    struct.pack_into("Q", attr, 40, 1)  # flags: disabled
    struct.pack_into("QQ", attr, 56, ctypes.addressof(cpath), off)
    buf = (ctypes.c_char * len(attr)).from_buffer(attr)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    out = []
    while NS() < until:
        t0 = NS()
        fd = syscall(298, buf, 0, -1, -1, 0)  # perf_event_open(attr, this process, any CPU)
        if fd < 0:
            raise SystemExit(f"perf_event_open (uprobe): errno {ctypes.get_errno()}")
        os.close(fd)
        out.append((t0, NS() - t0))
        time.sleep(0.001)
    return out


def run_victims(names, seconds, lib):
    """Starts each victim in its own process; returns {name: [(start_ns, ns)]}."""
    until = NS() + int(seconds * 1e9)
    procs = {}
    for n in names:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                res = {"fork": lambda: victim_fork(until), "mmap": lambda: victim_mmap(until, lib),
                       "uprobe": lambda: victim_uprobe(until)}[n]()
                data = json.dumps(res).encode()
                code = 0
            except BaseException as e:  # reported by the parent
                data = json.dumps({"error": repr(e)}).encode()
                code = 1
            with os.fdopen(w, "wb") as f:
                f.write(data)
            os._exit(code)
        os.close(w)
        procs[n] = (pid, r)
    out = {}
    for n, (pid, r) in procs.items():
        with os.fdopen(r, "rb") as f:
            data = json.loads(f.read() or b"{}")
        os.waitpid(pid, 0)
        out[n] = data
    return out


def summarize(ops, edges=()):
    if isinstance(ops, dict):
        return ops
    d = [x[1] / 1000 for x in ops]
    s = {"ops": len(d), "p50_us": pct(d, 0.5), "p99_us": pct(d, 0.99), "max_us": max(d, default=None)}
    if edges:
        def at_edge(op):
            return any(a <= op[0] + op[1] and op[0] <= b for a, b in edges)
        near = [x[1] / 1000 for x in ops if at_edge(x)]
        far = [x[1] / 1000 for x in ops if not at_edge(x)]
        s["at_edges"] = len(near)
        s["max_at_edge_us"] = max(near, default=None)
        s["max_elsewhere_us"] = max(far, default=None)
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--observer", required=True)
    ap.add_argument("--lib", required=True, help="the libcuda the observer probes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--window", default="100ms")
    ap.add_argument("--period", default="1s")
    ap.add_argument("--victims", default="fork,mmap,uprobe")
    ap.add_argument("--observer-args", default="", help="more observer arguments, space-separated")
    a = ap.parse_args()
    names = a.victims.split(",")
    os.makedirs(a.out, exist_ok=True)
    report = {"window": a.window, "period": a.period, "seconds": a.seconds, "phases": {}}
    # The library mapped by a process the observer sees, so that its probes have a target.
    holder = subprocess.Popen([sys.executable, "-c",
                               "import ctypes,sys,time; ctypes.CDLL(sys.argv[1]); time.sleep(1e6)",
                               a.lib])
    try:
        report["phases"]["none"] = {n: summarize(v) for n, v in
                                    run_victims(names, a.seconds, a.lib).items()}
        jsonl = os.path.join(a.out, "stalls.jsonl")
        err = open(os.path.join(a.out, "stalls.err"), "w")
        args = [a.observer, "--format", "jsonl", "--output", jsonl, "--no-nvml",
                "--libcuda", a.lib, "--capture-window", a.window, "--capture-period", a.period]
        args += a.observer_args.split()
        obs = subprocess.Popen(args, stderr=err)
        deadline = time.time() + 60
        while "gpu-observer: ready" not in open(err.name).read():
            if obs.poll() is not None or time.time() > deadline:
                raise SystemExit(f"observer did not start: {open(err.name).read()[-2000:]}")
            time.sleep(0.1)
        res = run_victims(names, a.seconds, a.lib)
        obs.send_signal(signal.SIGINT)
        obs.wait(30)
        edges = []
        kinds = {"open": [], "closed": []}
        for line in open(jsonl, errors="replace"):
            try:
                c = json.loads(line)
            except ValueError:
                continue
            if c.get("type") == "capture":
                took = c["took_us"] * 1000
                edges.append((c["ts_ns"] - took - 2_000_000, c["ts_ns"] + 2_000_000))
                kinds[c["state"]].append(c["took_us"])
        report["edges"] = {k: {"n": len(v), "p50_us": pct(v, 0.5), "max_us": max(v, default=None)}
                           for k, v in kinds.items()}
        report["phases"]["fleet"] = {n: summarize(v, edges) for n, v in res.items()}
    finally:
        holder.kill()
        holder.wait()
    json.dump(report, open(os.path.join(a.out, "stalls.json"), "w"), indent=1)
    print(f"\nwindow {a.window} every {a.period}; edges: {json.dumps(report['edges'])}")
    print("| victim | phase | ops | p50 µs | p99 µs | max µs | max at an edge µs | max elsewhere µs |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    failed = False
    for phase, vs in report["phases"].items():
        for n, s in vs.items():
            if "error" in s:
                failed = True
                print(f"| {n} | {phase} | error: {s['error']} |")
                continue
            f = lambda k: "" if s.get(k) is None else f"{s[k]:.0f}"
            print(f"| {n} | {phase} | {s['ops']} | {f('p50_us')} | {f('p99_us')} | {f('max_us')} "
                  f"| {f('max_at_edge_us')} | {f('max_elsewhere_us')} |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
