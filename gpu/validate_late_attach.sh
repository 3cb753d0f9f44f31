#!/usr/bin/env bash
# Late GPU timing (issue 17) on a real GPU: `gpu-observer --pid PID --gpu-timing --gpu-timing-for S`
# injects the observer's CUPTI library into a training job that is already running, times its GPU
# kernels, copies and memsets for S seconds, withdraws (CUPTI flushed and disabled, the library
# stays loaded idle) and goes on observing with its uprobes until it is stopped.
#
# For each job (WORKLOADS: torch = workloads/late_torch.py, jax = workloads/late_jax.py; a fixed
# number of deterministic training steps, ~35 s on an H100, a device synchronize and a JSON line per
# step):
#   (a) a reference run with no observer at all (the final loss and parameter checksum); the jobs'
#       reference runs go side by side, first (REF_PARALLEL=0: one after the other);
#   (b) the measured run, alone on the GPU: the job starts with no observer; ATTACH_AFTER_S (10) s
#       after it is ready (CUDA initialized, its first step done), `gpu-observer --pid PID
#       --gpu-timing --gpu-timing-for GPU_TIMING_FOR (10) --format jsonl --output OUTDIR/<job>.jsonl`
#       starts (also --trace-all, --ring-buffer-size and --cupti-lib where `gpu-observer --help`
#       lists them); OBS_LINGER_S (5) s after the window (its `withdrawn` line) it is stopped with
#       SIGINT, the job running on to its end (OBS_LINGER_S=exit: it runs until the job exits, and
#       ends with it). Either order of ends is handled: the job may end first, the observer may.
# gpucheck.compare_late then checks the observer's lines of the job's pid against the job's steps
# and the reference: every GPU record joined, every launch in the window named (graph launches
# aside; after the withdraw shown), the hijack pause <= 20 ms, the median step time after the
# withdraw within 5 % of before the attach (during shown), final loss and checksum equal to the
# reference's, bit for bit. A job that cannot run here (JAX missing or without a GPU, PyTorch
# without CUDA) is reported as not run and does not fail the validation (REQUIRE_ALL=1: it does);
# nothing run at all fails. ~3 minutes on an H100 (no measured run starts after BUDGET_S).
#
# GPU_OBSERVER_CUPTI_PATH (where the injected library finds libcupti; normally not needed): when it
# is set, it is passed to the JOBS, not to the observer: the injected library reads it from the
# target process's environment.
#
# usage (as root, from the repo root):
#   OBSERVER=.gpu-bundle/gpu-observer GIT_COMMIT=$(git rev-parse HEAD) gpu/validate_late_attach.sh [OUTDIR]
#
# OUTDIR (default $OUT, else /tmp/gpu-late-attach) receives: LATE_ATTACH.md (the report),
# late-results.json, <job>.jsonl.gz (the observer's JSON lines, gzipped once checked; one over
# 15 MiB is moved to the work dir; KEEP_RAW=1 leaves them as they are), <job>.err (the observer's
# stderr) and late-artifacts.tar.gz (the jobs' step files and logs, the observer's
# gpu_timing/cupti/summary/process_exit lines, results, env.json, nvidia-smi.txt).
# Exit 0 only if every job that ran passed (and at least one ran).
#
# Knobs (environment): WORKLOADS ("torch jax"), TORCH_STEPS / JAX_STEPS (the jobs' step counts;
# default theirs: 7500 / 9400), ATTACH_AFTER_S (10), GPU_TIMING_FOR (10), OBS_LINGER_S (5 or
# "exit"), REF_PARALLEL (1), WL_READY_TIMEOUT (120 s), WL_TIMEOUT (150 s a run), BUDGET_S (150: no
# measured run starts later), WARMUP_SHARE (0.2), AFTER_SKIP_S (1), RATIO_TOL (0.05), MAX_PAUSE_US
# (20000), MIN_STEPS (20), WITHDRAW_GRACE_S (15: how long past the window's nominal end a
# `withdrawn` line is waited for before the observer is stopped without one), OBS_ARGS (more
# observer options), REQUIRE_ALL, KEEP_RAW, PYTHON, CUPTI_LIB, READY_TIMEOUT (60 s), STOP_TIMEOUT
# (30 s), WORK_DIR.
# Self-test hooks: LATE_TORCH_WORKLOAD / LATE_JAX_WORKLOAD (scripts run instead of the jobs),
# ALLOW_NO_GPU=1 (no nvidia-smi), ALLOW_NONROOT=1.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=SCRIPTDIR/lib.sh
source "$HERE/lib.sh"

