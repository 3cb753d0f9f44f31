#!/usr/bin/env python3
"""PyTorch workloads with one known bottleneck each, for gpu/validate_verdicts.sh (issue 13).

usage: bottleneck.py --kind KIND [--seconds 14] [--out OUT.json] [--wait-start FILE]
                     [--wait-timeout-s 180] [--device 0] [kind options, below]

KIND (the verdict it is built for; gpu/gpucheck/compare_verdicts.py holds the same table):
  launch      launch_bound: x.add_(1) on a small int32 tensor in a Python loop, as fast as one
              thread can (~100 % of a core; kernels of ~2 µs, the GPU mostly idle); a
              synchronize every --launch-sync-s (0.1 s) only, so syncs/s stays ~10.
              [--launch-numel 1024] [--launch-sync-s 0.1]
  gemm        gpu_bound: NxN matmuls back to back (matmul(out=)), a synchronize every
              --gemm-sync-every (10) of them.  [--gemm-n 8192] [--gemm-dtype bf16|fp16|fp32]
  transfer    transfer_bound: a --transfer-mib (256) MiB pageable (not pinned) host tensor
              copied to the GPU and back (Tensor.copy_: cudaMemcpyAsync + a stream synchronize
              each; a pageable copy runs inside the call).  [--transfer-dirs both|htod|dtoh]
  sync        sync_bound: per iteration one kernel of --sync-kernel-us (1000) GPU time
              (torch.cuda._sleep, calibrated; a matmul of calibrated size without it), then a
              synchronize (--sync-api device: torch.cuda.synchronize; stream:
              Stream.synchronize; item: .item() of a one-element tensor), then --sync-cpu-us
              (1400) of CPU work.  Designed for ~400 syncs/s, ~40 % of the time blocked, the
              GPU ~40 % busy (sync_bound: >= 100/s, >= 30 %, busy < 50 %).
  cpu         host_bound, host cpu_busy: a producer thread does --cpu-ms (50) of pure-Python
              work per batch ("preprocessing") and queues it; the main thread takes each batch,
              copies it to the GPU (64 KiB), runs a --step-us (2000) kernel and synchronizes.
              The launching thread waits on the queue (its CPU stays low), the process keeps a
              core busy.
  cpu_inline  the same CPU work on the launching thread itself (no producer thread): the
              busiest launching thread is then CPU-saturated while its kernels are short, which
              the rules call launch_bound (launch_bound is tried before host_bound).  Not in the
              default set; informational.
  sleep       host_bound, host waiting: time.sleep(--sleep-ms 20), then a --step-us (2000)
              kernel and a synchronize.
  train       the training loop of train_bench.py (its model and step, imported from it):
              transformer LM, bf16 autocast, AdamW, a synchronize per step; no designed class
              (informational).  [--train-batch 48] [--train-model transformer|mlp]
              [--train-layers 4] [--train-d-model 1024] [--train-seq 256]

Flow: import torch; torch.cuda.is_available() (cuInit: libcuda is mapped from here on, no
context yet; cuInit through ctypes if it was not); print "bottleneck: pid=PID kind=KIND ...";
with --wait-start, print "bottleneck: waiting for FILE" and poll for FILE (observers attached
in --pid / all-process mode before the process creates its context); then set-up (context,
allocations, cuBLAS, calibration, a few warm-up iterations), then the steady loop for
--seconds, a synchronize, and OUT.json (atomically):
  {"workload": "bottleneck", "kind", "pid", "designed", "params", "cuda_start_ns",
   "steady_start_ns", "steady_end_ns", "setup_s", "steady_s", "iterations", "stats",
   "headline", "torch", "torch_cuda", "device", "cuda_injection"}
`stats` holds the workload's own measurements (rates, calibrated kernel time, time blocked in
its synchronizes, GB/s per direction, ...), `headline` one line of them.  Times are
time.monotonic_ns() (CLOCK_MONOTONIC, the observer's clock).

Exit status: 0 done, 1 a CUDA error or a failed self-check, 2 bad arguments, 3 PyTorch or
CUDA not usable, 4 the start file never came.
"""

import argparse
import ctypes
import os
import queue
import sys
import threading
import time

from results import write_json  # gpu/workloads/results.py, beside this script

KINDS = ("launch", "gemm", "transfer", "sync", "cpu", "cpu_inline", "sleep", "train")
DESIGNED = {"launch": "launch_bound", "gemm": "gpu_bound", "transfer": "transfer_bound",
            "sync": "sync_bound", "cpu": "host_bound (cpu_busy)", "cpu_inline": None,
            "sleep": "host_bound (waiting)", "train": None}


