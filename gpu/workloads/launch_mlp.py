"""Launch-bound PyTorch training step (docs/BENCHMARKS.md "Fleet mode"): 8 x Linear(256) +
ReLU, batch 32, MSE loss, SGD; ~61 launches a step on the H100, the GPU mostly idle.

Prints one JSON line: microseconds per step over the timed steps, the per-100-step chunks'
min/median/max (stalls show in the max), the CPUs the main thread ran on, and the final loss
(the same in every mode: the observer must not change the result)."""
import argparse
import json
import os
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=3000)
ap.add_argument("--warmup", type=int, default=300)
ap.add_argument("--step-times", help="write each step's end (warm-up too; CLOCK_MONOTONIC ns), one per line: "
                "the truth a fleet-mode estimate over any stretch is checked against")
args = ap.parse_args()

torch.manual_seed(0)
layers = []
for _ in range(8):
    layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(32, 256, device="cuda")
y = torch.randn(32, 256, device="cuda")


def step():
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


ends = []
for _ in range(args.warmup):
    step()
    ends.append(time.monotonic_ns())
torch.cuda.synchronize()
chunks, cpus = [], set()
t0 = time.perf_counter()
start_ns = time.monotonic_ns()
for _ in range(max(1, args.steps // 100)):
    a = time.perf_counter()
    for _ in range(100):
        loss = step()
        ends.append(time.monotonic_ns())
    torch.cuda.synchronize()
    chunks.append((time.perf_counter() - a) / 100 * 1e6)
    with open("/proc/self/stat") as f:
        cpus.add(int(f.read().rsplit(")", 1)[1].split()[36]))
steps = len(chunks) * 100
elapsed = time.perf_counter() - t0
chunks.sort()
if args.step_times:
    with open(args.step_times, "w") as f:
        f.write("\n".join(map(str, ends)) + "\n")
print(json.dumps({
    "pid": os.getpid(),
    "us_per_step": round(elapsed / steps * 1e6, 1),
    "steps": steps,
    "warmup": args.warmup,
    "timed_start_ns": start_ns,
    "timed_end_ns": time.monotonic_ns(),
    "chunk_min": round(chunks[0], 1),
    "chunk_med": round(chunks[len(chunks) // 2], 1),
    "chunk_max": round(chunks[-1], 1),
    "cpus": sorted(cpus),
    "loss": float(loss.detach()),
}), flush=True)
