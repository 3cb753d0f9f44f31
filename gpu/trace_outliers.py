#!/usr/bin/env python3
"""Explain the launches whose CUPTI API start lags the uprobe's launch stamp, from an ftrace.

usage:
  trace_outliers.py --run DIR [--run DIR ...] [--md OUTLIERS.md] [--json outliers.json]
                    [--excerpts FILE] [--threshold-ns 5000] [--controls 24] [--margin-ns 2000]
                    [--max-events 400] [--context-ms 20] [--control-events]

Each DIR is one run left by gpu/trace_outliers.sh (other tools can produce the same layout):
  events.jsonl[.gz]        the observer's JSONL (`gpu-observer --format jsonl run --trace-all`)
  trace_cpu.txt[.gz]       ftrace text of the global instance: sched_switch, sched_wakeup,
                           sched_migrate_task, irq/softirq/tasklet entry+exit, irq_vectors
                           *_entry/*_exit, nmi_handler (every CPU, every task)
  trace_task.txt[.gz]      ftrace text of the pid-filtered instance (the observer, the workload
                           and every thread they start, via set_event_pid + event-fork):
                           raw_syscalls, exceptions:page_fault_*, sched_process_*, task_*,
                           tlb_flush, signal_deliver, and the optional kprobes gpuobs_unr /
                           gpuobs_unr_ret (uprobe_notify_resume) and gpuobs_hmf / gpuobs_hmf_ret
                           (handle_mm_fault)
  trace_{cpu,task}.raw.txt[.gz]  (optional) the same buffers read again with options/raw: one
                           "PID CPU TS_NS ..." line per entry, in the same order.  ftrace's text
                           format prints trace_clock=mono stamps in microseconds only; the raw
                           read gives the nanoseconds, and an entry's ns stamp is used only when
                           its pid, cpu and rounded microseconds agree with the text line
                           (otherwise the microsecond stamp, +-0.5 us, is kept; the report says
                           how many entries got ns precision)
  stats_cpu.txt, stats_task.txt  (optional) per-CPU ring-buffer stats ("cpu N" then the
                           kernel's per_cpu/cpuN/stats): overruns / dropped events are reported
  threads.txt              (optional) "TID COMM" lines sampled from /proc during the run
  meta.txt                 (optional) "key value" lines (workload_pid, observer_pid, kernel, ...)

Both instances use trace_clock=mono, i.e. CLOCK_MONOTONIC like bpf_ktime_get_ns (launch_ts_ns)
and CUPTI's API record (cupti_api_start_ns / cupti_api_end_ns).  Two checks of that are
reported: trace_marker lines "gpuobs_clock mono_ns=N" (N = clock_gettime(MONOTONIC) just before
the write; trace stamp - N should be a few us) and the observer's `ioctl` lines vs the nearest
sys_enter ioctl of the same thread.

Only the trace entries within --context-ms of the launches analysed are parsed (0: all), plus
thread creation/renames and the clock markers.  Every trace entry is recorded in the context of
the task current on its CPU, so a thread's on-CPU intervals come from the sched_switch stream and
from its own events (one proves it was on that CPU, another context's event on the CPU that it was
not): a switch-in missing from the trace (lost events, the start of a kept range, kernels that do
not record some idle -> task switches: seen on a 6.18 VM and locally) is inferred at the CPU's
last event in another context before the thread's own event (usually the wakeup), a missing
switch-out at the CPU's next event in another context; both are flagged, and off-CPU time is
never claimed past an event of the thread itself.

States whose end is not in the trace are capped at the first proof that they ended, flagged
"unterminated", and never counted beyond it:
  syscalls     a sys_exit closes the thread's open sys_enter whatever NR it prints (the uretprobe
               trampoline's syscall, NR 335 on x86-64 since Linux 6.11, and rt_sigreturn print
               their exit as NR -1); a sys_enter with no exit ends at the thread's next sys_enter,
               its next user page fault, or the next of the observer's uprobe stamps at a CUDA
               call's entry (launch_ts_ns; launch/memcpy/memset/sync ts_ns in the JSONL): the
               thread was in user mode there.  So nothing that started before launch_ts_ns is
               syscall time in the gap.
  IRQs         a handler with no exit ends at a sched_switch or a syscall/user fault on the CPU,
               at an event whose ftrace flags show task context, at a new entry of its level
               (hard IRQs and vectors do not nest, nor do softirqs), or at an outer handler's exit;
  kprobes      an entry with no return ends at the thread's next syscall event or user fault.

Outliers: gpu_kernel lines with cupti_api_start_ns - launch_ts_ns > --threshold-ns.  Controls:
for each outlier the nearest normal launch (|gap| <= threshold) of the same kernel and thread,
then evenly spread normal launches, --controls in all.  For each one, over the gap
[launch_ts_ns, cupti_api_start_ns] and over the whole call [launch_ts_ns, cupti_api_end_ns],
the thread's time is attributed, in this priority, to:
  off-CPU      the thread was switched out (sched_switch prev_state R/R+ = preempted, S =
               sleeping, D = blocked), with who ran instead and who woke it;
  irq          hard IRQ handlers (irq_handler_entry/exit, by name), softirqs (by action),
               x86 vectors (local_timer, reschedule, call_function, irq_work, ...) and NMIs on
               the CPU while the thread was on it (exclusive time; the entry/exit stubs around
               a handler are not covered, ~0.5-1 us per interrupt);
  fault        page-fault handling (handle_mm_fault kprobe; without kprobes faults are
               listed and counted but have no duration: their time stays in `unattributed`);
  uprobe       uprobe handling (uprobe_notify_resume kprobe: the BPF program and the single-step
               of the probed instruction; without kprobes: not measurable, stays unattributed);
  syscall      inside a system call (by name);
  unattributed what is left: user-mode work (the driver, CUPTI, lock spinning), plus the
               un-instrumented kernel entry/exit paths.
Verdict (category): the causes holding >= max(1 us, 25 % of the gap's excess over the normal
launches' median gap), largest first: off-cpu | irq | fault | uprobe | syscall, or mixed (no
cause has 75 % of the explained time); none -> page-fault if faults were seen (unmeasured), else
user-mode (nothing visible); unknown where the thread's scheduling is not in the trace.
"partly:" marks verdicts whose causes explain less than half of the excess.
The report also lists the other threads of the process (CUPTI's, the injection library's flush
thread, the driver's) and of the observer that were on a CPU during the gap, with their
syscalls, and every trace event of the thread and of its CPU(s) around the window.

Exit status: 0 report written (also with no outliers), 2 bad input.
"""

import argparse
import bisect
import gzip
import json
import os
import re
import sys
from collections import Counter, defaultdict

sys.dont_write_bytecode = True

# ---------------------------------------------------------------------------- syscall names

# x86_64 syscall numbers (the GPU machine is x86-64); others print as "NR n".
SYSCALLS_X86_64 = {
    0: "read", 1: "write", 2: "open", 3: "close", 4: "stat", 5: "fstat", 6: "lstat", 7: "poll",
    8: "lseek", 9: "mmap", 10: "mprotect", 11: "munmap", 12: "brk", 13: "rt_sigaction",
    14: "rt_sigprocmask", 15: "rt_sigreturn", 16: "ioctl", 17: "pread64", 18: "pwrite64",
    19: "readv", 20: "writev", 21: "access", 22: "pipe", 23: "select", 24: "sched_yield",
    25: "mremap", 26: "msync", 27: "mincore", 28: "madvise", 29: "shmget", 30: "shmat",
    31: "shmctl", 32: "dup", 33: "dup2", 34: "pause", 35: "nanosleep", 36: "getitimer",
    37: "alarm", 38: "setitimer", 39: "getpid", 40: "sendfile", 41: "socket", 42: "connect",
    43: "accept", 44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg", 48: "shutdown",
    49: "bind", 50: "listen", 51: "getsockname", 52: "getpeername", 53: "socketpair",
    54: "setsockopt", 55: "getsockopt", 56: "clone", 57: "fork", 58: "vfork", 59: "execve",
    60: "exit", 61: "wait4", 62: "kill", 63: "uname", 72: "fcntl", 73: "flock", 74: "fsync",
    75: "fdatasync", 76: "truncate", 77: "ftruncate", 78: "getdents", 79: "getcwd",
    80: "chdir", 82: "rename", 83: "mkdir", 84: "rmdir", 87: "unlink", 89: "readlink",
    95: "umask", 96: "gettimeofday", 97: "getrlimit", 98: "getrusage", 99: "sysinfo",
    102: "getuid", 104: "getgid", 107: "geteuid", 108: "getegid", 110: "getppid",
    111: "getpgrp", 112: "setsid", 131: "sigaltstack", 137: "statfs", 138: "fstatfs",
    140: "getpriority", 141: "setpriority", 149: "mlock", 150: "munlock", 157: "prctl",
    158: "arch_prctl", 186: "gettid", 200: "tkill", 201: "time", 202: "futex",
    203: "sched_setaffinity", 204: "sched_getaffinity", 213: "epoll_create", 217: "getdents64",
    218: "set_tid_address", 228: "clock_gettime", 229: "clock_getres", 230: "clock_nanosleep",
    231: "exit_group", 232: "epoll_wait", 233: "epoll_ctl", 234: "tgkill", 257: "openat",
    262: "newfstatat", 270: "pselect6", 271: "ppoll", 273: "set_robust_list",
    281: "epoll_pwait", 283: "timerfd_create", 284: "eventfd", 285: "fallocate",
    286: "timerfd_settime", 288: "accept4", 290: "eventfd2", 291: "epoll_create1", 292: "dup3",
    293: "pipe2", 302: "prlimit64", 309: "getcpu", 318: "getrandom", 319: "memfd_create",
    321: "bpf", 324: "membarrier", 332: "statx", 334: "rseq", 425: "io_uring_setup",
    426: "io_uring_enter", 434: "pidfd_open", 435: "clone3", 436: "close_range",
    437: "openat2", 439: "faccessat2", 441: "epoll_pwait2",
    # Linux >= 6.11: the uretprobe trampoline's syscall (the fast path for return probes, e.g.
    # the observer's uretprobes); the uretprobe handlers (BPF) run inside it, and its sys_exit
    # prints "NR -1" (like rt_sigreturn's: both rewrite the registers)
    335: "uretprobe",
}
NR_IOCTL = 16


def sysname(nr):
    """The traces come from the x86-64 GPU machine, wherever this runs."""
    if nr == -1:
        return "NR -1 (exit of uretprobe/rt_sigreturn)"
    return SYSCALLS_X86_64.get(nr, f"NR {nr}")

# ---------------------------------------------------------------------------- trace parsing

LINE_RX = re.compile(
    r"^\s*(?P<comm>.*?)-(?P<pid>\d+)\s+(?:\(\s*(?P<tgid>[-\d]+)\s*\)\s+)?\[(?P<cpu>\d+)\]\s+"
    r"(?:(?P<flags>[^\s\[\]]{3,8})\s+)?(?P<sec>\d+)\.(?P<frac>\d+):\s+(?P<name>[^:\s]+):\s?(?P<body>.*)$")
LOST_RX = re.compile(r"^\s*CPU:(\d+) \[LOST (\d+) EVENTS\]")
RAW_RX = re.compile(r"^(\d+) (\d+) (\d+) ")
ENTRIES_RX = re.compile(r"entries-in-buffer/entries-written:\s*(\d+)/(\d+)")

