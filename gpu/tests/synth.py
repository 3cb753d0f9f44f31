#!/usr/bin/env python3
"""Synthetic workload JSON + observer JSONL for testing compare.py,
make_report.py and bench_report.py without a GPU.

usage: synth.py KIND OUTPREFIX [--drop-launch K] [--pid-offset D] [--ptds]
                [--memset-extra K] [--unknown-dir K] [--null-names K] [--rename K]
                [--drop-api API] [--wrong-host K] [--no-leak] [--extra-leak]
                [--no-failed-result] [--wrong-stream K] [--style-names]
KIND: copies | torch | bench | ground
Writes OUTPREFIX.json (workload) and OUTPREFIX.jsonl (observer).  Launch events follow the
issue-3 contract: `kernel` (demangled, null when unresolved) and `kernel_mangled`.
"""

import argparse
import json
import random

ADD_K = "add_k(unsigned int const*, unsigned int*, unsigned int, unsigned long)"
ADD_K_MANGLED = "_Z5add_kPKjPjjm"
EW = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
      "std::array<char*, 2ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 2ul>)")
# Phase B kernel names as the profiler prints them; the observer's spelling of the first one
# differs only in whitespace (must still match).
B_NAMES = ["void gemm<float, 128>(float*, int)", "ampere_sgemm_128x64_tn",
           "void at::native::(anonymous namespace)::relu_kernel<float>(float*)",
           "void reduce<float>(float const*, float*, unsigned long)", "k4", "k5", "k6", "k7", "k8"]
B_OBSERVED = {"void gemm<float, 128>(float*, int)": "void gemm<float,128>(float *, int)"}

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
    out.append(ev("launch", t + 10, "cuLaunchKernel" + sfx_l, obs_pid, comm, kernel=ADD_K,
                  kernel_mangled=ADD_K_MANGLED))
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
                          kernel=None if i < a.null_names else ADD_K,
                          kernel_mangled=None if i < a.null_names else ADD_K_MANGLED,
                          grid=[1024, 1, 1], block=[256, 1, 1],
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
         "device_syncs": 1, "bytes_per_copy": 1 << 20, "kernel_name": ADD_K,
         "kernel_mangled": ADD_K_MANGLED}
    return w, out


def torch_(a):
    n, m = 50, 30
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
                          kernel=EW, grid=[256, 1, 1],
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
    prof_names = {}
    for i in range(m):
        for j in range(9):
            api = "cuLaunchKernelEx" if j % 3 == 0 else "cuLaunchKernel"
            comm = "pt_autograd_0" if j > 4 else "python3"
            name = B_NAMES[j]
            prof_names[name] = prof_names.get(name, 0) + 1
            seen = B_OBSERVED.get(name, name)
            if a.style_names and name.startswith("void reduce"):
                # cpp_demangle's spelling of an integer literal template argument
                seen = "void reduce<float, (unsigned long)4>(float const*, float*, unsigned long)"
                name = "void reduce<float, 4ul>(float const*, float*, unsigned long)"
                prof_names[B_NAMES[j]] -= 1
                prof_names[name] = prof_names.get(name, 0) + 1
            if kernels < a.null_names:
                seen = None
            elif kernels < a.null_names + a.rename:
                seen = f"renamed_kernel_{j}"
            out.append(ev("launch", ts, api, obs_pid, comm, kernel=seen, grid=[1, 1, 1],
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
                               "consistent": True, "kernel_names": {EW: 10}}},
        "phaseB": {"start_ns": b_start, "end_ns": b_end, "profiler_kernels": kernels,
                   "profiler_memcpy": 0, "profiler_memset": 0,
                   "profiler_count_method": "synthetic", "profiler_kernel_names": prof_names}}
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


GT_COMM = "cuda-ground-tru"
GT_KERNELS = [("write_value", "write_value"), ("add_one", "add_one"),
              ("_Z9scale_vecPffj", "scale_vec(float*, float, unsigned int)")]