OUTDIR=${1:-${OUT:-/tmp/gpu-late-attach}}
PYTHON=${PYTHON:-python3}
WORKLOADS=${WORKLOADS:-torch jax}
ATTACH_AFTER_S=${ATTACH_AFTER_S:-10}
GPU_TIMING_FOR=${GPU_TIMING_FOR:-10}
OBS_LINGER_S=${OBS_LINGER_S:-5}
WL_READY_TIMEOUT=${WL_READY_TIMEOUT:-120}
WL_TIMEOUT=${WL_TIMEOUT:-150}
BUDGET_S=${BUDGET_S:-150}
WARMUP_SHARE=${WARMUP_SHARE:-0.2}
AFTER_SKIP_S=${AFTER_SKIP_S:-1}
RATIO_TOL=${RATIO_TOL:-0.05}
MAX_PAUSE_US=${MAX_PAUSE_US:-20000}
MIN_STEPS=${MIN_STEPS:-20}
REF_PARALLEL=${REF_PARALLEL:-1}
WITHDRAW_GRACE_S=${WITHDRAW_GRACE_S:-15}
OBS_ARGS=${OBS_ARGS:-}
# The jobs' environment gets GPU_OBSERVER_CUPTI_PATH (when set); the observer's does not.
WL_CUPTI_PATH=${GPU_OBSERVER_CUPTI_PATH:-}
unset GPU_OBSERVER_CUPTI_PATH
WL_ENV=()
[[ -z $WL_CUPTI_PATH ]] || WL_ENV=("GPU_OBSERVER_CUPTI_PATH=$WL_CUPTI_PATH")

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
rm -f "$OUTDIR/LATE_ATTACH.md" "$OUTDIR/late-results.json" "$OUTDIR/late-artifacts.tar.gz"
WORK=${WORK_DIR:-$(mktemp -d /tmp/gpu-late-attach-work.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
[[ $WORK != "$OUTDIR" ]] || die "WORK_DIR must differ from the output dir"
STATUS=$WORK/status.tsv
: >"$STATUS"

WL_PID=""
ENV_PID=""
REF_PIDS=()
on_exit_hook() {
    local p kids
    if [[ -n $WL_PID ]] && proc_alive "$WL_PID"; then
        kill -TERM "$WL_PID" 2>/dev/null || true
    fi
    # reference runs still going: their `timeout` passes SIGTERM on to the job
    for p in ${REF_PIDS[@]+"${REF_PIDS[@]}"}; do
        kids=$(child_pids "$p")
        # shellcheck disable=SC2086  # one pid per word
        [[ -z $kids ]] || kill -TERM $kids 2>/dev/null || true
    done
    [[ -f $WORK/LATE_ATTACH.md ]] && cp -f "$WORK/LATE_ATTACH.md" "$OUTDIR/LATE_ATTACH.md"
    [[ -f $WORK/late-results.json ]] && cp -f "$WORK/late-results.json" "$OUTDIR/late-results.json"
    pack_dir "$WORK" "$OUTDIR/late-artifacts.tar.gz"
    log "outputs in $OUTDIR (work dir $WORK)"
}
install_traps

read -r -a JOB_LIST <<<"$WORKLOADS"
read -r -a OBS_EXTRA <<<"$OBS_ARGS"
for w in "${JOB_LIST[@]}"; do
    case $w in
    torch | jax) ;;
    *) die "unknown workload '$w' in WORKLOADS (torch jax)" ;;
    esac