SWITCH_RX = re.compile(
    r"prev_comm=(?P<pc>.*?) prev_pid=(?P<pp>-?\d+) prev_prio=(?P<ppr>-?\d+) prev_state=(?P<ps>\S+)"
    r" ==> next_comm=(?P<nc>.*?) next_pid=(?P<np>-?\d+) next_prio=(?P<npr>-?\d+)")
WAKEUP_RX = re.compile(r"comm=(?P<c>.*?) pid=(?P<p>\d+) prio=(?P<pr>-?\d+).*?target_cpu=(?P<t>\d+)")
MIGRATE_RX = re.compile(r"comm=(?P<c>.*?) pid=(?P<p>\d+) prio=(?P<pr>-?\d+) orig_cpu=(?P<o>\d+) dest_cpu=(?P<d>\d+)")
FORK_RX = re.compile(r"comm=(?P<c>.*?) pid=(?P<p>\d+) child_comm=(?P<cc>.*?) child_pid=(?P<cp>\d+)")
NEWTASK_RX = re.compile(r"pid=(?P<p>\d+) comm=(?P<c>.*?) clone_flags=(?P<f>[0-9a-fA-Fx]+)")
RENAME_RX = re.compile(r"pid=(?P<p>\d+) oldcomm=(?P<o>.*?) newcomm=(?P<n>.*?) oom_score_adj")
SYS_ENTER_RX = re.compile(r"NR (?P<nr>-?\d+) \((?P<args>[^)]*)\)")
SYS_EXIT_RX = re.compile(r"NR (?P<nr>-?\d+) = (?P<ret>-?\d+)")
FAULT_RX = re.compile(r"address=(?P<a>\S+)\s+ip=(?P<ip>\S+)\s+error_code=(?P<e>\S+)")
IRQ_ENTRY_RX = re.compile(r"irq=(?P<irq>\d+) name=(?P<n>.*)$")
IRQ_EXIT_RX = re.compile(r"irq=(?P<irq>\d+) ret=(?P<r>\S+)")
SOFTIRQ_RX = re.compile(r"vec=(?P<v>\d+) \[action=(?P<a>[^\]]+)\]")
NMI_RX = re.compile(r"handler=(?P<h>\S+) delta_ns=(?P<d>\d+)")
TASKLET_RX = re.compile(r"(?:tasklet|func)=(?P<f>\S+)")
MARKER_RX = re.compile(r"gpuobs_clock mono_ns=(?P<n>\d+)")
KP_ADDR_RX = re.compile(r"address=(?P<a>0x[0-9a-fA-F]+)")

VECTOR_SKIP = ("vector_",)  # irq_vectors config events, not interrupts

CPU_TYPES = {"sched_switch", "sched_wakeup", "sched_wakeup_new", "sched_migrate_task",
             "irq_handler_entry", "irq_handler_exit", "softirq_entry", "softirq_exit",
             "tasklet_entry", "tasklet_exit", "nmi_handler"}


def is_vector(name):
    return (name.endswith("_entry") or name.endswith("_exit")) and not name.startswith(VECTOR_SKIP) \
        and name not in CPU_TYPES and name not in ("sys_enter", "sys_exit")


class Ev:
    __slots__ = ("ts", "cpu", "pid", "tgid", "comm", "name", "body", "src", "ns", "f", "flags")

    def __init__(self, ts, cpu, pid, tgid, comm, name, body, src, ns, flags=None):
        self.ts, self.cpu, self.pid, self.tgid, self.comm = ts, cpu, pid, tgid, comm
        self.name, self.body, self.src, self.ns = name, body, src, ns
        self.flags = flags
        self.f = None

    def ctx(self):
        """The context ftrace's flags give ('.' task, 's' softirq, 'h'/'H' hard IRQ, 'z'/'Z' NMI), or None."""
        fl = self.flags
        return fl[2] if fl and len(fl) >= 4 else None

    def fields(self):
        """Parsed body (a dict, cached); {} when it does not parse."""
        if self.f is None:
            self.f = parse_body(self.name, self.body)
        return self.f

    def line(self):
        t = f"({self.tgid})" if self.tgid is not None else ""
        return f"{self.comm}-{self.pid}{t} [{self.cpu:03d}] {self.name}: {self.body}"


def parse_body(name, body):
    m = None
    if name == "sched_switch":
        m = SWITCH_RX.search(body)
        if m:
            return {"prev_comm": m["pc"], "prev_pid": int(m["pp"]), "prev_state": m["ps"],
                    "next_comm": m["nc"], "next_pid": int(m["np"]), "next_prio": int(m["npr"]),
                    "prev_prio": int(m["ppr"])}
    elif name in ("sched_wakeup", "sched_wakeup_new", "sched_waking"):
        m = WAKEUP_RX.search(body)
        if m:
            return {"comm": m["c"], "pid": int(m["p"]), "target_cpu": int(m["t"])}
    elif name == "sched_migrate_task":
        m = MIGRATE_RX.search(body)
        if m:
            return {"comm": m["c"], "pid": int(m["p"]), "orig_cpu": int(m["o"]), "dest_cpu": int(m["d"])}
    elif name == "sched_process_fork":
        m = FORK_RX.search(body)
        if m:
            return {"comm": m["c"], "pid": int(m["p"]), "child_comm": m["cc"], "child_pid": int(m["cp"])}
    elif name == "task_newtask":
        m = NEWTASK_RX.search(body)
        if m:
            try:
                flags = int(m["f"], 16)
            except ValueError:
                flags = 0
            return {"pid": int(m["p"]), "comm": m["c"], "clone_flags": flags}
    elif name == "task_rename":
        m = RENAME_RX.search(body)
        if m:
            return {"pid": int(m["p"]), "oldcomm": m["o"], "newcomm": m["n"]}
    elif name == "sys_enter":
        m = SYS_ENTER_RX.search(body)
        if m:
            return {"nr": int(m["nr"]), "args": m["args"]}
    elif name == "sys_exit":
        m = SYS_EXIT_RX.search(body)
        if m:
            return {"nr": int(m["nr"]), "ret": int(m["ret"])}
    elif name in ("page_fault_user", "page_fault_kernel"):
        m = FAULT_RX.search(body)
        if m:
            return {"address": m["a"], "ip": m["ip"], "error_code": m["e"]}
    elif name == "irq_handler_entry":
        m = IRQ_ENTRY_RX.search(body)
        if m:
            return {"irq": int(m["irq"]), "irq_name": m["n"].strip()}
    elif name == "irq_handler_exit":
        m = IRQ_EXIT_RX.search(body)
        if m:
            return {"irq": int(m["irq"]), "ret": m["r"]}
    elif name in ("softirq_entry", "softirq_exit"):
        m = SOFTIRQ_RX.search(body)
        if m:
            return {"vec": int(m["v"]), "action": m["a"]}
    elif name in ("tasklet_entry", "tasklet_exit"):
        m = TASKLET_RX.search(body)
        if m:
            return {"func": m["f"]}
    elif name == "nmi_handler":
        m = NMI_RX.search(body)
        if m:
            return {"handler": m["h"], "delta_ns": int(m["d"])}
    elif name in ("gpuobs_hmf",):
        m = KP_ADDR_RX.search(body)
        return {"address": m["a"]} if m else {}
    return {}


def open_text(path):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, "r", encoding="utf-8", errors="replace")


def find_file(d, base):
    for p in (os.path.join(d, base), os.path.join(d, base + ".gz")):
        if os.path.exists(p):
            return p
    return None


class TraceFile:
    """One instance's text trace (and its raw read for ns stamps)."""

    def __init__(self, src):
        self.src = src
        self.events = []
        self.lost = []            # (cpu, count, ts of the next entry or None)
        self.entries = None       # (in buffer, written) from the header
        self.unparsed = 0
        self.raw_entries = 0
        self.ns_matched = 0
        self.skipped = 0
        self.first_ts = self.last_ts = None
        self.present = False


def raw_entries(path):
    """(pid, cpu, ts_ns) of each entry of a raw read, in order."""
    if not path:
        return
    with open_text(path) as f:
        for line in f:
            m = RAW_RX.match(line)
            if m:
                yield int(m.group(1)), int(m.group(2)), int(m.group(3))


TS_RX = re.compile(r"\]\s+(?:\S+\s+)?(\d+)\.(\d+):\s+([^:\s]+):")
# kept whatever their time (rare, and needed for thread names, process membership, clock checks)
ALWAYS = {"task_newtask", "task_rename", "sched_process_fork", "sched_process_exec", "sched_process_exit",
          "tracing_mark_write", "print"}


class Ranges:
    """Sorted, merged [start, end] time ranges: which trace entries to keep (None = all)."""

    def __init__(self, ranges):
        merged = []
        for s_, e_ in sorted(ranges):
            if merged and s_ <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e_)
            else:
                merged.append([s_, e_])
        self.r = merged
        self.starts = [x[0] for x in merged]

    def start_of(self, ts):
        """The start of the range holding ts, or None."""
        i = bisect.bisect_right(self.starts, ts) - 1
        if i >= 0 and ts <= self.r[i][1]:
            return self.r[i][0]
        return None

    def end_of(self, ts):
        """The end of the range holding ts, or None."""
        i = bisect.bisect_right(self.starts, ts) - 1
        if i >= 0 and ts <= self.r[i][1]:
            return self.r[i][1]
        return None


def read_trace(text_path, raw_path, src, keep=None):
    """Parse a text trace; with `keep` (Ranges), only entries inside it (and ALWAYS types).
    ns stamps come from the raw read, walked in step with the text entries."""
    tf = TraceFile(src)
    if not text_path:
        return tf
    tf.present = True
    raw = raw_entries(raw_path)
    buf = []          # raw entries read ahead, not yet paired
    raw_done = raw_path is None
    pending_lost = []
    evs = tf.events
    first = last = None
    with open_text(text_path) as f:
        for line in f:
            if line.startswith("#"):
                m = ENTRIES_RX.search(line)
                if m:
                    tf.entries = (int(m.group(1)), int(m.group(2)))
                continue
            mt = TS_RX.search(line)
            if not mt:
                ml = LOST_RX.match(line)
                if ml:
                    pending_lost.append((int(ml.group(1)), int(ml.group(2))))
                elif line.strip():
                    tf.unparsed += 1
                continue
            frac = mt.group(2)
            ts = int(mt.group(1)) * 1_000_000_000 + int(frac[:9].ljust(9, "0"))
            if first is None:
                first = ts
            last = ts
            if pending_lost:
                tf.lost.extend((c, n, ts) for c, n in pending_lost)
                pending_lost = []
            while not raw_done and len(buf) < 8:
                try:
                    buf.append(next(raw))
                    tf.raw_entries += 1
                except StopIteration:
                    raw_done = True
            if keep is not None and mt.group(3) not in ALWAYS and keep.start_of(ts) is None:
                if buf:
                    buf.pop(0)  # this entry's raw line (checked on the next kept entry)
                tf.skipped += 1
                continue
            m = LINE_RX.match(line)
            if not m:
                tf.unparsed += 1
                if buf:
                    buf.pop(0)
                continue
            precise = len(frac) >= 9
            pid = int(m.group("pid"))
            cpu = int(m.group("cpu"))
            if not precise and buf:
                us = ts // 1000
                # this entry's raw line, or one of the next few (an entry the text lacks)
                for k in range(min(6, len(buf))):
                    rp, rc, rts = buf[k]
                    if rp == pid and rc == cpu and (rts + 500) // 1000 == us:
                        ts = rts
                        precise = True
                        del buf[:k + 1]
                        tf.ns_matched += 1
                        break
            tg = m.group("tgid")
            tgid = int(tg) if tg and tg.isdigit() else None
            evs.append(Ev(ts, cpu, pid, tgid, m.group("comm").strip(), m.group("name"), m.group("body"), src,
                          precise, m.group("flags")))
    tf.lost.extend((c, n, None) for c, n in pending_lost)
    tf.first_ts, tf.last_ts = first, last
    return tf