def say(msg):
    print(f"bottleneck: {msg}", flush=True)


def die(msg, code=1):
    print(f"bottleneck: ERROR: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def libcuda_mapped():
    """Whether libcuda is mapped (an observer started with --pid attaches to it up front)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--seconds", type=float, default=14.0, help="steady-state duration")
    p.add_argument("--out", default=None, help="result JSON")
    p.add_argument("--wait-start", default=None, help="wait for this file before using the GPU")
    p.add_argument("--wait-timeout-s", type=float, default=180.0)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--launch-numel", type=int, default=1024)
    p.add_argument("--launch-sync-s", type=float, default=0.1)
    p.add_argument("--gemm-n", type=int, default=8192)
    p.add_argument("--gemm-dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--gemm-sync-every", type=int, default=10)
    p.add_argument("--transfer-mib", type=int, default=256)
    p.add_argument("--transfer-dirs", choices=["both", "htod", "dtoh"], default="both")
    p.add_argument("--sync-kernel-us", type=float, default=1000.0)
    p.add_argument("--sync-cpu-us", type=float, default=1400.0)
    p.add_argument("--sync-api", choices=["device", "stream", "item"], default="device")
    p.add_argument("--cpu-ms", type=float, default=50.0)
    p.add_argument("--step-us", type=float, default=2000.0)
    p.add_argument("--sleep-ms", type=float, default=20.0)
    p.add_argument("--train-model", choices=["transformer", "mlp"], default="transformer")
    p.add_argument("--train-batch", type=int, default=48)
    p.add_argument("--train-layers", type=int, default=4)
    p.add_argument("--train-d-model", type=int, default=1024)
    p.add_argument("--train-seq", type=int, default=256)
    p.add_argument("--train-warmup", type=int, default=5)
    a = p.parse_args(argv)
    if a.seconds <= 0:
        die("--seconds must be positive", 2)
    for k in ("launch_numel", "gemm_n", "gemm_sync_every", "transfer_mib", "train_batch",
              "train_layers", "train_d_model", "train_seq"):
        if getattr(a, k) <= 0:
            die(f"--{k.replace('_', '-')} must be positive", 2)
    for k in ("launch_sync_s", "sync_kernel_us", "sync_cpu_us", "cpu_ms", "step_us", "sleep_ms"):
        if getattr(a, k) < 0:
            die(f"--{k.replace('_', '-')} must not be negative", 2)
    return a


def cpu_work(seconds):
    """Pure-Python CPU work (an LCG) for `seconds` of wall time; returns its iterations."""
    end = time.perf_counter() + seconds
    x, n = 1, 0
    while True:
        for _ in range(200):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        n += 200
        if time.perf_counter() >= end:
            return n + (x & 1)


class Steady:
    """The steady part's clock: a runner calls start() after its set-up; it records the start
    (CLOCK_MONOTONIC) and returns the perf_counter deadline --seconds later."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.start_ns = None

    def start(self):
        self.start_ns = time.monotonic_ns()
        return time.perf_counter() + self.seconds


class GpuWork:
    """A kernel of a given GPU time: torch.cuda._sleep (one thread spinning on the SM clock),
    its cycles per µs measured with CUDA events; a square fp32 matmul of calibrated size where
    this torch has no _sleep."""

    def __init__(self, torch, dev):
        self.torch = torch
        self.dev = dev
        self.sleep = getattr(torch.cuda, "_sleep", None)
        self.cycles_per_us = None
        self.mats = {}
        if self.sleep is not None:
            self.sleep(1000)  # module load
            torch.cuda.synchronize()
            for _ in range(2):  # the second one at the clock the first one raised
                ms = self.time_ms(lambda: self.sleep(2_000_000))
                self.cycles_per_us = 2_000_000 / max(ms * 1000.0, 1e-3)

    def time_ms(self, fn):
        t = self.torch
        a, b = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    def prepare(self, us):
        """A callable that enqueues about `us` µs of GPU work, and its measured µs."""
        if us <= 0:
            return (lambda: None), 0.0
        if self.sleep is not None:
            cycles = max(1, int(us * self.cycles_per_us))
            fn = lambda: self.sleep(cycles)  # noqa: E731
        else:
            t = self.torch
            n = 256
            while True:
                x = t.randn(n, n, device=self.dev)
                self.time_ms(lambda: x @ x)
                if self.time_ms(lambda: x @ x) * 1000.0 >= us or n >= 16384:
                    break
                n *= 2
            self.mats[us] = x
            fn = lambda: x @ x  # noqa: E731
        fn()
        measured = min(self.time_ms(fn) for _ in range(3)) * 1000.0
        return fn, measured


def run_launch(torch, dev, a, clk):
    x = torch.zeros(a.launch_numel, dtype=torch.int32, device=dev)
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    x.zero_()
    torch.cuda.synchronize()
    n = syncs = 0
    end_at = clk.start()
    start = clk.start_ns
    next_sync = time.perf_counter() + a.launch_sync_s
    while True:
        for _ in range(256):
            x.add_(1)
        n += 256
        now = time.perf_counter()
        if now >= next_sync:
            torch.cuda.synchronize()
            syncs += 1
            next_sync = now + a.launch_sync_s
        if now >= end_at:
            break
    torch.cuda.synchronize()
    el = (time.monotonic_ns() - start) / 1e9
    got = int(x[0].item())
    if got != n:
        die(f"launch: x[0] = {got}, expected {n}")
    st = {"launches": n, "launches_per_s": n / el, "syncs": syncs, "syncs_per_s": syncs / el,
          "cpu_us_per_launch": el * 1e6 / n}
    return n, st, f"{n / el:,.0f} launches/s ({el * 1e6 / n:.1f} µs each), {syncs / el:.0f} syncs/s"


def run_gemm(torch, dev, a, clk):
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.gemm_dtype]
    n = a.gemm_n
    x = torch.randn(n, n, device=dev, dtype=dt)
    y = torch.randn(n, n, device=dev, dtype=dt)
    out = torch.empty_like(x)
    for _ in range(3):
        torch.matmul(x, y, out=out)
    torch.cuda.synchronize()
    count = syncs = 0
    end_at = clk.start()
    start = clk.start_ns
    while True:
        for _ in range(a.gemm_sync_every):
            torch.matmul(x, y, out=out)
        torch.cuda.synchronize()
        count += a.gemm_sync_every
        syncs += 1
        if time.perf_counter() >= end_at:
            break
    el = (time.monotonic_ns() - start) / 1e9
    tflops = 2.0 * n ** 3 * count / el / 1e12
    if not bool(torch.isfinite(out[0, :8].float()).all()):
        die("gemm: result not finite")
    st = {"matmuls": count, "matmul_ms": el * 1e3 / count, "tflops": tflops,
          "syncs_per_s": syncs / el}
    return count, st, (f"{count} matmuls {n}x{n} {a.gemm_dtype}, {el * 1e3 / count:.2f} ms each, "
                       f"{tflops:.0f} TFLOP/s, {syncs / el:.0f} syncs/s")


