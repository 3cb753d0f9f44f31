#!/usr/bin/env python3
"""A known GPU allocation and a steady matmul load, for gpu/validate_nvml.sh.

usage: nvml_alloc.py --ready READY.json --result RESULT.json --stop-file F
                     [--device 0] [--alloc-mib 2048] [--expect-uuid GPU-...] [--smi-index N]
                     [--matmul-n 8192] [--max-seconds 120]

Run one per GPU with CUDA_VISIBLE_DEVICES=<the GPU's uuid> (then --device 0 is that GPU).
Steps: import torch; torch.empty(alloc-mib MiB, uint8) on cuda:DEVICE, filled (every page
touched); two NxN bf16 (fp16 without bf16) matrices and an output; warm-up matmuls (cuBLAS
handle and workspace); synchronize.  From then on the process allocates nothing more, so its
GPU memory is stable.  It writes READY.json (atomically):
  {"pid", "device", "smi_index", "expect_uuid", "torch_uuid", "name", "pci_bus_id",
   "cuda_visible_devices", "alloc_bytes", "torch_allocated_bytes", "torch_reserved_bytes",
   "matmul_n", "dtype", "matmul_ms", "ready_ns", "torch_version", "torch_cuda", "python"}
then runs matmul(out=) back to back (a synchronize every ~50 ms) until F exists or
--max-seconds passed, and writes RESULT.json: READY's fields plus "iterations", "end_ns",
"torch_reserved_bytes_end", "stopped_by" ("stop_file" | "max_seconds").
Times are time.monotonic_ns() (CLOCK_MONOTONIC, the observer's clock).

Exit status: 0 done, 1 a CUDA error, 3 PyTorch or CUDA not usable (nothing written).
"""

import argparse
import os
import sys
import time

from results import write_json  # gpu/workloads/results.py, beside this script


def main():
    ap = argparse.ArgumentParser(description="known GPU allocation + matmul load")
    ap.add_argument("--ready", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--device", type=int, default=0, help="torch device index (after CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--smi-index", type=int, default=None, help="nvidia-smi index of the GPU (recorded)")
    ap.add_argument("--expect-uuid", default=None, help="uuid of the GPU (recorded, compared with torch's)")
    ap.add_argument("--alloc-mib", type=int, default=2048)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--max-seconds", type=float, default=120.0)
    a = ap.parse_args()

    try:
        import torch
    except Exception as exc:  # noqa: BLE001  any import failure means "not usable"
        print(f"nvml_alloc: import torch failed: {exc!r}", file=sys.stderr, flush=True)
        return 3
    if not torch.cuda.is_available():
        print("nvml_alloc: torch.cuda.is_available() is false", file=sys.stderr, flush=True)
        return 3

    try:
        dev = torch.device("cuda", a.device)
        torch.cuda.set_device(dev)
        props = torch.cuda.get_device_properties(dev)
        nbytes = a.alloc_mib << 20
        buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        buf.fill_(0xA5)  # touch every page
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        n = a.matmul_n
        x = torch.randn(n, n, device=dev, dtype=dtype)
        y = torch.randn(n, n, device=dev, dtype=dtype)
        out = torch.empty_like(x)
        for _ in range(3):
            torch.matmul(x, y, out=out)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(5):
            torch.matmul(x, y, out=out)
        torch.cuda.synchronize(dev)
        mm_s = (time.perf_counter() - t0) / 5
        batch = max(1, int(0.05 / max(mm_s, 1e-6)))
        if int(buf[nbytes - 1].item()) != 0xA5:
            print("nvml_alloc: allocation check failed", file=sys.stderr, flush=True)
            return 1
    except RuntimeError as exc:
        print(f"nvml_alloc: CUDA error during setup: {exc}", file=sys.stderr, flush=True)
        return 1

    tu = getattr(props, "uuid", None)
    tu = None if tu is None else str(tu)
    if tu and not tu.startswith(("GPU-", "MIG-")):
        tu = "GPU-" + tu
    pci = None
    if all(hasattr(props, k) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        pci = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    info = {
        "pid": os.getpid(), "device": a.device, "smi_index": a.smi_index,
        "expect_uuid": a.expect_uuid, "torch_uuid": tu, "name": props.name, "pci_bus_id": pci,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "alloc_bytes": nbytes, "torch_allocated_bytes": torch.cuda.memory_allocated(dev),
        "torch_reserved_bytes": torch.cuda.memory_reserved(dev), "matmul_n": n,
        "dtype": str(dtype).replace("torch.", ""), "matmul_ms": round(mm_s * 1e3, 3),
        "sync_every": batch, "ready_ns": time.monotonic_ns(), "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda, "python": sys.version.split()[0],
    }
    write_json(a.ready, info)
    print(f"nvml_alloc: ready pid {info['pid']} on {props.name} ({tu}), {a.alloc_mib} MiB allocated, "
          f"torch reserved {info['torch_reserved_bytes'] >> 20} MiB, matmul {mm_s * 1e3:.2f} ms",
          flush=True)

    deadline = time.monotonic() + a.max_seconds
    iters = 0
    stopped = "max_seconds"
    try:
        while True:
            for _ in range(batch):
                torch.matmul(x, y, out=out)
            torch.cuda.synchronize(dev)
            iters += batch
            if os.path.exists(a.stop_file):
                stopped = "stop_file"
                break
            if time.monotonic() >= deadline:
                break
    except RuntimeError as exc:
        print(f"nvml_alloc: CUDA error in the load loop: {exc}", file=sys.stderr, flush=True)
        return 1
    info.update({"iterations": iters, "end_ns": time.monotonic_ns(), "stopped_by": stopped,
                 "torch_reserved_bytes_end": torch.cuda.memory_reserved(dev)})
    write_json(a.result, info)
    print(f"nvml_alloc: done, {iters} matmuls, stopped by {stopped}", flush=True)
    del buf
    return 0


if __name__ == "__main__":
    sys.exit(main())