def read_stats(path):
    """per-CPU ring-buffer stats: {cpu: {key: int}}."""
    out = {}
    if not path or not os.path.exists(path):
        return out
    cpu = None
    with open_text(path) as f:
        for line in f:
            line = line.strip()
            m = re.match(r"^cpu\s*(\d+)$", line)
            if m:
                cpu = int(m.group(1))
                out[cpu] = {}
                continue
            if cpu is None or ":" not in line:
                continue
            k, v = line.split(":", 1)
            v = v.strip().split()
            if v and re.match(r"^-?\d+$", v[0]):
                out[cpu][k.strip()] = int(v[0])
    return out


def read_kv(path):
    out = {}
    if path and os.path.exists(path):
        with open_text(path) as f:
            for line in f:
                line = line.rstrip("\n")
                if not line or line.startswith("#"):
                    continue
                k, _, v = line.partition(" ")
                out[k] = v.strip()
    return out


# ---------------------------------------------------------------------------- the model


class Interval:
    """A stretch of a thread on one CPU; start_how / end_how say how its ends are known."""
    __slots__ = ("start", "end", "cpu", "start_known", "end_known", "out_state", "out_next", "in_prev",
                 "start_how", "end_how")

    def __init__(self, start, cpu, start_known, in_prev):
        self.start, self.cpu, self.start_known, self.in_prev = start, cpu, start_known, in_prev
        self.end, self.end_known, self.out_state, self.out_next = None, False, None, None
        self.start_how = self.end_how = None


# interrupt nesting levels: an entry closes the open handlers of its level and above (their exits
# are not in the trace); hard IRQs and vectors do not nest, a softirq does not run inside a hard IRQ
IRQ_LEVEL = {"softirq": 1, "tasklet": 2, "hardirq": 3, "vector": 3, "nmi": 4}
# how long after its sched_switch the switched-out task's events are still taken for the switch's
SWITCH_PATH_NS = 50_000
# the entry stamps of these JSONL lines are the observer's uprobes at a CUDA call's entry (an int3
# trap from user code): the thread was in user mode just before
UPROBE_ENTRY_TYPES = ("launch", "memcpy", "memset", "sync")


class Segment:
    __slots__ = ("start", "end", "kind", "label")

    def __init__(self, start, end, kind, label):
        self.start, self.end, self.kind, self.label = start, end, kind, label


def clip(a, b, s, e):
    s2, e2 = max(a, s), min(b, e)
    return (s2, e2) if e2 > s2 else None


