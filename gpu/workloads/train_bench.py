#!/usr/bin/env python3
"""A realistic PyTorch training loop, timed per step, for gpu/bench_cupti.sh.

usage: train_bench.py --out OUT.json [--label NAME] [--steps 200] [--warmup 30]
                      [--model transformer|mlp] [--d-model 1024] [--layers 4] [--heads 16]
                      [--batch 48] [--seq 256] [--vocab 8192] [--dtype bf16|fp32]
                      [--profiler] [--profiler-activities cpu,cuda]

Model (default): a small decoder-style language model: token embedding, `--layers`
pre-norm nn.TransformerEncoderLayer blocks (d_model 1024, 16 heads, FFN 4096, GELU,
dropout 0.1, scaled-dot-product attention), a vocabulary head, cross-entropy on random
tokens; bf16 autocast for forward and loss, fp32 master weights, AdamW (PyTorch's default
foreach implementation); batch 48 x 256 tokens, 67 M parameters, ~364 kernels per step.
On an H100 (PyTorch 2.11) a step takes ~21 ms of which ~14 ms is CPU issue time: GPU-bound,
as a training job sized for its GPU is.  `--batch 16` gives a launch-bound loop (~13 ms,
issue ~90 % of the step), where every per-launch cost shows in full.  `--model mlp`: `--layers` Linear-GELU-Linear residual blocks on
batch*seq tokens, MSE loss.  One step = zero_grad, forward, loss, backward, optimizer step,
then torch.cuda.synchronize(), so each step's time is its full GPU time plus whatever CPU
time is not hidden behind the GPU (launch overhead included).

Timing: `--warmup` untimed steps (allocator growth, cuBLAS/cuDNN heuristics, lazy module
loading), a synchronize, then `--steps` steps, each timed with time.monotonic_ns() around
step + synchronize.  The window (window_start_ns..window_end_ns) spans the timed steps.
Each step's CPU issue time (until the step's last call returned, before the synchronize) is
recorded too: when it is close to the step time the loop is launch-bound (CPU-bound), and any
per-launch cost an observer adds shows in full; when it is well below, the GPU is the limit
and such costs hide behind it.

--profiler: warm-up and timed steps run inside torch.profiler.profile(activities=[CPU,
CUDA]) (profiling every step, as a user looking at kernels would; --profiler-activities cuda
leaves the CPU ops out); after the window the profiler's CUDA kernels are counted
(kernels_per_step, over warm-up + timed steps; the profiler's post-processing, ~40 s for the
default run on an H100, is outside the timing and reported as profiler_post_s).  Without
it the script never touches torch.profiler (one CUPTI subscriber per process: under
`gpu-observer run` the injection library holds it).

Output JSON: {"workload": "train_bench", "pid", "label", "profiler", "steps", "warmup",
  "step_ns": [...], "median_step_ms", "mean_step_ms", "p90_step_ms", "min_step_ms",
  "median_issue_ms", "issue_fraction" (median issue / median step), "steps_per_s",
  "window_start_ns", "window_end_ns", "kernels_per_step" (profiler only),
  "model": {...}, "torch", "torch_cuda", "device", "final_loss", "cuda_injection"}
Exit: 0 ok, 1 error, 2 bad arguments, 3 no usable CUDA.
"""

import argparse
import json
import os
import statistics
import sys
import time


def die(msg, code=1):
    print(f"train_bench: ERROR: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output JSON path")
    p.add_argument("--label", default="run", help="name recorded in the JSON")
    p.add_argument("--steps", type=int, default=200, help="timed steps")
    p.add_argument("--warmup", type=int, default=30, help="untimed steps first")
    p.add_argument("--model", choices=["transformer", "mlp"], default="transformer")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: autocast to bfloat16 for forward and loss (fp32 weights)")
    p.add_argument("--profiler", action="store_true",
                   help="run warm-up and timed steps under torch.profiler (CPU + CUDA)")
    p.add_argument("--profiler-activities", default="cpu,cuda",
                   help="with --profiler: cpu,cuda (default) or cuda")
    a = p.parse_args()
    acts = {x.strip().lower() for x in a.profiler_activities.split(",") if x.strip()}
    if not acts or not acts <= {"cpu", "cuda"} or "cuda" not in acts:
        die("--profiler-activities: cpu,cuda or cuda", 2)
    a.profiler_acts = sorted(acts)
    for k in ("steps", "d_model", "layers", "heads", "batch", "seq", "vocab"):
        if getattr(a, k) <= 0:
            die(f"--{k.replace('_', '-')} must be positive", 2)
    if a.warmup < 1:
        die("--warmup must be at least 1", 2)
    if a.d_model % a.heads:
        die("--d-model must be a multiple of --heads", 2)
    return a


