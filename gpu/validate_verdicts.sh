#!/usr/bin/env bash
# Bottleneck verdicts (issue 13) on a real GPU: PyTorch workloads built to have one known
# bottleneck each (workloads/bottleneck.py: launch, gemm, transfer, sync, cpu, sleep, and the
# training loop of train_bench.py as "train"), each run twice:
#   cupti     gpu-observer run --format jsonl --interval-ms 1000 -- python3 bottleneck.py --kind K
#             (CUPTI injection library: exact GPU busy time)
#   observed  the workload waits (torch imported, cuInit done, no context) while three observers
#             start: all processes (--format jsonl), --pid PID (--format jsonl) and
#             --pid PID --format terminal --output FILE (the final summary a person reads); once
#             they are ready (and the --pid ones attached) it runs. Without CUPTI the GPU busy
#             time comes from NVML's per-process SM utilization.
# then gpucheck.compare_verdicts checks each observer's `verdict` lines for the workload's pid:
# over the span where the window is full length (>= FULL_S s after the process's first sample,
# to its exit) the designed class must be the majority and the class at the end; host_bound
# also checks evidence.host. The whole-run verdict (summary) and the terminal verdict line are
# reported. `train` is informational.
#
# usage (as root, from the repo root):
#   OBSERVER=.gpu-bundle/gpu-observer GIT_COMMIT=$(git rev-parse HEAD) gpu/validate_verdicts.sh [OUTDIR]
#
# OUTDIR defaults to $OUT if set, else /tmp/gpu-verdicts.  It receives three files:
#   VERDICTS.md                the report (also rewritten after each workload, so a run cut
#                              short still leaves one)
#   verdicts-results.json      env + every run's result
#   verdicts-artifacts.tar.gz  per run: the observer's verdict/summary/process_exit/cupti lines
#                              (NAME.verdicts.jsonl), observer stderr, terminal capture, workload
#                              log and JSON, result JSON; env.json, nvidia-smi.txt, status.tsv
# Work files stay in $WORK_DIR (default /tmp/gpu-verdicts-work.*); the observers' full JSONL
# go to $WORK_DIR.jsonl and are deleted once read (KEEP_JSONL=1 keeps them there).  Exit 0 only if every
# strict run passed.  ~5.5 minutes on an H100 with the defaults (no run starts after BUDGET_S).
#
# Knobs (environment): KINDS ("launch gemm transfer sync cpu sleep train"; also cpu_inline),
# MODES ("cupti observed"), SKIP (runs left out: "KIND" or "KIND/MODE", e.g. "train gemm/cupti"),
# WL_SECONDS (14: each workload's steady part), WL_TIMEOUT (WL_SECONDS + 60 s), BUDGET_S (390),
# INTERVAL_MS (1000), FULL_S (9), TERMINAL (1: the third, terminal-format observer),
# BOTTLENECK_ARGS (extra bottleneck.py options for every workload), ARGS_<KIND> (for one, e.g.
# ARGS_sync="--sync-kernel-us 800 --sync-cpu-us 1200"), EXPECT (overrides of the expected class:
# "KIND[/MODE]=CLASS[:HOST]|none ...", MODE cupti, all or pid), OBS_ARGS (extra options for every
# observer), PYTHON, CUPTI_LIB, READY_TIMEOUT (60 s), STOP_TIMEOUT (30 s), KEEP_JSONL=1, WORK_DIR.
# Self-test hooks: BOTTLENECK_WORKLOAD (script run instead of workloads/bottleneck.py),
# ALLOW_NO_GPU=1 (no nvidia-smi / torch checks), ALLOW_NONROOT=1.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=SCRIPTDIR/lib.sh
source "$HERE/lib.sh"

