#!/usr/bin/env python3
"""Stand-in for workloads/train_bench.py (standard library only, no GPU) for the self-test
of gpu/bench_cupti.sh: same command line, writes the same JSON with made-up step times
(a little slower under --profiler or CUDA_INJECTION64_PATH).  FAKE_TRAIN_FAIL=MODE makes the
run labelled MODE exit 1."""

import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="run")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--profiler", action="store_true")
    ap.add_argument("--profiler-activities", default="cpu,cuda")  # train_bench.py's default
    a, _rest = ap.parse_known_args()
    if os.environ.get("FAKE_TRAIN_FAIL") == a.label:
        print(f"train_bench: ERROR: fake failure of {a.label}", file=sys.stderr, flush=True)
        return 1
    ms = 5.0
    if a.profiler:
        ms *= 1.3
    if os.environ.get("CUDA_INJECTION64_PATH"):
        ms *= 1.02
    start = time.monotonic_ns()
    time.sleep(0.05)
    steps = [int(ms * 1e6 * (1 + 0.001 * (i % 5))) for i in range(a.steps)]
    end = time.monotonic_ns()
    res = {"workload": "train_bench", "pid": os.getpid(), "label": a.label,
           "profiler": a.profiler, "steps": a.steps, "warmup": a.warmup, "step_ns": steps,
           "median_step_ms": sorted(steps)[len(steps) // 2] / 1e6, "median_issue_ms": ms * 0.7,
           "steps_per_s": a.steps / (sum(steps) / 1e9), "window_start_ns": start,
           "window_end_ns": end, "kernels_per_step": 400.0 if a.profiler else None,
           "model": {"kind": "fake", "params": 1000}, "torch": "none",
           "profiler_activities": sorted(a.profiler_activities.split(",")) if a.profiler else None,
           "cuda_injection": os.environ.get("CUDA_INJECTION64_PATH")}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(res, f)
    print(f"train_bench: {a.label}: median {res['median_step_ms']:.3f} ms/step (fake)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