def run_transfer(torch, dev, a, clk):
    nbytes = a.transfer_mib << 20
    host = torch.empty(nbytes, dtype=torch.uint8)  # pageable
    host.fill_(7)  # every page touched before the loop
    if host.is_pinned():
        die("transfer: the host tensor is pinned")
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    gpu.copy_(host)
    host.copy_(gpu)
    torch.cuda.synchronize()
    dirs = {"htod": [0, 0.0], "dtoh": [0, 0.0]}  # copies, seconds inside copy_
    do_h = a.transfer_dirs in ("both", "htod")
    do_d = a.transfer_dirs in ("both", "dtoh")
    it = 0
    end_at = clk.start()
    start = clk.start_ns
    while True:
        if do_h:
            t0 = time.perf_counter()
            gpu.copy_(host)
            dirs["htod"][0] += 1
            dirs["htod"][1] += time.perf_counter() - t0
        if do_d:
            t0 = time.perf_counter()
            host.copy_(gpu)
            dirs["dtoh"][0] += 1
            dirs["dtoh"][1] += time.perf_counter() - t0
        it += 1
        if time.perf_counter() >= end_at:
            break
    torch.cuda.synchronize()
    el = (time.monotonic_ns() - start) / 1e9
    if int(host[nbytes - 1].item()) != 7:
        die("transfer: data check failed")
    st = {"bytes_per_copy": nbytes, "wall_s": el}
    parts = []
    for d, (n, s) in dirs.items():
        if n:
            gbs = n * nbytes / s / 1e9 if s > 0 else None
            st[d] = {"copies": n, "seconds_in_copy": s, "gb_per_s": gbs}
            parts.append(f"{d} {n}x {gbs:.1f} GB/s" if gbs else f"{d} {n}x")
    in_copy = sum(s for _, s in dirs.values()) / el
    st["fraction_in_copy"] = in_copy
    return it, st, f"{a.transfer_mib} MiB pageable: {', '.join(parts)}; {in_copy * 100:.0f}% of the time in copy_"