done
[[ $OBS_LINGER_S == exit || $OBS_LINGER_S =~ ^[0-9]+([.][0-9]+)?$ ]] || die "OBS_LINGER_S: a number of seconds or 'exit'"

# ------------------------------------------------------------ preflight
log "gpu-observer late GPU timing validation -> $OUTDIR (jobs: $WORKLOADS; attach ${ATTACH_AFTER_S} s in, window ${GPU_TIMING_FOR} s, observer stopped: $([[ $OBS_LINGER_S == exit ]] && echo 'with the job' || echo "${OBS_LINGER_S} s after the window"); work dir $WORK)"
require_root
require_tools timeout grep sed tail awk gzip date "$PYTHON"
[[ ${ALLOW_NO_GPU:-0} == 1 ]] || require_tools nvidia-smi
resolve_observer "$REPO_ROOT"
log "observer: $OBSERVER"
[[ -z $WL_CUPTI_PATH ]] || log "GPU_OBSERVER_CUPTI_PATH=$WL_CUPTI_PATH (passed to the jobs only)"
OBS_HELP=$WORK/observer_help.txt
timeout 30 "$OBSERVER" --help >"$OBS_HELP" 2>&1 || true
has_flag() { grep -qE -- "(^|[[:space:],])$1([[:space:]=,]|\$)" "$OBS_HELP"; }
NO_FEATURE=""
for f in --gpu-timing --gpu-timing-for; do
    has_flag "$f" || NO_FEATURE+="$f "
done
[[ -z $NO_FEATURE ]] || warn "the observer's --help lists no ${NO_FEATURE% } (an older build?): the measured runs cannot be made"
resolve_cupti "$REPO_ROOT" "$WORK/observer_run_help.txt"
log "CUPTI injection library: ${CUPTI_LIB_PATH:-not found (the observer looks beside itself)}"
OBS_FLAGS=()
has_flag --trace-all && OBS_FLAGS+=(--trace-all)
has_flag --ring-buffer-size && OBS_FLAGS+=(--ring-buffer-size 67108864)
# The ring comes out of the memory budget (--memory-limit-mb, 256 by default): with a 64 MiB ring
# and --trace-all the CUPTI join's share was too small on the H100 (calls evicted before their
# API record came: 5 % joined); 1 GiB leaves it room.
has_flag --memory-limit-mb && OBS_FLAGS+=(--memory-limit-mb 1024)
has_flag --cupti-lib && OBS_FLAGS+=(${CUPTI_ARGS[@]+"${CUPTI_ARGS[@]}"})
log "observer options beyond --pid/--gpu-timing/--format/--output: ${OBS_FLAGS[*]:-none} ${OBS_ARGS}"
# The environment is recorded while the reference runs go (it imports torch: seconds).
"$PYTHON" -m gpucheck.make_report env --out "$WORK/env.json" --observer "$OBSERVER" \
    --python "$PYTHON" --cupti-lib "$CUPTI_LIB_PATH" --observer-run "$OBS_RUN_HELP" >"$WORK/env.log" 2>&1 &
ENV_PID=$!
if [[ ${ALLOW_NO_GPU:-0} != 1 ]]; then
    nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1 || die "nvidia-smi failed: $(tail -n 3 "$WORK/nvidia-smi.txt")"
    sed -n '1,12p' "$WORK/nvidia-smi.txt"
