#!/usr/bin/env python3
"""A deterministic PyTorch training job for the late-attach validation (gpu/validate_late_attach.sh,
issue 17): an observer injects its CUPTI library into it while it runs, times its GPU work for a
while and withdraws. The job knows nothing about that; it only records its own steps.

An MLP (--width 1024 -> --hidden 4096 -> 4096 -> 1024, ReLU) learns a fixed random teacher
(y = tanh(x W)) with AdamW, MSE, fp32 (no TF32), batch --batch 1024, on --batches synthetic batches
made once on the GPU from a seeded generator and cycled; torch.use_deterministic_algorithms, cuDNN
deterministic, fixed seeds: the same --steps give the same final loss and parameters bit for bit.
Each step ends with torch.cuda.synchronize() (a few ms a step on an H100).

Options and output: see late_common.py (--steps N or $LATE_STEPS, default 7500, ~35 s on an H100;
--out FILE, --ready FILE). Exits 3 (SKIP) if torch or CUDA is not usable.

usage: late_torch.py [--steps N | --seconds S] --out RESULTS.jsonl [--ready READY.json]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
import late_common  # noqa: E402

NAME = "late_torch"
DEFAULT_STEPS = 7500


def extra(ap):
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)


def main():
    a = late_common.parse_args(NAME, DEFAULT_STEPS, extra)
    # cuBLAS is deterministic with a fixed workspace configuration (set before CUDA starts).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot run here"
        late_common.skip(NAME, a.out, f"import torch failed: {exc}")
    if not torch.cuda.is_available():
        late_common.skip(NAME, a.out, "torch.cuda.is_available() is false")
    torch.manual_seed(a.seed)
    torch.cuda.manual_seed_all(a.seed)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda")

    g = torch.Generator(device=dev)
    g.manual_seed(a.seed + 1)
    xs = torch.randn(a.batches, a.batch, a.width, generator=g, device=dev)
    teacher = torch.randn(a.width, a.width, generator=g, device=dev) / a.width ** 0.5
    ys = torch.tanh(xs @ teacher)
    model = torch.nn.Sequential(
        torch.nn.Linear(a.width, a.hidden), torch.nn.ReLU(),
        torch.nn.Linear(a.hidden, a.hidden), torch.nn.ReLU(),
        torch.nn.Linear(a.hidden, a.width)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    log = late_common.StepLog(NAME, a)

    loss = None
    i = 0
    while log.more(i):
        t0 = time.monotonic_ns()
        x, y = xs[i % a.batches], ys[i % a.batches]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        log.step(i, t0, time.monotonic_ns())
        i += 1
    with torch.no_grad():
        checksum = sum(p.detach().cpu().double().sum().item() for p in model.parameters())
    log.final(loss.item(), checksum, torch=torch.__version__, device=torch.cuda.get_device_name(0),
              batch=a.batch, width=a.width, hidden=a.hidden, seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
