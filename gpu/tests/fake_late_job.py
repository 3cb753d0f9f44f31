#!/usr/bin/env python3
"""Stand-in for workloads/late_torch.py and late_jax.py (standard library only, no GPU) for the
self-test of gpu/validate_late_attach.sh: the same options and output (late_common.py) with
made-up steps: each sleeps FAKE_STEP_MS (5) ms and is recorded as exactly that long, so the step
time before and after an attach is the same; the final loss and checksum depend on the step count
only. Which job it is comes from its name (a symlink named *jax* is the JAX job).

FAKE_LATE_SKIP="jax ..." : those jobs cannot run here (a `skipped` line, exit 3).
FAKE_LATE_FAULT=loss     : a measured run (its --out name has no `.ref.`) ends one ulp off.
"""

import math
import os
import sys
import time

HERE = os.path.dirname(os.path.realpath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "workloads"))
import late_common  # noqa: E402

NAME = "late_jax" if "jax" in os.path.basename(sys.argv[0]) else "late_torch"


def main():
    a = late_common.parse_args(NAME, 600)
    job = NAME.split("_", 1)[1]
    if job in os.environ.get("FAKE_LATE_SKIP", "").split():
        late_common.skip(NAME, a.out, f"{job} not available (fake)")
    step_ns = int(float(os.environ.get("FAKE_STEP_MS", "5")) * 1e6)
    log = late_common.StepLog(NAME, a)
    i = 0
    while log.more(i):
        time.sleep(step_ns / 1e9)
        t1 = time.monotonic_ns()
        log.step(i, t1 - step_ns, t1)
        i += 1
    loss = 1.0 / (3.0 + i)
    if os.environ.get("FAKE_LATE_FAULT") == "loss" and ".ref." not in os.path.basename(a.out):
        loss = math.nextafter(loss, 1.0)
    log.final(loss, 1000.0 + i / 7.0, device="fake",
              gpu_observer_cupti_path=os.environ.get("GPU_OBSERVER_CUPTI_PATH"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