OUTDIR=${1:-${OUT:-/tmp/gpu-verdicts}}
PYTHON=${PYTHON:-python3}
KINDS=${KINDS:-launch gemm transfer sync cpu sleep train}
MODES=${MODES:-cupti observed}
SKIP=${SKIP:-}
WL_SECONDS=${WL_SECONDS:-14}
WL_TIMEOUT=${WL_TIMEOUT:-$(awk -v s="$WL_SECONDS" 'BEGIN { printf "%d", s + 60.999 }')}
BUDGET_S=${BUDGET_S:-390}
INTERVAL_MS=${INTERVAL_MS:-1000}
FULL_S=${FULL_S:-9}
TERMINAL=${TERMINAL:-1}
EXPECT=${EXPECT:-}
BOTTLENECK_ARGS=${BOTTLENECK_ARGS:-}
OBS_ARGS=${OBS_ARGS:-}
WORKLOAD=${BOTTLENECK_WORKLOAD:-$HERE/workloads/bottleneck.py}
OBS_ENV=()

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
rm -f "$OUTDIR/VERDICTS.md" "$OUTDIR/verdicts-results.json" "$OUTDIR/verdicts-artifacts.tar.gz"
WORK=${WORK_DIR:-$(mktemp -d /tmp/gpu-verdicts-work.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
[[ $WORK != "$OUTDIR" ]] || die "WORK_DIR must differ from the output dir"
STATUS=$WORK/status.tsv
: >"$STATUS"
# The observers' full JSONL (hundreds of MB for the launch loop) stay out of the work dir (and so
# out of the artifacts): only their verdict, summary, process_exit and cupti lines are kept.
FULL_DIR=$WORK.jsonl
mkdir -p "$FULL_DIR"

declare -A BG_PID=() # observers of the `observed` runs, by role (all, pid, term)
declare -A BG_RC=()
WL_PID=""
on_exit_hook() {
    local k
    for k in "${!BG_PID[@]}"; do
        [[ -z ${BG_PID[$k]} ]] || bg_stop "$k"
    done
    if [[ -n $WL_PID ]] && proc_alive "$WL_PID"; then
        kill -TERM "$WL_PID" 2>/dev/null || true
    fi
    [[ ${KEEP_JSONL:-0} == 1 ]] || rm -rf "$FULL_DIR"
    [[ -f $WORK/VERDICTS.md ]] && cp -f "$WORK/VERDICTS.md" "$OUTDIR/VERDICTS.md"
    [[ -f $WORK/verdicts-results.json ]] && cp -f "$WORK/verdicts-results.json" "$OUTDIR/verdicts-results.json"
    pack_dir "$WORK" "$OUTDIR/verdicts-artifacts.tar.gz"
    log "outputs in $OUTDIR (work dir $WORK)"
}
install_traps

read -r -a KIND_LIST <<<"$KINDS"
read -r -a MODE_LIST <<<"$MODES"
read -r -a WL_COMMON <<<"$BOTTLENECK_ARGS"
read -r -a OBS_EXTRA <<<"$OBS_ARGS"
for k in "${KIND_LIST[@]}"; do
    case $k in
    launch | gemm | transfer | sync | cpu | cpu_inline | sleep | train) ;;
    *) die "unknown kind '$k' in KINDS (launch gemm transfer sync cpu cpu_inline sleep train)" ;;
    esac
done
for m in "${MODE_LIST[@]}"; do
    case $m in
    cupti | observed) ;;
    *) die "unknown mode '$m' in MODES (cupti observed)" ;;
    esac