def ground(a):
    """cuda-ground-truth's JSON and the observer's JSONL for it, per the issue-3 contract."""
    iters, b = 4, 4096
    pid = PID
    opid = PID + a.pid_offset
    stream = "0x55c36c638880"
    t = 20_000_000_000
    out = []
    calls = {}
    exp_bytes = {}

    def call(typ, api, count=True, **kw):
        nonlocal t
        t += 1000
        if count:
            calls[api] = calls.get(api, 0) + 1
            if kw.get("bytes") is not None and typ != "free":
                exp_bytes[api] = exp_bytes.get(api, 0) + kw["bytes"]
        if typ is not None:
            kw.setdefault("result", 0)
            out.append(ev(typ, t, api, opid, GT_COMM, **kw))
    # before the window (observer attached later: nothing of this is seen)
    start = t + 500
    t = start
    call("module", "cuModuleLoadData", handle=None, owner=None,
         result=0 if a.no_failed_result else 218)
    call("module", "cuModuleLoadData", handle="0x7700", owner=None)
    for entry, dem in GT_KERNELS:
        call("symbol", "cuModuleGetFunction", handle=f"0x{len(out):x}", owner="0x7700",
             name=entry, kernel=dem)
    call(None, "cuStreamCreate")
    for addr in ("0xa000", "0xb000", "0xc000"):
        call("alloc", "cuMemAlloc_v2", bytes=b, address=addr, memory="device")
    call("alloc", "cuMemAllocHost_v2", bytes=b, address="0xf000", memory="host")
    n_launch = 0
    n_generic = 0

    def launch(entry, dem):
        nonlocal n_launch
        named = n_launch >= a.null_names
        n_launch += 1
        call("launch", "cuLaunchKernel", kernel=dem if named else None,
             kernel_mangled=entry if named else None, grid=[b // 4 // 256, 1, 1],
             block=[256, 1, 1], shared_mem_bytes=0,
             stream="0x1234" if n_launch <= a.wrong_stream else stream)

    n_pinned = 0

    def generic(direction, host, dst, src):
        nonlocal n_generic, n_pinned
        n_generic += 1
        if host == "pinned":
            n_pinned += 1
            if n_pinned <= a.wrong_host:
                host = "pageable"
        if n_generic <= a.unknown_dir:
            direction, host = "unknown", None
        call("memcpy", "cuMemcpy", direction=direction, host_memory=host, bytes=b, dst=dst, src=src)

    for _ in range(iters):
        call("memcpy", "cuMemcpyHtoD_v2", direction="cpu_to_gpu", host_memory="pageable", bytes=b)
        launch(*GT_KERNELS[0])
        call("memcpy", "cuMemcpyDtoHAsync_v2", direction="gpu_to_cpu", host_memory="pinned",
             bytes=b, stream=stream)
        call("sync", "cuStreamSynchronize", handle=stream)
        out.append(ev("ioctl", t + 1, None, opid, GT_COMM, fd=5, cmd="0xc020462a",
                      parent_api="cuStreamSynchronize"))
        generic("gpu_to_gpu", None, "0xb000", "0xa000")
        generic("cpu_to_gpu", "pinned", "0xc000", "0xf000")
        launch(*GT_KERNELS[1])
        launch(*GT_KERNELS[2])
        call("sync", "cuStreamSynchronize", handle=stream)
        generic("gpu_to_cpu", "pinned", "0xf000", "0xc000")
        call("memset", "cuMemsetD32_v2", bytes=b, address="0xb000")
    call("memcpy", "cuMemcpyHtoD_v2", direction="cpu_to_gpu", host_memory="pageable", bytes=b)
    call("memcpy", "cuMemcpyDtoH_v2", direction="gpu_to_cpu", host_memory="pageable", bytes=b)
    call("sync", "cuCtxSynchronize", handle=None)
    call("free", "cuMemFree_v2", bytes=b, address="0xa000", memory="device")
    call("free", "cuMemFree_v2", bytes=b, address="0xb000", memory="device")
    call("free", "cuMemFreeHost", bytes=b, address="0xf000", memory="host")
    exp_bytes["cuMemFree_v2"] = 2 * b
    exp_bytes["cuMemFreeHost"] = b
    call(None, "cuStreamDestroy_v2")
    call("module", "cuModuleUnload", handle="0x7700", owner=None)
    call(None, "cuDevicePrimaryCtxRelease_v2")
    end = t + 500
    noise(out, start, end)
    if a.drop_api:
        idx = next(i for i, e in enumerate(out) if e.get("api") == a.drop_api and e["pid"] == opid)
        del out[idx]
    exit_ts = end + 50_000
    out.append(ev("process_exit", exit_ts, None, opid, GT_COMM))
    leaks = [] if a.no_leak else [{"api": "cuMemAlloc_v2", "memory": "device", "count": 1, "bytes": b}]
    if a.extra_leak:
        leaks.append({"api": "cuMemAllocHost_v2", "memory": "host", "count": 1, "bytes": b})
    for l_ in leaks:
        # written at exit and again when the observer stops: the comparer keeps the latest
        out.append(dict(ev("leak", exit_ts, None, opid, GT_COMM, process_exited=True), **l_))
        out.append(dict(ev("leak", exit_ts + 9, None, opid, GT_COMM, process_exited=True), **l_))
    random.Random(3).shuffle(out)
    for e in out:
        if e.get("api") is None:
            e.pop("api", None)
    out.append({"type": "summary", "scope": "process", "pid": opid, "comm": GT_COMM,
                "events": len(out), "dropped": 0, "launches": n_launch,
                "named_launches": n_launch - a.null_names, "unresolved_launches": a.null_names,
                "leaks": leaks})
    out.append({"type": "summary", "scope": "total", "pid": None, "ts_ns": exit_ts + 100,
                "events": len(out), "dropped": 0})
    generic_rows = [
        {"api": "cuMemcpy", "direction": d, "host_memory": h, "bytes_per_copy": b,
         "count": iters, "bytes": iters * b}
        for d, h in (("cpu_to_gpu", "pinned"), ("gpu_to_cpu", "pinned"), ("gpu_to_gpu", None))]
    explicit = [
        {"api": "cuMemcpyDtoHAsync_v2", "direction": "gpu_to_cpu", "host_memory": "pinned",
         "bytes_per_copy": b, "count": iters, "bytes": iters * b},
        {"api": "cuMemcpyDtoH_v2", "direction": "gpu_to_cpu", "host_memory": "pageable",
         "bytes_per_copy": b, "count": 1, "bytes": b},
        {"api": "cuMemcpyHtoD_v2", "direction": "cpu_to_gpu", "host_memory": "pageable",
         "bytes_per_copy": b, "count": iters + 1, "bytes": (iters + 1) * b}]
    w = {"workload": "cuda-ground-truth", "pid": pid, "iters": iters, "elems": b // 4,
         "buffer_bytes": b, "window_start_ns": start, "window_end_ns": end, "calls": calls,
         "bytes": exp_bytes, "calls_before_window": {"cuInit": 1, "cuDeviceGet": 1,
                                                     "cuDevicePrimaryCtxRetain": 1,
                                                     "cuCtxSetCurrent": 1},
         "kernels": {k: iters for k, _ in GT_KERNELS},
         "kernel_names": {k: d for k, d in GT_KERNELS},
         "launch": {"grid": [b // 4 // 256, 1, 1], "block": [256, 1, 1], "shared_mem_bytes": 0},
         "handles": {"module": "0x7700", "stream": stream},
         "copies": generic_rows + explicit, "generic_copies": generic_rows,
         "failed_calls": [{"api": "cuModuleLoadData", "result": 218, "count": 1}],
         "leaks": [{"api": "cuMemAlloc_v2", "count": 1, "bytes": b}],
         "invalid_ptx_result": 218,
         "hypotheses": {"H1": True, "H2": True, "H3": True, "H9": True},
         "hypothesis_details": {"H1": "synthetic"}, "error": None}
    return w, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["copies", "torch", "bench", "ground"])
    ap.add_argument("prefix")
    ap.add_argument("--drop-launch", type=int, default=0)
    ap.add_argument("--pid-offset", type=int, default=0)
    ap.add_argument("--ptds", action="store_true")
    ap.add_argument("--memset-extra", type=int, default=0)
    ap.add_argument("--unknown-dir", type=int, default=0)
    ap.add_argument("--null-names", type=int, default=0, help="first K launches unnamed")
    ap.add_argument("--rename", type=int, default=0, help="K phase B launches misnamed")
    ap.add_argument("--style-names", action="store_true",
                    help="torch: one phase B kernel spelled differently by the two demanglers")
    ap.add_argument("--drop-api", default=None, help="ground: drop one event of this API")
    ap.add_argument("--wrong-host", type=int, default=0, help="ground: K pinned copies as pageable")
    ap.add_argument("--wrong-stream", type=int, default=0, help="ground: K launches on another stream")
    ap.add_argument("--no-leak", action="store_true", help="ground: no leak lines")
    ap.add_argument("--extra-leak", action="store_true", help="ground: a leak that is not one")
    ap.add_argument("--no-failed-result", action="store_true",
                    help="ground: the invalid PTX load reported as successful")
    a = ap.parse_args()
    if a.kind == "copies":
        w, out = copies(a)
    elif a.kind == "ground":
        w, out = ground(a)
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