fi
SETTINGS="WORKLOADS=\`$WORKLOADS\`, ATTACH_AFTER_S=$ATTACH_AFTER_S, GPU_TIMING_FOR=$GPU_TIMING_FOR, OBS_LINGER_S=$OBS_LINGER_S"
SETTINGS+=", observer options \`--pid PID --gpu-timing --gpu-timing-for $GPU_TIMING_FOR --format jsonl --output OUTDIR/<job>.jsonl${OBS_FLAGS[*]:+ ${OBS_FLAGS[*]}}${OBS_ARGS:+ $OBS_ARGS}\`"
[[ -z ${TORCH_STEPS:-} ]] || SETTINGS+=", TORCH_STEPS=$TORCH_STEPS"
[[ -z ${JAX_STEPS:-} ]] || SETTINGS+=", JAX_STEPS=$JAX_STEPS"
[[ -z $WL_CUPTI_PATH ]] || SETTINGS+=", GPU_OBSERVER_CUPTI_PATH=\`$WL_CUPTI_PATH\` (jobs only)"

# ------------------------------------------------------------ helpers

status() { printf '%s\t%s\n' "$1" "$2" >>"$STATUS"; }
mono_ns() { "$PYTHON" -c 'import time; print(time.monotonic_ns())'; }
now_ms() { date +%s%3N; }
budget_left() { ((SECONDS - _T0 <= BUDGET_S)); }

# job_script JOB / job_steps JOB: the script and its --steps option (one word per line, or none).
job_script() {
    case $1 in
    torch) echo "${LATE_TORCH_WORKLOAD:-$HERE/workloads/late_torch.py}" ;;
    jax) echo "${LATE_JAX_WORKLOAD:-$HERE/workloads/late_jax.py}" ;;
    esac
}
job_steps() {
    local v
    v=$(echo "$1" | tr '[:lower:]' '[:upper:]')_STEPS
    [[ -z ${!v:-} ]] || printf '%s\n' --steps "${!v}"
}

# skip_reason RESULTS: the reason a job wrote when it could not run here, or nothing.
skip_reason() {
    "$PYTHON" -c 'import json, sys
for l in open(sys.argv[1], encoding="utf-8", errors="replace"):
    try:
        e = json.loads(l)
    except ValueError:
        continue
    if isinstance(e, dict) and "skipped" in e:
        print(e["skipped"]); break' "$1" 2>/dev/null || true
}

# run_reference JOB: reference JOB, its status in WORK/JOB.ref.rc and its reason in WORK/JOB.ref.why.
run_reference() {
    local rc=0
    SKIP_WHY=""
    reference "$1" || rc=$?
    echo "$rc" >"$WORK/$1.ref.rc"
    printf '%s\n' "$SKIP_WHY" >"$WORK/$1.ref.why"
}

# reference JOB: the job with no observer at all. 0 ran, 1 failed, 3 cannot run here (reason in
# SKIP_WHY).
reference() {
    local w=$1 rc=0 script
    script=$(job_script "$w")
    local -a steps
    mapfile -t steps < <(job_steps "$w")
    log "=== $w: reference run, no observer ($(basename "$script") ${steps[*]:-(default steps)})"
    env -u CUDA_INJECTION64_PATH ${WL_ENV[@]+"${WL_ENV[@]}"} timeout --kill-after=10 "$WL_TIMEOUT" \
        "$PYTHON" "$script" ${steps[@]+"${steps[@]}"} --out "$WORK/$w.ref.steps.jsonl" \
        </dev/null >"$WORK/$w.ref.log" 2>&1 || rc=$?
    tail -n 1 "$WORK/$w.ref.log" | sed 's/^/    /'
    SKIP_WHY=$(skip_reason "$WORK/$w.ref.steps.jsonl")
    if [[ -n $SKIP_WHY ]]; then
        return 3
    elif ((rc != 0)); then
        SKIP_WHY="reference run failed, rc=$rc: $(tail -n 1 "$WORK/$w.ref.log")"
        return 1
    fi
    return 0
}

