#!/usr/bin/env python3
"""Stand-in for gpu-observer, for testing the GPU scripts on a machine without
a GPU.  It follows the CLI contract (--format jsonl --output FILE [--pid N]
[--duration S]), prints "gpu-observer: ready" on stderr, writes a few events
and, on SIGINT/SIGTERM, a final summary line, then exits 0.

FAKE_MODE (env): normal | ignore_int (ignores SIGINT and SIGTERM) |
die_early (exits 3 before ready) | never_ready (never prints the ready line).
"""

import argparse
import json
import os
import signal
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="jsonl")
    ap.add_argument("--output", required=True)
    ap.add_argument("--pid", type=int, default=None)
    ap.add_argument("--trace-all", action="store_true")
    ap.add_argument("--duration", type=float, default=None)
    a = ap.parse_args()
    mode = os.environ.get("FAKE_MODE", "normal")
    if mode == "die_early":
        print("gpu-observer: error: cannot attach (fake)", file=sys.stderr, flush=True)
        sys.exit(3)
    stop = {"flag": False}

    def on_sig(_signum, _frame):
        stop["flag"] = True

    if mode == "ignore_int":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGINT, on_sig)
        signal.signal(signal.SIGTERM, on_sig)
    out = open(a.output, "w", encoding="utf-8")
    time.sleep(0.3)
    if mode != "never_ready":
        print("gpu-observer: attached 42 probes (fake)", file=sys.stderr, flush=True)
        print("gpu-observer: ready", file=sys.stderr, flush=True)
    n = 0
    t_end = time.monotonic() + a.duration if a.duration else None
    while not stop["flag"]:
        ev = {"type": "init", "ts_ns": time.monotonic_ns(), "pid": os.getpid(),
              "tid": os.getpid(), "comm": "fake", "api": "cuInit"}
        out.write(json.dumps(ev) + "\n")
        out.flush()
        n += 1
        if t_end is not None and time.monotonic() >= t_end:
            break
        time.sleep(0.05)
    out.write(json.dumps({"type": "summary", "ts_ns": time.monotonic_ns(), "events": n,
                          "dropped": 0}) + "\n")
    out.close()
    print(f"gpu-observer: stopped, {n} events, 0 dropped (fake)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
