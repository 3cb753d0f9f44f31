#!/usr/bin/env bash
# Why do a few launches have CUPTI's API start 5-18 us after the uprobe's launch stamp?
# Runs cuda-ground-truth under `gpu-observer run --trace-all` (CUPTI), exactly as
# gpu/validate.sh's cupti_ground_truth run does, with ftrace recording what the kernel did
# meanwhile, then gpu/trace_outliers.py attributes each outlier's gap to off-CPU time, IRQs on
# its CPU, page faults, uprobe handling, syscalls, or nothing visible (user-mode work).
#
# usage (as root, from the repo root, on the GPU machine):
#   OBSERVER=.gpu-bundle/gpu-observer gpu/trace_outliers.sh [OUTDIR]
#
# OUTDIR defaults to $OUT if set, else /tmp/gpu-trace-outliers.  It receives:
#   OUTLIERS.md                     the report (per-outlier tables, verdicts, controls)
#   outliers.json                   the same as data (+ every listed event)
#   outliers-excerpts.txt           every trace line within 200 us of each outlier
#   trace-outliers-artifacts.tar.gz the work dir: per run runN/{events.jsonl.gz,
#       trace_cpu.txt.gz, trace_cpu.raw.txt.gz, trace_task.txt.gz, trace_task.raw.txt.gz,
#       stats_*.txt, threads.txt, meta.txt, observer.err, workload.log, workload.json},
#       tracefs.log (the full traces are left out if the tarball would pass 15 MiB)
# The analysis can be redone anywhere from the unpacked tarball:
#   python3 gpu/trace_outliers.py --run run1 --run run2 --md OUTLIERS.md --json outliers.json
#
# Tracing (tracefs, two instances, trace_clock=mono = CLOCK_MONOTONIC like bpf_ktime_get_ns
# and CUPTI's timestamps; removed again on every exit path):
#   gpuobs_cpu   all CPUs, all tasks: sched_switch, sched_wakeup(_new), sched_migrate_task,
#                irq_handler_entry/exit, softirq_entry/exit, tasklet_entry/exit, nmi_handler,
#                irq_vectors:*_entry/*_exit (local timer, IPIs, ...): an IRQ hits a CPU, not a pid
#   gpuobs_task  set_event_pid = this script + options/event-fork, set before the observer
#                starts, so the observer, the workload (held at the observer's gate, then
#                exec'd) and every thread they create are traced from their first instruction:
#                raw_syscalls sys_enter/exit, exceptions:page_fault_user/kernel,
#                sched_process_fork/exec/exit, task_newtask/task_rename, tlb_flush,
#                signal_deliver, and (KPROBES=1, when kprobe_events exists) kprobes on
#                uprobe_notify_resume (uprobe handling incl. the BPF program and single-step)
#                and handle_mm_fault (page-fault duration), entry + return; enabled in runs 1
#                and 3, not in run 2 (they cost each uprobe hit and fault a little).
# Each trace is read twice (text, then options/raw) so the analysis gets ns stamps; the text
# format alone prints trace_clock=mono in us.  options/record-tgid gives each line its tgid.
#
# Environment knobs: OBSERVER, GROUND_TRUTH, CUPTI_LIB (as in validate.sh), PYTHON (python3),
# GT_ITERS (200), RUNS (3; a run starts only if the time budget allows), BUDGET_S (105),
# WORKLOAD_TIMEOUT (45 s per run), READY_TIMEOUT (30 s), STOP_TIMEOUT (15 s),
# CPU_BUF_KB (16384 per CPU, global instance), TASK_BUF_KB (8192 per CPU), MAX_TRACE_MB (2048:
# both instances' buffers together are scaled down to this), KPROBES (1: odd runs; all; 0),
# THRESHOLD_NS (5000), CONTROLS (24), WORK_DIR.
# Exit 0 when the report was written (whatever it says), 1 otherwise.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$HERE/.." && pwd)
READY_TIMEOUT=${READY_TIMEOUT:-30}
STOP_TIMEOUT=${STOP_TIMEOUT:-15}
# shellcheck source=SCRIPTDIR/lib.sh
source "$HERE/lib.sh"

