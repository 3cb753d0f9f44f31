#!/usr/bin/env python3
"""PyTorch workload with known CUDA activity inside CLOCK_MONOTONIC windows.

usage: torch_loop.py [--n 500] [--m 20] [--no-profiler] OUT.json

--no-profiler (or TORCH_LOOP_NO_PROFILER=1): never start torch.profiler.  Needed under
`gpu-observer run` (CUPTI injection): a process has one CUPTI subscriber and the injection
library holds it, so the profiler would fail to subscribe.  Then the phase A self-check is
skipped and phase B runs the same steps in the same window without a profiler session; its
profiler_* counts are null ("profiler": "skipped") and compare_cupti.py checks the CUPTI
records against the observer's uprobe launch counts instead.  If CUDA_INJECTION64_PATH names
gpu-observer's injection library the profiler is skipped too (with a note).

Phase A (exact by construction), N iterations of:
    h_src.fill_(i)                            CPU only, pinned buffer
    x.copy_(h_src, non_blocking=True)         1 host->device copy (cudaMemcpyAsync)
    x.add_(1.0)                               1 elementwise kernel
    h_dst.copy_(x, non_blocking=True)         1 device->host copy (cudaMemcpyAsync)
    torch.cuda.current_stream().synchronize() 1 stream synchronize
    check h_dst == i + 1                      CPU only
  Everything is warmed up first; the window is taken with time.monotonic_ns()
  after torch.cuda.synchronize() at both ends.

Self-check (outside every window): 10 more phase A iterations run under
torch.profiler; the JSON records whether the profiler saw exactly 10 kernels,
20 memcpys and 0 memsets ("phaseA.profiler_selfcheck").

Phase B (cross-check against CUPTI via torch.profiler): M iterations of a small
training step (Linear -> ReLU -> Linear, MSE, backward, SGD step) inside a
profiler session (activities CPU + CUDA).  Warm-up: one unprofiled iteration
and one iteration inside a separate, discarded profiler session.  In the
counted session, the window opens after a synchronize *inside* the profiler
context and closes after a synchronize before leaving it, so every GPU
activity the profiler records belongs to an API call made inside the window.

Profiler counting method (recorded in the output as "profiler_count_method"):
  primary:    prof.export_chrome_trace(); count complete ("ph":"X") events by
              Kineto category: "kernel", "gpu_memcpy", "gpu_memset".  These
              categories are Kineto's activity-type names and are stable
              across torch 1.x/2.x.
  cross-check: prof.events() entries whose device_type is DeviceType.CUDA,
              classified by FunctionEvent.activity_type where the torch
              version has it, else by name ("Memcpy*" / "Memset*" / other =
              kernel, GPU user annotations skipped).
  If the trace export fails, the cross-check numbers are used.  Also recorded:
  the CUDA runtime/driver API calls the profiler saw (profiler_api_calls) and
  how many of them were launch calls (profiler_launch_api_calls), and the kernel names
  (profiler_kernel_names: CUPTI's demangled name -> count; phase A's self-check records
  its own in profiler_selfcheck.kernel_names), against which compare.py checks the
  observer's `kernel` of each launch.

Output JSON:
  {"pid", "profiler": "used" | "skipped", "cuda_injection": CUDA_INJECTION64_PATH or null,
   "phaseA": {"start_ns","end_ns","launches","htod","dtoh","stream_syncs"},
   "phaseB": {"start_ns","end_ns","profiler_kernels","profiler_memcpy",
              "profiler_memset","profiler_kernel_names", ...diagnostics}}
  (profiler_* are null when the profiler was skipped.)
"""

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter


