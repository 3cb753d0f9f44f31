#!/usr/bin/env bash
# Self-test of gpu/trace_outliers.py and gpu/trace_outliers.sh, without a GPU.
#
#  1. synthetic: a run directory with a hand-made ftrace (both instances, ns raw reads for one,
#     us only for the other, old/new line formats, odd comms, a LOST marker) and JSONL with
#     outliers whose causes are known (preemption, IRQ + nested softirq/timer, page faults with
#     and without the handle_mm_fault kprobe, uprobe handling, a futex sleep, a migration,
#     another thread busy on another CPU, an IRQ on another CPU, a switch-in missing from the
#     trace; states whose end is missing: an ioctl sys_enter with no exit 0.5 ms before the launch,
#     a uretprobe NR 335 enter/exit printed "NR -1" before it, a local timer entry with no exit,
#     a thread woken from idle whose switch-in is missing; and a real ioctl inside the gap) and
#     normal controls:
#     every verdict and every attributed time is checked.
#  2. local tracefs (root, tracefs with instances; SKIP_TRACEFS=1 skips): gpu/trace_outliers.sh
#     end to end with a fake observer and a fake workload whose "launch" windows contain a
#     nanosleep, page faults, a read() syscall, or a busy loop; the verdicts are checked (the
#     busy loop leniently: it can be preempted), and that no ftrace instance or kprobe is left.
#  3. the same script with an observer that fails before ready: non-zero exit, tracefs clean.
#
# usage: bash gpu/tests/trace_outliers_selftest.sh      (exit 0 = all passed)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
GPU=$(cd "$HERE/.." && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONDONTWRITEBYTECODE=1
T=$(mktemp -d /tmp/trace-outliers-selftest.XXXXXX)
trap '[[ ${KEEP:-0} == 1 ]] || rm -rf "$T"' EXIT
fail=0
ok() { printf 'ok   %s\n' "$*"; }
bad() {
    printf 'FAIL %s\n' "$*"
    fail=1
}

# ------------------------------------------------------------------ 1. synthetic
mkdir -p "$T/syn/run1"
"$PYTHON" - "$T/syn/run1" <<'EOF'
import gzip, json, os, sys
d = sys.argv[1]
BASE = 5_000_000_000_000  # 5000 s, CLOCK_MONOTONIC
PID, T, W, C = 4000, 4000, 4001, 4002      # workload: main thread, driver worker, CUPTI thread
OBS, OBT = 3000, 3001                     # observer and its tokio thread
cpu_ev, task_ev = [], []


def ev(lst, ts, cpu, comm, pid, tgid, name, body, flags="d.h1."):
    lst.append((ts, cpu, comm, pid, tgid, name, body, flags))


def sw(ts, cpu, pc, pp, ps, nc, np_):
    ev(cpu_ev, ts, cpu, pc, pp, PID if pp in (T, W, C) else (0 if pp == 0 else pp), "sched_switch",
       f"prev_comm={pc} prev_pid={pp} prev_prio=120 prev_state={ps} ==> next_comm={nc} next_pid={np_} next_prio=120",
       "d..2.")


def irq(cpu, a, b, n=130, name="nvidia", who=("cuda-ground-tru", T)):
    ev(cpu_ev, a, cpu, who[0], who[1], PID, "irq_handler_entry", f"irq={n} name={name}", "d.h1.")
    ev(cpu_ev, b, cpu, who[0], who[1], PID, "irq_handler_exit", f"irq={n} ret=handled", "d.h1.")


def tsk(ts, cpu, name, body, pid=T, comm="cuda-ground-tru"):
    ev(task_ev, ts, cpu, comm, pid, None, name, body, "d...")  # old 4-char flags, no tgid column


lines = []   # JSONL
def gk(k, t0, gap, kernel, end=2000, tid=T):
    lines.append({"type": "launch", "ts_ns": t0, "pid": PID, "tid": tid, "comm": "cuda-ground-tru",
                  "api": "cuLaunchKernel", "kernel": kernel})
    lines.append({"type": "gpu_kernel", "ts_ns": t0 + 50_000, "pid": PID, "tid": tid, "comm": "cuda-ground-tru",
                  "api": "cuLaunchKernel", "cupti_api": "cuLaunchKernel", "correlation_id": 100 + k,
                  "kernel": kernel, "launch_ts_ns": t0, "cupti_api_start_ns": t0 + gap,
                  "cupti_api_end_ns": t0 + gap + end, "gpu_start_ns": t0 + 50_000, "gpu_end_ns": t0 + 60_000})


def memcpy(t0, since_return, dur=985_000):
    end = t0 - since_return
    lines.append({"type": "memcpy", "ts_ns": end - dur, "pid": PID, "tid": T, "comm": "cuda-ground-tru",
                  "api": "cuMemcpyHtoD_v2", "duration_ns": dur, "bytes": 4 << 20, "direction": "cpu_to_gpu"})


# T on CPU 2 from the start; the observer thread on CPU 0; marker on CPU 0
sw(BASE, 2, "swapper/2", 0, "R", "cuda-ground-tru", T)
ev(cpu_ev, BASE + 10_000, 0, "python3", 2999, 2999, "tracing_mark_write", f"gpuobs_clock mono_ns={BASE + 7_000}", "....")
ev(task_ev, BASE + 10_500, 0, "python3", 2999, None, "tracing_mark_write", f"gpuobs_clock mono_ns={BASE + 8_000}", "....")
sw(BASE + 20_000, 0, "swapper/0", 0, "R", "tokio-runtime-w", OBT)
# an ioctl seen by the observer and by the trace (clock check)
lines.append({"type": "ioctl", "ts_ns": BASE + 30_000, "pid": PID, "tid": T, "comm": "cuda-ground-tru",
              "fd": 5, "cmd": "0xc0", "duration_ns": 3000})
tsk(BASE + 30_200, 2, "sys_enter", "NR 16 (5, c0, 7ffd0000, 0, 0, 0)")
tsk(BASE + 33_000, 2, "sys_exit", "NR 16 = 0")
# a LOST marker on an unrelated CPU
LOST_AT = BASE + 40_000
ev(cpu_ev, LOST_AT, 7, "<idle>", 0, None, "__LOST__", "")

MS = 1_000_000
expect = {}
# 1 preempted: R+ at +1 us, back at +9 us
t0 = BASE + 1 * MS
memcpy(t0, 15_000)
gk(1, t0, 10_000, "preempt")
ev(cpu_ev, t0 + 900, 2, "cuda-ground-tru", T, PID, "sched_wakeup", "comm=kworker/2:1 pid=50 prio=120 target_cpu=002", "dNh1.")
sw(t0 + 1_000, 2, "cuda-ground-tru", T, "R+", "kworker/2:1", 50)
sw(t0 + 9_000, 2, "kworker/2:1", 50, "I", "cuda-ground-tru", T)
expect[101] = ("off-cpu", {"offcpu": 8_000, "unattributed": 2_000})
# 2 IRQ 6 us, then a softirq 1 us with a nested local timer 0.2 us
t0 = BASE + 2 * MS
gk(2, t0, 9_000, "irq")
irq(2, t0 + 1_000, t0 + 7_000)
ev(cpu_ev, t0 + 7_200, 2, "cuda-ground-tru", T, PID, "softirq_entry", "vec=6 [action=TASKLET]", "..s1.")
ev(cpu_ev, t0 + 7_500, 2, "cuda-ground-tru", T, PID, "local_timer_entry", "vector=236", "d.h2.")
ev(cpu_ev, t0 + 7_700, 2, "cuda-ground-tru", T, PID, "local_timer_exit", "vector=236", "d.h2.")
ev(cpu_ev, t0 + 8_200, 2, "cuda-ground-tru", T, PID, "softirq_exit", "vec=6 [action=TASKLET]", "..s1.")
expect[102] = ("irq", {"irq": 7_000, "unattributed": 2_000},
               {"irq 130 nvidia": 6_000, "softirq TASKLET": 800, "vector local_timer": 200})
# 3 a user page fault, no duration (no kprobe)
t0 = BASE + 3 * MS
gk(3, t0, 8_000, "fault")
tsk(t0 + 500, 2, "page_fault_user", "address=0x7f0000001000 ip=0x7f1234567890 error_code=0x6")
expect[103] = ("page-fault", {"unattributed": 8_000})
# 4 a page fault measured by the handle_mm_fault kprobe (6 us)
t0 = BASE + 4 * MS
gk(4, t0, 8_000, "fault_kp")
tsk(t0 + 400, 2, "page_fault_user", "address=0x7f0000002000 ip=0x7f1234567890 error_code=0x6")
tsk(t0 + 450, 2, "gpuobs_hmf", "(handle_mm_fault+0x0/0x2c0) address=0x7f0000002000")
tsk(t0 + 6_450, 2, "gpuobs_hmf_ret", "(do_user_addr_fault+0x1d8/0x6a0 <- handle_mm_fault)")
expect[104] = ("fault", {"fault": 6_000, "unattributed": 2_000})
# 5 nothing on T; the driver worker runs on CPU 3 with a futex; an IRQ on CPU 3 (not T's CPU)
t0 = BASE + 5 * MS
gk(5, t0, 12_000, "user")
sw(t0 + 1_000, 3, "swapper/3", 0, "R", "cuda-EvtHandlr", W)
tsk(t0 + 1_500, 3, "sys_enter", "NR 202 (7f00, 81, 1, 0, 0, 0)", W, "cuda-EvtHandlr")
irq(3, t0 + 2_000, t0 + 5_000, 131, "nvidia", ("cuda-EvtHandlr", W))
tsk(t0 + 2_500, 3, "sys_exit", "NR 202 = 1", W, "cuda-EvtHandlr")
sw(t0 + 6_000, 3, "cuda-EvtHandlr", W, "S", "swapper/3", 0)
expect[105] = ("user-mode", {"unattributed": 12_000})
# 6 uprobe handling (kprobe on uprobe_notify_resume) from before t0 to +7 us
t0 = BASE + 6 * MS
gk(6, t0, 8_000, "uprobe")
tsk(t0 - 300, 2, "gpuobs_unr", "(uprobe_notify_resume+0x0/0x80)")
tsk(t0 + 7_000, 2, "gpuobs_unr_ret", "(exit_to_user_mode_loop+0x9e/0x130 <- uprobe_notify_resume)")
expect[106] = ("uprobe", {"uprobe": 7_000, "unattributed": 1_000})
# 7 a futex: 1 us in the syscall, asleep 6.5 us (woken by the CUPTI thread), 0.5 us back in it
t0 = BASE + 7 * MS
gk(7, t0, 10_000, "futex")
tsk(t0 + 1_000, 2, "sys_enter", "NR 202 (7f00, 80, 0, 0, 0, 0)")
sw(t0 + 2_000, 2, "cuda-ground-tru", T, "S", "swapper/2", 0)
sw(t0 + 7_900, 3, "swapper/3", 0, "R", "gpuobs-cupti", C)
ev(cpu_ev, t0 + 8_000, 3, "gpuobs-cupti", C, PID, "sched_wakeup", f"comm=cuda-ground-tru pid={T} prio=120 target_cpu=002", "d..2.")
sw(t0 + 8_500, 2, "swapper/2", 0, "R", "cuda-ground-tru", T)
tsk(t0 + 9_000, 2, "sys_exit", "NR 202 = 0")
sw(t0 + 20_000, 3, "gpuobs-cupti", C, "S", "swapper/3", 0)
expect[107] = ("off-cpu", {"offcpu": 6_500, "syscall": 1_500, "unattributed": 2_000})
# 8 preempted on CPU 2, migrated, back on CPU 5 where an IRQ hits it (mixed)
t0 = BASE + 8 * MS
gk(8, t0, 9_000, "migrate")
sw(t0 + 1_000, 2, "cuda-ground-tru", T, "R", "kworker/2:1", 50)
ev(cpu_ev, t0 + 3_000, 5, "migration/5", 60, 60, "sched_migrate_task",
   f"comm=cuda-ground-tru pid={T} prio=120 orig_cpu=2 dest_cpu=5", "d..2.")
sw(t0 + 6_000, 5, "swapper/5", 0, "R", "cuda-ground-tru", T)
irq(5, t0 + 6_500, t0 + 8_500)
sw(t0 + 9_500, 2, "kworker/2:1", 50, "I", "swapper/2", 0)
sw(t0 + 500_000, 5, "cuda-ground-tru", T, "R", "swapper/5", 0)
sw(t0 + 500_100, 2, "swapper/2", 0, "R", "cuda-ground-tru", T)
expect[108] = ("mixed", {"offcpu": 5_000, "irq": 2_000, "unattributed": 2_000})
# controls: 1 us gaps; one with a 0.3 us timer interrupt (< 1 us: no cause)
for k in range(9, 15):
    t0 = BASE + k * MS
    gk(k, t0, 1_000, ["preempt", "irq", "fault", "user", "uprobe", "futex"][k % 6])
    if k == 10:
        ev(cpu_ev, t0 + 200, 2, "cuda-ground-tru", T, PID, "local_timer_entry", "vector=236", "d.h1.")
        ev(cpu_ev, t0 + 500, 2, "cuda-ground-tru", T, PID, "local_timer_exit", "vector=236", "d.h1.")
# 16 asleep in a futex, woken from idle, and the idle -> task switch is not in the trace (some
# kernels do not record it): the switch-in is inferred from the wakeup
t0 = BASE + 16 * MS
gk(16, t0, 7_000, "no_switch_in")
tsk(t0 + 500, 2, "sys_enter", "NR 202 (7f00, 80, 0, 0, 0, 0)")
sw(t0 + 1_000, 2, "cuda-ground-tru", T, "S", "swapper/2", 0)
ev(cpu_ev, t0 + 6_000, 2, "<idle>", 0, None, "sched_wakeup", f"comm=cuda-ground-tru pid={T} prio=120 target_cpu=002", "dNh4.")
tsk(t0 + 6_500, 2, "sys_exit", "NR 202 = 0")
expect[116] = ("off-cpu", {"offcpu": 5_000, "syscall": 1_000, "unattributed": 1_000})
# T stays on CPU 2 (from the inferred switch-in above) until the trace ends at 20 ms.
# 117 an ioctl entered 0.5 ms before the launch whose sys_exit is not in the trace: the launch's
# uprobe stamp proves the thread was back in user mode, so none of the gap is syscall time
t0 = BASE + 17 * MS
tsk(t0 - 500_000, 2, "sys_enter", "NR 16 (5, c0, 7ffd0000, 0, 0, 0)")
gk(17, t0, 8_000, "unterminated_ioctl")
expect[117] = ("user-mode", {"unattributed": 8_000})
# 118 the uretprobe trampoline's syscall (NR 335) before the launch, its sys_exit printed as
# "NR -1", then an instruction-fetch page fault in the gap (run1 corr 2 of the H100 trace)
t0 = BASE + 17_500_000
tsk(t0 - 12_000, 2, "sys_enter", "NR 335 (6, 114, 7ffd5b971550, 0, 28, 7ffd5b97122c)")
tsk(t0 - 7_000, 2, "sys_exit", "NR -1 = 0")
tsk(t0 + 3_000, 2, "page_fault_user", "address=0x7f2e31b5df00 ip=0x7f2e31b5df00 error_code=0x14")
gk(18, t0, 11_800, "uretprobe_before")
expect[118] = ("page-fault", {"unattributed": 11_800})
# 119 a real syscall inside the gap: 6 us of ioctl
t0 = BASE + 18 * MS
tsk(t0 + 2_000, 2, "sys_enter", "NR 16 (5, c0, 7ffd0000, 0, 0, 0)")
tsk(t0 + 8_000, 2, "sys_exit", "NR 16 = 0")
gk(19, t0, 10_000, "ioctl_in_gap")
expect[119] = ("syscall", {"syscall": 6_000, "unattributed": 4_000}, {"syscall ioctl": 6_000})
# 120 a local timer entry 3 us before the launch whose exit is not in the trace; a user page
# fault of T on CPU 2 at -1 us proves the CPU left it; a 0.5 us softirq in the gap (whose exit
# the old analysis took for the timer's resumption)
t0 = BASE + 18_500_000
ev(cpu_ev, t0 - 3_000, 2, "cuda-ground-tru", T, PID, "local_timer_entry", "vector=236", "d.h1.")
tsk(t0 - 1_000, 2, "page_fault_user", "address=0x7f0000003000 ip=0x7f1234567890 error_code=0x6")
ev(cpu_ev, t0 + 4_000, 2, "cuda-ground-tru", T, PID, "softirq_entry", "vec=9 [action=RCU]", "..s1.")
ev(cpu_ev, t0 + 4_500, 2, "cuda-ground-tru", T, PID, "softirq_exit", "vec=9 [action=RCU]", "..s1.")
gk(20, t0, 8_000, "irq_no_exit")
expect[120] = ("user-mode", {"irq": 500, "unattributed": 7_500}, {"softirq RCU": 500})
# 121 the driver worker W (asleep since case 5) is woken by the idle task on CPU 3, its switch-in
# is not in the trace, then it runs a uretprobe syscall and launches: its own events prove it is
# on CPU 3 (not off-CPU since 5 ms)
t0 = BASE + 19 * MS
ev(cpu_ev, t0 - 100_000, 3, "<idle>", 0, None, "sched_wakeup", f"comm=cuda-EvtHandlr pid={W} prio=120 target_cpu=003", "dNh4.")
tsk(t0 - 12_000, 3, "sys_enter", "NR 335 (6, 114, 7ffd5b971550, 0, 28, 7ffd5b97122c)", W, "cuda-EvtHandlr")
tsk(t0 - 7_000, 3, "sys_exit", "NR -1 = 0", W, "cuda-EvtHandlr")
gk(21, t0, 9_000, "no_switch_in_w", tid=W)
expect[121] = ("user-mode", {"unattributed": 9_000})
# an early one (CUPTI start before the uprobe stamp): counted, not analysed
gk(15, BASE + 15 * MS, -6_000, "early")
# the trace ends; one entry far from every launch (skipped with the default --context-ms 20)
sw(BASE + 20 * MS, 2, "cuda-ground-tru", T, "S", "swapper/2", 0)
sw(BASE + 300 * MS, 6, "swapper/6", 0, "R", "kworker/6:0", 66)


def us_stamp(ts):
    us = (ts + 500) // 1000
    return f"{us // 1_000_000:5d}.{us % 1_000_000:06d}"


HDR = ("# tracer: nop\n#\n# entries-in-buffer/entries-written: {n}/{n}   #P:8\n#\n"
       "#           TASK-PID     CPU#  |||||  TIMESTAMP  FUNCTION\n#              | |         |   |||||     |         |\n")


def write(name, evs, with_tgid, raw):
    evs = sorted(evs, key=lambda e: e[0])
    n = sum(1 for e in evs if e[5] != "__LOST__")
    with gzip.open(os.path.join(d, name + ".txt.gz"), "wt") as f:
        f.write(HDR.format(n=n))
        for ts, cpu, comm, pid, tgid, nm, body, flags in evs:
            if nm == "__LOST__":
                f.write(f"CPU:{cpu} [LOST 17 EVENTS]\n")
                continue
            tg = ""
            if with_tgid:
                tg = f"({tgid:>7}) " if tgid else "(-------) "
            f.write(f"{comm:>16}-{pid:<7} {tg}[{cpu:03d}] {flags} {us_stamp(ts)}: {nm}: {body}\n")
    if raw:
        with open(os.path.join(d, name + ".raw.txt"), "w") as f:
            f.write(HDR.format(n=n))
            for ts, cpu, comm, pid, tgid, nm, body, flags in evs:
                if nm == "__LOST__":
                    f.write(f"CPU:{cpu} [LOST 17 EVENTS]\n")
                    continue
                f.write(f"{pid} {cpu} {ts} type: 317\n")


write("trace_cpu", cpu_ev, True, True)
write("trace_task", task_ev, False, False)
with open(os.path.join(d, "events.jsonl"), "w") as f:
    for o in lines:
        f.write(json.dumps(o) + "\n")
with open(os.path.join(d, "meta.txt"), "w") as f:
    f.write(f"workload_pid {PID}\nobserver_pid {OBS}\nkernel synthetic\n")
with open(os.path.join(d, "threads.txt"), "w") as f:
    f.write(f"{T} cuda-ground-tru\n{W} cuda-EvtHandlr\n{C} gpuobs-cupti\n")
with open(os.path.join(d, "stats_cpu.txt"), "w") as f:
    f.write("cpu 0\nentries: 10\noverrun: 0\ncpu 7\nentries: 3\noverrun: 17\n")
with open(os.path.join(d, "..", "expect.json"), "w") as f:
    json.dump({str(k): v for k, v in expect.items()}, f)
EOF
if "$PYTHON" "$GPU/trace_outliers.py" --run "$T/syn/run1" --md "$T/syn/OUTLIERS.md" \
    --json "$T/syn/outliers.json" --excerpts "$T/syn/excerpts.txt" --controls 6 2>"$T/syn/err"; then
    ok "synthetic: trace_outliers.py ran ($(cat "$T/syn/err"))"
else
    bad "synthetic: trace_outliers.py failed: $(cat "$T/syn/err")"
fi
if "$PYTHON" - "$T/syn" <<'EOF'; then ok "synthetic: verdicts, attributed times, controls, trace quality"; else bad "synthetic checks"; fi
import json, sys
d = sys.argv[1]
res = json.load(open(f"{d}/outliers.json"))
exp = json.load(open(f"{d}/expect.json"))
errs = []
outl = {r["correlation_id"]: r for r in res["outliers"]}
if sorted(outl) != sorted(int(k) for k in exp):
    errs.append(f"outliers {sorted(outl)} != {sorted(exp)}")
for k, e in exp.items():
    r = outl.get(int(k))
    if not r:
        continue
    cat, times = e[0], e[1]
    if r["category"] != cat:
        errs.append(f"corr {k}: category {r['category']} != {cat} ({r['verdict']})")
    for c, v in times.items():
        got = r["gap_by_cause_ns"][c]
        tol = 1000 if k in ("103", "104", "105", "106", "107", "116", "117", "118", "119", "121") else 10  # task-instance lines: us stamps
        if abs(got - v) > tol:
            errs.append(f"corr {k}: {c} {got} != {v} (+-{tol}) {r['gap_by_cause_ns']}")
    for c in r["gap_by_cause_ns"]:
        if c not in times and r["gap_by_cause_ns"][c] > (1000 if k in ("104", "106", "107", "116", "119") else 0):
            errs.append(f"corr {k}: unexpected {c} {r['gap_by_cause_ns'][c]}")
    if len(e) > 2:
        for lbl, v in e[2].items():
            got = r["gap_detail_ns"].get(lbl)
            if got is None or abs(got - v) > 10:
                errs.append(f"corr {k}: detail {lbl} {got} != {v} ({r['gap_detail_ns']})")
    if not any(x.get("mark", "").startswith("== launch_ts_ns") for x in r.get("events", [])):
        errs.append(f"corr {k}: no launch mark in the event list")
r = outl.get(101)
if r and (r["prev_call"] or {}).get("since_return_ns") != 15_000:
    errs.append(f"prev_call {r['prev_call']}")
r = outl.get(103)
if r and r["faults_in_gap"] != 1:
    errs.append(f"corr 103 faults {r['faults_in_gap']}")
r = outl.get(105)
if r:
    o = {x["tid"]: x for x in r["others"]}
    w = o.get(4001)
    if not w or w["on_cpu_ns"] != 5000 or w["syscalls"] != {"futex": 1} or w["comm"] != "cuda-EvtHandlr":
        errs.append(f"corr 105 others {r['others']}")
r = outl.get(107)
if r:
    if not any("sched_wakeup" in x.get("line", "") and "gpuobs-cupti" in x.get("line", "") for x in r["events"]):
        errs.append("corr 107: the wakeup by the CUPTI thread is not listed")
    o = r["offcpu"]
    if len(o) != 1 or o[0]["what"] != "sleeping" or o[0]["in_gap_ns"] != 6500 or \
            o[0]["woken_by"][0]["by"] != "gpuobs-cupti-4002" or o[0]["ran_instead"] != "swapper/2-0":
        errs.append(f"corr 107 offcpu {o}")
r = outl.get(101)
if r:
    oc = r["on_cpu_at_launch"]
    if not oc or oc["cpu"] != 2 or oc["since_rel_ns"] != -1_000_000 or not oc["switch_in_seen"]:
        errs.append(f"corr 101 on_cpu_at_launch {oc}")
r = outl.get(116)
if r:
    o = r["offcpu"]
    if len(o) != 1 or o[0]["switch_in_seen"] or o[0]["end_rel_ns"] != 6000 or o[0]["woken_by"][0]["by"] != "<idle>-0":
        errs.append(f"corr 116 offcpu {o}")
r = outl.get(108)
if r and r["cpus"] != [2, 5]:
    errs.append(f"corr 108 cpus {r['cpus']}")
r = outl.get(117)
if r:
    x = [s for s in r["syscalls"] if s["name"] == "ioctl"]
    if len(x) != 1 or x[0]["start_rel_ns"] != -500_000 or x[0]["end_rel_ns"] != 0 or \
            not (x[0]["flag"] or "").startswith("unterminated") or "uprobe stamp" not in x[0]["flag"]:
        errs.append(f"corr 117: the unterminated ioctl {r['syscalls']}")
r = outl.get(118)
if r:
    x = [s for s in r["syscalls"] + [r["syscall_before"] or {}] if s.get("name") == "uretprobe"]
    if len(x) != 1 or x[0]["start_rel_ns"] != -12_000 or x[0]["end_rel_ns"] != -7_000 or x[0]["flag"] or \
            not x[0]["exit"].startswith("NR -1") or x[0]["ret"] != 0:
        errs.append(f"corr 118: the uretprobe syscall {r['syscalls']}")
    if r["faults_in_gap"] != 1:
        errs.append(f"corr 118 faults {r['faults_in_gap']}")
r = outl.get(119)
if r and "verdict: syscall" not in open(f"{d}/OUTLIERS.md").read():
    errs.append("OUTLIERS.md lacks the syscall verdict")
r = outl.get(120)
if r and any("unterminated" in k for k in r["gap_detail_ns"]):
    errs.append(f"corr 120: an unterminated handler counted in the gap {r['gap_detail_ns']}")
r = outl.get(121)
if r:
    oc = r["on_cpu_at_launch"]
    if not oc or oc["cpu"] != 3 or oc["since_rel_ns"] != -100_000 or oc["switch_in_seen"] or \
            "own event" not in (oc.get("start_how") or ""):
        errs.append(f"corr 121 on_cpu_at_launch {oc}")
    if r["offcpu"]:
        errs.append(f"corr 121 offcpu {r['offcpu']}")
ctl = res["controls"]
if len(ctl) < 6:
    errs.append(f"{len(ctl)} controls")
for c in ctl:
    if c["category"] != "user-mode" or c["gap_ns"] != 1000:
        errs.append(f"control {c['correlation_id']}: {c['category']} gap {c['gap_ns']}")
if res["summary"]["controls"]["with_any_cause_ge_1us"] != 0:
    errs.append("a control has a cause >= 1 us")
run = res["runs"][0]
if run["trace_cpu_entries"] != run["trace_cpu_events"] + 1 or run["trace_task_entries"] != run["trace_task_events"]:
    errs.append(f"kept entries {run['trace_cpu_entries']} {run['trace_cpu_events']}")
# inferred switch-ins: T woken from idle (116), W woken from idle (121), the marker writer on
# CPU 0 and the migration thread on CPU 5 (each seen only by an event in its own context)
if run["early"] != 1 or run["outliers"] != 14 or run["inferred_switch_ins"] != 4:
    errs.append(f"run counts {run['outliers']} outliers, {run['early']} early, "
                f"{run['inferred_switch_ins']} inferred switch-ins")
if run["unterminated"].get("syscall", 0) < 1 or run["unterminated"].get("irq", 0) < 1:
    errs.append(f"unterminated counts {run['unterminated']}")
if not (0.2 < run["ns_precision_share"] < 1.0):
    errs.append(f"ns share {run['ns_precision_share']}")
if [x["count"] for x in run["lost"]] != [17] or run["overruns"]["cpu"] != {"7": {"overrun": 17}} and \
        run["overruns"]["cpu"] != {7: {"overrun": 17}}:
    errs.append(f"lost {run['lost']} overruns {run['overruns']}")
ck = run["clock"]
if not ck["markers"] or ck["markers"]["min_ns"] < 2000 or ck["markers"]["max_ns"] > 3000:
    errs.append(f"markers {ck['markers']}")
if not ck["ioctl"] or ck["ioctl"]["within_2us"] != 1:
    errs.append(f"ioctl check {ck['ioctl']}")
if run["process_threads"].get("4001") != "cuda-EvtHandlr":
    errs.append(f"threads {run['process_threads']}")
md = open(f"{d}/OUTLIERS.md").read()
for s in ("## Summary", "## Outliers", "## Controls", "verdict: off-cpu", "irq 130 nvidia", "gpuobs-cupti"):
    if s not in md:
        errs.append(f"OUTLIERS.md lacks {s!r}")
ex = open(f"{d}/excerpts.txt").read()
if ex.count("### run") != 14:
    errs.append("excerpts")
for e in errs:
    print("   ", e)
sys.exit(1 if errs else 0)
EOF
if "$PYTHON" "$GPU/trace_outliers.py" --run "$T/syn/run1" --json "$T/syn/all.json" --controls 6 --context-ms 0 \
    2>/dev/null && "$PYTHON" - "$T/syn/outliers.json" "$T/syn/all.json" <<'EOF'; then
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
key = lambda res: [(r["correlation_id"], r["category"], r["gap_by_cause_ns"]) for r in res["outliers"] + res["controls"]]
sys.exit(0 if key(a) == key(b) and b["runs"][0]["trace_cpu_entries"] == b["runs"][0]["trace_cpu_events"] else 1)
EOF
    ok "synthetic: the same results from the whole trace (--context-ms 0)"
else
    bad "synthetic: --context-ms 0 gives other results"
fi

# ------------------------------------------------------------------ 2./3. local tracefs
TRACEFS=""
for d in /sys/kernel/tracing /sys/kernel/debug/tracing; do
    [[ -d $d/instances ]] && TRACEFS=$d && break
done
if [[ ${SKIP_TRACEFS:-0} == 1 ]]; then
    echo "skip local tracefs tests (SKIP_TRACEFS=1)"
elif [[ $(id -u) -ne 0 || -z $TRACEFS ]]; then
    echo "skip local tracefs tests (needs root and tracefs with instances)"
else
    F=$T/fake
    mkdir -p "$F"
    # The fake observer: `run --help`; `run --format jsonl --output F ... -- CMD`: ready line,
    # starts CMD with FAKE_JSONL=F, "started pid N", waits, exits with CMD's status.
    cat >"$F/gpu-observer" <<'EOF'
#!/usr/bin/env python3
import os, subprocess, sys, time
a = sys.argv[1:]
if a[:1] != ["run"]:
    sys.exit(2)
if "--help" in a:
    print("usage: gpu-observer run [options] -- CMD")
    sys.exit(0)
if os.environ.get("FAKE_MODE") == "die_early":
    print("gpu-observer: error: cannot attach (fake)", file=sys.stderr, flush=True)
    sys.exit(3)
i = a.index("--")
opts, cmd = a[:i], a[i + 1:]
out = opts[opts.index("--output") + 1]
time.sleep(0.2)
print("gpu-observer: ready", file=sys.stderr, flush=True)
p = subprocess.Popen(cmd, env=dict(os.environ, FAKE_JSONL=out))
print(f"gpu-observer: started pid {p.pid}", file=sys.stderr, flush=True)
sys.exit(p.wait())
EOF
    # The fake workload: --iters N --out F; per iteration one "launch" window
    # [launch_ts_ns, cupti_api_start_ns] around a nanosleep, page faults, a read() or a busy loop,
    # then normal ones; a second thread wakes up every millisecond.
    cat >"$F/cuda-ground-truth" <<'EOF'
#!/usr/bin/env python3
import json, mmap, os, sys, threading, time
a = sys.argv[1:]
iters = int(a[a.index("--iters") + 1])
outp = a[a.index("--out") + 1]
pid = os.getpid()
stop = False
def worker():
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write("fake-cupti")
    while not stop:
        time.sleep(0.001)
th = threading.Thread(target=worker, name="fake-cupti")
th.start()
fd = os.open("/dev/zero", os.O_RDONLY)
buf = bytearray(1 << 20)
lines = []
mono = time.monotonic_ns
kinds = ["sleep", "fault", "syscall", "busy", "normal", "normal"]
for i in range(iters):
    kind = kinds[i % len(kinds)]
    m = mmap.mmap(-1, 256 * 4096) if kind == "fault" else None
    time.sleep(0.002)
    t0 = mono()
    if kind == "sleep":
        time.sleep(0.0002)
    elif kind == "fault":
        for off in range(0, 256 * 4096, 4096):
            m[off] = 1
    elif kind == "syscall":
        os.readv(fd, [buf])
    elif kind == "busy":
        while mono() - t0 < 40_000:
            pass
    t1 = mono()
    if m is not None:
        m.close()
    lines.append({"type": "gpu_kernel", "ts_ns": t1 + 10_000, "pid": pid, "tid": threading.get_native_id(),
                  "comm": "cuda-ground-tru", "api": "cuLaunchKernel", "correlation_id": i, "kernel": kind,
                  "launch_ts_ns": t0, "cupti_api_start_ns": t1, "cupti_api_end_ns": t1 + 1000})
stop = True
th.join()
with open(os.environ["FAKE_JSONL"], "w") as f:
    for o in lines:
        f.write(json.dumps(o) + "\n")
with open(outp, "w") as f:
    json.dump({"pid": pid, "iters": iters}, f)
EOF
    chmod +x "$F/gpu-observer" "$F/cuda-ground-truth"
    : >"$F/libgpu_observer_cupti.so"
    rc=0
    env OBSERVER="$F/gpu-observer" GROUND_TRUTH="$F/cuda-ground-truth" GT_ITERS=60 RUNS=2 \
        CPU_BUF_KB=4096 TASK_BUF_KB=4096 WORK_DIR="$T/e2e-work" \
        bash "$GPU/trace_outliers.sh" "$T/e2e-out" >"$T/e2e.log" 2>&1 || rc=$?
    left=$(ls -d "$TRACEFS"/instances/gpuobs_* 2>/dev/null || true)
    if ((rc == 0)) && [[ -s $T/e2e-out/OUTLIERS.md && -s $T/e2e-out/outliers.json ]]; then
        ok "local tracefs: trace_outliers.sh ran end to end ($(grep -c 'run [0-9]: workload' "$T/e2e.log") runs)"
    else
        bad "local tracefs: trace_outliers.sh rc=$rc"
        tail -n 30 "$T/e2e.log" | sed 's/^/    /'
    fi
    if [[ -z $left && ! -d $TRACEFS/events/gpuobs ]]; then
        ok "local tracefs: no instance or kprobe left"
    else
        bad "local tracefs: left behind: $left"
    fi
    if [[ -s $T/e2e-out/outliers.json ]]; then
        if "$PYTHON" - "$T/e2e-out/outliers.json" "$T/e2e-out/trace-outliers-artifacts.tar.gz" <<'EOF'; then
import json, sys, tarfile
res = json.load(open(sys.argv[1]))
errs = []
by = {}
for r in res["outliers"]:
    by.setdefault(r["kernel"], []).append(r)
want = {"sleep": "off-cpu", "fault": "page-fault", "syscall": "syscall"}
for k, cat in want.items():
    rs = by.get(k, [])
    if len(rs) < 15:
        errs.append(f"{k}: {len(rs)} outliers (want 20)")
    good = [r for r in rs if r["category"] == cat]
    if len(good) < 0.8 * len(rs):
        errs.append(f"{k}: {len(good)}/{len(rs)} {cat}: " + "; ".join(sorted({r['verdict'] for r in rs if r['category'] != cat}))[:400])
rs = by.get("busy", [])
if len(rs) < 15 or sum(1 for r in rs if r["category"] == "user-mode") < 0.5 * len(rs):
    errs.append("busy: " + ", ".join(r["category"] for r in rs))
if any(r["faults_in_gap"] < 200 for r in by.get("fault", [])):
    errs.append("fault: fewer than 200 faults seen: " + str([r["faults_in_gap"] for r in by.get("fault", [])]))
ctl = res["controls"]
if not ctl or sum(1 for c in ctl if c["category"] == "user-mode") < 0.8 * len(ctl):
    errs.append("controls: " + ", ".join(c["category"] for c in ctl))
for run in res["runs"]:
    if (run["ns_precision_share"] or 0) < 0.99:
        errs.append(f"{run['name']}: ns share {run['ns_precision_share']}")
    mk = run["clock"]["markers"]
    if not mk or not (0 <= mk["min_ns"] < 1_000_000):
        errs.append(f"{run['name']}: clock markers {mk}")
    if "fake-cupti" not in run["process_threads"].values():
        errs.append(f"{run['name']}: threads {run['process_threads']}")
    if run["unparsed_lines"]:
        errs.append(f"{run['name']}: {run['unparsed_lines']} unparsed trace lines")
names = tarfile.open(sys.argv[2]).getnames()
for n in ("./run1/trace_cpu.txt.gz", "./run1/trace_task.raw.txt.gz", "./run1/events.jsonl.gz", "./run1/meta.txt"):
    if n not in names:
        errs.append(f"artifacts lack {n}")
for e in errs:
    print("   ", e)
sys.exit(1 if errs else 0)
EOF
            ok "local tracefs: nanosleep -> off-cpu, faults -> page-fault, read -> syscall, busy -> user-mode, controls clean"
        else
            bad "local tracefs: verdicts (see $T/e2e-out/OUTLIERS.md)"
            KEEP=1
        fi
    fi
    rc=0
    env OBSERVER="$F/gpu-observer" GROUND_TRUTH="$F/cuda-ground-truth" FAKE_MODE=die_early RUNS=1 \
        CPU_BUF_KB=1024 TASK_BUF_KB=1024 WORK_DIR="$T/fail-work" \
        bash "$GPU/trace_outliers.sh" "$T/fail-out" >"$T/fail.log" 2>&1 || rc=$?
    left=$(ls -d "$TRACEFS"/instances/gpuobs_* 2>/dev/null || true)
    if [[ -z $left && ! -d $TRACEFS/events/gpuobs ]]; then
        ok "observer failing before ready: rc=$rc, tracefs clean"
    else
        bad "observer failing before ready: left behind: $left"
    fi
fi
if [[ ${KEEP:-0} == 1 ]]; then
    trap - EXIT
    echo "kept $T"
fi
if ((fail)); then
    echo "trace_outliers self-test FAILED"
    exit 1
fi
echo "trace_outliers self-test passed"
