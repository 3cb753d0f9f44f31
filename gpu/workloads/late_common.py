"""What late_torch.py and late_jax.py share (gpu/validate_late_attach.sh, issue 17): their
options, the ready marker, the per-step JSON lines and the final line.

Options come from the command line, with defaults from the environment (LATE_STEPS, LATE_OUT,
LATE_READY, ...) and extra words from $LATE_ARGS, as env_args.py does for launchers:

  --steps N      a fixed number of training steps (default $LATE_STEPS, else the workload's own:
                 ~35 s on an H100); the same N gives the same final loss, bit for bit
  --seconds S    run by time instead (S seconds of steps; the result is then not comparable)
  --out FILE     the results (JSON lines): one per step, {"step": i, "t_ns": CLOCK_MONOTONIC ns at
                 the end of the step (after the device synchronize), "step_ns": its duration}, then
                 {"final_loss": ..., "steps": n, "params_checksum": ..., "pid": ..., ...}
  --ready FILE   written (atomically, JSON: pid, t_ns, workload) once CUDA is initialized and the
                 first step has run (modules loaded, libraries' handles made); a line
                 "<name>: ready pid=N" is printed at the same moment
  --seed N       the seed of parameters and data (default 0)

A workload that cannot run here (JAX missing, no GPU) writes {"skipped": reason} as its only line,
prints "<name>: SKIP: reason" and exits with SKIP_RC.
The workloads know nothing about any observer.
"""

import argparse
import json
import os
import shlex
import sys
import time

SKIP_RC = 3


def parse_args(name, default_steps, extra=None):
    """The options (see the module doc); `extra(ap)` adds a workload's own."""
    ap = argparse.ArgumentParser(prog=name)
    ap.add_argument("--steps", type=int, default=int(os.environ.get("LATE_STEPS", default_steps)))
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--out", default=os.environ.get("LATE_OUT"))
    ap.add_argument("--ready", default=os.environ.get("LATE_READY"))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("LATE_SEED", "0")))
    if extra:
        extra(ap)
    argv = shlex.split(os.environ.get("LATE_ARGS", "")) + sys.argv[1:]
    a = ap.parse_args(argv)
    if not a.out:
        ap.error("--out (or LATE_OUT) is required")
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    return a


def write_json_atomic(path, obj):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.write("\n")
    os.replace(tmp, path)


def skip(name, out, reason):
    """Cannot run here: say so and exit SKIP_RC."""
    print(f"{name}: SKIP: {reason}", flush=True)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(json.dumps({"skipped": reason, "pid": os.getpid()}) + "\n")
    sys.exit(SKIP_RC)


class StepLog:
    """The results file: a line per step, then the final line."""

    def __init__(self, name, a):
        self.name = name
        self.a = a
        self.f = open(a.out, "w", encoding="utf-8", buffering=1)
        self.ready_done = False
        self.n = 0
        self.t_start = time.monotonic_ns()

    def step(self, i, t0, t1):
        self.f.write(f'{{"step": {i}, "t_ns": {t1}, "step_ns": {t1 - t0}}}\n')
        self.n = i + 1
        if not self.ready_done:
            self.ready_done = True
            if self.a.ready:
                write_json_atomic(self.a.ready, {"pid": os.getpid(), "t_ns": t1, "workload": self.name})
            print(f"{self.name}: ready pid={os.getpid()}", flush=True)

    def more(self, i):
        """Whether step i is to be run."""
        if self.a.seconds is not None:
            return i == 0 or time.monotonic_ns() - self.t_start < self.a.seconds * 1e9
        return i < self.a.steps

    def final(self, loss, checksum, **info):
        line = {"final_loss": float(loss), "steps": self.n, "params_checksum": float(checksum),
                "pid": os.getpid(), "workload": self.name, "by_time": self.a.seconds is not None,
                "elapsed_ns": time.monotonic_ns() - self.t_start}
        line.update(info)
        self.f.write(json.dumps(line) + "\n")
        self.f.close()
        print(f"{self.name}: {self.n} steps, final loss {float(loss)!r}, params checksum "
              f"{float(checksum)!r}", flush=True)
