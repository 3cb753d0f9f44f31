#!/usr/bin/env python3
"""Synthetic workload JSON + observer JSONL for testing compare.py,
make_report.py and bench_report.py without a GPU.

usage: synth.py KIND OUTPREFIX [--drop-launch K] [--pid-offset D] [--ptds]
                [--memset-extra K] [--unknown-dir K]
KIND: copies | torch | bench
Writes OUTPREFIX.json (workload) and OUTPREFIX.jsonl (observer).
"""

import argparse
import json
import random

PID = 4242
TID = 4243


def ev(typ, ts, api, pid, comm, **kw):
    d = {"type": typ, "ts_ns": ts, "pid": pid, "tid": TID if pid == PID else pid + 1,
         "comm": comm, "api": api}
    d.update(kw)
    return d


def noise(out, t0, t1, n=50):
    # another process, inside the window: must be ignored
    for i in range(n):
        out.append(ev("launch", t0 + (t1 - t0) * i // n, "cuLaunchKernel", 999, "other",
                      kernel="k", grid=[1, 1, 1], block=[1, 1, 1], shared_mem_bytes=0, stream="0x0"))


def copies(a):
    n = 100
    pid = PID
    obs_pid = PID + a.pid_offset
    comm = "copies_kernels_" if a.ptds else "copies_kernels"
    sfx_l = "_ptsz" if a.ptds else ""
    sfx_s = "_ptds" if a.ptds else ""
    t = 1_000_000_000
    out = []
    # warm-up before the window (must not count)
    out.append(ev("memcpy", t, "cuMemcpyHtoD_v2" + sfx_s, obs_pid, comm, direction="cpu_to_gpu",
                  bytes=1 << 20, duration_ns=1000, bandwidth_mbps=1000.0, stream=None, **{"async": False}))
    out.append(ev("launch", t + 10, "cuLaunchKernel" + sfx_l, obs_pid, comm, kernel="_Z5add_kPKjPjjm"))
    start = t + 1000
    ts = start + 100
    for i in range(n):
        out.append(ev("memcpy", ts, "cuMemcpyHtoD_v2" + sfx_s, obs_pid, comm,
                      direction="unknown" if i < a.unknown_dir else "cpu_to_gpu",
                      bytes=1 << 20, duration_ns=50000, bandwidth_mbps=20000.0, stream=None,
                      **{"async": False}))
        ts += 10
        if i >= a.drop_launch:
            out.append(ev("launch", ts, "cuLaunchKernel" + sfx_l, obs_pid, comm,
                          kernel="_Z5add_kPKjPjjm", grid=[1024, 1, 1], block=[256, 1, 1],
                          shared_mem_bytes=0, stream="0x2" if a.ptds else "0x0"))
        ts += 10
        out.append(ev("ioctl", ts, "ioctl", obs_pid, comm, fd=5, cmd="0xc0104629",
                      duration_ns=300, parent_api="cuLaunchKernel" + sfx_l))
        ts += 10
        out.append(ev("memcpy", ts, "cuMemcpyDtoHAsync_v2" + sfx_l, obs_pid, comm,
                      direction="gpu_to_cpu", bytes=1 << 20, duration_ns=3000,
                      bandwidth_mbps=300000.0, stream="0x5555", **{"async": True}))
        ts += 10
        out.append(ev("sync", ts, "cuStreamSynchronize" + sfx_l, obs_pid, comm, duration_ns=40000))
        ts += 100
    out.append(ev("sync", ts, "cuCtxSynchronize", obs_pid, comm, duration_ns=1000))
    end = ts + 1000
    noise(out, start, end)
    out.append(ev("free", end + 500, "cuMemFree_v2", obs_pid, comm, bytes=0, address="0x7f00"))
    random.Random(1).shuffle(out)  # the observer need not emit in ts order
    out.append({"type": "summary", "ts_ns": end + 10_000, "events": len(out), "dropped": 0})
    w = {"workload": "copies_kernels", "pid": pid, "per_thread_default_stream": a.ptds,
         "loop_start_ns": start, "loop_end_ns": end, "iterations": n, "launches": n, "htod": n,
         "dtoh": n, "htod_bytes": n << 20, "dtoh_bytes": n << 20, "stream_syncs": n,
         "device_syncs": 1, "bytes_per_copy": 1 << 20}
    return w, out