class Run:
    """One run: its JSONL and its two traces, indexed."""

    def __init__(self, d, name):
        """The run's JSONL, meta and thread samples; load_traces() reads the traces."""
        self.dir, self.name = d, name
        self.meta = read_kv(os.path.join(d, "meta.txt"))
        self.stats = {"cpu": read_stats(os.path.join(d, "stats_cpu.txt")),
                      "task": read_stats(os.path.join(d, "stats_task.txt"))}
        self.jsonl_path = find_file(d, "events.jsonl")
        self.lines = []
        self.bad_lines = 0
        if self.jsonl_path:
            with open_text(self.jsonl_path) as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        o = json.loads(line)
                    except ValueError:
                        self.bad_lines += 1
                        continue
                    if isinstance(o, dict):
                        self.lines.append(o)
        # tid -> sorted uprobe stamps at CUDA calls' entries: proofs that the thread was in user mode
        um = defaultdict(set)
        for o in self.lines:
            tid = o.get("tid")
            if not isinstance(tid, int):
                continue
            t = o.get("ts_ns") if o.get("type") in UPROBE_ENTRY_TYPES else \
                o.get("launch_ts_ns") if o.get("type") == "gpu_kernel" else None
            if isinstance(t, int):
                um[tid].add(t)
        self.umode = {t: sorted(v) for t, v in um.items()}
        self.proc_threads = defaultdict(set)   # tid -> comms from /proc sampling
        tp = os.path.join(d, "threads.txt")
        if os.path.exists(tp):
            with open_text(tp) as f:
                for line in f:
                    p = line.rstrip("\n").split(" ", 1)
                    if len(p) == 2 and p[0].isdigit():
                        self.proc_threads[int(p[0])].add(p[1])
        self.keep = None

    def load_traces(self, keep=None):
        """Read both traces (only the entries inside `keep`, a Ranges, if given) and index them."""
        self.keep = keep
        d = self.dir
        self.cpu = read_trace(find_file(d, "trace_cpu.txt"), find_file(d, "trace_cpu.raw.txt"), "cpu", keep)
        self.task = read_trace(find_file(d, "trace_task.txt"), find_file(d, "trace_task.raw.txt"), "task", keep)
        self._merge()
        self._index()

    def drop_traces(self):
        """Free the parsed traces (the results keep what they need)."""
        for k in ("events", "all_ts", "by_cpu", "by_tid", "about_tid", "cpu_ts", "tid_ts", "about_ts", "switches",
                  "iv", "iv_start", "segs", "seg_start", "sys", "faults", "kp", "all_by_cpu", "all_cpu_ts"):
            setattr(self, k, None)
        self.cpu.events = []
        self.task.events = []

    # -- merging the two instances
    def _merge(self):
        cpu_names = {e.name for e in self.cpu.events} - {"tracing_mark_write", "print"}
        evs = list(self.cpu.events)
        for e in self.task.events:
            if e.name in cpu_names:
                continue  # the global instance has the same event type (all tasks)
            evs.append(e)
        evs.sort(key=lambda e: e.ts)
        self.events = evs
        self.all_ts = [e.ts for e in evs]
        firsts = [x for x in (self.cpu.first_ts, self.task.first_ts) if x is not None]
        lasts = [x for x in (self.cpu.last_ts, self.task.last_ts) if x is not None]
        self.first_ts = min(firsts) if firsts else None
        self.last_ts = max(lasts) if lasts else None
        self.ns_share = None
        tot = len(self.cpu.events) + len(self.task.events)
        if tot:
            self.ns_share = (sum(1 for e in self.cpu.events if e.ns) + sum(1 for e in self.task.events if e.ns)) / tot

    def _index(self):
        self.by_cpu = defaultdict(list)      # cpu -> events seen on that CPU (global instance)
        self.all_by_cpu = defaultdict(list)  # cpu -> events of both instances on that CPU
        self.by_tid = defaultdict(list)      # tid -> events in that thread's context
        self.about_tid = defaultdict(list)   # tid -> wakeups/migrations/switches of it
        self.cpu_first = {}
        self.comms = defaultdict(Counter)    # tid -> comm -> count
        self.tgid = {}                       # tid -> tgid
        self.switches = []
        self.markers = []
        cpu_src_present = self.cpu.present
        for e in self.events:
            if e.cpu not in self.cpu_first:
                self.cpu_first[e.cpu] = e.ts
            if e.src == "cpu" or not cpu_src_present:
                self.by_cpu[e.cpu].append(e)
            self.all_by_cpu[e.cpu].append(e)
            if e.pid:
                self.by_tid[e.pid].append(e)
                if e.comm and e.comm != "<...>":
                    self.comms[e.pid][e.comm] += 1
                if e.tgid is not None and e.tgid > 0:
                    self.tgid.setdefault(e.pid, e.tgid)
            n = e.name
            if n == "sched_switch":
                f = e.fields()
                if f:
                    self.switches.append(e)
                    for k, c in (("prev_pid", "prev_comm"), ("next_pid", "next_comm")):
                        if f[k]:
                            self.about_tid[f[k]].append(e)
                            self.comms[f[k]][f[c]] += 1
            elif n in ("sched_wakeup", "sched_wakeup_new", "sched_migrate_task"):
                f = e.fields()
                if f:
                    self.about_tid[f["pid"]].append(e)
                    self.comms[f["pid"]][f["comm"]] += 1
            elif n == "task_newtask":
                f = e.fields()
                if f:
                    self.comms[f["pid"]][f["comm"]] += 1
                    if f["clone_flags"] & 0x10000:  # CLONE_THREAD
                        tg = self.tgid.get(e.pid, e.tgid if e.tgid else e.pid)
                        self.tgid.setdefault(f["pid"], tg)
                    else:
                        self.tgid.setdefault(f["pid"], f["pid"])
            elif n == "task_rename":
                f = e.fields()
                if f:
                    self.comms[f["pid"]][f["newcomm"]] += 1
            elif n == "tracing_mark_write" or n == "print":
                m = MARKER_RX.search(e.body)
                if m:
                    self.markers.append((e.src, e.ts - int(m.group("n")), e.ns))
        for tid, names in self.proc_threads.items():
            for c in names:
                self.comms[tid][c] += 1
        self.cpu_ts = {c: [e.ts for e in l] for c, l in self.by_cpu.items()}
        self.all_cpu_ts = {c: [e.ts for e in l] for c, l in self.all_by_cpu.items()}
        self.tid_ts = {t: [e.ts for e in l] for t, l in self.by_tid.items()}
        self.about_ts = {t: [e.ts for e in l] for t, l in self.about_tid.items()}
        self.unterminated = Counter()
        self._intervals()
        self._irq_segments()
        self._per_thread()

    def _intervals(self):
        """Per-thread on-CPU intervals: from the sched_switch stream, and from whose context each
        trace entry on a CPU was recorded in (both instances).

        Every entry is recorded in the context of the task current on its CPU, so an event of the
        thread itself proves it was running there, and an event of another context (another task,
        the idle task) proves it was not.  A switch-in missing from the trace (lost events, the start
        of a kept range, kernels that do not record some idle -> task switches: seen on a 6.18 VM)
        is inferred at the CPU's last event in another context before the thread's first own event
        (the earliest it can have been switched in); a missing switch-out at the CPU's first event
        in another context (the latest it can have ended).  Both are flagged (start_how / end_how),
        and off-CPU time is never claimed past an event of the thread itself.  Nothing is carried
        over a hole between kept trace ranges."""
        self.iv = defaultdict(list)
        self.inferred_switch_ins = 0
        self.inferred_switch_outs = 0
        cur = {}        # cpu -> (tid, Interval) of the non-idle task running there
        where = {}      # tid -> the cpu where it has an open interval
        last_out = {}   # tid -> its last switch-out (seen or inferred)
        last_own = {}   # (tid, cpu) -> its last own event there
        # cpu -> (ts, prev_pid) of its last sched_switch, while no other context's event followed it:
        # the switched-out task's events then (tlb_flush "flush on task switch", or stamped to the
        # us with the switch) belong to the switch itself, not to a new stretch on the CPU
        last_sw = {}
        ranges = self.keep.r if self.keep is not None else None
        ri = 0

        def close(c, ts, how, count=True):
            held = cur.pop(c, None)
            if held is None:
                return
            tid, iv = held
            iv.end, iv.end_known, iv.end_how = max(ts, iv.start), False, how
            if where.get(tid) == c:
                del where[tid]
            last_out[tid] = iv.end
            if count:
                self.inferred_switch_outs += 1

        def infer_in(c, tid, ts, how):
            start = self._inferred_start(c, tid, ts, last_out.get(tid))
            c2 = where.get(tid)
            if c2 is not None and c2 != c:
                # still open on another CPU: it left that one before it came here
                close(c2, min(ts, max(start, last_own.get((tid, c2), start))),
                      "inferred: seen on another CPU (switch-out not in the trace)")
                start = max(start, last_out[tid])
            iv = Interval(start, c, False, None)
            iv.start_how = how
            self.iv[tid].append(iv)
            self.inferred_switch_ins += 1
            cur[c] = (tid, iv)
            where[tid] = c
            return iv

        for e in self.events:
            c, p = e.cpu, e.pid
            if ranges is not None:
                moved = False
                while ri < len(ranges) and e.ts > ranges[ri][1]:
                    ri += 1
                    moved = True
                if moved and ri > 0:
                    # a hole in the kept trace: nothing is known across it
                    for c0 in list(cur):
                        close(c0, ranges[ri - 1][1], "end of a kept trace range", False)
                    last_sw.clear()
            held = cur.get(c)
            sw = last_sw.get(c)
            if sw is not None and p != sw[1]:
                del last_sw[c]
                sw = None
            f = e.fields() if e.name == "sched_switch" else None
            if f:
                prev, nxt = f["prev_pid"], f["next_pid"]
                if prev:
                    if held is not None and held[0] == prev:
                        iv = held[1]
                    else:
                        if held is not None:
                            close(c, e.ts, "inferred: another task was switched out (switch-out not in the trace)")
                        iv = infer_in(c, prev, e.ts, "inferred: switched out, switch-in not in the trace")
                    iv.end, iv.end_known, iv.end_how = e.ts, True, "sched_switch"
                    iv.out_state = f["prev_state"]
                    iv.out_next = (f["next_comm"], nxt)
                    last_out[prev] = e.ts
                    last_own[(prev, c)] = e.ts
                    cur.pop(c, None)
                    if where.get(prev) == c:
                        del where[prev]
                elif held is not None:
                    close(c, e.ts, "inferred: the idle task ran (switch-out not in the trace)")
                if nxt:
                    c2 = where.get(nxt)
                    if c2 is not None and c2 != c:
                        close(c2, max(cur[c2][1].start, min(e.ts, last_own.get((nxt, c2), e.ts))),
                              "inferred: switched in on another CPU (switch-out not in the trace)")
                    iv = Interval(e.ts, c, True, (f["prev_comm"], prev, f["prev_state"]))
                    iv.start_how = "sched_switch"
                    self.iv[nxt].append(iv)
                    cur[c] = (nxt, iv)
                    where[nxt] = c
                last_sw[c] = (e.ts, prev)
                continue
            if held is not None and held[0] == p:
                last_own[(p, c)] = e.ts
                continue
            if sw is not None and e.ts - sw[0] <= SWITCH_PATH_NS:
                continue  # the switched-out task's event in the switch path (see last_sw)
            if p == 0:
                if held is not None:
                    close(c, e.ts, "inferred: the idle task ran (switch-out not in the trace)")
                continue
            if held is not None:
                close(c, e.ts, "inferred: another task ran (switch-out not in the trace)")
            infer_in(c, p, e.ts, "inferred: own event (switch-in not in the trace)")
            last_own[(p, c)] = e.ts
        for c, (tid, iv) in cur.items():
            iv.end, iv.end_how = max(iv.start, self.last_ts), "end of the trace"
        for tid, l in self.iv.items():
            l.sort(key=lambda i: i.start)
        self.iv_start = {t: [i.start for i in l] for t, l in self.iv.items()}

    def _inferred_start(self, cpu, tid, t, prev_out):
        """Earliest time tid can have been switched in on cpu before t (no switch-in seen): after the
        CPU's last event in another context, its own previous switch-out and the kept range's start."""
        lst, tss = self.all_by_cpu.get(cpu, []), self.all_cpu_ts.get(cpu, [])
        i = bisect.bisect_left(tss, t) - 1
        start = None
        while i >= 0:
            e = lst[i]
            if e.pid != tid:
                start = e.ts
                break
            i -= 1
        if start is None:
            start = self.cpu_first.get(cpu, t)
        if prev_out is not None and prev_out > start:
            start = prev_out
        if self.keep is not None:
            rs = self.keep.start_of(t)
            if rs is not None and rs > start:
                start = rs  # nothing is known before the kept range
        return min(start, t)

    def _irq_segments(self):
        """Exclusive interrupt-context segments per CPU (a nested handler's time is its own).

        A handler whose exit is not in the trace is closed where the CPU is proven out of it, and
        labelled "(unterminated)": a sched_switch; a syscall or user page fault of the task on the
        CPU; an event whose ftrace flags show task context ('.'; 's' = softirq ends hard-IRQ
        handlers only); a new entry of the same level (hard IRQs and vectors do not nest, softirqs
        do not nest, a softirq does not run inside a hard IRQ); the exit of an outer handler."""
        self.segs = defaultdict(list)
        for c, evs in self.all_by_cpu.items():
            stack = []  # [kind, label, key, since, entry stamp in ns (not us)]
            out = self.segs[c]

            def emit(top, ts, flag=""):
                if flag:
                    self.unterminated["irq"] += 1
                if ts > top[3]:
                    out.append(Segment(top[3], ts, top[0], top[1] + flag))

            def unwind(ts, level, e=None):
                """Close, unterminated, every open handler of this level or above (for a proof event e:
                not one stamped, to the us, with the handler's entry: it may have come before it)."""
                closed = False
                while stack and IRQ_LEVEL[stack[-1][0]] >= level:
                    top = stack[-1]
                    if e is not None and not (e.ns and top[4]) and e.ts - top[3] <= 1000:
                        break
                    emit(stack.pop(), ts, " (unterminated)")
                    closed = True
                if closed and stack:
                    stack[-1][3] = ts

            for e in evs:
                n = e.name
                kind = key = label = None
                entry = None
                if n == "irq_handler_entry" or n == "irq_handler_exit":
                    f = e.fields()
                    if not f:
                        continue
                    kind, key = "hardirq", ("irq", f["irq"])
                    entry = n.endswith("entry")
                    label = f"irq {f['irq']} {f['irq_name']}" if entry else None
                elif n == "softirq_entry" or n == "softirq_exit":
                    f = e.fields()
                    if not f:
                        continue
                    kind, key, label = "softirq", ("softirq", f["vec"]), f"softirq {f['action']}"
                    entry = n.endswith("entry")
                elif n == "tasklet_entry" or n == "tasklet_exit":
                    f = e.fields()
                    kind, key, label = "tasklet", ("tasklet",), f"tasklet {f.get('func', '?')}"
                    entry = n.endswith("entry")
                elif n == "nmi_handler":
                    f = e.fields()
                    if f:
                        s = e.ts - f["delta_ns"]
                        out.append(Segment(s, e.ts, "nmi", f"nmi {f['handler']}"))
                    continue
                elif is_vector(n):
                    base = n.rsplit("_", 1)[0]
                    kind, key, label = "vector", ("vec", base), f"vector {base}"
                    entry = n.endswith("_entry")
                else:
                    if stack:
                        if n in ("sched_switch", "sys_enter", "sys_exit", "page_fault_user"):
                            unwind(e.ts, 0, e)
                        else:
                            cx = e.ctx()
                            if cx == ".":
                                unwind(e.ts, 0, e)
                            elif cx == "s":
                                unwind(e.ts, IRQ_LEVEL["hardirq"], e)
                    continue
                if entry:
                    unwind(e.ts, IRQ_LEVEL[kind])
                    if stack:
                        emit(stack[-1], e.ts)
                    stack.append([kind, label, key, e.ts, e.ns])
                else:
                    idx = None
                    for i in range(len(stack) - 1, -1, -1):
                        if stack[i][2] == key:
                            idx = i
                            break
                    if idx is None:
                        continue  # entered before the trace began
                    # anything above it never saw its exit: close it here too
                    while len(stack) > idx + 1:
                        emit(stack.pop(), e.ts, " (unterminated)")
                    emit(stack.pop(), e.ts)
                    if stack:
                        stack[-1][3] = e.ts
            out.sort(key=lambda s: s.start)
        self.seg_start = {c: [s.start for s in l] for c, l in self.segs.items()}

    def _per_thread(self):
        """Syscall intervals, faults and kprobe intervals per thread.

        A syscall ends at the thread's next sys_exit, whatever NR that prints (uretprobe's and
        rt_sigreturn's exits print NR -1).  One with no exit before the thread's next sys_enter, or
        before a proof that the thread was in user mode (a page_fault_user of it, or one of the
        observer's uprobe stamps at a CUDA call's entry: launch_ts_ns, launch/memcpy/memset/sync
        ts_ns), ends there and is flagged "unterminated"; a sys_exit with no sys_enter starts at
        the thread's last such proof (or previous sys_exit), flagged "enter not in the trace".
        The kprobe intervals (uprobe / fault handling) are capped the same way."""
        self.sys = defaultdict(list)      # tid -> [start, end, nr, args, ret, flag, exit_nr]
        self.faults = defaultdict(list)   # tid -> (ts, kind, address, ip, error_code)
        self.kp = defaultdict(list)       # tid -> [start, end, kind, info, flag]
        self.kprobes_seen = Counter()
        for tid in set(self.by_tid) | set(self.umode):
            evs = self.by_tid.get(tid, [])
            proofs = self.umode.get(tid, [])
            pi = 0
            open_sys = None
            open_kp = {}
            last_user = None   # the last time the thread is known to have been in user mode
            sysl, kpl = self.sys[tid], self.kp[tid]

            def end_sys(ts, flag):
                nonlocal open_sys
                open_sys[1], open_sys[5] = max(ts, open_sys[0]), flag
                sysl.append(open_sys)
                self.unterminated["syscall"] += 1
                open_sys = None

            def end_kp(kinds, ts, flag):
                for k in [k for k, v in open_kp.items() if v[2] in kinds]:
                    iv = open_kp.pop(k)
                    iv[1], iv[4] = max(ts, iv[0]), flag
                    kpl.append(iv)
                    self.unterminated["kprobe"] += 1

            for e in evs + [None]:
                t_e = e.ts if e is not None else None
                while pi < len(proofs) and (t_e is None or proofs[pi] <= t_e):
                    p = proofs[pi]
                    pi += 1
                    if open_sys is not None and open_sys[0] < p:
                        end_sys(p, "unterminated: the thread was in user mode (uprobe stamp)")
                    end_kp(("fault",), p, "unterminated: the thread was in user mode (uprobe stamp)")
                    last_user = p
                if e is None:
                    break
                n = e.name
                if n == "sys_enter":
                    f = e.fields()
                    if not f:
                        continue
                    if open_sys is not None:
                        end_sys(e.ts, "unterminated: next sys_enter")
                    end_kp(("fault", "uprobe"), e.ts, "unterminated: sys_enter")
                    open_sys = [e.ts, None, f["nr"], f["args"], None, None, None]
                elif n == "sys_exit":
                    f = e.fields()
                    if not f:
                        continue
                    end_kp(("uprobe",), e.ts, "unterminated: sys_exit")
                    if open_sys is not None:
                        open_sys[1], open_sys[4], open_sys[6] = e.ts, f["ret"], f["nr"]
                        sysl.append(open_sys)
                        open_sys = None
                    else:
                        st = last_user
                        if self.keep is not None:
                            rs = self.keep.start_of(e.ts)
                            if rs is not None and (st is None or rs > st):
                                st = rs
                        sysl.append([st, e.ts, f["nr"], "", f["ret"], "enter not in the trace", f["nr"]])
                    last_user = e.ts
                elif n in ("page_fault_user", "page_fault_kernel"):
                    f = e.fields()
                    self.faults[tid].append((e.ts, "user" if n.endswith("user") else "kernel",
                                             f.get("address"), f.get("ip"), f.get("error_code")))
                    if n == "page_fault_user":
                        if open_sys is not None:
                            end_sys(e.ts, "unterminated: the thread was in user mode (page_fault_user)")
                        end_kp(("fault", "uprobe"), e.ts, "unterminated: page_fault_user")
                        last_user = e.ts
                elif n.startswith("gpuobs_"):
                    self.kprobes_seen[n] += 1
                    if n in ("gpuobs_unr", "gpuobs_hmf"):
                        info = e.fields().get("address") if n == "gpuobs_hmf" else None
                        if n in open_kp:
                            end_kp((open_kp[n][2],), e.ts, "unterminated: next entry")
                        open_kp[n] = [e.ts, None, "uprobe" if n == "gpuobs_unr" else "fault", info, None]
                    elif n in ("gpuobs_unr_ret", "gpuobs_hmf_ret"):
                        k = n[:-4]
                        if k in open_kp:
                            iv = open_kp.pop(k)
                            iv[1] = e.ts
                            kpl.append(iv)
            if open_sys is not None:
                rend = self.keep.end_of(open_sys[0]) if self.keep is not None else None
                end_sys(rend if rend is not None else self.last_ts, "unterminated: no exit in the trace")
        for d in (self.sys, self.kp):
            for tid, l in list(d.items()):
                if not l:
                    del d[tid]
                    continue
                l.sort(key=lambda x: x[0] if x[0] is not None else x[1])

    # -- queries
    def comm(self, tid):
        c = self.comms.get(tid)
        if not c:
            return "?"
        return c.most_common(1)[0][0]

    def on_cpu(self, tid, a, b):
        """[(start, end, cpu, Interval)] of tid clipped to [a, b]."""
        out = []
        l = self.iv.get(tid)
        if not l:
            return out
        i = max(0, bisect.bisect_right(self.iv_start[tid], a) - 2)
        for iv in l[i:]:
            if iv.start >= b:
                break
            end = iv.end if iv.end is not None else self.last_ts
            c = clip(a, b, iv.start, end)
            if c:
                out.append((c[0], c[1], iv.cpu, iv))
        return out

    def known_span(self, tid):
        l = self.iv.get(tid)
        if not l:
            return None
        return (l[0].start, max(i.end or self.last_ts for i in l))

    def cpu_at(self, tid, t):
        """The CPU tid was on at t (or last on before t), and how it is known."""
        l = self.iv.get(tid)
        if l:
            i = bisect.bisect_right(self.iv_start[tid], t) - 1
            if i >= 0:
                return l[i].cpu, "sched_switch" if l[i].start_known else "its own events (switch-in inferred)"
            return l[0].cpu, "sched_switch (next)"
        ts = self.tid_ts.get(tid)
        if ts:
            i = bisect.bisect_left(ts, t)
            cands = [j for j in (i - 1, i) if 0 <= j < len(ts)]
            j = min(cands, key=lambda j: abs(ts[j] - t))
            return self.by_tid[tid][j].cpu, "own events"
        return None, "unknown"

    def segs_in(self, cpu, a, b):
        l = self.segs.get(cpu, [])
        if not l:
            return []
        i = max(0, bisect.bisect_left(self.seg_start[cpu], a) - 8)
        out = []
        for s in l[i:]:
            if s.start >= b:
                break
            c = clip(a, b, s.start, s.end)
            if c:
                out.append((c[0], c[1], s))
        return out

    def events_between(self, lst, tss, a, b):
        i = bisect.bisect_left(tss, a)
        j = bisect.bisect_right(tss, b)
        return lst[i:j]

    def lost_near(self, cpus, a, b):
        """Lost-event markers on these CPUs before b (their window may be incomplete)."""
        out = []
        for tf in (self.cpu, self.task):
            for c, n, ts in tf.lost:
                if c in cpus and (ts is None or ts <= b + 1_000_000):
                    if ts is None or ts >= a - 1_000_000_000:
                        out.append((tf.src, c, n, ts))
        return out