done
declare -A EXP=()
for item in $EXPECT; do
    [[ $item == *=* ]] || die "EXPECT: '$item' is not KIND[/MODE]=CLASS[:HOST]"
    EXP[${item%%=*}]=${item#*=}
done

# ------------------------------------------------------------ preflight
log "gpu-observer verdict validation -> $OUTDIR (kinds: $KINDS; modes: $MODES; ${WL_SECONDS} s each; work dir $WORK)"
require_root
require_tools timeout grep sed tail awk "$PYTHON"
[[ ${ALLOW_NO_GPU:-0} == 1 ]] || require_tools nvidia-smi
resolve_observer "$REPO_ROOT"
[[ -f $WORKLOAD ]] || die "workload not found: $WORKLOAD"
log "observer: $OBSERVER"
CUPTI_SKIP=""
CUPTI_LIB_PATH=""
CUPTI_ARGS=()
OBS_RUN_HELP="not needed"
if [[ " $MODES " == *" cupti "* ]]; then
    resolve_cupti "$REPO_ROOT" "$WORK/observer_run_help.txt"
    log "CUPTI injection library: ${CUPTI_LIB_PATH:-not found}; observer run subcommand: $OBS_RUN_HELP"
    [[ -z $CUPTI_SKIP ]] || warn "the cupti runs cannot be made: $CUPTI_SKIP"
fi
"$PYTHON" -m gpucheck.make_report env --out "$WORK/env.json" --observer "$OBSERVER" \
    --python "$PYTHON" --cupti-lib "$CUPTI_LIB_PATH" --observer-run "$OBS_RUN_HELP" || warn "env capture failed"
NOT_USABLE=""
if [[ ${ALLOW_NO_GPU:-0} != 1 ]]; then
    nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1 || die "nvidia-smi failed: $(tail -n 3 "$WORK/nvidia-smi.txt")"
    sed -n '1,12p' "$WORK/nvidia-smi.txt"
    if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)' \
        >"$WORK/torch_check.log" 2>&1; then
        NOT_USABLE="PyTorch with CUDA not usable from $PYTHON: $(tail -n 1 "$WORK/torch_check.log")"
        warn "$NOT_USABLE"
    fi
fi
SETTINGS="KINDS=\`$KINDS\`, MODES=\`$MODES\`, WL_SECONDS=$WL_SECONDS, INTERVAL_MS=$INTERVAL_MS, FULL_S=$FULL_S"
[[ -z $BOTTLENECK_ARGS ]] || SETTINGS+=", BOTTLENECK_ARGS=\`$BOTTLENECK_ARGS\`"
for k in "${KIND_LIST[@]}"; do
    v="ARGS_$k"
    [[ -z ${!v:-} ]] || SETTINGS+=", $v=\`${!v}\`"
done
[[ -z $EXPECT ]] || SETTINGS+=", EXPECT=\`$EXPECT\`"
[[ -z $SKIP ]] || SETTINGS+=", SKIP=\`$SKIP\`"
[[ -z $OBS_ARGS ]] || SETTINGS+=", OBS_ARGS=\`$OBS_ARGS\`"

# ------------------------------------------------------------ helpers

# status NAME KIND MODE TEXT: a run without a result of its own (not run, did not start).
status() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$STATUS"; }

skipped() { [[ " $SKIP " == *" $1 "* || " $SKIP " == *" $1/$2 "* ]]; }

# expect_args KIND MODE: the --expect override of EXPECT, if any (one word per line).
expect_args() {
    local v=${EXP[$1/$2]:-${EXP[$1]:-}}
    [[ -z $v ]] || printf '%s\n' --expect "$v"
}