def syncer(torch, api):
    if api == "device":
        return torch.cuda.synchronize
    if api == "stream":
        return torch.cuda.current_stream().synchronize
    one = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
    return lambda: one.item()


def run_sync(torch, dev, a, clk, gw):
    work, kus = gw.prepare(a.sync_kernel_us)
    sync = syncer(torch, a.sync_api)
    cpu_s = a.sync_cpu_us / 1e6
    n = 0
    blocked = 0.0
    end_at = clk.start()
    start = clk.start_ns
    while True:
        work()
        t0 = time.perf_counter()
        sync()
        t1 = time.perf_counter()
        blocked += t1 - t0
        n += 1
        if cpu_s > 0:
            cpu_work(cpu_s)
        if t1 >= end_at:
            break
    el = (time.monotonic_ns() - start) / 1e9
    st = {"iterations": n, "syncs_per_s": n / el, "kernel_us": kus, "blocked_fraction": blocked / el,
          "gpu_busy_estimate": n * kus / 1e6 / el, "iteration_us": el * 1e6 / n, "sync_api": a.sync_api}
    return n, st, (f"{n / el:.0f} syncs/s, kernel {kus:.0f} µs, iteration {el * 1e6 / n:.0f} µs, "
                   f"{blocked / el * 100:.0f}% blocked in syncs, GPU ~{st['gpu_busy_estimate'] * 100:.0f}% busy")


def gpu_step(torch, dev, work, batch):
    """A small training-like step: the batch to the GPU (pageable, 64 KiB), a kernel of known GPU
    time, a synchronize."""
    batch.to(dev)
    work()
    torch.cuda.synchronize()


def run_cpu(torch, dev, a, clk, gw, inline):
    work, kus = gw.prepare(a.step_us)
    cpu_s = a.cpu_ms / 1e3
    n = 0
    prod = {"batches": 0, "cpu_s": 0.0}
    end_at = clk.start()
    start = clk.start_ns
    if inline:
        while True:
            cpu_work(cpu_s)
            gpu_step(torch, dev, work, torch.ones(16384))
            n += 1
            if time.perf_counter() >= end_at:
                break
    else:
        q = queue.Queue(maxsize=2)
        stop = threading.Event()

        def producer():
            while not stop.is_set():
                t0 = time.thread_time()
                cpu_work(cpu_s)
                b = torch.ones(16384)
                prod["cpu_s"] += time.thread_time() - t0
                prod["batches"] += 1
                while not stop.is_set():
                    try:
                        q.put(b, timeout=0.1)
                        break
                    except queue.Full:
                        pass

        th = threading.Thread(target=producer, name="preprocess", daemon=True)
        th.start()
        while True:
            b = q.get()
            gpu_step(torch, dev, work, b)
            n += 1
            if time.perf_counter() >= end_at:
                break
        stop.set()
        th.join(timeout=5)
    el = (time.monotonic_ns() - start) / 1e9
    st = {"steps": n, "steps_per_s": n / el, "kernel_us": kus, "cpu_ms_per_batch": a.cpu_ms,
          "producer_thread": not inline, "gpu_busy_estimate": n * kus / 1e6 / el}
    if not inline:
        st["producer_cpu_fraction"] = prod["cpu_s"] / el
    where = "on the launching thread" if inline else "in a producer thread"
    return n, st, (f"{n / el:.1f} steps/s, {a.cpu_ms:.0f} ms CPU per batch {where}, kernel {kus:.0f} µs, "
                   f"GPU ~{st['gpu_busy_estimate'] * 100:.1f}% busy")


def run_sleep(torch, dev, a, clk, gw):
    work, kus = gw.prepare(a.step_us)
    n = 0
    end_at = clk.start()
    start = clk.start_ns
    while True:
        time.sleep(a.sleep_ms / 1e3)
        work()
        torch.cuda.synchronize()
        n += 1
        if time.perf_counter() >= end_at:
            break
    el = (time.monotonic_ns() - start) / 1e9
    st = {"steps": n, "steps_per_s": n / el, "kernel_us": kus, "sleep_ms": a.sleep_ms,
          "gpu_busy_estimate": n * kus / 1e6 / el}
    return n, st, (f"{n / el:.1f} steps/s, sleep {a.sleep_ms:.0f} ms + kernel {kus:.0f} µs, "
                   f"GPU ~{st['gpu_busy_estimate'] * 100:.1f}% busy")