# ---------------------------------------------------------------------------- analysis

PRIO = {"offcpu": 0, "irq": 1, "fault": 2, "uprobe": 3, "syscall": 4}
CAUSES = ("offcpu", "irq", "fault", "uprobe", "syscall", "unattributed")
STATE_NAMES = {"R": "preempted", "R+": "preempted", "S": "sleeping", "D": "blocked (D)",
               "I": "idle (I)", "T": "stopped", "t": "traced", "X": "dead", "Z": "zombie"}


def state_name(s):
    if s is None:
        return "unknown"
    if s in STATE_NAMES:
        return STATE_NAMES[s]
    if s.startswith("R"):
        return "preempted"
    if s.startswith("D"):
        return "blocked (D)"
    if s.startswith("S"):
        return "sleeping"
    return f"state {s}"


def account(run, tid, a, b):
    """Attribute [a, b] of tid's time to causes; returns (totals, details, labeled intervals)."""
    labeled = []   # (start, end, cat, label)
    totals = dict.fromkeys(CAUSES, 0)
    details = Counter()
    if b <= a:
        return totals, details, labeled, {}
    on = run.on_cpu(tid, a, b)
    span = run.known_span(tid)
    coverage = "full"
    if span is None:
        coverage = "no sched_switch of this thread"
    # off-CPU: the complement of the on-CPU intervals within [a, b] (inside the known span)
    if span is not None:
        lo, hi = max(a, span[0]), min(b, span[1])
        if lo > a or hi < b:
            coverage = "partial (thread's known span)"
        cur = lo
        prev_iv = None
        # the interval before a, for the state it left in
        l = run.iv.get(tid, [])
        i0 = bisect.bisect_right(run.iv_start.get(tid, []), lo) - 1
        if i0 >= 0:
            prev_iv = l[i0]
        for s, e, c, iv in on:
            if s > cur:
                labeled.append((cur, s, "offcpu", offcpu_label(prev_iv)))
            cur = max(cur, e)
            prev_iv = iv
        if cur < hi:
            labeled.append((cur, hi, "offcpu", offcpu_label(prev_iv)))
    # interrupts on the CPU while the thread was on it
    for s, e, c, iv in on:
        for s2, e2, seg in run.segs_in(c, s, e):
            labeled.append((s2, e2, "irq", seg.label))
    if span is None:
        # no scheduler view of the thread: use the CPU its own events name
        c, how = run.cpu_at(tid, a)
        if c is not None:
            for s2, e2, seg in run.segs_in(c, a, b):
                labeled.append((s2, e2, "irq", seg.label))
    for s, e, kind, info, flag in run.kp.get(tid, ()):
        if s is None or e is None:
            continue
        if s >= b:
            break
        cl = clip(a, b, s, e)
        if cl:
            lbl = "page fault (handle_mm_fault)" if kind == "fault" else "uprobe handling"
            labeled.append((cl[0], cl[1], kind, lbl + (" (unterminated)" if flag else "")))
    for s, e, nr, args, ret, flag, exit_nr in run.sys.get(tid, ()):
        # every syscall has an end: its sys_exit, or where the thread is proven out of it
        s2 = s if s is not None else a
        e2 = e if e is not None else s2
        if s2 >= b:
            break
        cl = clip(a, b, s2, e2)
        if cl:
            labeled.append((cl[0], cl[1], "syscall", syscall_label(nr, flag)))
    # sweep: each elementary piece goes to the highest-priority label covering it
    pts = sorted({a, b} | {x for s, e, _, _ in labeled for x in (s, e) if a <= x <= b})
    for p, q in zip(pts, pts[1:]):
        if q <= p:
            continue
        best = None
        for s, e, cat, label in labeled:
            if s <= p and e >= q and (best is None or PRIO[cat] < PRIO[best[0]]):
                best = (cat, label)
        if best is None:
            totals["unattributed"] += q - p
            details["unattributed (user-mode or untraced kernel)"] += q - p
        else:
            totals[best[0]] += q - p
            details[best[1]] += q - p
    return totals, details, labeled, {"coverage": coverage}


def offcpu_label(prev_iv):
    """The label of an off-CPU stretch after the interval prev_iv."""
    if prev_iv is not None and not prev_iv.end_known:
        return "off-CPU (switch-out not in the trace: another context ran on its CPU)"
    return f"off-CPU {state_name(prev_iv.out_state if prev_iv is not None else None)}"


def syscall_label(nr, flag):
    lbl = f"syscall {sysname(nr)}"
    if flag and flag.startswith("unterminated"):
        lbl += " (unterminated)"
    elif flag:
        lbl += f" ({flag})"
    return lbl


def prev_call(run_lines_by_tid, tid, t0):
    """The thread's last uprobe event (any CUDA call) that started before t0."""
    lst = run_lines_by_tid.get(tid)
    if not lst:
        return None
    ts = [x[0] for x in lst]
    i = bisect.bisect_left(ts, t0) - 1
    while i >= 0:
        t, o = lst[i]
        if t < t0:
            dur = o.get("duration_ns")
            end = t + dur if isinstance(dur, int) else None
            return {"type": o.get("type"), "api": o.get("api"), "ts_ns": t, "duration_ns": dur,
                    "end_ns": end, "since_return_ns": (t0 - end) if end is not None else None,
                    "since_start_ns": t0 - t, "ioctl_count": o.get("ioctl_count"),
                    "bytes": o.get("bytes")}
        i -= 1
    return None


def fmt_us(ns, d=1):
    if ns is None:
        return "-"
    return f"{ns / 1000:.{d}f}"