OUTDIR=${1:-${OUT:-/tmp/gpu-trace-outliers}}
PYTHON=${PYTHON:-python3}
GT_ITERS=${GT_ITERS:-200}
RUNS=${RUNS:-3}
BUDGET_S=${BUDGET_S:-105}
WORKLOAD_TIMEOUT=${WORKLOAD_TIMEOUT:-45}
CPU_BUF_KB=${CPU_BUF_KB:-16384}
TASK_BUF_KB=${TASK_BUF_KB:-8192}
MAX_TRACE_MB=${MAX_TRACE_MB:-2048}
KPROBES=${KPROBES:-1}
THRESHOLD_NS=${THRESHOLD_NS:-5000}
CONTROLS=${CONTROLS:-24}
INST_CPU=gpuobs_cpu
INST_TASK=gpuobs_task
KP_GROUP=gpuobs
OBS_ENV=()

TRACEFS=""
CPUD=""
TASKD=""
KP_DEFINED=()
SAMPLER_PID=""

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
rm -f "$OUTDIR/OUTLIERS.md" "$OUTDIR/outliers.json" "$OUTDIR/outliers-excerpts.txt" \
    "$OUTDIR/trace-outliers-artifacts.tar.gz"
WORK=${WORK_DIR:-$(mktemp -d /tmp/gpu-trace-outliers-work.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
[[ $WORK != "$OUTDIR" ]] || die "WORK_DIR must differ from the output dir"
TLOG=$WORK/tracefs.log
: >"$TLOG"

# ------------------------------------------------------------ tracefs helpers

# tw FILE VALUE: truncating write (under a timeout); ta FILE VALUE: appending write.
# shellcheck disable=SC2016  # $1/$2 are the inner sh's arguments
tw() {
    timeout 10 sh -c 'printf "%s\n" "$2" > "$1"' tw "$1" "$2" 2>>"$TLOG"
}
# shellcheck disable=SC2016
ta() {
    timeout 10 sh -c 'printf "%s\n" "$2" >> "$1"' ta "$1" "$2" 2>>"$TLOG"
}

find_tracefs() {
    local d
    for d in /sys/kernel/tracing /sys/kernel/debug/tracing; do
        if [[ -d $d/instances ]]; then
            TRACEFS=$d
            return 0
        fi
    done
    mount -t tracefs nodev /sys/kernel/tracing >>"$TLOG" 2>&1 ||
        mount -t debugfs nodev /sys/kernel/debug >>"$TLOG" 2>&1 || true
    for d in /sys/kernel/tracing /sys/kernel/debug/tracing; do
        if [[ -d $d/instances ]]; then
            TRACEFS=$d
            return 0
        fi
    done
    return 1
}

# inst_remove NAME: stop, disable and remove an instance (ours, or a leftover of a killed run).
inst_remove() {
    local d=$TRACEFS/instances/$1
    [[ -d $d ]] || return 0
    tw "$d/tracing_on" 0 || true
    tw "$d/set_event_pid" "" || true
    tw "$d/set_event" "" || true # disables every event of the instance, kprobes included
    local i
    for i in 1 2 3 4 5; do
        rmdir "$d" 2>>"$TLOG" && return 0
        sleep 0.2
    done
    warn "could not remove $d (see $TLOG)"
    return 1
}

kprobes_remove() {
    local n
    [[ -n $TRACEFS && -w $TRACEFS/kprobe_events ]] || return 0
    for n in ${KP_DEFINED[@]+"${KP_DEFINED[@]}"}; do
        ta "$TRACEFS/kprobe_events" "-:$KP_GROUP/$n" || warn "could not remove kprobe $KP_GROUP/$n"
    done
    KP_DEFINED=()
    # leftovers of an earlier, killed run
    if [[ -d $TRACEFS/events/$KP_GROUP ]]; then
        for n in "$TRACEFS/events/$KP_GROUP"/*/; do
            [[ -d $n ]] || continue
            n=$(basename "$n")
            ta "$TRACEFS/kprobe_events" "-:$KP_GROUP/$n" || true
        done
    fi
}

tracefs_cleanup() {
    [[ -n $TRACEFS ]] || return 0
    inst_remove "$INST_CPU" || true
    inst_remove "$INST_TASK" || true
    kprobes_remove
    CPUD=""
    TASKD=""
}

# inst_create NAME BUF_KB: a stopped, empty instance with trace_clock=mono.
inst_create() {
    local name=$1 kb=$2 d=$TRACEFS/instances/$1
    mkdir "$d" 2>>"$TLOG" || die "cannot create the ftrace instance $d (see $TLOG)"
    tw "$d/tracing_on" 0 || die "cannot stop $d"
    grep -qw mono "$d/trace_clock" || die "trace_clock has no 'mono' here: $(cat "$d/trace_clock")"
    tw "$d/trace_clock" mono || die "cannot set trace_clock=mono on $d"
    grep -q '\[mono\]' "$d/trace_clock" || die "trace_clock is not mono: $(cat "$d/trace_clock")"
    tw "$d/buffer_size_kb" "$kb" || warn "cannot set buffer_size_kb=$kb on $name (kept $(cat "$d/buffer_size_kb"))"
    tw "$d/options/overwrite" 1 || true
    tw "$d/options/record-tgid" 1 || warn "no record-tgid option: lines will carry no tgid"
    tw "$d/trace" "" || true
    echo "$name: buffer_size_kb=$(cat "$d/buffer_size_kb") trace_clock=$(cat "$d/trace_clock")" >>"$TLOG"
}

# inst_enable DIR EVENT...: enable each SYSTEM/EVENT that exists; ENABLED gets the enabled
# ones, MISSING_EVENTS the others.
inst_enable() {
    local d=$1 e
    local -a ok=()
    shift
    for e in "$@"; do
        if [[ -e $d/events/$e/enable ]] && tw "$d/events/$e/enable" 1; then
            ok+=("$e")
        else
            echo "event not available: $e" >>"$TLOG"
            MISSING_EVENTS+=("$e")
        fi
    done
    ENABLED="${ok[*]}"
}

# kprobes_define: uprobe_notify_resume and handle_mm_fault, entry and return (best effort).
kprobes_define() {
    local kf=$TRACEFS/kprobe_events def name
    KP_DEFINED=()
    if [[ $KPROBES != 1 && $KPROBES != all ]]; then
        KP_NOTE="off (KPROBES=$KPROBES)"
        return 0
    fi
    if [[ ! -w $kf ]]; then
        KP_NOTE="no kprobe_events in $TRACEFS (kernel without CONFIG_KPROBE_EVENTS)"
        return 0
    fi
    local -a defs=("p:$KP_GROUP/gpuobs_unr uprobe_notify_resume"
        "r:$KP_GROUP/gpuobs_unr_ret uprobe_notify_resume")
    if [[ $(uname -m) == x86_64 ]]; then
        defs+=("p:$KP_GROUP/gpuobs_hmf handle_mm_fault address=%si:x64"
            "r:$KP_GROUP/gpuobs_hmf_ret handle_mm_fault")
    else
        defs+=("p:$KP_GROUP/gpuobs_hmf handle_mm_fault" "r:$KP_GROUP/gpuobs_hmf_ret handle_mm_fault")
    fi
    for def in "${defs[@]}"; do
        name=${def%% *}
        name=${name#*/}
        if ta "$kf" "$def"; then
            KP_DEFINED+=("$name")
        else
            echo "kprobe not accepted: $def ($(tail -n 2 "$TRACEFS/error_log" 2>/dev/null | tr '\n' ' '))" >>"$TLOG"
        fi
    done
    KP_NOTE="defined: ${KP_DEFINED[*]:-none}"
}

save_instance() { # DIR DEST_PREFIX  (tracing must be off)
    local d=$1 dest=$2 c
    {
        for c in "$d"/per_cpu/cpu*; do
            echo "cpu ${c##*/cpu}"
            cat "$c/stats" 2>/dev/null || true
        done
    } >"$dest.stats" 2>>"$TLOG" || true
    if ! timeout 40 cat "$d/trace" | gzip -1 >"$dest.txt.gz"; then
        warn "reading $d/trace failed or timed out"
    fi
    if tw "$d/options/raw" 1; then
        if ! timeout 40 cat "$d/trace" | gzip -1 >"$dest.raw.txt.gz"; then
            warn "reading $d/trace (raw) failed or timed out; us stamps only"
            rm -f "$dest.raw.txt.gz"
        fi
        tw "$d/options/raw" 0 || true
    fi
}

mark_clock() { # TRACE_MARKER... : "gpuobs_clock mono_ns=N" with N read just before each write
    timeout 10 "$PYTHON" - "$@" <<'EOF' 2>>"$TLOG" || true
import os, sys, time
for p in sys.argv[1:]:
    fd = os.open(p, os.O_WRONLY)
    for _ in range(5):
        os.write(fd, b"gpuobs_clock mono_ns=%d\n" % time.monotonic_ns())
    os.close(fd)
EOF
}

# sample_threads PID FILE: "TID COMM" of the process's threads every 0.2 s while it lives.
sample_threads() {
    local pid=$1 out=$2 t c n=0
    while [[ -d /proc/$pid ]] && ((n < 600)); do
        for t in /proc/"$pid"/task/*; do
            c=""
            { read -r c <"$t/comm"; } 2>/dev/null || continue
            printf '%s %s\n' "${t##*/}" "$c"
        done
        n=$((n + 1))
        sleep 0.2
    done >>"$out"
}

