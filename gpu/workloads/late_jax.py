#!/usr/bin/env python3
"""The JAX twin of late_torch.py for the late-attach validation (gpu/validate_late_attach.sh,
issue 17). JAX compiles and loads its GPU modules once, at the first step: an observer that comes
later never sees their cuModuleGetFunction calls, and must name the kernels all the same.

An MLP (--width 1024 -> --hidden 4096 -> 4096 -> 1024, ReLU) learns a fixed random teacher
(y = tanh(x W)) with SGD and momentum, MSE, fp32 at the highest matmul precision, batch --batch
1024, on --batches synthetic batches made once with jax.random from a fixed key and cycled; the
train step is one jax.jit'd function (parameters donated), and each step ends with
block_until_ready. XLA runs deterministically (--xla_gpu_deterministic_ops, no autotuning by
timing): the same --steps give the same final loss and parameters bit for bit. XLA's command
buffers are off (--xla_gpu_enable_command_buffer=, unless --graphs): XLA would otherwise capture
the whole step in a CUDA graph (one cuGraphLaunch a step, whose kernels no launch names), and
every kernel is a plain launch of a function JAX loaded at start, before any observer came.

Options and output: see late_common.py (--steps N or $LATE_STEPS, default 9400, ~35 s on an H100;
--out FILE, --ready FILE). Exits 3 (SKIP), with the reason, if JAX is missing or has no GPU.

usage: late_jax.py [--steps N | --seconds S] --out RESULTS.jsonl [--ready READY.json]
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
import late_common  # noqa: E402

NAME = "late_jax"
DEFAULT_STEPS = 9400
DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true"
# XLA's command buffers (CUDA graphs) off: each kernel is a launch of a function loaded at start.
NO_GRAPHS_FLAG = "--xla_gpu_enable_command_buffer="


def extra(ap):
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--graphs", action="store_true",
                    help="keep XLA's command buffers (CUDA graphs: one cuGraphLaunch a step)")


def main():
    a = late_common.parse_args(NAME, DEFAULT_STEPS, extra)
    # Before JAX starts: deterministic XLA, and memory taken as needed (not 75 % of the GPU).
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in flags:
        flags = (flags + " " + DETERMINISTIC_FLAG).strip()
    if not a.graphs and "xla_gpu_enable_command_buffer" not in flags:
        flags = (flags + " " + NO_GRAPHS_FLAG).strip()
    os.environ["XLA_FLAGS"] = flags
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot run here"
        late_common.skip(NAME, a.out, f"import jax failed: {exc}")
    try:
        gpus = jax.devices("gpu")
    except Exception as exc:  # noqa: BLE001 - RuntimeError: no GPU backend
        late_common.skip(NAME, a.out, f"JAX has no GPU: {exc}")
    if not gpus:
        late_common.skip(NAME, a.out, "JAX has no GPU")
    jax.config.update("jax_default_matmul_precision", "highest")
    dev = gpus[0]

    key = jax.random.PRNGKey(a.seed)
    k_data, k_teacher, k_params = jax.random.split(key, 3)
    xs = jax.device_put(jax.random.normal(k_data, (a.batches, a.batch, a.width), jnp.float32), dev)
    teacher = jax.device_put(jax.random.normal(k_teacher, (a.width, a.width), jnp.float32) / a.width ** 0.5, dev)
    ys = jnp.tanh(xs @ teacher)
    batches = [(xs[j], ys[j]) for j in range(a.batches)]
    dims = [a.width, a.hidden, a.hidden, a.width]
    params = []
    for j, kk in enumerate(jax.random.split(k_params, len(dims) - 1)):
        w = jax.random.normal(kk, (dims[j], dims[j + 1]), jnp.float32) / dims[j] ** 0.5
        params.append((jax.device_put(w, dev), jax.device_put(jnp.zeros((dims[j + 1],), jnp.float32), dev)))
    mom = jax.tree_util.tree_map(jnp.zeros_like, params)

    def loss_fn(ps, x, y):
        h = x
        for j, (w, b) in enumerate(ps):
            h = h @ w + b
            if j < len(ps) - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - y) ** 2)

    lr = a.lr

    def train_step(ps, ms, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(ps, x, y)
        ms = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, ms, grads)
        ps = jax.tree_util.tree_map(lambda p, m: p - lr * m, ps, ms)
        return ps, ms, loss

    step = jax.jit(train_step, donate_argnums=(0, 1))
    log = late_common.StepLog(NAME, a)
    loss = None
    i = 0
    while log.more(i):
        t0 = time.monotonic_ns()
        x, y = batches[i % a.batches]
        params, mom, loss = step(params, mom, x, y)
        jax.block_until_ready((params, mom, loss))
        log.step(i, t0, time.monotonic_ns())
        i += 1
    checksum = sum(float(np.asarray(leaf, dtype=np.float64).sum()) for leaf in jax.tree_util.tree_leaves(params))
    log.final(float(loss), checksum, jax=jax.__version__, device=str(dev.device_kind),
              batch=a.batch, width=a.width, hidden=a.hidden, seed=a.seed,
              xla_flags=os.environ.get("XLA_FLAGS", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
