#!/usr/bin/env python3
"""Captures the dashboard (issue 15) on a real GPU: runs the observer on a pseudo-terminal of a
fixed size while a workload runs, keeps the raw terminal stream up to a moment, sends `q`, and
keeps the rest (the restored terminal and the final summary).

usage (root, repo root):
  python3 gpu/capture_dashboard.py OUT_PREFIX [--cols 120] [--rows 40] [--after-s 8]
      [--observer .gpu-bundle/gpu-observer] [--keys KEYS] -- WORKLOAD ARGS...

Writes OUT_PREFIX.screen.raw (the stream until `q` was sent: replay it through a terminal
emulator to see the screen a person saw), OUT_PREFIX.exit.raw (the stream after), and
OUT_PREFIX.json ({"cols", "rows", "after_s", "observer_rc", "workload_rc", "after_ready":
{"table_s", "gpu_panel_s"}: seconds from the observer's "ready" to the first frame with the
process table, and with the first GPU's panel}). The observer
watches every process (its default); the workload starts once the observer says it is ready
(on its stderr, kept in OUT_PREFIX.err).
"""

import argparse
import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time


def read_for(fd, seconds, out):
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return True
        r, _, _ = select.select([fd], [], [], min(left, 0.1))
        if r:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return False  # the observer closed the terminal
            if not chunk:
                return False
            out.extend(chunk)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prefix")
    ap.add_argument("--cols", type=int, default=120)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--after-s", type=float, default=8.0)
    ap.add_argument("--observer", default=".gpu-bundle/gpu-observer")
    ap.add_argument("--keys", default="", help="typed 2 s before the capture ends (\\r: Enter)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    workload = argv[cut + 1:]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", a.rows, a.cols, 0, 0))
    err = open(a.prefix + ".err", "wb")
    env = dict(os.environ, TERM="xterm-256color")
    obs = subprocess.Popen([a.observer], stdin=slave, stdout=slave, stderr=err, env=env,
                           start_new_session=True,
                           preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    screen = bytearray()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        read_for(master, 0.05, screen)
        with open(a.prefix + ".err", "rb") as f:
            if b"ready" in f.read():
                break
    # How long after "ready" the table, then the GPU panel with NVML data, first appear.
    ready_at, firsts = time.monotonic(), {}
    while time.monotonic() - ready_at < 10 and len(firsts) < 2:
        read_for(master, 0.02, screen)
        for key, needle in (("table_s", b"LAUNCH/s"), ("gpu_panel_s", b"GPU 0 \xc2\xb7")):
            if key not in firsts and needle in screen:
                firsts[key] = round(time.monotonic() - ready_at, 3)
    wl = subprocess.Popen(workload, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if workload else None
    if a.keys:
        read_for(master, max(a.after_s - 2, 0), screen)
        os.write(master, a.keys.encode().decode("unicode_escape").encode())
        read_for(master, min(a.after_s, 2), screen)
    else:
        read_for(master, a.after_s, screen)
    os.write(master, b"q")
    rest = bytearray()
    read_for(master, 10, rest)
    try:
        orc = obs.wait(timeout=20)
    except subprocess.TimeoutExpired:
        obs.kill()
        orc = obs.wait()
    wrc = None
    if wl:
        try:
            wrc = wl.wait(timeout=120)
        except subprocess.TimeoutExpired:
            wl.kill()
            wrc = wl.wait()
    with open(a.prefix + ".screen.raw", "wb") as f:
        f.write(screen)
    with open(a.prefix + ".exit.raw", "wb") as f:
        f.write(rest)
    with open(a.prefix + ".json", "w") as f:
        json.dump({"cols": a.cols, "rows": a.rows, "after_s": a.after_s, "observer_rc": orc,
                   "workload_rc": wrc, "after_ready": firsts}, f)
    print(f"capture_dashboard: {len(screen)} bytes until q, {len(rest)} after; observer rc {orc}, "
          f"workload rc {wrc}; after ready: {firsts}")
    return 0 if orc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
