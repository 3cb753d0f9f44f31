#!/usr/bin/env python3
"""CuPy loops for the anomaly detector (issue 14): steady ones, and ones with planted outliers.

usage: anomaly_loops.py --kind KIND [--iterations N] [--plant-every K] [--out OUT.json]

KIND:
  cupy   a steady CuPy loop: per iteration an elementwise a*b+c, a sum, a 1024x1024 fp32
         matmul and a .get() of the sum (a device-to-host copy that waits for the GPU).
  spin   one RawKernel that spins --spin-us (20) µs on the SM clock (calibrated with CUDA
         events), a Stream.synchronize after each launch.  With --plant-every K, every Kth
         launch spins --plant-factor (10) times longer.
  copy   a --copy-mib (4) MiB host-to-device copy from pinned memory (cudaMemcpyAsync on a
         stream, then Stream.synchronize), and back every --dtoh-every (4)th iteration.  With
         --plant-every K, every Kth host-to-device copy is from pageable memory instead (the
         same size: a slower path through a staging buffer).

The loop runs --warmup (200) iterations first (not recorded), then --iterations (20000).
OUT.json (atomically): {"workload": "anomaly_loops", "kind", "pid", "params", "iterations",
"steady_start_ns", "steady_end_ns", "planted": [{"index", "start_ns", "end_ns"}], "stats"}.
A planted launch's or copy's [start_ns, end_ns] spans its call and the synchronize after it
(time.monotonic_ns(), the observer's clock): the kernel ran, or the copy was made, inside it.

Exit status: 0 done, 1 a CUDA error or a failed self-check, 2 bad arguments, 3 CuPy not usable.
"""

import argparse
import os
import sys
import time

from results import write_json  # gpu/workloads/results.py, beside this script

SPIN_SRC = r"""
extern "C" __global__ void anomaly_spin(long long cycles, unsigned long long* out) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    if (threadIdx.x == 0) atomicAdd(out, 1ULL);
}
"""


def say(msg):
    print(f"anomaly_loops: {msg}", flush=True)