def torch_(a):
    n, m = 50, 5
    obs_pid = PID + a.pid_offset
    out = []
    t = 5_000_000_000
    a_start = t
    ts = a_start + 100
    for i in range(n):
        out.append(ev("memcpy", ts, "cuMemcpyHtoDAsync_v2", obs_pid, "python3",
                      direction="cpu_to_gpu", bytes=1 << 20, duration_ns=2000,
                      bandwidth_mbps=1.0, stream="0x0", **{"async": True}))
        if i >= a.drop_launch:
            out.append(ev("launch", ts + 1, "cuLaunchKernel", obs_pid, "python3",
                          kernel="vectorized_elementwise_kernel", grid=[256, 1, 1],
                          block=[128, 1, 1], shared_mem_bytes=0, stream="0x0"))
        out.append(ev("memcpy", ts + 2, "cuMemcpyDtoHAsync_v2", obs_pid, "python3",
                      direction="gpu_to_cpu", bytes=1 << 20, duration_ns=2000,
                      bandwidth_mbps=1.0, stream="0x0", **{"async": True}))
        out.append(ev("sync", ts + 3, "cuStreamSynchronize", obs_pid, "python3", duration_ns=9))
        ts += 100
    a_end = ts + 100
    b_start = a_end + 1_000_000
    ts = b_start + 100
    kernels = 0
    for i in range(m):
        for j in range(9):
            api = "cuLaunchKernelEx" if j % 3 == 0 else "cuLaunchKernel"
            comm = "pt_autograd_0" if j > 4 else "python3"
            out.append(ev("launch", ts, api, obs_pid, comm, kernel=f"k{j}", grid=[1, 1, 1],
                          block=[1, 1, 1], shared_mem_bytes=0, stream="0x0"))
            kernels += 1
            ts += 10
        if i < a.memset_extra:
            out.append(ev("memset", ts, "cuMemsetD32Async", obs_pid, "python3", bytes=4096,
                          duration_ns=10, stream="0x0"))
        ts += 10
    b_end = ts + 100
    noise(out, a_start, b_end)
    out.append({"type": "summary", "ts_ns": b_end + 1, "events": len(out), "dropped": 3})
    w = {"workload": "torch_loop", "pid": PID, "phaseA": {
        "start_ns": a_start, "end_ns": a_end, "launches": n, "htod": n, "dtoh": n,
        "stream_syncs": n, "bytes_per_copy": 1 << 20, "htod_bytes": n << 20, "dtoh_bytes": n << 20,
        "profiler_selfcheck": {"iterations": 10, "kernels": 10, "memcpy": 20, "memset": 0,
                               "consistent": True}},
        "phaseB": {"start_ns": b_start, "end_ns": b_end, "profiler_kernels": kernels,
                   "profiler_memcpy": 0, "profiler_memset": 0,
                   "profiler_count_method": "synthetic"}}
    return w, out


def bench(a):
    L, R = 1000, 3
    out = []
    starts, ends = [], []
    t = 9_000_000_000
    for r in range(R):
        starts.append(t)
        for i in range(L):
            if r == 0 and i < a.drop_launch:
                continue
            out.append(ev("launch", t + 1 + i, "cuLaunchKernel", PID + a.pid_offset,
                          "launch_bench", kernel="_Z12empty_kernelv"))
        ends.append(t + L + 2)
        t += 10_000
    bstarts, bends = [], []
    LB = 256
    for r in range(R):
        bstarts.append(t)
        for i in range(LB):
            out.append(ev("launch", t + 1 + i, "cuLaunchKernel", PID + a.pid_offset,
                          "launch_bench", kernel="_Z12empty_kernelv"))
            if i % 128 == 127:
                out.append(ev("sync", t + 1 + i, "cuCtxSynchronize", PID + a.pid_offset,
                              "launch_bench", duration_ns=5000))
        bends.append(t + LB + 2)
        t += 10_000
    out.append({"type": "summary", "ts_ns": t, "events": len(out), "dropped": 0})
    base = {"workload": "launch_bench", "pid": PID + 7, "launches_per_round": L,
            "ns_per_launch_median": 2500.0, "rounds": [2500.0, 2490.0, 2510.0],
            "window_start_ns": [0, 0, 0], "window_end_ns": [1, 1, 1],
            "submit_ns_per_launch_median": 1500.0, "submit_rounds": [1500.0, 1490.0, 1510.0],
            "batched_launches_per_round": LB, "batch": 128,
            "batched_window_start_ns": [0, 0, 0], "batched_window_end_ns": [1, 1, 1]}
    w = dict(base, pid=PID, ns_per_launch_median=3100.0, rounds=[3100.0, 3090.0, 3120.0],
             window_start_ns=starts, window_end_ns=ends, submit_ns_per_launch_median=2100.0,
             submit_rounds=[2100.0, 2050.0, 2110.0], batched_window_start_ns=bstarts,
             batched_window_end_ns=bends)
    return (base, w), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["copies", "torch", "bench"])
    ap.add_argument("prefix")
    ap.add_argument("--drop-launch", type=int, default=0)
    ap.add_argument("--pid-offset", type=int, default=0)
    ap.add_argument("--ptds", action="store_true")
    ap.add_argument("--memset-extra", type=int, default=0)
    ap.add_argument("--unknown-dir", type=int, default=0)
    a = ap.parse_args()
    if a.kind == "copies":
        w, out = copies(a)
    elif a.kind == "torch":
        w, out = torch_(a)
    else:
        (base, w), out = bench(a)
        with open(a.prefix + ".base.json", "w") as f:
            json.dump(base, f)
    with open(a.prefix + ".json", "w") as f:
        json.dump(w, f)
    with open(a.prefix + ".jsonl", "w") as f:
        for e in out:
            f.write(json.dumps(e) + "\n")


if __name__ == "__main__":
    main()
