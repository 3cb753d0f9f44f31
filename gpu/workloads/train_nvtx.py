#!/usr/bin/env python3
"""A PyTorch training loop annotated with NVTX, for the timeline check (gpu/validate_timeline.sh).

Each step:  push "model_inference" > push "gpu.forward_pass" > the forward pass (matmul, relu,
matmul) > pop; push "gpu.backward_pass" > loss, backward > pop; push "optimizer" > SGD step >
pop; pop.  Once per run a process-wide range is started on the main thread and ended on a
helper thread (nvtxRangeStart/End), and one step runs under torch.autograd.profiler.emit_nvtx()
(a range per PyTorch op).  It writes what it did as JSON:

usage: train_nvtx.py [--steps 40] OUT.json
"""

import argparse
import json
import os
import threading
import time

import torch
import torch.cuda.nvtx as nvtx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024, device=dev)
    y = torch.randn(256, 1024, device=dev)

    def step():
        nvtx.range_push("model_inference")
        nvtx.range_push("gpu.forward_pass")
        out = model(x)
        nvtx.range_pop()
        nvtx.range_push("gpu.backward_pass")
        loss = torch.nn.functional.mse_loss(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nvtx.range_pop()
        nvtx.range_push("optimizer")
        opt.step()
        nvtx.range_pop()
        nvtx.range_pop()

    step()  # warm-up (cuBLAS handles, allocator)
    torch.cuda.synchronize()
    t0 = time.monotonic_ns()
    epoch = nvtx.range_start("epoch")
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    t1 = time.monotonic_ns()
    ended = threading.Thread(target=nvtx.range_end, args=(epoch,))
    ended.start()
    ended.join()
    with torch.autograd.profiler.emit_nvtx():
        step()
    torch.cuda.synchronize()
    with open(args.out, "w") as f:
        json.dump({"pid": os.getpid(), "steps": args.steps, "loop_ns": t1 - t0,
                   "step_ms": (t1 - t0) / args.steps / 1e6, "torch": torch.__version__}, f)


if __name__ == "__main__":
    main()
