#!/usr/bin/env python3
"""Synthetic inputs of gpucheck.compare_late for the self-test (issue 17): a training job's
results (PREFIX.steps.jsonl), its reference run's (PREFIX.ref.jsonl) and a late observer's JSON
lines (PREFIX.jsonl), all consistent, then the faults asked for.

The job: pid 4242, 1000 steps of ~10 ms from t=1000 s. The observer starts 0.5 s before the attach
(launches before it, unnamed for the first half: it had not seen those modules load), injects at
the end of step 300 (pause 900 µs, diverted 300 µs, thread 4243), CUPTI active 2 ms later; per
step a named launch and its joined gpu_kernel, every 10th step a joined gpu_memcpy, every 50th a
graph launch (kernel null) with two joined graph kernels; CUPTI idle and withdrawn 3 s after the
attach; named launches after; the observer stopped 2 s after the withdraw.

usage: late_synth.py PREFIX [--fault F]...   faults: unjoined (one gpu_kernel not joined),
  unnamed (one launch in the window unnamed), unnamed_after (one after the withdraw: informational),
  pause (pause_us 25000), ratio (steps after the withdraw 8 % slower), ratio_small (4 % slower:
  within tolerance), loss (final loss one ulp off), checksum (parameter checksum off),
  refused (a refused line instead of the attach: no CUPTI, no records), no_withdraw (no withdrawn
  line), no_cupti_lines (no `cupti` lines: the window from the gpu_timing lines), already_loaded
  (already_loaded instead of injected), graph_unnamed_only (only graph launches in the window),
  slow_attach_step (the step of the attach takes 40 ms: informational)
Prints the pid and the attach's ts_ns.
"""

import argparse
import json
import math

PID = 4242
T0 = 1_000_000_000_000
STEP = 10_000_000
N = 1000
ATTACH_STEP = 300
WINDOW = 3_000_000_000