# measured JOB: the job alone, the observer attached ATTACH_AFTER_S s after it is ready; then
# gpucheck.compare_late.
measured() {
    local w=$1 wrc=0 orc="" script
    local ready=$WORK/$w.ready steps_out=$WORK/$w.steps.jsonl
    local jsonl=$OUTDIR/$w.jsonl err=$OUTDIR/$w.err wlog=$WORK/$w.log
    local obs_start="" obs_stop="" ready_ms="" deadline why="" started
    script=$(job_script "$w")
    local -a steps
    mapfile -t steps < <(job_steps "$w")
    rm -f "$ready" "$steps_out" "$jsonl" "$jsonl.gz" "$err"
    OBS_RC=""
    log "=== $w: measured run: the job alone, then gpu-observer --pid PID --gpu-timing --gpu-timing-for $GPU_TIMING_FOR"
    env -u CUDA_INJECTION64_PATH ${WL_ENV[@]+"${WL_ENV[@]}"} "$PYTHON" "$script" ${steps[@]+"${steps[@]}"} \
        --out "$steps_out" --ready "$ready" </dev/null >"$wlog" 2>&1 &
    WL_PID=$!
    started=$(now_ms)
    deadline=$((started + WL_TIMEOUT * 1000))
    if ! wait_for_line "$ready" '"pid"' "$WL_READY_TIMEOUT" "$WL_PID"; then
        why="the job never became ready"
    else
        log "job pid $WL_PID ready; the observer comes in ${ATTACH_AFTER_S} s"
        sleep "$ATTACH_AFTER_S"
        proc_alive "$WL_PID" || why="the job ended before the attach (make it longer: ${w^^}_STEPS)"
    fi
    if [[ -z $why ]]; then
        obs_start=$(mono_ns)
        rm -f "$err"
        set -m
        "$OBSERVER" --pid "$WL_PID" --gpu-timing --gpu-timing-for "$GPU_TIMING_FOR" --format jsonl \
            --output "$jsonl" ${OBS_FLAGS[@]+"${OBS_FLAGS[@]}"} ${OBS_EXTRA[@]+"${OBS_EXTRA[@]}"} \
            </dev/null >"$WORK/$w.obs.out" 2>"$err" &
        OBS_PID=$!
        # shellcheck disable=SC2034  # read by lib.sh's stop_observer
        OBS_RUN=""
        set +m
        if await_ready observer "$err" "$READY_TIMEOUT" rc; then
            ready_ms=$(now_ms)
        else
            orc=${OBS_RC:-}
            obs_stop=$(mono_ns)
        fi
    fi
    if [[ -n $why ]] && proc_alive "$WL_PID"; then
        kill -TERM "$WL_PID" 2>/dev/null || true
    fi
    # Until the job ends. Unless OBS_LINGER_S=exit, the observer is stopped OBS_LINGER_S s after the
    # window: after ready + GPU_TIMING_FOR + OBS_LINGER_S, and OBS_LINGER_S after it withdrew (a
    # "withdrawn" notice on its stderr or line in its output, looked for twice a second from the
    # window's nominal end), or at the latest WITHDRAW_GRACE_S s later without one.
    local for_ms linger_ms nominal="" t_w="" looked=0 now
    for_ms=$(awk -v a="$GPU_TIMING_FOR" 'BEGIN { printf "%d", a * 1000 }')
    linger_ms=$(awk -v a="${OBS_LINGER_S/exit/0}" 'BEGIN { printf "%d", a * 1000 }')
    [[ -z $ready_ms || $OBS_LINGER_S == exit ]] || nominal=$((ready_ms + for_ms + linger_ms))
    while proc_alive "$WL_PID" && (($(now_ms) < deadline)); do
        now=$(now_ms)
        if [[ -n $OBS_PID && -n $nominal ]]; then
            if [[ -z $t_w ]] && ((now >= ready_ms + for_ms && now - looked >= 500)); then
                looked=$now
                # its stderr notice, else the end of its output (tens of MB a second with --trace-all)
                if grep -qiF "withdrawn" "$err" 2>/dev/null ||
                    grep -qF withdrawn < <(tail -c 134217728 "$jsonl" 2>/dev/null); then
                    t_w=$now
                    log "the observer withdrew: $(grep -iF withdrawn "$err" 2>/dev/null | head -n 1 || true)"
                fi
            fi
            if { [[ -n $t_w ]] && ((now >= nominal && now >= t_w + linger_ms)); } ||
                ((now >= nominal + WITHDRAW_GRACE_S * 1000)); then
                if [[ -z $t_w ]]; then
                    warn "no withdrawn line ${WITHDRAW_GRACE_S} s after the window's nominal end; stopping the observer"
                elif proc_alive "$OBS_PID"; then
                    log "window over ${OBS_LINGER_S} s ago: stopping the observer (SIGINT), the job runs on"
                fi
                stop_observer
                orc=$OBS_RC
                obs_stop=$(mono_ns)
                nominal=""
            fi
        fi
        if [[ -n $OBS_PID ]] && ! proc_alive "$OBS_PID"; then
            if proc_alive "$WL_PID"; then
                warn "the observer exited before the job did"
                stop_observer
            else
                stop_observer
                log "the observer ended with the job (rc=$OBS_RC)"
            fi
            orc=$OBS_RC
            obs_stop=$(mono_ns)
        fi
        sleep 0.1
    done
    if proc_alive "$WL_PID"; then
        warn "job still running after ${WL_TIMEOUT} s; stopping it"
        kill -TERM "$WL_PID" 2>/dev/null || true
        sleep 5
        kill -KILL "$WL_PID" 2>/dev/null || true
    fi
    wait "$WL_PID" 2>/dev/null || wrc=$?
    WL_PID=""
    log "job rc=$wrc: $(tail -n 1 "$wlog")"
    if [[ -n $OBS_PID ]]; then
        # A --pid observer ends with its process: give it STOP_TIMEOUT s, then stop it.
        if await_exit "$STOP_TIMEOUT" "observer still running ${STOP_TIMEOUT} s after the job exited; stopping it"; then
            log "the observer ended with the job (rc=$OBS_RC)"
        fi
        orc=$OBS_RC
        obs_stop=$(mono_ns)
    fi
    log "observer rc=${orc:-none}; stderr: $(grep -c . "$err" 2>/dev/null || echo 0) lines"
    tail -n 6 "$err" 2>/dev/null | sed 's/^/    observer: /' || true
    if [[ -n $why ]]; then
        warn "$w: $why"
        tail -n 5 "$wlog" | sed 's/^/    job: /'
        status "$w" "FAIL ($why)"
        return 0
    fi
    if [[ ! -s $jsonl ]]; then
        status "$w" "FAIL (no observer output; job rc=$wrc, observer rc=${orc:-none})"
        return 0
    fi
    grep -F -e '"gpu_timing"' -e '"cupti"' -e '"summary"' -e '"process_exit"' "$jsonl" >"$WORK/$w.lines.jsonl" || true
    local -a args=(--name "$w" --steps "$steps_out" --reference "$WORK/$w.ref.steps.jsonl" --events "$jsonl"
        --pid "$(sed -n 's/.*"pid": *\([0-9][0-9]*\).*/\1/p' "$ready")" --workload-rc "$wrc"
        --observer-start-ns "$obs_start" --gpu-timing-for "$GPU_TIMING_FOR" --warmup-share "$WARMUP_SHARE"
        --after-skip-s "$AFTER_SKIP_S" --ratio-tol "$RATIO_TOL" --max-pause-us "$MAX_PAUSE_US"
        --min-steps "$MIN_STEPS" --result-out "$WORK/$w.result.json" --section-out "$WORK/$w.section.md")
    [[ ! $orc =~ ^[0-9]+$ ]] || args+=(--observer-rc "$orc")
    [[ -z $obs_stop ]] || args+=(--observer-stop-ns "$obs_stop")
    "$PYTHON" -m gpucheck.compare_late check "${args[@]}" | sed 's/^/    /' || true
    if [[ ${KEEP_RAW:-0} != 1 ]]; then
        gzip -f -1 "$jsonl"
        # Kept in OUTDIR up to 15 MiB (what some runners bring back); a larger one goes to WORK.
        if (($(stat -c %s "$jsonl.gz" 2>/dev/null || echo 0) > 15728640)); then
            mv -f "$jsonl.gz" "$WORK/"
            log "$(basename "$jsonl").gz is over 15 MiB: moved to $WORK"
        fi
    fi
    return 0
}