def analyze_launch(run, g, args, lines_by_tid, proc_tids, obs_tids, full):
    tid = g.get("tid")
    t0 = g["launch_ts_ns"]
    t1 = g["cupti_api_start_ns"]
    t2 = g.get("cupti_api_end_ns")
    gap = t1 - t0
    call_end = max(t1, t2) if isinstance(t2, int) else t1
    a_gap, b_gap = t0, max(t0, t1)
    acc_gap, det_gap, lab_gap, cov = account(run, tid, a_gap, b_gap)
    acc_call, det_call, _, _ = account(run, tid, t0, call_end)
    margin = args.margin_ns
    wa, wb = t0 - margin, call_end + margin
    cpu0, how = run.cpu_at(tid, t0)
    on = run.on_cpu(tid, wa, wb)
    cpus = sorted({c for _, _, c, _ in on} | ({cpu0} if cpu0 is not None else set()))
    faults = [f for f in run.faults.get(tid, ()) if a_gap - margin <= f[0] <= call_end + margin]
    faults_gap = [f for f in faults if a_gap <= f[0] <= b_gap]
    sysc = [s for s in run.sys.get(tid, ())
            if (s[0] if s[0] is not None else s[1]) <= wb and (s[1] if s[1] is not None else wb) >= wa]
    before = [s for s in run.sys.get(tid, ()) if s[1] is not None and s[1] <= t0 and s not in sysc]
    offs = off_cpu_periods(run, tid, a_gap, b_gap, t0)
    since = None
    for s_, e_, c_, iv in run.on_cpu(tid, t0, t0 + 1):
        since = {"cpu": iv.cpu, "since_rel_ns": iv.start - t0, "switch_in_seen": iv.start_known,
                 "start_how": iv.start_how,
                 "after": iv.in_prev[0] + "-" + str(iv.in_prev[1]) if iv.in_prev else None}
    rec = {
        "run": run.name, "pid": g.get("pid"), "tid": tid, "comm": run.comm(tid) if tid else None,
        "correlation_id": g.get("correlation_id"), "kernel": g.get("kernel"), "api": g.get("api"),
        "cupti_api": g.get("cupti_api"), "launch_ts_ns": t0, "cupti_api_start_ns": t1,
        "cupti_api_end_ns": t2, "gap_ns": gap, "call_ns": call_end - t0,
        "cupti_call_ns": (t2 - t1) if isinstance(t2, int) else None,
        "cpu": cpu0, "cpu_from": how, "cpus": cpus, "coverage": cov.get("coverage"),
        "gap_by_cause_ns": acc_gap, "gap_detail_ns": dict(det_gap.most_common()),
        "call_by_cause_ns": acc_call, "call_detail_ns": dict(det_call.most_common()),
        "faults_in_gap": len(faults_gap),
        "faults": [{"rel_ns": f[0] - t0, "kind": f[1], "address": f[2], "ip": f[3], "error_code": f[4]}
                   for f in faults],
        "syscalls": [{"start_rel_ns": (s[0] - t0) if s[0] is not None else None,
                      "end_rel_ns": (s[1] - t0) if s[1] is not None else None,
                      "name": sysname(s[2]), "args": s[3], "ret": s[4], "flag": s[5],
                      "exit": sysname(s[6]) if s[6] is not None else None} for s in sysc],
        "syscall_before": ({"start_rel_ns": (before[-1][0] - t0) if before[-1][0] is not None else None,
                            "end_rel_ns": before[-1][1] - t0, "name": sysname(before[-1][2]),
                            "args": before[-1][3], "ret": before[-1][4], "flag": before[-1][5],
                            "exit": sysname(before[-1][6]) if before[-1][6] is not None else None}
                           if before else None),
        "offcpu": offs,
        "on_cpu_at_launch": since,
        "prev_call": prev_call(lines_by_tid, tid, t0),
        "lost_events": [{"instance": x[0], "cpu": x[1], "count": x[2], "before_ts_ns": x[3]}
                        for x in run.lost_near(set(cpus), wa, wb)],
    }
    rec["others"] = others_during(run, tid, a_gap, b_gap, proc_tids, obs_tids)
    if full:
        rec["events"] = window_events(run, tid, cpus, wa, wb, t0, t1, t2, args.max_events,
                                      [x["tid"] for x in rec["others"]])
    return rec


def off_cpu_periods(run, tid, a, b, t0):
    """The thread's off-CPU periods overlapping [a, b]: state, who ran, who woke it."""
    out = []
    l = run.iv.get(tid, [])
    if not l:
        return out
    j0 = max(0, bisect.bisect_right(run.iv_start[tid], a) - 2)
    for j in range(j0, len(l) - 1):
        s_, e_ = l[j].end, l[j + 1].start
        if s_ is None or s_ >= b:
            if s_ is not None and s_ >= b:
                break
            continue
        c = clip(a, b, s_, e_)
        if not c:
            continue
        wk = [x for x in run.events_between(run.about_tid.get(tid, []), run.about_ts.get(tid, []), s_, e_)
              if x.name.startswith("sched_wakeup")]
        out.append({"start_rel_ns": s_ - t0, "end_rel_ns": e_ - t0, "in_gap_ns": c[1] - c[0],
                    "state": l[j].out_state, "what": state_name(l[j].out_state),
                    "from_cpu": l[j].cpu, "ran_instead": "%s-%s" % l[j].out_next if l[j].out_next else None,
                    "back_on_cpu": l[j + 1].cpu, "switch_in_seen": l[j + 1].start_known,
                    "switch_out_seen": l[j].end_known, "switch_out_how": l[j].end_how,
                    "switch_in_how": l[j + 1].start_how,
                    "woken_by": [{"by": f"{x.comm}-{x.pid}", "cpu": x.cpu, "rel_ns": x.ts - t0} for x in wk]})
    return out


def others_during(run, tid, a, b, proc_tids, obs_tids):
    """Threads of the workload and of the observer on a CPU during [a, b], and what they did."""
    out = []
    if b <= a:
        b = a + 1
    for group, tids in (("process", proc_tids), ("observer", obs_tids)):
        for t in sorted(tids):
            if t == tid:
                continue
            on = run.on_cpu(t, a, b)
            if not on:
                continue
            ns = sum(e - s for s, e, _, _ in on)
            sc = Counter()
            for s in run.sys.get(t, ()):
                st = s[0] if s[0] is not None else s[1]
                en = s[1] if s[1] is not None else b
                if st <= b and en >= a:
                    sc[sysname(s[2])] += 1
            nf = sum(1 for f in run.faults.get(t, ()) if a <= f[0] <= b)
            out.append({"group": group, "tid": t, "comm": run.comm(t), "cpus": sorted({c for _, _, c, _ in on}),
                        "on_cpu_ns": ns, "syscalls": dict(sc), "faults": nf})
    return out


def window_events(run, tid, cpus, a, b, t0, t1, t2, limit, others=()):
    seen = set()
    rows = []

    def add(e, why):
        k = id(e)
        if k in seen:
            return
        seen.add(k)
        rows.append((e.ts, e, why))

    for c in cpus:
        for e in run.events_between(run.by_cpu.get(c, []), run.cpu_ts.get(c, []), a, b):
            add(e, "cpu")
    for e in run.events_between(run.by_tid.get(tid, []), run.tid_ts.get(tid, []), a, b):
        add(e, "thread")
    for e in run.events_between(run.about_tid.get(tid, []), run.about_ts.get(tid, []), a, b):
        add(e, "about")
    for t in others:
        for e in run.events_between(run.by_tid.get(t, []), run.tid_ts.get(t, []), a, b):
            add(e, "other")
    rows.sort(key=lambda r: r[0])
    marks = [(t0, "== launch_ts_ns (uprobe stamp at cuLaunchKernel entry)"),
             (t1, "== cupti_api_start_ns")]
    if isinstance(t2, int):
        marks.append((t2, "== cupti_api_end_ns"))
    marks.sort(key=lambda m: m[0])
    out = []
    truncated = 0
    for ts, e, why in rows:
        while marks and marks[0][0] <= ts:
            mt, mtxt = marks.pop(0)
            out.append({"rel_ns": mt - t0, "mark": mtxt})
        if len(out) >= limit:
            truncated += 1
            continue
        out.append({"rel_ns": ts - t0, "ts_ns": ts, "ns": e.ns, "cpu": e.cpu, "why": why,
                    "self": e.pid == tid, "line": e.line()})
    for mt, mtxt in marks:
        out.append({"rel_ns": mt - t0, "mark": mtxt})
    if truncated:
        out.append({"mark": f"... {truncated} more events not shown"})
    return out


def verdict(rec, baseline):
    acc = rec["gap_by_cause_ns"]
    gap = rec["gap_ns"]
    excess = max(gap - (baseline or 0), 0)
    thr = max(1000, 0.25 * excess)
    named = {"offcpu": "off-CPU", "irq": "IRQ/softirq", "fault": "page fault", "uprobe": "uprobe handling",
             "syscall": "syscall"}
    causes = [(k, acc[k]) for k in ("offcpu", "irq", "fault", "uprobe", "syscall") if acc[k] >= thr]
    causes.sort(key=lambda x: -x[1])
    if rec.get("coverage") and rec["coverage"] != "full" and not causes:
        return "unknown", f"trace coverage: {rec['coverage']}"
    if not causes:
        if rec["faults_in_gap"]:
            return "page-fault", (f"{rec['faults_in_gap']} page fault(s) in the gap (duration not measured; "
                                  f"{fmt_us(acc['unattributed'])} us unattributed)")
        return "user-mode", f"nothing visible in the trace: user-mode work ({fmt_us(acc['unattributed'])} us unattributed)"
    # details of the top cause
    det = rec["gap_detail_ns"]
    parts = []
    for k, v in causes:
        top = [(lbl, ns) for lbl, ns in det.items() if category_of(lbl) == k][:2]
        tops = ", ".join(f"{lbl} {fmt_us(ns)}" for lbl, ns in top)
        parts.append(f"{named[k]} {fmt_us(v)} us ({tops})")
    explained = sum(v for _, v in causes)
    cat = causes[0][0] if len(causes) == 1 else "mixed"
    if cat == "mixed" and causes[0][1] >= 0.75 * explained:
        cat = causes[0][0]
    cat = {"offcpu": "off-cpu"}.get(cat, cat)
    if explained < 0.5 * excess:
        return cat, "partly: " + "; ".join(parts) + f"; {fmt_us(acc['unattributed'])} us unattributed (user-mode)"
    return cat, "; ".join(parts)


def category_of(label):
    if label.startswith("off-CPU"):
        return "offcpu"
    if label.startswith(("irq ", "softirq", "tasklet", "vector", "nmi")):
        return "irq"
    if label.startswith("page fault"):
        return "fault"
    if label.startswith("uprobe"):
        return "uprobe"
    if label.startswith("syscall"):
        return "syscall"
    return "unattributed"


# ---------------------------------------------------------------------------- runs and reports


def pick_pid(run):
    pid = run.meta.get("workload_pid")
    if pid and pid.isdigit():
        return int(pid)
    c = Counter(o.get("pid") for o in run.lines if o.get("type") == "gpu_kernel")
    return c.most_common(1)[0][0] if c else None