def dump(f, obj):
    f.write(json.dumps(obj, separators=(",", ":")) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix")
    ap.add_argument("--fault", action="append", default=[])
    a = ap.parse_args()
    faults = set(a.fault)

    # the job's steps
    steps = []
    t = T0
    attach_ts = withdraw_ts = None
    for i in range(N):
        d = STEP + (i % 7) * 20_000  # 10.00 .. 10.12 ms
        if withdraw_ts is not None and t >= withdraw_ts + 1_000_000_000:
            if "ratio" in faults:
                d = int(d * 1.08)
            elif "ratio_small" in faults:
                d = int(d * 1.04)
        if attach_ts is not None and t <= attach_ts < t + d:
            pass
        if "slow_attach_step" in faults and i == ATTACH_STEP + 1:
            d = 40_000_000
        t_end = t + d
        steps.append((i, t_end, d))
        if i == ATTACH_STEP:
            attach_ts = t_end + 5_000_000
            withdraw_ts = attach_ts + WINDOW
        t = t_end + 200_000  # the write between steps
    loss, checksum = 0.012345678901234567, 10123.22908723435
    with open(a.prefix + ".ref.jsonl", "w", encoding="utf-8") as f:
        for i, te, d in steps:
            dump(f, {"step": i, "t_ns": te - 7 * 10**9, "step_ns": d})
        dump(f, {"final_loss": loss, "steps": N, "params_checksum": checksum, "pid": PID + 1,
                 "workload": "late_torch", "by_time": False})
    with open(a.prefix + ".steps.jsonl", "w", encoding="utf-8") as f:
        for i, te, d in steps:
            dump(f, {"step": i, "t_ns": te, "step_ns": d})
        dump(f, {"final_loss": math.nextafter(loss, 1.0) if "loss" in faults else loss, "steps": N,
                 "params_checksum": checksum + (1e-9 if "checksum" in faults else 0.0), "pid": PID,
                 "workload": "late_torch", "by_time": False})

    # the observer's lines, in time order
    obs_start = attach_ts - 500_000_000
    obs_stop = withdraw_ts + 2_000_000_000
    lines = []
    common = {"pid": PID, "comm": "python3"}

    def add(ts, ty, **kw):
        ev = {"type": ty, "ts_ns": ts, **common, "tid": kw.pop("tid", PID)}
        ev.update(kw)
        lines.append(ev)

    refused = "refused" in faults
    if refused:
        add(attach_ts, "gpu_timing", event="refused", reason="ptrace_denied",
            message="ptrace(PTRACE_SEIZE): Operation not permitted (fake)")
    elif "already_loaded" in faults:
        add(attach_ts, "gpu_timing", event="already_loaded")
    else:
        add(attach_ts, "gpu_timing", event="injected", tid=PID + 1, pause_us=25000 if "pause" in faults else 900,
            diverted_us=300, library="memfd:gpu-observer-cupti")
    active_ts = attach_ts + 2_000_000
    idle_ts = withdraw_ts - 1_000_000
    no_cupti = "no_cupti_lines" in faults
    if not refused and not no_cupti:
        add(active_ts, "cupti", state="active", cupti_result=0, message="CUPTI active (fake)")
    records = 0
    unjoined_done = unnamed_done = unnamed_after_done = False
    named = unresolved = 0
    for i, te, d in steps:
        ts = te - d + 100_000  # the launch, early in the step
        if ts < obs_start or ts > obs_stop:
            continue
        in_win = attach_ts <= ts <= withdraw_ts
        cupti_on = not refused and active_ts <= ts <= idle_ts
        graph = i % 50 == 0
        if graph:
            add(ts, "launch", api="cuGraphLaunch", kernel=None, kernel_mangled=None, function="0x7f00dead0000")
            unresolved += 1
            if cupti_on:
                for k in range(2):
                    add(ts + 20_000 + k * 5000, "gpu_kernel", api="cuGraphLaunch", launch_ts_ns=ts,
                        gpu_start_ns=ts + 20_000 + k * 5000, graph_id=7, kernel=f"graph_kernel_{k}")
                    records += 1
            continue
        if "graph_unnamed_only" in faults and in_win:
            continue
        name = "void at::native::vectorized_elementwise_kernel<4, float>(int, float*)"
        if ts < attach_ts and ts < obs_start + 250_000_000:
            name = None  # launched from modules loaded before the observer came
        if "unnamed" in faults and in_win and not unnamed_done and i > ATTACH_STEP + 10:
            name, unnamed_done = None, True
        if "unnamed_after" in faults and ts > withdraw_ts and not unnamed_after_done:
            name, unnamed_after_done = None, True
        add(ts, "launch", api="cuLaunchKernel", kernel=name, kernel_mangled=None, function="0x7f00beef0000")
        if name is None:
            unresolved += 1
        else:
            named += 1
        if cupti_on:
            joined = not ("unjoined" in faults and not unjoined_done)
            unjoined_done = unjoined_done or not joined
            add(ts + 30_000, "gpu_kernel", api="cuLaunchKernel", launch_ts_ns=ts if joined else None,
                gpu_start_ns=ts + 30_000, graph_id=None, kernel=name)
            records += 1
            if i % 10 == 0:
                add(ts + 60_000, "gpu_memcpy", api="cuMemcpyAsync", launch_ts_ns=ts + 50_000,
                    gpu_start_ns=ts + 60_000, bytes=4096, copy_kind="dtoh")
                records += 1
    if not refused and not no_cupti:
        add(idle_ts, "cupti", state="idle", cupti_result=0, message="CUPTI withdrawn (fake)")
    if not refused and "no_withdraw" not in faults:
        add(withdraw_ts, "gpu_timing", event="withdrawn", records=records)
    lines.sort(key=lambda e: e["ts_ns"])
    with open(a.prefix + ".jsonl", "w", encoding="utf-8") as f:
        for ev in lines:
            dump(f, ev)
        dump(f, {"type": "summary", "scope": "process", "ts_ns": obs_stop, **common, "events": len(lines),
                 "dropped": 0, "named_launches": named, "unresolved_launches": unresolved,
                 "cupti": None if refused else {"state": "idle", "kernels": records, "joined": records, "unjoined": 0}})
        dump(f, {"type": "summary", "scope": "total", "ts_ns": obs_stop, "pid": None, "events": len(lines),
                 "dropped": 0})
    print(PID, attach_ts, obs_start, obs_stop)


if __name__ == "__main__":
    main()