# report: LATE_ATTACH.md and late-results.json from the results so far.
report() {
    local rrc=0 f
    local -a res=() extra=()
    for f in "$WORK"/*.result.json; do
        [[ -e $f ]] && res+=("$f")
    done
    [[ ${REQUIRE_ALL:-0} != 1 ]] || extra=(--require-all)
    "$PYTHON" -m gpucheck.compare_late report --env "$WORK/env.json" --status-file "$STATUS" \
        --settings "$SETTINGS" --out "$WORK/LATE_ATTACH.md" --json-out "$WORK/late-results.json" \
        ${extra[@]+"${extra[@]}"} ${res[@]+"${res[@]}"} >"$WORK/report.log" 2>&1 || rrc=$?
    [[ -f $WORK/LATE_ATTACH.md ]] && cp -f "$WORK/LATE_ATTACH.md" "$OUTDIR/LATE_ATTACH.md"
    [[ -f $WORK/late-results.json ]] && cp -f "$WORK/late-results.json" "$OUTDIR/late-results.json"
    return "$rrc"
}

# ------------------------------------------------------------ runs
# The reference runs first, side by side (REF_PARALLEL=1; only their results count, not their
# speed), then each measured run alone on the GPU.
for w in "${JOB_LIST[@]}"; do
    rm -f "$WORK/$w".*
done
if [[ $REF_PARALLEL == 1 ]]; then
    log "=== reference runs, no observer, side by side: ${JOB_LIST[*]}"
    for w in "${JOB_LIST[@]}"; do
        run_reference "$w" >"$WORK/$w.ref.out" 2>&1 &
        REF_PIDS+=($!)
    done
    for p in "${REF_PIDS[@]}"; do
        wait "$p" 2>/dev/null || true
    done
    REF_PIDS=()
    for w in "${JOB_LIST[@]}"; do
        sed 's/^/  /' "$WORK/$w.ref.out"
    done
else
    for w in "${JOB_LIST[@]}"; do
        run_reference "$w"
    done
fi
wait "$ENV_PID" 2>/dev/null || warn "env capture failed: $(tail -n 1 "$WORK/env.log")"
ENV_PID=""
for w in "${JOB_LIST[@]}"; do
    rrc=$(cat "$WORK/$w.ref.rc" 2>/dev/null || echo 1)
    SKIP_WHY=$(cat "$WORK/$w.ref.why" 2>/dev/null || echo "reference run gave no status")
    if ((rrc == 3)); then
        log "$w cannot run here: $SKIP_WHY"
        status "$w" "NOT RUN ($SKIP_WHY)"
        continue
    elif ((rrc != 0)); then
        warn "$w: $SKIP_WHY"
        status "$w" "FAIL ($SKIP_WHY)"
        continue
    fi
    if [[ -n $NO_FEATURE ]]; then
        status "$w" "FAIL (the observer has no ${NO_FEATURE% }: an older build?)"
        continue
    fi
    if ! budget_left; then
        warn "time budget (${BUDGET_S} s) exhausted; $w not run"
        status "$w" "FAIL (not run: time budget ${BUDGET_S} s exhausted)"
        continue
    fi
    measured "$w"
    report || true
done

finish_report "LATE GPU TIMING"