def clock_checks(run, pid):
    out = {"markers": None, "ioctl": None}
    if run.markers:
        offs = sorted(o for _, o, _ in run.markers)
        out["markers"] = {"n": len(offs), "min_ns": offs[0], "median_ns": offs[len(offs) // 2], "max_ns": offs[-1]}
    diffs = []
    enters = {}
    for o in run.lines:
        if o.get("type") != "ioctl" or o.get("pid") != pid:
            continue
        tid, ts = o.get("tid"), o.get("ts_ns")
        if not isinstance(ts, int):
            continue
        if run.keep is not None and run.keep.start_of(ts) is None:
            continue  # not in the kept trace
        if tid not in enters:
            enters[tid] = sorted(x[0] for x in run.sys.get(tid, ()) if x[2] == NR_IOCTL and x[0] is not None)
        l = enters[tid]
        if not l:
            continue
        i = bisect.bisect_left(l, ts)
        best = min((l[j] - ts for j in (i - 1, i) if 0 <= j < len(l)), key=abs)
        diffs.append(best)
    if diffs:
        diffs.sort()
        out["ioctl"] = {"n": len(diffs), "min_ns": diffs[0], "median_ns": diffs[len(diffs) // 2],
                        "max_ns": diffs[-1], "within_2us": sum(1 for d in diffs if abs(d) <= 2000)}
    return out


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else None


def analyze(args):
    runs = []
    for i, d in enumerate(args.run):
        if not os.path.isdir(d):
            print(f"trace_outliers.py: not a directory: {d}", file=sys.stderr)
            sys.exit(2)
        name = os.path.basename(os.path.normpath(d)) or f"run{i + 1}"
        runs.append(Run(d, name))
    result = {"threshold_ns": args.threshold_ns, "margin_ns": args.margin_ns, "runs": [], "outliers": [],
              "controls": []}
    all_normals_gap = []
    excerpts = open(args.excerpts, "w", encoding="utf-8") if args.excerpts else None
    for run in runs:
        pid = pick_pid(run)
        gk = [o for o in run.lines if o.get("type") == "gpu_kernel" and o.get("pid") == pid
              and isinstance(o.get("launch_ts_ns"), int) and isinstance(o.get("cupti_api_start_ns"), int)]
        gk.sort(key=lambda o: o["launch_ts_ns"])
        outl = [o for o in gk if o["cupti_api_start_ns"] - o["launch_ts_ns"] > args.threshold_ns]
        early = [o for o in gk if o["cupti_api_start_ns"] - o["launch_ts_ns"] < -args.threshold_ns]
        normals = [o for o in gk if abs(o["cupti_api_start_ns"] - o["launch_ts_ns"]) <= args.threshold_ns]
        all_normals_gap += [o["cupti_api_start_ns"] - o["launch_ts_ns"] for o in normals]
        lines_by_tid = defaultdict(list)
        for o in run.lines:
            if o.get("pid") == pid and o.get("type") in (
                    "launch", "memcpy", "memset", "sync", "alloc", "free", "module", "symbol", "init") \
                    and isinstance(o.get("ts_ns"), int):
                lines_by_tid[o.get("tid")].append((o["ts_ns"], o))
        for l in lines_by_tid.values():
            l.sort(key=lambda x: x[0])
        # controls: per outlier the nearest normal launch of the same kernel and thread, then spread
        controls = []
        chosen = set()
        for o in outl:
            cands = [n for n in normals if n.get("kernel") == o.get("kernel") and n.get("tid") == o.get("tid")
                     and id(n) not in chosen]
            if cands:
                n = min(cands, key=lambda n: abs(n["launch_ts_ns"] - o["launch_ts_ns"]))
                chosen.add(id(n))
                controls.append(n)
        quota = -(-args.controls // max(1, len(runs)))
        if normals and quota:
            step = len(normals) / quota
            for k in range(min(quota, len(normals))):
                n = normals[min(len(normals) - 1, int(k * step + step / 2))]
                if id(n) not in chosen:
                    chosen.add(id(n))
                    controls.append(n)
        controls.sort(key=lambda o: o["launch_ts_ns"])
        # the traces: only around the launches analysed (and a few ioctls, for the clock check)
        keep = None
        if args.context_ms > 0:
            ctx = int(args.context_ms * 1_000_000)
            rng = [(o["launch_ts_ns"] - ctx, max(o["cupti_api_start_ns"], o.get("cupti_api_end_ns") or 0) + ctx)
                   for o in outl + controls]
            io = [o["ts_ns"] for o in run.lines if o.get("type") == "ioctl" and o.get("pid") == pid
                  and isinstance(o.get("ts_ns"), int)]
            for t in io[::max(1, len(io) // 50)]:
                rng.append((t - 100_000, t + 100_000))
            keep = Ranges(rng)
        run.load_traces(keep)
        obs_pid = run.meta.get("observer_pid")
        obs_pid = int(obs_pid) if obs_pid and obs_pid.isdigit() else None
        proc_tids = {t for t, tg in run.tgid.items() if tg == pid} | set(run.proc_threads) | \
            {o.get("tid") for o in run.lines if o.get("pid") == pid and isinstance(o.get("tid"), int)}
        if pid is not None:
            proc_tids.add(pid)
        obs_tids = {t for t, tg in run.tgid.items() if obs_pid is not None and tg == obs_pid}
        stats_over = {src: {c: {k: v for k, v in st.items() if k in ("overrun", "dropped events", "commit overrun")
                                and v}
                            for c, st in s.items()} for src, s in run.stats.items()}
        stats_over = {src: {c: v for c, v in s.items() if v} for src, s in stats_over.items()}
        rinfo = {
            "name": run.name, "dir": run.dir, "workload_pid": pid, "observer_pid": obs_pid,
            "jsonl": run.jsonl_path, "jsonl_lines": len(run.lines), "jsonl_bad_lines": run.bad_lines,
            "gpu_kernel_lines": len(gk), "outliers": len(outl), "early": len(early), "normals": len(normals),
            "normal_gap_median_ns": median([o["cupti_api_start_ns"] - o["launch_ts_ns"] for o in normals]),
            "trace_cpu_events": len(run.cpu.events), "trace_task_events": len(run.task.events),
            "trace_cpu_entries": len(run.cpu.events) + run.cpu.skipped,
            "trace_task_entries": len(run.task.events) + run.task.skipped,
            "kept_ranges": len(run.keep.r) if run.keep else None,
            "trace_cpu_present": run.cpu.present, "trace_task_present": run.task.present,
            "ns_precision_share": run.ns_share,
            "inferred_switch_ins": run.inferred_switch_ins,
            "inferred_switch_outs": run.inferred_switch_outs,
            "unterminated": dict(run.unterminated),
            "sched_switches": len(run.switches),
            "unparsed_lines": run.cpu.unparsed + run.task.unparsed,
            "lost": [{"instance": tf.src, "cpu": c, "count": n, "before_ts_ns": ts}
                     for tf in (run.cpu, run.task) for c, n, ts in tf.lost],
            "entries_header": {"cpu": run.cpu.entries, "task": run.task.entries},
            "overruns": stats_over,
            "first_ts_ns": run.first_ts, "last_ts_ns": run.last_ts,
            "kprobes_seen": dict(run.kprobes_seen),
            "process_threads": {str(t): run.comm(t) for t in sorted(x for x in proc_tids if isinstance(x, int))},
            "observer_threads": {str(t): run.comm(t) for t in sorted(obs_tids)},
            "clock": clock_checks(run, pid),
            "meta": run.meta,
        }
        if gk and run.first_ts is not None:
            rinfo["launches_before_trace"] = sum(1 for o in gk if o["launch_ts_ns"] < run.first_ts)
            rinfo["launches_after_trace"] = sum(1 for o in gk if o["launch_ts_ns"] > run.last_ts)
        result["runs"].append(rinfo)
        recs = [analyze_launch(run, o, args, lines_by_tid, proc_tids, obs_tids, True) for o in outl]
        result["outliers"] += recs
        result["controls"] += [analyze_launch(run, o, args, lines_by_tid, proc_tids, obs_tids, args.control_events)
                               for o in controls]
        if excerpts is not None:
            write_excerpts(excerpts, run, recs)
        run.drop_traces()
    if excerpts is not None:
        excerpts.close()
    baseline = median(all_normals_gap)
    result["baseline_gap_ns"] = baseline
    for rec in result["outliers"] + result["controls"]:
        rec["category"], rec["verdict"] = verdict(rec, baseline)
    summ = {}
    for key in ("outliers", "controls"):
        recs = result[key]
        summ[key] = {
            "n": len(recs),
            "by_category": dict(Counter(r["category"] for r in recs)),
            "gap_total_ns": sum(r["gap_ns"] for r in recs),
            "gap_by_cause_total_ns": {c: sum(r["gap_by_cause_ns"][c] for r in recs) for c in CAUSES},
            "with_any_cause_ge_1us": sum(1 for r in recs if any(r["gap_by_cause_ns"][c] >= 1000
                                                                for c in CAUSES if c != "unattributed")),
            "with_faults_in_gap": sum(1 for r in recs if r["faults_in_gap"]),
            "after_memcpy": sum(1 for r in recs if (r.get("prev_call") or {}).get("type") == "memcpy"),
        }
    result["summary"] = summ
    return result


def write_excerpts(f, run, recs):
    """Every trace line (both instances) within 200 us of each outlier's window, for the record."""
    for rec in recs:
        t0 = rec["launch_ts_ns"]
        a = t0 - 200_000
        b = max(rec["cupti_api_start_ns"], rec["cupti_api_end_ns"] or 0) + 200_000
        f.write(f"### run {rec['run']} corr {rec['correlation_id']} tid {rec['tid']} launch_ts_ns {t0} "
                f"cupti_api_start_ns {rec['cupti_api_start_ns']} gap_ns {rec['gap_ns']}\n")
        for e in run.events[bisect.bisect_left(run.all_ts, a):bisect.bisect_right(run.all_ts, b)]:
            f.write(f"{e.ts} {(e.ts - t0) / 1000:+.3f}us {e.src} {e.line()}\n")


# ---------------------------------------------------------------------------- markdown


def md_table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(x).replace("|", "\\|") for x in r) + " |")
    return "\n".join(out)


def short_prev(p):
    if not p:
        return "-"
    s = f"{p.get('api') or p.get('type')}"
    if p.get("since_return_ns") is not None:
        s += f" returned {fmt_us(p['since_return_ns'])} us before (ran {fmt_us(p.get('duration_ns'))} us)"
    else:
        s += f" started {fmt_us(p['since_start_ns'])} us before"
    return s


def others_text(rec):
    o = rec.get("others") or []
    if not o:
        return "-"
    return ", ".join(f"{x['comm']}/{x['tid']}{'(obs)' if x['group'] == 'observer' else ''} {fmt_us(x['on_cpu_ns'])}us"
                     for x in sorted(o, key=lambda x: -x["on_cpu_ns"])[:4])


def row(rec, i):
    g = rec["gap_by_cause_ns"]
    return [i, rec["run"], rec["correlation_id"], (rec.get("kernel") or "?")[:28], rec["tid"],
            rec["cpu"] if rec["cpu"] is not None else "?", fmt_us(rec["gap_ns"]), fmt_us(rec["call_ns"]),
            fmt_us(g["offcpu"]), fmt_us(g["irq"]),
            f"{rec['faults_in_gap']}" + (f" / {fmt_us(g['fault'])}" if g["fault"] else ""),
            fmt_us(g["uprobe"]), fmt_us(g["syscall"]), fmt_us(g["unattributed"]), rec["category"],
            short_prev(rec.get("prev_call")), others_text(rec)]


HEAD = ["#", "run", "corr", "kernel", "tid", "cpu", "gap us", "call us", "off-CPU", "irq", "faults (n / us)",
        "uprobe", "syscall", "unattributed", "category", "previous call of the thread",
        "others on CPU in the gap"]


def render_md(res):
    L = []
    L.append("# Launch-timestamp outliers: cupti_api_start_ns - launch_ts_ns > "
             f"{res['threshold_ns'] / 1000:g} us, explained from an ftrace")
    L.append("")
    L.append("Produced by `gpu/trace_outliers.sh` / `gpu/trace_outliers.py`. Time attributed in the gap "
             "[launch_ts_ns, cupti_api_start_ns] of the launching thread, by priority: off-CPU > IRQ/softirq/"
             "vector/NMI on its CPU > page-fault handling (kprobe) > uprobe handling (kprobe) > syscall > "
             "unattributed (user-mode work, un-instrumented kernel entry/exit). Times in µs.")
    L.append("")
    s = res["summary"]
    L.append("## Summary")
    L.append("")
    L.append(f"- baseline (median gap of the normal launches): {fmt_us(res.get('baseline_gap_ns'), 2)} µs")
    for key in ("outliers", "controls"):
        x = s[key]
        cats = ", ".join(f"{k}: {v}" for k, v in sorted(x["by_category"].items(), key=lambda kv: -kv[1])) or "-"
        tot = x["gap_by_cause_total_ns"]
        L.append(f"- {key}: {x['n']} (by verdict: {cats}); gap time {fmt_us(x['gap_total_ns'])} µs = "
                 + ", ".join(f"{c} {fmt_us(tot[c])}" for c in CAUSES)
                 + f"; with a cause ≥ 1 µs: {x['with_any_cause_ge_1us']}; with page faults in the gap: "
                 f"{x['with_faults_in_gap']}; right after a memcpy: {x['after_memcpy']}")
    L.append("")
    L.append("## Runs and trace quality")
    L.append("")
    rows = []
    for r in res["runs"]:
        ck = r["clock"]
        mk = ck.get("markers")
        io = ck.get("ioctl")
        lost = sum(x["count"] for x in r["lost"])
        ovr = sum(sum(v.values()) for s_ in r["overruns"].values() for v in s_.values())
        rows.append([r["name"], r["workload_pid"], r["gpu_kernel_lines"], r["outliers"], r["early"],
                     fmt_us(r["normal_gap_median_ns"], 2),
                     f"{r['trace_cpu_entries']} / {r['trace_task_entries']} ({r['trace_cpu_events']} / "
                     f"{r['trace_task_events']})",
                     f"{(r['ns_precision_share'] or 0) * 100:.1f} %",
                     f"{r['sched_switches']} ({r['inferred_switch_ins']} / {r.get('inferred_switch_outs', 0)})",
                     ", ".join(f"{k} {v}" for k, v in sorted((r.get("unterminated") or {}).items())) or "-",
                     f"{lost} / {ovr}",
                     (f"{fmt_us(mk['min_ns'], 2)}..{fmt_us(mk['max_ns'], 2)}" if mk else "-"),
                     (f"median {fmt_us(io['median_ns'], 2)}, {io['within_2us']}/{io['n']} ≤ 2 µs" if io else "-"),
                     ({"1": "on: ", "0": "off: "}.get(r["meta"].get("kprobes_enabled"), "")
                      + (", ".join(f"{k} {v}" for k, v in r["kprobes_seen"].items()) or "none"))])
    L.append(md_table(["run", "pid", "gpu_kernel", "outliers", "< -thr", "normal gap median us",
                       "trace entries cpu / task (kept)", "ns stamps", "sched_switch (switch-ins / -outs inferred)",
                       "unterminated (capped)", "lost / overrun", "clock marker offset us",
                       "ioctl vs sys_enter us", "kprobes"], rows))
    L.append("")
    L.append("The marker offset is trace stamp − clock_gettime(CLOCK_MONOTONIC) taken just before the write "
             "(a few µs when both are CLOCK_MONOTONIC); the ioctl row compares the observer's ioctl "
             "stamps with the trace's sys_enter of the same thread. Without ns stamps, trace times are "
             "±0.5 µs. Every trace entry is recorded in the context of the task current on its CPU: a "
             "thread's own event proves it was on that CPU, another context's event that it was not. A "
             "switch-in missing from the trace (lost events, kernels that do not record some idle → task "
             "switches) is inferred at the CPU's last event in another context before the thread's own "
             "event (usually the wakeup); a missing switch-out at the CPU's first event in another "
             "context. Unterminated: syscalls with no sys_exit before the thread's next sys_enter or a "
             "proof it was in user mode (a user page fault, one of the observer's uprobe stamps at a CUDA "
             "call's entry), IRQ handlers with no exit before the CPU is proven out of them, kprobe "
             "entries with no return: each ends at that proof (flagged \"unterminated\"), never "
             "later. A sys_exit matches the thread's last sys_enter whatever NR it prints (uretprobe's, "
             "NR 335, and rt_sigreturn's print NR -1). Only the trace entries "
             "within --context-ms of the launches analysed are kept (and those of thread creation, "
             "renames and clock markers).")
    for r in res["runs"]:
        warn = []
        if not r["trace_cpu_present"]:
            warn.append("no global (cpu) trace")
        if not r["trace_task_present"]:
            warn.append("no per-task trace")
        if r["lost"] or any(r["overruns"].values()):
            warn.append("events were lost/overwritten (see outliers.json runs[].lost / overruns)")
        if r.get("launches_before_trace"):
            warn.append(f"{r['launches_before_trace']} launches before the trace's first event (overwritten)")
        if warn:
            L.append(f"- {r['name']}: " + "; ".join(warn))
    L.append("")
    L.append("## Outliers")
    L.append("")
    if not res["outliers"]:
        L.append("No gpu_kernel line had cupti_api_start_ns − launch_ts_ns above the threshold.")
    else:
        L.append(md_table(HEAD, [row(r, i + 1) for i, r in enumerate(res["outliers"])]))
    L.append("")
    L.append("## Controls (normal launches)")
    L.append("")
    if res["controls"]:
        L.append(md_table(HEAD, [row(r, i + 1) for i, r in enumerate(res["controls"])]))
    else:
        L.append("none")
    L.append("")
    L.append("## Each outlier")
    for i, r in enumerate(res["outliers"]):
        L.append("")
        L.append(f"### {i + 1}. run {r['run']}, correlation {r['correlation_id']}, `{r.get('kernel')}`, "
                 f"tid {r['tid']} ({r['comm']})")
        L.append("")
        L.append(f"- gap {fmt_us(r['gap_ns'], 3)} µs (launch_ts_ns {r['launch_ts_ns']} → cupti_api_start_ns "
                 f"{r['cupti_api_start_ns']}); CUPTI API record {fmt_us(r.get('cupti_call_ns'), 3)} µs; "
                 f"uprobe stamp → CUPTI end {fmt_us(r['call_ns'], 3)} µs")
        L.append(f"- CPU {r['cpu']} (from {r['cpu_from']}); CPUs in the window: {r['cpus']}; coverage: {r['coverage']}")
        L.append(f"- previous call of the thread: {short_prev(r.get('prev_call'))}")
        oc = r.get("on_cpu_at_launch")
        if oc:
            L.append(f"- at the launch it had been on CPU {oc['cpu']} for {fmt_us(-oc['since_rel_ns'], 1)} µs ("
                     + (f"switched in after {oc['after'] or '?'}" if oc["switch_in_seen"]
                        else f"at least: {oc.get('start_how') or 'switch-in inferred'}") + ")")
        for o in r.get("offcpu", []):
            wk = ", ".join(f"{w['by']} on CPU {w['cpu']} at {fmt_us(w['rel_ns'], 3)}" for w in o["woken_by"]) or "-"
            L.append(f"- off CPU {fmt_us(o['start_rel_ns'], 3)}..{fmt_us(o['end_rel_ns'], 3)} µs "
                     f"({fmt_us(o['in_gap_ns'], 3)} µs in the gap): {o['what']} (prev_state {o['state']}) on "
                     f"CPU {o['from_cpu']}, {o['ran_instead']} ran instead; woken by {wk}; back on CPU "
                     f"{o['back_on_cpu']}" + ("" if o["switch_in_seen"] else f" ({o.get('switch_in_how') or 'switch-in inferred'})")
                     + ("" if o.get("switch_out_seen", True) else f"; {o.get('switch_out_how')}"))
        L.append(f"- **verdict: {r['category']}** — {r['verdict']}")
        if r["lost_events"]:
            L.append(f"- lost events near this window: {r['lost_events']}")
        L.append("")
        rows = []
        keys = list(dict.fromkeys(list(r["gap_detail_ns"]) + list(r["call_detail_ns"])))
        for k in keys:
            rows.append([k, fmt_us(r["gap_detail_ns"].get(k, 0), 3), fmt_us(r["call_detail_ns"].get(k, 0), 3)])
        L.append(md_table(["time went to", "in the gap (µs)", "uprobe stamp → CUPTI end (µs)"], rows))
        if r["faults"]:
            L.append("")
            L.append("Page faults of the thread: " + "; ".join(
                f"{fmt_us(f['rel_ns'], 3)} µs {f['kind']} addr {f['address']} ip {f['ip']} err {f['error_code']}"
                for f in r["faults"][:20]))
        if r["syscalls"] or r.get("syscall_before"):
            L.append("")
            L.append("Syscalls of the thread: " + "; ".join(
                ("before the window: " if x is r.get("syscall_before") else "")
                + f"{x['name']} {fmt_us(x['start_rel_ns'], 3)}..{fmt_us(x['end_rel_ns'], 3)} µs = {x['ret']}"
                + (f" (exit prints {x['exit']})" if x.get("exit") and x["exit"] != x["name"] else "")
                + (f" [{x['flag']}]" if x.get("flag") else "")
                for x in ([r["syscall_before"]] if r.get("syscall_before") else []) + r["syscalls"][:20]))
        if r["others"]:
            L.append("")
            L.append("On a CPU during the gap (other threads of the process / the observer):")
            L.append("")
            L.append(md_table(["group", "tid", "comm", "cpus", "on-CPU µs", "syscalls", "faults"],
                              [[x["group"], x["tid"], x["comm"], x["cpus"], fmt_us(x["on_cpu_ns"], 3),
                                ", ".join(f"{k}×{v}" for k, v in x["syscalls"].items()) or "-", x["faults"]]
                               for x in r["others"]]))
        L.append("")
        L.append("Events (µs from launch_ts_ns; `*` = this thread's context, `c` = on its CPU, `a` = about it, "
                 "`o` = another thread listed above; `~` = µs stamp):")
        L.append("")
        L.append("```")
        for e in r.get("events", []):
            if "mark" in e:
                rel = f"{e['rel_ns'] / 1000:+9.3f}" if "rel_ns" in e else " " * 9
                L.append(f"{rel}          {e['mark']}")
            else:
                tag = "*" if e["self"] else {"cpu": "c", "about": "a", "thread": "*", "other": "o"}[e["why"]]
                prec = "" if e["ns"] else "~"
                L.append(f"{e['rel_ns'] / 1000:+9.3f}{prec:1} {tag} {e['line']}")
        L.append("```")
    L.append("")
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True, help="a run directory (repeatable)")
    ap.add_argument("--md", default=None, help="write the markdown report here")
    ap.add_argument("--json", default=None, help="write the JSON result here")
    ap.add_argument("--excerpts", default=None, help="write the trace lines around each outlier here")
    ap.add_argument("--threshold-ns", type=int, default=5000)
    ap.add_argument("--controls", type=int, default=24)
    ap.add_argument("--margin-ns", type=int, default=2000)
    ap.add_argument("--max-events", type=int, default=400, help="events listed per outlier")
    ap.add_argument("--context-ms", type=float, default=20.0,
                    help="trace entries kept around each analysed launch (0 = the whole trace)")
    ap.add_argument("--control-events", action="store_true", help="also list the controls' events in the JSON")
    args = ap.parse_args(argv)
    res = analyze(args)
    md = render_md(res)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1, default=str)
    s = res["summary"]
    print(f"trace_outliers: {s['outliers']['n']} outliers {s['outliers']['by_category']}, "
          f"{s['controls']['n']} controls {s['controls']['by_category']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
