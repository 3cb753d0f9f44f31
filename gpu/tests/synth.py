#!/usr/bin/env python3
"""Synthetic workload JSON + observer JSONL for testing compare.py,
make_report.py and bench_report.py without a GPU.

usage: synth.py KIND OUTPREFIX [--drop-launch K] [--pid-offset D] [--ptds]
                [--memset-extra K] [--unknown-dir K] [--null-names K] [--rename K]
                [--drop-api API] [--wrong-host K] [--no-leak] [--extra-leak]
                [--no-failed-result] [--wrong-stream K] [--style-names]
                [--unjoined K] [--ts-off K] [--drop-gpu-kernel K] [--state S]
                [--warmup-outlier] [--with-profiler] [--no-cupti-block]
KIND: copies | torch | bench | ground | cupti_torch | cupti_ground | bench_cupti
Writes OUTPREFIX.json (workload) and OUTPREFIX.jsonl (observer).  Launch events follow the
issue-3 contract: `kernel` (demangled, null when unresolved) and `kernel_mangled`.
cupti_torch / cupti_ground: the same runs under `gpu-observer run` with CUPTI: every launch,
memcpy and memset also has its gpu_kernel / gpu_memcpy / gpu_memset line, a `cupti` state
line and the per-process summary's `cupti` block (faults: unjoined kernels, a CUPTI API
timestamp 6 us off, missing gpu_kernel lines, another state).  bench_cupti: OUTPREFIX.d/
with the per-run files bench_cupti.sh leaves for bench_cupti_report.py.
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


# ------------------------------------------------------------------ CUPTI (gpu-observer run)

COPY_KIND = {"cpu_to_gpu": "htod", "gpu_to_cpu": "dtoh", "gpu_to_gpu": "dtod"}


def add_cupti(a, out, w, opid, windows, names=None):
    """Add the CUPTI lines of the workload pid's launches, copies and memsets to `out` (the
    uprobe events), apply the faults to the gpu_kernel lines inside `windows`, and replace the
    summaries with a per-process one carrying the cupti block and a total."""
    names = names or {}
    evs = [e for e in out if e.get("type") != "summary"]
    gpu = []
    corr = 100
    for e in sorted((e for e in evs if e.get("pid") == opid), key=lambda e: e["ts_ns"]):
        typ = e.get("type")
        ts = e["ts_ns"]
        corr += 1
        common = {"pid": opid, "tid": e.get("tid"), "comm": e.get("comm"), "correlation_id": corr,
                  "device": 0, "context": 1, "stream": 7}
        if typ == "launch":
            graph = str(e.get("api")).startswith("cuGraphLaunch")
            for g in range(2 if graph else 1):
                start = ts + 40 + g * 5
                end = start + 30
                kern = e.get("kernel")
                if kern is None and e.get("kernel_mangled"):
                    kern = names.get(e["kernel_mangled"], e["kernel_mangled"])
                capi = "cudaLaunchKernel" if e.get("api") == "cuLaunchKernel" else e.get("api")
                gpu.append(dict(common, type="gpu_kernel", ts_ns=start, api=e.get("api"),
                                cupti_api=capi,
                                gpu_start_ns=start, gpu_end_ns=end, gpu_duration_ns=end - start,
                                launch_ts_ns=ts, queue_delay_ns=start - ts,
                                cupti_api_start_ns=ts + 700 + (corr % 5) * 100,
                                cupti_api_end_ns=ts + 2500, graph_id=7 if graph else None,
                                kernel=kern if kern is not None else f"graph_node_{g}",
                                kernel_mangled=e.get("kernel_mangled"), grid=[1, 1, 1],
                                block=[128, 1, 1], registers_per_thread=32,
                                static_shared_mem_bytes=0, dynamic_shared_mem_bytes=0,
                                occupancy=0.5, is_slow=False, attributes={}))
        elif typ == "memcpy":
            start = ts + 20
            gpu.append(dict(common, type="gpu_memcpy", ts_ns=start, api=e.get("api"),
                            gpu_start_ns=start, gpu_end_ns=start + 10, gpu_duration_ns=10,
                            launch_ts_ns=ts, queue_delay_ns=20, cupti_api_start_ns=ts + 600,
                            cupti_api_end_ns=ts + 900, graph_id=None, bytes=e.get("bytes"),
                            copy_kind=COPY_KIND.get(e.get("direction"), "unknown"),
                            src_kind="pinned", dst_kind="device", bandwidth_mbps=1000.0,
                            is_slow=False, attributes={}))
        elif typ == "memset":
            start = ts + 20
            gpu.append(dict(common, type="gpu_memset", ts_ns=start, api=e.get("api"),
                            gpu_start_ns=start, gpu_end_ns=start + 5, gpu_duration_ns=5,
                            launch_ts_ns=ts, queue_delay_ns=20, cupti_api_start_ns=ts + 600,
                            cupti_api_end_ns=ts + 900, graph_id=None, bytes=e.get("bytes"),
                            value=0, memory_kind="device", is_slow=False, attributes={}))
    # another process's CUPTI lines inside the windows: ignored
    for s_, e_ in windows:
        gpu.append({"type": "gpu_kernel", "ts_ns": s_ + 1, "pid": 999, "tid": 1000, "comm": "other",
                    "api": None, "gpu_start_ns": s_ + 1, "gpu_end_ns": s_ + 2, "launch_ts_ns": None,
                    "cupti_api_start_ns": None, "graph_id": None, "kernel": "k"})
    inwin = sorted((g for g in gpu if g["type"] == "gpu_kernel" and g["pid"] == opid
                    and any(s_ <= g["ts_ns"] <= e_ for s_, e_ in windows)), key=lambda g: g["ts_ns"])
    for g in inwin[:a.unjoined]:
        g.update(launch_ts_ns=None, queue_delay_ns=None, api=None)
    for g in [g for g in inwin if g["launch_ts_ns"] is not None][:a.ts_off]:
        g["cupti_api_start_ns"] = g["launch_ts_ns"] + 6000
    # the last window's last joined lines: CUPTI's start 6 us late, or before the uprobe stamp
    late = [g for g in inwin if g["launch_ts_ns"] is not None]
    for g in late[len(late) - a.ts_off_last:] if a.ts_off_last else []:
        g["cupti_api_start_ns"] = g["launch_ts_ns"] + 6000
    driver = [g for g in late if not str(g.get("cupti_api")).startswith("cuda")]
    for g in driver[len(driver) - a.early_last:] if a.early_last else []:
        g["cupti_api_start_ns"] = g["launch_ts_ns"] - 1000
    drop = {id(g) for g in inwin[len(inwin) // 2:len(inwin) // 2 + a.drop_gpu_kernel]}
    gpu = [g for g in gpu if id(g) not in drop]
    if a.warmup_outlier:
        t0 = min(s_ for s_, _ in windows) - 50_000
        evs.append(ev("launch", t0, "cuLaunchKernel", opid, evs[0].get("comm") or "python3",
                      kernel="warmup_k", grid=[1, 1, 1], block=[1, 1, 1], stream="0x0"))
        gpu.append({"type": "gpu_kernel", "ts_ns": t0 + 9000, "pid": opid, "tid": TID,
                    "api": "cuLaunchKernel", "gpu_start_ns": t0 + 9000, "gpu_end_ns": t0 + 9500,
                    "gpu_duration_ns": 500, "launch_ts_ns": t0, "queue_delay_ns": 9000,
                    "cupti_api_start_ns": t0 + 8000, "cupti_api_end_ns": t0 + 8500,
                    "graph_id": None, "kernel": "warmup_k"})
    mine = [g for g in gpu if g["pid"] == opid]
    kern = [g for g in mine if g["type"] == "gpu_kernel"]
    joined = sum(1 for g in kern if g["launch_ts_ns"] is not None)
    state = a.state
    t_first = min(e["ts_ns"] for e in evs)
    comm = next((e.get("comm") for e in evs if e.get("pid") == opid), "python3")
    lines = [{"type": "cupti", "ts_ns": t_first - 1000, "pid": opid, "tid": opid, "comm": comm,
              "state": state, "cupti_result": 0 if state == "active" else 39,
              "message": "activity collection on" if state == "active" else "another subscriber"}]
    block = {"state": state, "kernels": len(kern),
             "memcpys": sum(1 for g in mine if g["type"] == "gpu_memcpy"),
             "memsets": sum(1 for g in mine if g["type"] == "gpu_memset"), "joined": joined,
             "unjoined": len(kern) - joined,
             "gpu_kernel_ns": sum(g.get("gpu_duration_ns") or 0 for g in kern),
             "cupti_dropped": 0, "rate_limited": 0, "buffers": 3}
    if a.top_kernels:
        block["top_kernels"] = [{"kernel": "k7", "count": 30, "gpu_ns": 900}]
    allv = evs + gpu + lines
    t_end = max(e["ts_ns"] for e in allv) + 1000
    psum = {"type": "summary", "scope": "process", "pid": opid, "comm": comm,
            "events": sum(1 for e in allv if e.get("pid") == opid), "dropped": 0,
            "cupti": None if a.no_cupti_block else block}
    total = {"type": "summary", "scope": "total", "pid": None, "ts_ns": t_end,
             "events": len(allv), "dropped": 0, "trace_all": True}
    random.Random(5).shuffle(allv)
    return allv + [psum, total]


def cupti_torch(a):
    w, out = torch_(a)
    pa, pb = w["phaseA"], w["phaseB"]
    # one graph launch in phase B (its two kernels do not count against the launches)
    out.append(ev("launch", pb["start_ns"] + 50, "cuGraphLaunch", PID + a.pid_offset, "python3",
                  kernel=None, function="0xabc", stream="0x0"))
    if a.with_profiler:
        pb["profiler_kernels"] += 2  # the profiler sees the graph's kernels too
    else:
        pb.update(profiler_kernels=None, profiler_memcpy=None, profiler_memset=None,
                  profiler_kernel_names=None,
                  profiler_count_method="none (profiler skipped: TORCH_LOOP_NO_PROFILER)")
        pa["profiler_selfcheck"] = {"skipped": "TORCH_LOOP_NO_PROFILER"}
        w["profiler"] = "skipped"
    w["cuda_injection"] = "/opt/gpu-observer/libgpu_observer_cupti.so"
    out = add_cupti(a, out, w, PID + a.pid_offset,
                    [(pa["start_ns"], pa["end_ns"]), (pb["start_ns"], pb["end_ns"])])
    return w, out


def cupti_ground(a):
    w, out = ground(a)
    names = {k: d for k, d in GT_KERNELS}
    out = add_cupti(a, out, w, PID + a.pid_offset, [(w["window_start_ns"], w["window_end_ns"])],
                    names)
    return w, out


def bench_cupti(a):
    """Per-run files of bench_cupti.sh: NAME.json (train_bench.py) and, for observer runs,
    NAME.obs.json (bench_cupti_report.py extract), in OUTPREFIX.d/."""
    import os
    d = a.prefix + ".d"
    os.makedirs(d, exist_ok=True)
    base_ms = {"base": 5.00, "uprobes": 5.10, "cupti": 5.15, "profiler": 6.40}
    if a.cupti_slow:
        base_ms["cupti"] = 5.60
    order = ["base", "uprobes", "cupti", "profiler"]
    rounds = 3
    for r in range(rounds):
        for i in range(4):
            mode = order[(i + r) % 4]
            name = f"r{r + 1}_{mode}"
            if a.drop_run and name == "r2_profiler":
                continue
            ms = base_ms[mode] * (1.0 + 0.004 * (r - 1))
            steps = [int(ms * 1e6 * (1 + 0.01 * ((j % 7) - 3))) for j in range(200)]
            t0 = 10_000_000_000 * (r * 4 + i + 1)
            js = {"workload": "train_bench", "pid": 5000 + r * 4 + i, "label": mode,
                  "profiler": mode == "profiler", "steps": 200, "warmup": 30,
                  "step_ns": steps, "median_step_ms": sorted(steps)[100] / 1e6,
                  "median_issue_ms": 3.5 * (1.1 if mode != "base" else 1.0),
                  "mean_step_ms": sum(steps) / len(steps) / 1e6,
                  "steps_per_s": 200 / (sum(steps) / 1e9),
                  "window_start_ns": t0, "window_end_ns": t0 + sum(steps),
                  "kernels_per_step": 412.0 if mode == "profiler" else None,
                  "model": {"kind": "transformer", "d_model": 1024, "layers": 4, "batch": 16,
                            "seq": 256, "dtype": "bf16-autocast", "params": 60_000_000},
                  "torch": "2.11.0+cu130", "device": "NVIDIA H100 80GB HBM3",
                  "final_loss": 9.1, "cuda_injection": None}
            with open(os.path.join(d, name + ".json"), "w") as f:
                json.dump(js, f)
            if mode in ("uprobes", "cupti"):
                obs = {"pid": js["pid"], "found_pid": True, "lines": 90000,
                       "total": {"events": 95000, "dropped": 0, "trace_all": mode == "uprobes"},
                       "process": {"events": 94000, "dropped": 0},
                       "launches_in_window": 82400, "gpu_kernels_in_window": 0,
                       "cupti": None, "cupti_lines": []}
                if mode == "cupti":
                    obs["cupti"] = {"state": a.state, "kernels": 95000, "memcpys": 10,
                                    "memsets": 700, "joined": 95000, "unjoined": 0,
                                    "gpu_kernel_ns": 900_000_000, "cupti_dropped": 0,
                                    "rate_limited": 0, "buffers": 40}
                    obs["gpu_kernels_in_window"] = 120
                with open(os.path.join(d, name + ".obs.json"), "w") as f:
                    json.dump(obs, f)
    with open(os.path.join(d, "plan.tsv"), "w") as f:
        for r in range(rounds):
            for i in range(4):
                mode = order[(i + r) % 4]
                f.write(f"{r + 1}\t{mode}\tr{r + 1}_{mode}\n")
    return None, []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["copies", "torch", "bench", "ground", "cupti_torch",
                                     "cupti_ground", "bench_cupti"])
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
    ap.add_argument("--unjoined", type=int, default=0, help="cupti: K gpu_kernel lines unjoined")
    ap.add_argument("--ts-off", type=int, default=0,
                    help="cupti: K joined lines with cupti_api_start_ns 6 us after launch_ts_ns")
    ap.add_argument("--ts-off-last", type=int, default=0,
                    help="cupti: the last K joined lines (phase B) with cupti_api_start_ns 6 us late")
    ap.add_argument("--early-last", type=int, default=0,
                    help="cupti: the last K driver-timed joined lines with CUPTI's start 1 us first")
    ap.add_argument("--drop-gpu-kernel", type=int, default=0, help="cupti: K gpu_kernel lines missing")
    ap.add_argument("--state", default="active", help="cupti: the process's CUPTI state")
    ap.add_argument("--warmup-outlier", action="store_true",
                    help="cupti: a warm-up kernel (outside the windows) 8 us off")
    ap.add_argument("--with-profiler", action="store_true",
                    help="cupti_torch: phase B keeps the profiler's counts")
    ap.add_argument("--no-cupti-block", action="store_true",
                    help="cupti: per-process summary without the cupti block")
    ap.add_argument("--top-kernels", action="store_true", help="cupti: top_kernels in the block")
    ap.add_argument("--cupti-slow", action="store_true", help="bench_cupti: CUPTI mode 12%% slower")
    ap.add_argument("--drop-run", action="store_true", help="bench_cupti: one run missing")
    a = ap.parse_args()
    if a.kind == "bench_cupti":
        bench_cupti(a)
        return
    if a.kind == "cupti_torch":
        w, out = cupti_torch(a)
    elif a.kind == "cupti_ground":
        w, out = cupti_ground(a)
    elif a.kind == "copies":
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