def build(torch, a, dev):
    nn = torch.nn
    torch.manual_seed(0)
    if a.model == "transformer":
        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(a.vocab, a.d_model)
                layer = nn.TransformerEncoderLayer(
                    a.d_model, a.heads, 4 * a.d_model, dropout=0.1, activation="gelu",
                    batch_first=True, norm_first=True)
                self.enc = nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False)
                self.norm = nn.LayerNorm(a.d_model)
                self.head = nn.Linear(a.d_model, a.vocab)

            def forward(self, tok):
                return self.head(self.norm(self.enc(self.emb(tok), is_causal=False)))

        model = LM().to(dev)
        x = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
        y = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)

        def loss_fn(out):
            return torch.nn.functional.cross_entropy(out.reshape(-1, a.vocab).float(),
                                                     y.reshape(-1))
    else:
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.LayerNorm(a.d_model)
                self.up = nn.Linear(a.d_model, 4 * a.d_model)
                self.down = nn.Linear(4 * a.d_model, a.d_model)

            def forward(self, h):
                return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))

        model = nn.Sequential(*[Block() for _ in range(a.layers)]).to(dev)
        x = torch.randn(a.batch * a.seq, a.d_model, device=dev)
        y = torch.randn(a.batch * a.seq, a.d_model, device=dev)

        def loss_fn(out):
            return torch.nn.functional.mse_loss(out.float(), y)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    use_amp = a.dtype == "bf16"

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            loss = loss_fn(model(x))
        loss.backward()
        opt.step()
        return loss

    params = sum(p.numel() for p in model.parameters())
    return step, params


def count_cuda_kernels(prof):
    """CUDA kernels among the profiler's events (Kineto activity type where the torch build
    has it; otherwise by name: memcpy/memset and GPU user annotations left out)."""
    try:
        from torch.autograd import DeviceType
    except ImportError:
        from torch._C._autograd import DeviceType  # type: ignore
    n = 0
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        act = getattr(e, "activity_type", None)
        if isinstance(act, str) and act:
            n += act.lower() == "kernel"
            continue
        if getattr(e, "is_user_annotation", False):
            continue
        low = str(getattr(e, "name", "")).lower()
        if not (low.startswith("memcpy") or low.startswith("memset")):
            n += 1
    return n


def main():
    a = parse_args()
    try:
        import torch
    except ImportError as exc:
        die(f"cannot import torch: {exc}", 3)
    if not torch.cuda.is_available():
        die("torch.cuda.is_available() is False", 3)
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    print(f"train_bench: pid={os.getpid()} label={a.label} torch={torch.__version__} "
          f"device={torch.cuda.get_device_name(0)} model={a.model} profiler={a.profiler}",
          flush=True)
    step, params = build(torch, a, dev)

    prof = None
    ctx = None
    if a.profiler:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if "cpu" in a.profiler_acts else [])
        ctx = profile(activities=acts)
        prof = ctx.__enter__()
    try:
        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        times = []
        issue = []
        losses = []
        start = time.monotonic_ns()
        for _ in range(a.steps):
            t0 = time.monotonic_ns()
            losses.append(step())
            t1 = time.monotonic_ns()
            torch.cuda.synchronize()
            t2 = time.monotonic_ns()
            times.append(t2 - t0)
            issue.append(t1 - t0)
        end = time.monotonic_ns()
    finally:
        if ctx is not None:
            t_post = time.monotonic()
            ctx.__exit__(None, None, None)
    res = {"workload": "train_bench", "pid": os.getpid(), "label": a.label,
           "profiler": bool(a.profiler), "steps": a.steps, "warmup": a.warmup,
           "step_ns": times}
    if a.profiler:
        res["profiler_activities"] = a.profiler_acts
    kernels = None
    if prof is not None:
        try:
            kernels = count_cuda_kernels(prof)
            res["profiler_kernels"] = kernels
        except Exception as exc:  # the timing is what matters
            res["profiler_count_error"] = repr(exc)
        res["profiler_post_s"] = round(time.monotonic() - t_post, 2)
    last = float(losses[-1].item())
    if last != last or last in (float("inf"), float("-inf")):
        die(f"loss is not finite: {last}")
    ms = [t / 1e6 for t in times]
    srt = sorted(ms)
    res.update({
        "median_step_ms": statistics.median(ms), "mean_step_ms": statistics.fmean(ms),
        "p90_step_ms": srt[min(len(srt) - 1, int(0.9 * len(srt)))], "min_step_ms": srt[0],
        "median_issue_ms": statistics.median(issue) / 1e6,
        "issue_fraction": statistics.median(issue) / statistics.median(times),
        "steps_per_s": a.steps / ((end - start) / 1e9),
        "window_start_ns": start, "window_end_ns": end,
        "kernels_per_step": (kernels / (a.steps + a.warmup)) if kernels else None,
        "model": {"kind": a.model, "d_model": a.d_model, "layers": a.layers, "heads": a.heads,
                  "batch": a.batch, "seq": a.seq, "vocab": a.vocab,
                  "dtype": "bf16-autocast" if a.dtype == "bf16" else "fp32", "params": params,
                  "optimizer": "AdamW"},
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0), "final_loss": last,
        "cuda_injection": os.environ.get("CUDA_INJECTION64_PATH") or None})
    tmp = a.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(res, f)
        f.write("\n")
    os.replace(tmp, a.out)
    kps = f" kernels/step~{res['kernels_per_step']:.1f}" if res["kernels_per_step"] else ""
    print(f"train_bench: {a.label}: median {res['median_step_ms']:.3f} ms/step (CPU issue "
          f"{res['median_issue_ms']:.3f} ms), {res['steps_per_s']:.1f} steps/s over {a.steps} "
          f"steps{kps}; loss {last:.4f}", flush=True)


if __name__ == "__main__":
    main()