stop_sampler() {
    if [[ -n $SAMPLER_PID ]]; then
        kill "$SAMPLER_PID" 2>/dev/null || true
        wait "$SAMPLER_PID" 2>/dev/null || true
        SAMPLER_PID=""
    fi
}

on_exit_hook() {
    stop_sampler
    tracefs_cleanup
    if [[ -d $TRACEFS/instances/$INST_CPU || -d $TRACEFS/instances/$INST_TASK ]]; then
        warn "an ftrace instance is left: rmdir $TRACEFS/instances/{$INST_CPU,$INST_TASK}"
    fi
    local f
    for f in OUTLIERS.md outliers.json outliers-excerpts.txt; do
        [[ -f $WORK/$f ]] && cp -f "$WORK/$f" "$OUTDIR/$f"
    done
    pack_artifacts
    local have=""
    for f in OUTLIERS.md outliers.json outliers-excerpts.txt trace-outliers-artifacts.tar.gz; do
        [[ -e $OUTDIR/$f ]] && have+="$f "
    done
    log "outputs in $OUTDIR: ${have:-none} (work dir $WORK)"
}

# The work dir as a tarball under 15 MiB: without the raw reads, then without the full traces
# (the excerpts stay), then without the JSONL.
pack_artifacts() {
    command -v tar >/dev/null 2>&1 || return 0
    local tgz=$OUTDIR/trace-outliers-artifacts.tar.gz max=15728640 size ex
    local -a steps=("" "--exclude=*.raw.txt.gz" "--exclude=trace_*.txt.gz" "--exclude=*.jsonl.gz")
    local -a excl=()
    for ex in "${steps[@]}"; do
        [[ -z $ex ]] || excl+=("$ex")
        tar -C "$WORK" -czf "$tgz" ${excl[@]+"${excl[@]}"} . 2>/dev/null || {
            warn "packing $WORK failed"
            return 0
        }
        size=$(stat -c %s "$tgz" 2>/dev/null || echo 0)
        ((size > max)) || break
    done
    ((${#excl[@]} == 0)) || log "artifacts packed without: ${excl[*]} (kept in $WORK)"
}
install_traps

# ------------------------------------------------------------ preflight
log "trace outliers -> $OUTDIR (work dir $WORK)"
require_root
require_tools timeout grep sed gzip tar mount "$PYTHON"
resolve_observer "$REPO_ROOT"
GT_BIN=$(resolve_exe "${GROUND_TRUTH:-$(dirname "$OBSERVER")/cuda-ground-truth}" "$REPO_ROOT")
if [[ -z $GT_BIN && -z ${GROUND_TRUTH:-} ]]; then
    GT_BIN=$(resolve_exe .gpu-bundle/cuda-ground-truth "$REPO_ROOT")
fi
[[ -n $GT_BIN ]] || die "cuda-ground-truth not found (set GROUND_TRUTH=/path/to/cuda-ground-truth)"
resolve_cupti "$REPO_ROOT" "$WORK/observer_run_help.txt"
[[ -z $CUPTI_SKIP ]] || die "cannot make the CUPTI run: $CUPTI_SKIP"
log "observer: $OBSERVER; ground truth: $GT_BIN; CUPTI library: $CUPTI_LIB_PATH"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1 || true
fi
find_tracefs || die "no tracefs with instances (tried /sys/kernel/tracing, /sys/kernel/debug/tracing)"
log "tracefs: $TRACEFS; kernel $(uname -r); $(nproc) CPUs online"

# ------------------------------------------------------------ tracefs setup
tracefs_cleanup # leftovers of a killed earlier run
NCPU=$(find "$TRACEFS/per_cpu" -maxdepth 1 -name 'cpu[0-9]*' 2>/dev/null | wc -l) || NCPU=0
((NCPU > 0)) || NCPU=$(getconf _NPROCESSORS_CONF)
total_mb=$((NCPU * (CPU_BUF_KB + TASK_BUF_KB) / 1024))
if ((total_mb > MAX_TRACE_MB)); then
    CPU_BUF_KB=$((CPU_BUF_KB * MAX_TRACE_MB / total_mb))
    TASK_BUF_KB=$((TASK_BUF_KB * MAX_TRACE_MB / total_mb))
    log "ring buffers scaled to $CPU_BUF_KB + $TASK_BUF_KB KiB per CPU ($NCPU CPUs, MAX_TRACE_MB=$MAX_TRACE_MB)"
fi
MISSING_EVENTS=()
inst_create "$INST_CPU" "$CPU_BUF_KB"
CPUD=$TRACEFS/instances/$INST_CPU
inst_create "$INST_TASK" "$TASK_BUF_KB"
TASKD=$TRACEFS/instances/$INST_TASK

CPU_EVENTS=(sched/sched_switch sched/sched_wakeup sched/sched_wakeup_new sched/sched_migrate_task
    irq/irq_handler_entry irq/irq_handler_exit irq/softirq_entry irq/softirq_exit
    irq/tasklet_entry irq/tasklet_exit nmi/nmi_handler)
for f in "$CPUD"/events/irq_vectors/*_entry "$CPUD"/events/irq_vectors/*_exit; do
    [[ -d $f ]] || continue
    case ${f##*/} in vector_*) continue ;; esac
    CPU_EVENTS+=("irq_vectors/${f##*/}")
done
TASK_EVENTS=(raw_syscalls/sys_enter raw_syscalls/sys_exit exceptions/page_fault_user
    exceptions/page_fault_kernel sched/sched_process_fork sched/sched_process_exec
    sched/sched_process_exit task/task_newtask task/task_rename tlb/tlb_flush signal/signal_deliver)
KP_NOTE=""
kprobes_define
for n in ${KP_DEFINED[@]+"${KP_DEFINED[@]}"}; do TASK_EVENTS+=("$KP_GROUP/$n"); done
ENABLED=""
inst_enable "$CPUD" "${CPU_EVENTS[@]}"
EN_CPU=$ENABLED
inst_enable "$TASKD" "${TASK_EVENTS[@]}"
EN_TASK=$ENABLED
[[ $EN_CPU == *sched/sched_switch* ]] || die "cannot enable sched:sched_switch (see $TLOG)"
[[ $EN_TASK == *raw_syscalls/sys_enter* ]] || warn "raw_syscalls not enabled: no syscalls in the report"
tw "$TASKD/options/event-fork" 1 || die "no options/event-fork: cannot follow the observer's children"
log "global instance: $(wc -w <<<"$EN_CPU") events; per-task instance: $(wc -w <<<"$EN_TASK") events; kprobes: $KP_NOTE"
grep -h "not available\|not accepted" "$TLOG" | sed 's/^/    /' || true

# ------------------------------------------------------------ runs
declare -a RUN_DIRS=()
last_run_s=0
for ((i = 1; i <= RUNS; i++)); do
    elapsed=$((SECONDS - _T0))
    if ((i > 1 && elapsed + last_run_s + 35 > BUDGET_S)); then
        log "time budget: no run $i (elapsed ${elapsed}s, last run ${last_run_s}s, budget ${BUDGET_S}s)"
        break
    fi
    RD=$WORK/run$i
    mkdir -p "$RD"
    t_run=$SECONDS
    # kprobes cost every uprobe hit and page fault a little: by default runs 1 and 3 have them,
    # run 2 not (outlier counts with and without; KPROBES=all: every run)
    kp_on=0
    if ((${#KP_DEFINED[@]} > 0)); then
        if [[ $KPROBES == all ]] || ((i % 2 == 1)); then kp_on=1; fi
        for n in "${KP_DEFINED[@]}"; do
            tw "$TASKD/events/$KP_GROUP/$n/enable" "$kp_on" || warn "cannot set kprobe $n to $kp_on"
        done
    fi
    log "=== run $i: cuda-ground-truth --iters $GT_ITERS under gpu-observer run --trace-all, traced (kprobes $kp_on)"
    tw "$CPUD/trace" "" || true
    tw "$TASKD/trace" "" || true
    # this shell and everything it starts from now on (event-fork): the observer, its child
    echo $$ >"$TASKD/set_event_pid" || die "cannot write set_event_pid"
    tw "$CPUD/tracing_on" 1 || die "cannot start tracing"
    tw "$TASKD/tracing_on" 1 || die "cannot start tracing"
    mark_clock "$CPUD/trace_marker" "$TASKD/trace_marker"
    rc=0
    wpid=""
    if start_observer_run "$RD/events.jsonl" "$RD/observer.err" "$RD/workload.log" --trace-all \
        ${CUPTI_ARGS[@]+"${CUPTI_ARGS[@]}"} -- "$GT_BIN" --iters "$GT_ITERS" --out "$RD/workload.json"; then
        obs_pid=$OBS_PID
        if wait_for_line "$RD/observer.err" "started pid" 5 "$OBS_PID"; then
            wpid=$(sed -n 's/.*started pid \([0-9][0-9]*\).*/\1/p' "$RD/observer.err" | head -n 1)
        fi
        [[ -n $wpid || -z $OBS_PID ]] || wpid=$(child_pids "$OBS_PID" | head -n 1)
        if [[ -n $wpid ]]; then
            sample_threads "$wpid" "$RD/threads.txt" &
            SAMPLER_PID=$!
        fi
        if wait_observer_run "$WORKLOAD_TIMEOUT"; then
            rc=${OBS_RC:-0}
        else
            rc=124
        fi
    else
        obs_pid=""
        rc=125
        warn "gpu-observer run did not start (run $i)"
    fi
    mark_clock "$CPUD/trace_marker" "$TASKD/trace_marker"
    tw "$CPUD/tracing_on" 0 || true
    tw "$TASKD/tracing_on" 0 || true
    tw "$TASKD/set_event_pid" "" || true
    stop_sampler
    log "run $i: workload/observer rc=$rc, jsonl $(wc -l <"$RD/events.jsonl" 2>/dev/null || echo 0) lines; saving traces"
    tail -n 3 "$RD/observer.err" 2>/dev/null | sed 's/^/    observer: /' || true
    save_instance "$CPUD" "$RD/trace_cpu"
    save_instance "$TASKD" "$RD/trace_task"
    mv -f "$RD/trace_cpu.stats" "$RD/stats_cpu.txt" 2>/dev/null || true
    mv -f "$RD/trace_task.stats" "$RD/stats_task.txt" 2>/dev/null || true
    [[ ! -s $RD/events.jsonl ]] || gzip -f -1 "$RD/events.jsonl"
    {
        echo "run $i"
        echo "workload_pid $wpid"
        echo "observer_pid $obs_pid"
        echo "rc $rc"
        echo "gt_iters $GT_ITERS"
        echo "kernel $(uname -r)"
        echo "tracefs $TRACEFS"
        echo "ncpu $NCPU"
        echo "buffer_kb_cpu $(cat "$CPUD/buffer_size_kb")"
        echo "buffer_kb_task $(cat "$TASKD/buffer_size_kb")"
        echo "events_cpu $EN_CPU"
        echo "events_task $EN_TASK"
        echo "events_missing ${MISSING_EVENTS[*]:-}"
        echo "kprobes $KP_NOTE"
        echo "kprobes_enabled $kp_on"
        echo "observer $OBSERVER"
        echo "ground_truth $GT_BIN"
    } >"$RD/meta.txt"
    du -sh "$RD" | sed 's/^/    /' || true
    RUN_DIRS+=(--run "$RD")
    last_run_s=$((SECONDS - t_run))
done
tracefs_cleanup
log "tracefs state removed"
have_jsonl=0
for ((k = 2; k <= ${#RUN_DIRS[@]}; k += 2)); do
    [[ ! -s ${RUN_DIRS[k - 1]}/events.jsonl.gz ]] || have_jsonl=$((have_jsonl + 1))
done

# ------------------------------------------------------------ analysis
left=$((BUDGET_S + 10 - (SECONDS - _T0)))
((left >= 15)) || left=15
log "=== analysis (timeout ${left}s)"
arc=0
timeout "$left" "$PYTHON" "$HERE/trace_outliers.py" "${RUN_DIRS[@]}" --md "$WORK/OUTLIERS.md" \
    --json "$WORK/outliers.json" --excerpts "$WORK/outliers-excerpts.txt" \
    --threshold-ns "$THRESHOLD_NS" --controls "$CONTROLS" || arc=$?
if ((arc != 0)); then
    warn "trace_outliers.py failed (rc=$arc); redo it from the artifacts: python3 gpu/trace_outliers.py --run run1 ..."
    exit 1
fi
sed -n '/^## Summary/,/^## Runs/p' "$WORK/OUTLIERS.md" | sed '$d'
log "done in $((SECONDS - _T0)) s"
if ((have_jsonl == 0)); then
    warn "no run left observer output: the report has nothing to explain"
    exit 1
fi