# workload_args KIND: BOTTLENECK_ARGS then ARGS_<KIND> (one word per line).
workload_args() {
    local v="ARGS_$1"
    local -a extra=()
    read -r -a extra <<<"${!v:-}"
    local -a all=(${WL_COMMON[@]+"${WL_COMMON[@]}"} ${extra[@]+"${extra[@]}"})
    # Nothing at all must print nothing: one empty line would become an empty argument.
    ((${#all[@]} == 0)) || printf '%s\n' "${all[@]}"
}

# bg_observer ROLE ERRFILE ARGS...: an observer in the background (SIGINT deliverable).
bg_observer() {
    local role=$1 err=$2
    shift 2
    rm -f "$err"
    set -m
    "$OBSERVER" "$@" ${OBS_EXTRA[@]+"${OBS_EXTRA[@]}"} </dev/null >"${err%.err}.obs.out" 2>"$err" &
    BG_PID[$role]=$!
    set +m
}

# bg_stop ROLE: stop it as lib.sh stops the observer (SIGINT, then SIGTERM, SIGKILL); BG_RC.
bg_stop() {
    local role=$1
    [[ -n ${BG_PID[$role]:-} ]] || return 0
    OBS_PID=${BG_PID[$role]}
    OBS_RUN=""
    stop_observer
    BG_RC[$role]=$OBS_RC
    BG_PID[$role]=""
}

# bg_end ROLE TIMEOUT_S: wait for it to exit by itself (a --pid observer ends with its process),
# then stop it.
bg_end() {
    local role=$1 t=$2 pid=${BG_PID[$1]:-} i
    [[ -n $pid ]] || return 0
    for ((i = 0; i < t * 10; i++)); do
        proc_alive "$pid" || break
        sleep 0.1
    done
    proc_alive "$pid" && warn "$role observer still running ${t} s after its process exited; stopping it"
    bg_stop "$role"
}

# check NAME KIND MODE JSONL WJSON WLOG WL_RC OBS_RC|- [TERMINAL_FILE]: keep the lines that matter
# (WORK/NAME.verdicts.jsonl), drop the full JSONL (in FULL_DIR; kept with KEEP_JSONL=1), run
# gpucheck.compare_verdicts check.
check() {
    local name=$1 kind=$2 mode=$3 jsonl=$4 wjson=$5 wlog=$6 wrc=$7 orc=$8 term=${9:-} pid
    local small="$WORK/$name.verdicts.jsonl"
    local -a ex=()
    if [[ ! -s $jsonl ]]; then
        status "$name" "$kind" "$mode" "FAIL (no observer output; workload rc=$wrc, observer rc=$orc)"
        return 0
    fi
    grep -F -e '"verdict"' -e '"summary"' -e '"process_exit"' -e '"cupti"' "$jsonl" >"$small" || true
    log "$name: observer JSONL $(wc -l <"$jsonl") lines, $(wc -l <"$small") kept"
    [[ ${KEEP_JSONL:-0} == 1 ]] || rm -f "$jsonl"
    local -a args=(--events "$small" --name "$name" --kind "$kind" --mode "$mode"
        --workload "$wjson" --workload-rc "$wrc" --full-s "$FULL_S" --result-out "$WORK/$name.result.json")
    [[ ! $orc =~ ^[0-9]+$ ]] || args+=(--observer-rc "$orc")
    pid=$(sed -n 's/^bottleneck: pid=\([0-9][0-9]*\) .*/\1/p' "$wlog" 2>/dev/null | head -n 1)
    [[ -s $wjson || -z $pid ]] || args+=(--pid "$pid")
    [[ -z $term || ! -s $term ]] || args+=(--terminal "$term")
    mapfile -t ex < <(expect_args "$kind" "$mode")
    "$PYTHON" -m gpucheck.compare_verdicts check "${args[@]}" ${ex[@]+"${ex[@]}"} | sed 's/^/    /' || true
    return 0
}

budget_left() { ((SECONDS - _T0 <= BUDGET_S)); }

# run_cupti KIND: the workload under `gpu-observer run` (CUPTI).
run_cupti() {
    local kind=$1 name=${1}_cupti rc=0
    local jsonl="$FULL_DIR/$name.jsonl" err="$WORK/$name.err" wjson="$WORK/$name.json" wlog="$WORK/$name.log"
    rm -f "$WORK/$name".*
    log "=== $name: bottleneck.py --kind $kind under gpu-observer run (CUPTI)"
    if [[ -n $NOT_USABLE ]]; then
        status "$name" "$kind" cupti "NOT RUN ($NOT_USABLE)"
        return 0
    elif [[ -n $CUPTI_SKIP ]]; then
        status "$name" "$kind" cupti "NOT RUN ($CUPTI_SKIP)"
        return 0
    elif ! budget_left; then
        warn "time budget (${BUDGET_S} s) exhausted; $name not run"
        status "$name" "$kind" cupti "NOT RUN (time budget ${BUDGET_S} s)"
        return 0
    fi
    local -a wargs
    mapfile -t wargs < <(workload_args "$kind")
    OBS_ENV=()
    if ! start_observer_run "$jsonl" "$err" "$wlog" --interval-ms "$INTERVAL_MS" \
        ${OBS_EXTRA[@]+"${OBS_EXTRA[@]}"} ${CUPTI_ARGS[@]+"${CUPTI_ARGS[@]}"} -- \
        "$PYTHON" "$WORKLOAD" --kind "$kind" --seconds "$WL_SECONDS" --out "$wjson" \
        ${wargs[@]+"${wargs[@]}"}; then
        status "$name" "$kind" cupti "FAIL (gpu-observer run did not start, rc=${OBS_RC:-?})"
        return 0
    fi
    if wait_observer_run "$WL_TIMEOUT"; then
        rc=${OBS_RC:-0} # the workload's exit status, passed on by the observer
    else
        rc=124
    fi
    log "workload (and observer) rc=$rc"
    tail -n 2 "$wlog" 2>/dev/null | sed 's/^/    workload: /' || true
    ((rc == 0)) || tail -n 12 "$err" 2>/dev/null | sed 's/^/    stderr: /' || true
    check "$name" "$kind" cupti "$jsonl" "$wjson" "$wlog" "$rc" -
}

# run_observed KIND: the workload waits for a start file while the three observers start; then
# runs; the --pid observers end with it, the all-process one is stopped a second later.
run_observed() {
    local kind=$1 base=${1}_observed rc=0 role ok=1 why=""
    local go="$WORK/$base.start" wjson="$WORK/$base.json" wlog="$WORK/$base.log"
    local term="$WORK/$base.term.txt"
    rm -f "$WORK/$base".* "$WORK/${kind}_all".* "$WORK/${kind}_pid".* "$WORK/${kind}_term".*
    log "=== $base: bottleneck.py --kind $kind, observed by all-process, --pid (jsonl) and --pid (terminal) observers"
    if [[ -n $NOT_USABLE ]]; then
        status "${kind}_all" "$kind" all "NOT RUN ($NOT_USABLE)"
        status "${kind}_pid" "$kind" pid "NOT RUN ($NOT_USABLE)"
        return 0
    elif ! budget_left; then
        warn "time budget (${BUDGET_S} s) exhausted; $base not run"
        status "${kind}_all" "$kind" all "NOT RUN (time budget ${BUDGET_S} s)"
        status "${kind}_pid" "$kind" pid "NOT RUN (time budget ${BUDGET_S} s)"
        return 0
    fi
    local -a wargs
    mapfile -t wargs < <(workload_args "$kind")
    env -u CUDA_INJECTION64_PATH "$PYTHON" "$WORKLOAD" --kind "$kind" --seconds "$WL_SECONDS" \
        --out "$wjson" --wait-start "$go" --wait-timeout-s "$((READY_TIMEOUT + 90))" \
        ${wargs[@]+"${wargs[@]}"} </dev/null >"$wlog" 2>&1 &
    WL_PID=$!
    BG_RC=()
    bg_observer all "$WORK/${kind}_all.err" --format jsonl --output "$FULL_DIR/${kind}_all.jsonl" \
        --interval-ms "$INTERVAL_MS"
    bg_observer pid "$WORK/${kind}_pid.err" --pid "$WL_PID" --format jsonl \
        --output "$FULL_DIR/${kind}_pid.jsonl" --interval-ms "$INTERVAL_MS"
    if ((TERMINAL)); then
        bg_observer term "$WORK/${kind}_term.err" --pid "$WL_PID" --format terminal --output "$term" \
            --interval-ms "$INTERVAL_MS"
    fi
    for role in all pid term; do
        [[ -n ${BG_PID[$role]:-} ]] || continue
        if wait_for_line "$WORK/${kind}_$role.err" "$READY_LINE" "$READY_TIMEOUT" "${BG_PID[$role]}"; then
            log "$role observer pid ${BG_PID[$role]} ready"
        else
            ok=0
            why+="$role observer not ready; "
            tail -n 8 "$WORK/${kind}_$role.err" 2>/dev/null | sed "s/^/    $role: /" || true
        fi
    done
    if ! wait_for_line "$wlog" "bottleneck: waiting for" "$((READY_TIMEOUT + 60))" "$WL_PID"; then
        ok=0
        why+="workload did not reach its start point; "
        tail -n 10 "$wlog" 2>/dev/null | sed 's/^/    workload: /' || true
    fi
    if ((ok)); then
        log "workload pid $WL_PID waiting: $(sed -n 1p "$wlog")"
        # The --pid observers attach to the libcuda the process maps (up front, or at their next
        # rescan, within --interval-ms): wait for that, so they see the process from its context.
        for role in pid term; do
            [[ -n ${BG_PID[$role]:-} ]] || continue
            wait_for_line "$WORK/${kind}_$role.err" "gpu-observer: attached" \
                "$(((INTERVAL_MS * 3 + 999) / 1000 + 2))" "${BG_PID[$role]}" ||
                warn "$role observer has not said it attached; starting the workload anyway"
        done
        : >"$go"
        local deadline=$((SECONDS + WL_TIMEOUT))
        while proc_alive "$WL_PID" && ((SECONDS < deadline)); do
            sleep 0.2
        done
        if proc_alive "$WL_PID"; then
            warn "workload still running after ${WL_TIMEOUT} s; stopping it"
            kill -TERM "$WL_PID" 2>/dev/null || true
            sleep 5
            kill -KILL "$WL_PID" 2>/dev/null || true
        fi
    else
        kill -TERM "$WL_PID" 2>/dev/null || true
    fi
    wait "$WL_PID" 2>/dev/null || rc=$?
    WL_PID=""
    ((ok)) || rc=98
    log "workload rc=$rc"
    tail -n 2 "$wlog" 2>/dev/null | sed 's/^/    workload: /' || true
    bg_end pid 15
    bg_end term 15
    sleep 1
    bg_stop all
    log "observer rc: all=${BG_RC[all]:-?} pid=${BG_RC[pid]:-?} term=${BG_RC[term]:--}"
    if ((!ok)); then
        status "${kind}_all" "$kind" all "FAIL (${why%; })"
        status "${kind}_pid" "$kind" pid "FAIL (${why%; })"
        return 0
    fi
    check "${kind}_all" "$kind" all "$FULL_DIR/${kind}_all.jsonl" "$wjson" "$wlog" "$rc" "${BG_RC[all]:-?}"
    check "${kind}_pid" "$kind" pid "$FULL_DIR/${kind}_pid.jsonl" "$wjson" "$wlog" "$rc" "${BG_RC[pid]:-?}" "$term"
}

# report: VERDICTS.md and verdicts-results.json from every result so far (copied to OUTDIR).
report() {
    local rrc=0 f
    local -a res=()
    for f in "$WORK"/*.result.json; do
        [[ -e $f ]] && res+=("$f")
    done
    "$PYTHON" -m gpucheck.compare_verdicts report --env "$WORK/env.json" --status-file "$STATUS" \
        --settings "$SETTINGS" --full-s "$FULL_S" --out "$WORK/VERDICTS.md" \
        --json-out "$WORK/verdicts-results.json" ${res[@]+"${res[@]}"} >"$WORK/report.log" 2>&1 || rrc=$?
    [[ -f $WORK/VERDICTS.md ]] && cp -f "$WORK/VERDICTS.md" "$OUTDIR/VERDICTS.md"
    [[ -f $WORK/verdicts-results.json ]] && cp -f "$WORK/verdicts-results.json" "$OUTDIR/verdicts-results.json"
    return "$rrc"
}

# ------------------------------------------------------------ runs
for kind in "${KIND_LIST[@]}"; do
    for m in "${MODE_LIST[@]}"; do
        if [[ $m == cupti ]]; then
            skipped "$kind" cupti || run_cupti "$kind"
        else
            skipped "$kind" observed || run_observed "$kind"
        fi
    done
    report || true
done

finish_report "VERDICT"