def die(msg, code=1):
    print(f"torch_loop: ERROR: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=500, help="phase A iterations")
    p.add_argument("--m", type=int, default=20, help="phase B profiled iterations")
    p.add_argument("--elems", type=int, default=256 * 1024,
                   help="float32 elements per phase A copy (default 1 MiB)")
    p.add_argument("--no-profiler", action="store_true",
                   help="never start torch.profiler (also TORCH_LOOP_NO_PROFILER=1)")
    p.add_argument("out", help="output JSON path")
    a = p.parse_args()
    if a.n <= 0 or a.m <= 0 or a.elems <= 0:
        die("--n, --m and --elems must be positive", 2)
    return a


def profiler_skipped(a):
    """Why torch.profiler must not run (None: it may)."""
    if a.no_profiler:
        return "--no-profiler"
    if os.environ.get("TORCH_LOOP_NO_PROFILER", "") not in ("", "0"):
        return "TORCH_LOOP_NO_PROFILER"
    inj = os.environ.get("CUDA_INJECTION64_PATH", "")
    if "gpu_observer_cupti" in os.path.basename(inj):
        return f"CUDA_INJECTION64_PATH={inj} (CUPTI is held by gpu-observer's injection library)"
    return None


def phase_a(torch, n, elems):
    dev = torch.device("cuda", 0)
    x = torch.zeros(elems, dtype=torch.float32, device=dev)
    h_src = torch.empty(elems, dtype=torch.float32, pin_memory=True)
    h_dst = torch.empty(elems, dtype=torch.float32, pin_memory=True)
    if not (h_src.is_pinned() and h_dst.is_pinned()):
        die("pinned host memory not available")
    stream = torch.cuda.current_stream()

    def one(i):
        h_src.fill_(float(i))
        x.copy_(h_src, non_blocking=True)
        x.add_(1.0)
        h_dst.copy_(x, non_blocking=True)
        stream.synchronize()
        want = float(i + 1)
        # CPU-side checks only (no CUDA calls).
        if h_dst[0].item() != want or h_dst[-1].item() != want or not bool((h_dst == want).all()):
            die(f"phase A mismatch at iteration {i}: got {h_dst[0].item()} want {want}")

    # Warm-up: kernel module load, caching allocators, pinned-memory events.
    for i in range(5):
        one(1000 + i)
    torch.cuda.synchronize()

    start = time.monotonic_ns()
    for i in range(n):
        one(i)
    torch.cuda.synchronize()
    end = time.monotonic_ns()
    res = {"start_ns": start, "end_ns": end, "launches": n, "htod": n, "dtoh": n,
           "stream_syncs": n, "bytes_per_copy": elems * 4,
           "htod_bytes": n * elems * 4, "dtoh_bytes": n * elems * 4}
    return res, one


def phase_a_selfcheck(torch, one, tmpdir, k=10):
    """After the phase A window: run k more phase A iterations under the
    profiler to confirm "1 kernel + 2 memcpy per iteration" holds on this
    torch build (so a mismatch in the report cannot come from this script)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore", message=".*[Pp]rofiler clears events.*")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        for i in range(k):
            one(2000 + i)
        torch.cuda.synchronize()
    path = os.path.join(tmpdir, "phaseA_check.json")
    prof.export_chrome_trace(path)
    cats, api, names = count_from_trace(path)
    got = {"iterations": k, "kernels": cats.get("kernel", 0), "memcpy": cats.get("gpu_memcpy", 0),
           "memset": cats.get("gpu_memset", 0), "api_calls": dict(api.most_common(12)),
           "kernel_names": dict(names)}
    got["consistent"] = (got["kernels"], got["memcpy"], got["memset"]) == (k, 2 * k, 0)
    if not got["consistent"]:
        print(f"torch_loop: WARN: phase A self-check under the profiler: {got} "
              f"(expected {k} kernels, {2 * k} memcpy, 0 memset)", file=sys.stderr, flush=True)
    return got


def count_from_trace(path):
    """Complete events by Kineto category, the CUDA API calls by name, and the kernel
    names (CUPTI's demangled names, a multiset) of the "kernel" category."""
    with open(path, "r", encoding="utf-8") as f:
        trace = json.load(f)
    evs = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    cats = Counter()
    api = Counter()
    names = Counter()
    for e in evs:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = str(e.get("cat", "")).lower()
        cats[cat] += 1
        if cat in ("cuda_runtime", "cuda_driver"):
            api[str(e.get("name", "?"))] += 1
        elif cat == "kernel":
            names[str(e.get("name", "?"))] += 1
    return cats, api, names


def count_from_events(prof):
    """Cross-check: classify prof.events() entries on the CUDA device.  Uses
    FunctionEvent.activity_type (Kineto category, newer torch) when present,
    otherwise the name, skipping GPU user annotations (which also live on the
    CUDA device, e.g. "Optimizer.step#SGD.step")."""
    try:
        from torch.autograd import DeviceType
    except ImportError:  # layout differs in some versions
        from torch._C._autograd import DeviceType  # type: ignore
    k = c = s = 0
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        act = getattr(e, "activity_type", None)
        if isinstance(act, str) and act:
            act = act.lower()
            if act == "kernel":
                k += 1
            elif act == "gpu_memcpy":
                c += 1
            elif act == "gpu_memset":
                s += 1
            continue
        if getattr(e, "is_user_annotation", False):
            continue
        low = str(getattr(e, "name", getattr(e, "key", ""))).lower()
        if low.startswith("memcpy"):
            c += 1
        elif low.startswith("memset"):
            s += 1
        else:
            k += 1
    return {"kernels": k, "memcpy": c, "memset": s}


def phase_b(torch, m, tmpdir, skip=None):
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    xb = torch.randn(128, 256, device=dev)
    yb = torch.randn(128, 64, device=dev)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
        return loss

    # Warm-up 1: unprofiled.
    step()
    torch.cuda.synchronize()
    if skip:
        return phase_b_unprofiled(torch, m, step, losses, skip)

    import warnings

    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore", message=".*[Pp]rofiler clears events.*")
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    # Warm-up 2: inside a separate profiler session (CUPTI/Kineto init).
    with profile(activities=acts):
        step()
        torch.cuda.synchronize()
    torch.cuda.synchronize()

    with profile(activities=acts) as prof:
        torch.cuda.synchronize()
        start = time.monotonic_ns()
        for _ in range(m):
            losses.append(step())
        torch.cuda.synchronize()
        end = time.monotonic_ns()

    # .item() only after the window closed and profiling stopped.
    last = float(losses[-1].item())
    if last != last or last in (float("inf"), float("-inf")):
        die(f"phase B loss is not finite: {last}")

    res = {"start_ns": start, "end_ns": end, "iterations": m, "final_loss": last}
    cross = None
    try:
        cross = count_from_events(prof)
        res["profiler_events_crosscheck"] = cross
    except Exception as exc:  # keep going, trace is primary
        res["profiler_events_crosscheck_error"] = repr(exc)

    trace_path = os.path.join(tmpdir, "phaseB_trace.json")
    try:
        prof.export_chrome_trace(trace_path)
        cats, api, names = count_from_trace(trace_path)
        res["profiler_kernels"] = cats.get("kernel", 0)
        # The multiset of kernel names, for the observer's name coverage (compare.py).
        res["profiler_kernel_names"] = dict(names)
        res["profiler_memcpy"] = cats.get("gpu_memcpy", 0)
        res["profiler_memset"] = cats.get("gpu_memset", 0)
        res["profiler_count_method"] = "chrome_trace_categories(kernel,gpu_memcpy,gpu_memset)"
        res["profiler_categories"] = dict(cats)
        res["profiler_api_calls"] = dict(api.most_common(40))
        res["profiler_launch_api_calls"] = sum(
            n for name, n in api.items()
            if "LaunchKernel" in name or "GraphLaunch" in name or "LaunchCooperative" in name)
    except Exception as exc:
        res["profiler_trace_error"] = repr(exc)
        if cross is None:
            die(f"could not count profiler events: {exc!r}")
        res["profiler_kernels"] = cross["kernels"]
        res["profiler_memcpy"] = cross["memcpy"]
        res["profiler_memset"] = cross["memset"]
        res["profiler_count_method"] = "prof.events() device_type==CUDA by name"
    if cross is not None and (cross["kernels"], cross["memcpy"], cross["memset"]) != (
            res["profiler_kernels"], res["profiler_memcpy"], res["profiler_memset"]):
        print(f"torch_loop: WARN: profiler cross-check differs: trace="
              f"{(res['profiler_kernels'], res['profiler_memcpy'], res['profiler_memset'])} "
              f"events()={(cross['kernels'], cross['memcpy'], cross['memset'])}",
              file=sys.stderr, flush=True)
    if res["profiler_kernels"] <= 0:
        die("profiler recorded no CUDA kernels (CUPTI unavailable?)")
    return res


def phase_b_unprofiled(torch, m, step, losses, why):
    """Phase B without torch.profiler: the same warm-up count (a second step stands in for
    the discarded profiler session) and the same window around M steps."""
    step()
    torch.cuda.synchronize()
    torch.cuda.synchronize()
    start = time.monotonic_ns()
    for _ in range(m):
        losses.append(step())
    torch.cuda.synchronize()
    end = time.monotonic_ns()
    last = float(losses[-1].item())
    if last != last or last in (float("inf"), float("-inf")):
        die(f"phase B loss is not finite: {last}")
    return {"start_ns": start, "end_ns": end, "iterations": m, "final_loss": last,
            "profiler_kernels": None, "profiler_memcpy": None, "profiler_memset": None,
            "profiler_kernel_names": None,
            "profiler_count_method": f"none (profiler skipped: {why})"}


def main():
    a = parse_args()
    try:
        import torch
    except ImportError as exc:
        die(f"cannot import torch: {exc}")
    if not torch.cuda.is_available():
        die("torch.cuda.is_available() is False")
    torch.cuda.init()
    print(f"torch_loop: pid={os.getpid()} torch={torch.__version__} cuda={torch.version.cuda} "
          f"device={torch.cuda.get_device_name(0)}", flush=True)

    skip = profiler_skipped(a)
    if skip:
        print(f"torch_loop: torch.profiler not used ({skip})", flush=True)
    pa, one = phase_a(torch, a.n, a.elems)
    with tempfile.TemporaryDirectory(prefix="torch_loop_") as td:
        if skip:
            pa["profiler_selfcheck"] = {"skipped": skip}
        else:
            try:
                pa["profiler_selfcheck"] = phase_a_selfcheck(torch, one, td)
            except Exception as exc:  # informational only
                pa["profiler_selfcheck"] = {"error": repr(exc)}
        pb = phase_b(torch, a.m, td, skip)

    out = {"workload": "torch_loop", "pid": os.getpid(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "profiler": "skipped" if skip else "used",
           "profiler_skipped_because": skip,
           "cuda_injection": os.environ.get("CUDA_INJECTION64_PATH") or None,
           "phaseA": pa, "phaseB": pb}
    tmp = a.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    os.replace(tmp, a.out)
    print(f"torch_loop: ok phaseA n={a.n} window_ms={(pa['end_ns'] - pa['start_ns']) / 1e6:.1f}; "
          f"phaseB m={a.m} window_ms={(pb['end_ns'] - pb['start_ns']) / 1e6:.1f} "
          f"kernels={pb['profiler_kernels']} memcpy={pb['profiler_memcpy']} "
          f"memset={pb['profiler_memset']} ({pb['profiler_count_method']})", flush=True)


if __name__ == "__main__":
    main()