def run_train(torch, dev, a, clk):
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import train_bench  # the same model and step as gpu/bench_cupti.sh
    cfg = argparse.Namespace(model=a.train_model, d_model=a.train_d_model, layers=a.train_layers,
                             heads=16 if a.train_d_model % 16 == 0 else 1, batch=a.train_batch,
                             seq=a.train_seq, vocab=8192, dtype="bf16")
    step, params = train_bench.build(torch, cfg, dev)
    for _ in range(a.train_warmup):
        step()
    torch.cuda.synchronize()
    n = 0
    times = []
    end_at = clk.start()
    start = clk.start_ns
    while True:
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        n += 1
        if time.perf_counter() >= end_at:
            break
    el = (time.monotonic_ns() - start) / 1e9
    last = float(loss.item())
    if last != last:
        die("train: loss is NaN")
    times.sort()
    med = times[len(times) // 2] * 1e3
    st = {"steps": n, "steps_per_s": n / el, "median_step_ms": med, "params": params,
          "model": vars(cfg), "final_loss": last}
    return n, st, (f"{a.train_model} {params / 1e6:.0f} M params, batch {a.train_batch}: "
                   f"{n / el:.1f} steps/s, median {med:.1f} ms/step")


def main(argv=None):
    a = parse_args(argv)
    try:
        import torch
    except Exception as exc:  # noqa: BLE001  any import failure means "not usable"
        die(f"cannot import torch: {exc!r}", 3)
    if not torch.cuda.is_available():
        die("torch.cuda.is_available() is false", 3)
    if not libcuda_mapped():
        # is_available() may have asked NVML only (PYTORCH_NVML_BASED_CUDA_CHECK): map libcuda
        # and initialize the driver now, so a --pid observer attaches before the start file.
        try:
            ctypes.CDLL("libcuda.so.1").cuInit(0)
        except OSError:
            pass
    pid = os.getpid()
    say(f"pid={pid} kind={a.kind} seconds={a.seconds:g} torch={torch.__version__} "
        f"libcuda={'mapped' if libcuda_mapped() else 'not-mapped'} "
        f"injection={os.environ.get('CUDA_INJECTION64_PATH') or '-'}")
    if a.wait_start:
        say(f"waiting for {a.wait_start}")
        deadline = time.monotonic() + a.wait_timeout_s
        while not os.path.exists(a.wait_start):
            if time.monotonic() >= deadline:
                die(f"start file {a.wait_start} never came", 4)
            time.sleep(0.01)
    cuda_start = time.monotonic_ns()
    try:
        dev = torch.device("cuda", a.device)
        torch.cuda.set_device(dev)
        name = torch.cuda.get_device_name(dev)
        gw = GpuWork(torch, dev) if a.kind in ("sync", "cpu", "cpu_inline", "sleep") else None
        clk = Steady(a.seconds)
        runners = {
            "launch": lambda: run_launch(torch, dev, a, clk),
            "gemm": lambda: run_gemm(torch, dev, a, clk),
            "transfer": lambda: run_transfer(torch, dev, a, clk),
            "sync": lambda: run_sync(torch, dev, a, clk, gw),
            "cpu": lambda: run_cpu(torch, dev, a, clk, gw, inline=False),
            "cpu_inline": lambda: run_cpu(torch, dev, a, clk, gw, inline=True),
            "sleep": lambda: run_sleep(torch, dev, a, clk, gw),
            "train": lambda: run_train(torch, dev, a, clk),
        }
        iters, stats, head = runners[a.kind]()
        torch.cuda.synchronize()
    except RuntimeError as exc:
        die(f"CUDA error: {exc}")
    end = time.monotonic_ns()
    steady_start = clk.start_ns
    res = {"workload": "bottleneck", "kind": a.kind, "pid": pid, "designed": DESIGNED[a.kind],
           "params": {k: v for k, v in vars(a).items() if k not in ("out", "wait_start")},
           "cuda_start_ns": cuda_start, "steady_start_ns": steady_start, "steady_end_ns": end,
           "iterations": iters, "stats": stats, "headline": head,
           "torch": torch.__version__, "torch_cuda": torch.version.cuda, "device": name,
           "cuda_injection": os.environ.get("CUDA_INJECTION64_PATH") or None}
    if steady_start is not None:
        res["setup_s"] = (steady_start - cuda_start) / 1e9
        res["steady_s"] = (end - steady_start) / 1e9
    if a.out:
        write_json(a.out, res)
    say(f"{a.kind}: {head}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