def die(msg, code=1):
    print(f"anomaly_loops: ERROR: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", required=True, choices=("cupy", "spin", "copy"))
    p.add_argument("--iterations", type=int, default=20000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--plant-every", type=int, default=0)
    p.add_argument("--plant-factor", type=float, default=10.0)
    p.add_argument("--spin-us", type=float, default=20.0)
    p.add_argument("--copy-mib", type=int, default=4)
    p.add_argument("--dtoh-every", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.iterations <= 0 or a.warmup < 0 or a.plant_every < 0 or a.copy_mib <= 0:
        die("--iterations and --copy-mib must be positive, --warmup and --plant-every not negative", 2)
    if a.spin_us <= 0 or a.plant_factor <= 1 or a.dtoh_every <= 0:
        die("--spin-us and --dtoh-every must be positive, --plant-factor over 1", 2)
    return a


def planted(a, i):
    return a.plant_every > 0 and i % a.plant_every == a.plant_every - 1


def run_cupy(cp, a):
    x = cp.random.random((1 << 20,), dtype=cp.float32)
    y = cp.random.random((1 << 20,), dtype=cp.float32)
    m = cp.random.random((1024, 1024), dtype=cp.float32)
    total = 0.0

    def one():
        z = x * y + 1.0
        s = z.sum()
        p = m @ m
        return float(s.get()) + float(p[0, 0].get())

    for _ in range(a.warmup):
        one()
    start = time.monotonic_ns()
    for _ in range(a.iterations):
        total += one()
    end = time.monotonic_ns()
    if total != total:
        die("cupy: the sum is NaN")
    return start, end, [], {"per_iteration_us": (end - start) / a.iterations / 1e3}


def run_spin(cp, a):
    import numpy as np
    kernel = cp.RawKernel(SPIN_SRC, "anomaly_spin")
    out = cp.zeros(1, dtype=cp.uint64)
    stream = cp.cuda.Stream(non_blocking=True)

    def launch(cycles):
        with stream:
            kernel((1,), (32,), (np.int64(cycles), out))

    # Cycles per µs at the clock the GPU runs the loop at (the second measurement, warm).
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    per_us = None
    for _ in range(3):
        ev0.record(stream)
        launch(2_000_000)
        ev1.record(stream)
        ev1.synchronize()
        per_us = 2_000_000 / max(cp.cuda.get_elapsed_time(ev0, ev1) * 1000.0, 1e-3)
    base = max(1, int(a.spin_us * per_us))
    big = max(base + 1, int(base * a.plant_factor))
    for _ in range(a.warmup):
        launch(base)
        stream.synchronize()
    plants = []
    start = time.monotonic_ns()
    for i in range(a.iterations):
        p = planted(a, i)
        t0 = time.monotonic_ns() if p else 0
        launch(big if p else base)
        stream.synchronize()
        if p:
            plants.append({"index": i, "start_ns": t0, "end_ns": time.monotonic_ns()})
    end = time.monotonic_ns()
    done = int(out.get()[0])
    if done != a.warmup + a.iterations + 3:
        die(f"spin: {done} kernels ran, expected {a.warmup + a.iterations + 3}")
    return start, end, plants, {"cycles_per_us": per_us, "cycles": base, "planted_cycles": big}


def run_copy(cp, a):
    import numpy as np
    n = a.copy_mib << 20
    pinned_mem = cp.cuda.alloc_pinned_memory(n)
    pinned = np.frombuffer(pinned_mem, dtype=np.uint8, count=n)
    pinned[:] = 3
    pageable = np.full(n, 3, dtype=np.uint8)  # every page touched before the loop
    back_mem = cp.cuda.alloc_pinned_memory(n)
    back = np.frombuffer(back_mem, dtype=np.uint8, count=n)
    dev = cp.empty(n, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime

    def htod(src):
        rt.memcpyAsync(dev.data.ptr, src.ctypes.data, n, rt.memcpyHostToDevice, stream.ptr)
        stream.synchronize()

    def dtoh():
        rt.memcpyAsync(back.ctypes.data, dev.data.ptr, n, rt.memcpyDeviceToHost, stream.ptr)
        stream.synchronize()

    for i in range(a.warmup):
        htod(pinned)
        if i % a.dtoh_every == 0:
            dtoh()
    plants = []
    start = time.monotonic_ns()
    for i in range(a.iterations):
        p = planted(a, i)
        t0 = time.monotonic_ns()
        htod(pageable if p else pinned)
        if p:
            plants.append({"index": i, "start_ns": t0, "end_ns": time.monotonic_ns()})
        if i % a.dtoh_every == 0:
            dtoh()
    end = time.monotonic_ns()
    if int(back[n - 1]) != 3:
        die("copy: data check failed")
    return start, end, plants, {"bytes_per_copy": n}


def main(argv=None):
    a = parse_args(argv)
    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001  any import or driver failure means "not usable"
        die(f"cupy not usable: {exc!r}", 3)
    say(f"pid={os.getpid()} kind={a.kind} iterations={a.iterations} plant_every={a.plant_every}")
    runners = {"cupy": run_cupy, "spin": run_spin, "copy": run_copy}
    try:
        start, end, plants, stats = runners[a.kind](cp, a)
        cp.cuda.Device().synchronize()
    except cp.cuda.runtime.CUDARuntimeError as exc:
        die(f"CUDA error: {exc}")
    res = {"workload": "anomaly_loops", "kind": a.kind, "pid": os.getpid(),
           "params": {k: v for k, v in vars(a).items() if k != "out"},
           "iterations": a.iterations, "steady_start_ns": start, "steady_end_ns": end,
           "planted": plants, "stats": stats}
    if a.out:
        write_json(a.out, res)
    say(f"{a.kind}: {a.iterations} iterations in {(end - start) / 1e9:.2f} s, {len(plants)} planted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
