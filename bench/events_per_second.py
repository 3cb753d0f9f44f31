#!/usr/bin/env python3
"""Events/s the agent sustains without drops, with the fake libcuda (no GPU needed).

Runs, side by side in one invocation: the workload alone, then under the observer
(all-process mode, JSON lines to a file), for two shapes of load:
  burst  - cuLaunchKernel in a tight loop on one thread (entry-only probe)
  mixed  - every probed entry point from 2 threads (entry+return probes, ioctls)
and prints calls/s, the slowdown ratio, events captured and dropped.
Run it as root: `cargo xtask bench`.
"""
import json, os, subprocess, sys, tempfile, time

BIN = os.environ["GPU_OBSERVER_BIN"]
FX = os.environ["GPU_OBSERVER_FIXTURES"]
CALLS = int(os.environ.get("CALLS", "2000000"))


class Workload:
    def __init__(self, lib):
        env = dict(os.environ, FAKE_CUDA_SYNC_US="0")
        self.p = subprocess.Popen([os.path.join(FX, "cuda_workload")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        self.pid = int(self.p.stdout.readline().split()[1])
        self.cmd(f"load {lib}")
        self.cmd("init")

    def cmd(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        reply = self.p.stdout.readline().strip()
        if not reply.startswith("ok"):
            sys.exit(f"workload: {line} -> {reply}")
        return reply

    def timed(self, line):
        t = time.perf_counter()
        self.cmd(line)
        return time.perf_counter() - t

    def close(self):
        self.cmd("exit")
        self.p.wait()


def start_agent(out):
    p = subprocess.Popen([BIN, "--format", "jsonl", "--trace-all", "--output", out], stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        if "ready" in line:
            return p
    sys.exit("observer did not start")


def stop_agent(p, out):
    p.send_signal(2)
    p.wait(timeout=60)
    last = None
    with open(out) as f:
        for line in f:
            last = line
    return json.loads(last)


def main():
    d = tempfile.mkdtemp(prefix="gpu-observer-bench-")
    lib = os.path.join(d, "libcuda.so.1")
    subprocess.check_call(["cp", os.path.join(FX, "libcuda.so.1"), lib])
    mixed_iters = max(1, CALLS // (75 * 2))
    shapes = [("burst", f"burst {CALLS}", CALLS),
              ("mixed", f"run 2 {mixed_iters} {d}/exp.jsonl", 2 * mixed_iters * 75)]
    rows = []
    for name, cmd, calls in shapes:
        w = Workload(lib)
        w.timed(cmd)  # warm-up
        base = w.timed(cmd)
        w.close()
        out = os.path.join(d, f"{name}.jsonl")
        agent = start_agent(out)
        w = Workload(lib)
        time.sleep(1.5)  # the agent finds the library
        observed = w.timed(cmd)
        w.close()
        total = stop_agent(agent, out)
        rows.append((name, calls, base, observed, total["events"], total["dropped"]))
    print(f"{'load':<6} {'calls':>9} {'alone calls/s':>14} {'observed calls/s':>17} {'ratio':>6} "
          f"{'us/call added':>13} {'events':>9} {'dropped':>8} {'events/s':>10}")
    for name, calls, base, observed, events, dropped in rows:
        print(f"{name:<6} {calls:>9} {calls / base:>14.0f} {calls / observed:>17.0f} {observed / base:>6.2f} "
              f"{(observed - base) / calls * 1e6:>13.2f} {events:>9} {dropped:>8} {events / observed:>10.0f}")


if __name__ == "__main__":
    main()
