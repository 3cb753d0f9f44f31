# shellcheck shell=bash
# Shared helpers for the gpu/*.sh scripts (sourced, not executed).
#
# Sets PYTHONPATH so that `"$PYTHON" -m gpucheck.MODULE` finds gpu/gpucheck from any directory.
# Provides: log/warn/die, require_root, find_nvcc, gpu_sm_arch, resolve_observer,
# resolve_exe, wait_for_line, start_observer/stop_observer (background observer
# lifecycle; OBS_PID, OBS_RC; await_ready/await_exit), start_observer_run/wait_observer_run (`gpu-observer run
# -- CMD`: the observer starts CMD and exits with its status), resolve_cupti (the
# injection library and the `run` subcommand), child_pids, any_alive, and
# install_traps (the observer, and in run mode its command, is always stopped on
# exit/INT/TERM).

READY_TIMEOUT=${READY_TIMEOUT:-60}   # seconds to wait for "gpu-observer: ready"
STOP_TIMEOUT=${STOP_TIMEOUT:-30}     # seconds to wait after SIGINT
READY_LINE='gpu-observer: ready'
export PYTHONUNBUFFERED=1
# The Python side is the package gpu/gpucheck (`"$PYTHON" -m gpucheck.MODULE`): gpu/ goes on
# the module path, so it is found wherever the script is run from.
GPU_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
case ":${PYTHONPATH:-}:" in
*":$GPU_DIR:"*) ;;
*) export PYTHONPATH="$GPU_DIR${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
OBS_PID=""
OBS_RUN=""  # 1 while OBS_PID is a `gpu-observer run` (it has the workload as its child)
# shellcheck disable=SC2034  # read by the scripts that source this file
OBS_RC=""
_T0=$SECONDS

log() { printf '[%4ds] %s\n' "$((SECONDS - _T0))" "$*"; }
warn() { log "WARN: $*"; }

# The end of a validation that defines `report` (writes $WORK/report.log, fails when a run
# failed): shows the report, then "NAME VALIDATION PASSED", or "... FAILED" and exit 1.
finish_report() {
    local rc=0
    report || rc=$?
    log "=== results (${SECONDS}s total)"
    sed 's/^/  /' "$WORK/report.log"
    if ((rc != 0)); then
        log "$1 VALIDATION FAILED"
        exit 1
    fi
    log "$1 VALIDATION PASSED"
}
die() {
    log "ERROR: $*" >&2
    exit 1
}

require_root() {
    if [[ $(id -u) -ne 0 ]]; then
        if [[ ${ALLOW_NONROOT:-0} == 1 ]]; then
            warn "not root; the observer will probably fail to attach uprobes"
        else
            die "run as root: gpu-observer attaches eBPF uprobes (or set ALLOW_NONROOT=1)"
        fi
    fi
}

require_tools() {
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null 2>&1 || die "required tool '$t' not found in PATH"
    done
}

# Echo the nvcc to use: $NVCC, then PATH, then /usr/local/cuda/bin/nvcc.
find_nvcc() {
    if [[ -n ${NVCC:-} ]]; then
        [[ -x $NVCC ]] || command -v "$NVCC" >/dev/null 2>&1 || die "NVCC=$NVCC is not executable"
        echo "$NVCC"
    elif command -v nvcc >/dev/null 2>&1; then
        command -v nvcc
    elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
        echo /usr/local/cuda/bin/nvcc
    else
        die "nvcc not found (set NVCC=/path/to/nvcc or add /usr/local/cuda/bin to PATH)"
    fi
}

# Echo sm_XY for GPU 0 ($CUDA_ARCH overrides, e.g. CUDA_ARCH=sm_90).
gpu_sm_arch() {
    if [[ -n ${CUDA_ARCH:-} ]]; then
        echo "$CUDA_ARCH"
        return
    fi
    local cap
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | sed -n 1p | tr -d ' .\r') || cap=""
    if [[ $cap =~ ^[0-9]+$ ]]; then
        echo "sm_$cap"
    else
        warn "could not read compute_cap from nvidia-smi ('$cap'); assuming sm_90" >&2
        echo sm_90
    fi
}

# Make $OBSERVER absolute; relative paths are tried against $PWD then the repo root.
resolve_observer() {
    local repo_root=$1
    OBSERVER=${OBSERVER:-.gpu-bundle/gpu-observer}
    if [[ $OBSERVER != /* ]]; then
        if [[ -e $PWD/$OBSERVER ]]; then
            OBSERVER=$PWD/$OBSERVER
        elif [[ -e $repo_root/$OBSERVER ]]; then
            OBSERVER=$repo_root/$OBSERVER
        elif command -v "$OBSERVER" >/dev/null 2>&1; then
            OBSERVER=$(command -v "$OBSERVER")
        fi
    fi
    [[ -e $OBSERVER ]] || die "observer binary not found: $OBSERVER (set OBSERVER=/path/to/gpu-observer)"
    [[ -x $OBSERVER ]] || chmod +x "$OBSERVER" 2>/dev/null || true
    [[ -x $OBSERVER ]] || die "observer binary is not executable: $OBSERVER"
    export OBSERVER
}

# resolve_exe PATH REPO_ROOT: echo PATH made absolute (a relative path is tried
# against $PWD, then REPO_ROOT), or nothing if no such executable file.
resolve_exe() {
    local p=$1 root=$2 c
    if [[ $p == /* ]]; then
        c=$p
    elif [[ -e $PWD/$p ]]; then
        c=$PWD/$p
    else
        c=$root/$p
    fi
    [[ -f $c ]] || return 0
    [[ -x $c ]] || chmod +x "$c" 2>/dev/null || true
    [[ -x $c ]] && echo "$c"
    return 0
}

# wait_for_line FILE FIXED-STRING TIMEOUT_S [PID]: 0 once FILE contains the string;
# 1 after TIMEOUT_S seconds, or as soon as PID (if given) is no longer alive.
wait_for_line() {
    local file=$1 str=$2 timeout=$3 pid=${4:-} i
    for ((i = 0; i < timeout * 10; i++)); do
        grep -qF -- "$str" "$file" 2>/dev/null && return 0
        if [[ -n $pid ]] && ! proc_alive "$pid"; then
            grep -qF -- "$str" "$file" 2>/dev/null && return 0
            return 1
        fi
        sleep 0.1
    done
    return 1
}

# True if pid exists and is not a zombie (a finished-but-unreaped child of
# ours is a zombie, and kill -0 would still succeed on it).
proc_alive() {
    local st
    [[ -r /proc/$1/stat ]] || return 1
    st=$(sed -E 's/^.*\) ([A-Za-z]).*$/\1/' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $st && $st != Z && $st != X ]]
}

# start_observer JSONL ERRFILE [extra observer args...]
# Starts the observer in the background (all processes unless --pid is
# passed), waits for the ready line on its stderr.  Returns 1 on failure.
start_observer() {
    local jsonl=$1 err=$2
    shift 2
    rm -f "$jsonl" "$err"
    # Job control on while forking: a non-interactive shell would otherwise
    # start the background job with SIGINT ignored.
    set -m
    "$OBSERVER" --format jsonl --trace-all --output "$jsonl" "$@" </dev/null >"${err%.err}.obs.out" 2>"$err" &
    OBS_PID=$!
    set +m
    await_ready observer "$err" "$READY_TIMEOUT"
}

# await_ready LABEL ERRFILE TIMEOUT_S [rc]: waits for the observer (OBS_PID) to print its
# ready line into ERRFILE. An observer that printed it and already exited (a short run)
# is a success. Returns 1 if it exited without it (OBS_PID cleared; with `rc`, OBS_RC gets
# its exit status) or never printed it in time (then it is stopped). LABEL names it in the
# messages.
await_ready() {
    local label=$1 err=$2 timeout=$3 set_rc=${4:-} i
    for ((i = 0; i < timeout * 10; i++)); do
        if grep -qF "$READY_LINE" "$err" 2>/dev/null; then
            log "$label pid $OBS_PID ready after $((i / 10)).$((i % 10)) s"
            return 0
        fi
        if ! proc_alive "$OBS_PID"; then
            grep -qF "$READY_LINE" "$err" 2>/dev/null && return 0
            local rc=0
            wait "$OBS_PID" 2>/dev/null || rc=$?
            OBS_PID=""
            OBS_RUN=""
            # shellcheck disable=SC2034
            [[ -z $set_rc ]] || OBS_RC=$rc
            warn "$label exited before becoming ready (rc=$rc); last stderr lines:"
            tail -n 20 "$err" 2>/dev/null | sed 's/^/    /' || true
            return 1
        fi
        sleep 0.1
    done
    warn "$label not ready after ${timeout} s; last stderr lines:"
    tail -n 20 "$err" 2>/dev/null | sed 's/^/    /' || true
    stop_observer
    return 1
}

# await_exit TIMEOUT_S MESSAGE: waits for the observer (OBS_PID) to exit by itself; OBS_RC
# gets its exit status. After TIMEOUT_S s it warns MESSAGE, stops it (stop_observer) and
# returns 1.
await_exit() {
    local timeout=$1 deadline rc=0
    [[ -n $OBS_PID ]] || return 0
    deadline=$((SECONDS + timeout))
    while proc_alive "$OBS_PID"; do
        if ((SECONDS >= deadline)); then
            warn "$2"
            stop_observer
            return 1
        fi
        sleep 0.1
    done
    wait "$OBS_PID" 2>/dev/null || rc=$?
    OBS_PID=""
    OBS_RUN=""
    # shellcheck disable=SC2034
    OBS_RC=$rc
    return 0
}

# SIGINT, wait up to STOP_TIMEOUT s, then SIGTERM (5 s), then SIGKILL.
# Sets OBS_RC to the observer's exit status. Never fails.
# In run mode (OBS_RUN=1) the observer's command is stopped first (SIGTERM, then
# SIGKILL after 10 s); the observer normally exits by itself once it has, and
# anything of it still alive after the observer is gone is killed.
stop_observer() {
    [[ -n $OBS_PID ]] || return 0
    local pid=$OBS_PID i rc=0 kids=""
    if [[ $OBS_RUN == 1 ]] && proc_alive "$pid"; then
        kids=$(child_pids "$pid")
        if [[ -n $kids ]]; then
            warn "stopping the observed command (pid ${kids//$'\n'/ }) with SIGTERM"
            # shellcheck disable=SC2086  # one pid per word
            kill -TERM $kids 2>/dev/null || true
            for ((i = 0; i < 100; i++)); do
                proc_alive "$pid" || break
                # shellcheck disable=SC2086
                any_alive $kids || break
                sleep 0.1
            done
            # shellcheck disable=SC2086
            if any_alive $kids; then
                warn "observed command ignored SIGTERM; sending SIGKILL"
                # shellcheck disable=SC2086
                kill -KILL $kids 2>/dev/null || true
            fi
            # The observer writes its summary and exits once its command has exited.
            for ((i = 0; i < STOP_TIMEOUT * 10; i++)); do
                proc_alive "$pid" || break
                sleep 0.1
            done
        fi
    fi
    if proc_alive "$pid"; then
        kill -INT "$pid" 2>/dev/null || true
        for ((i = 0; i < STOP_TIMEOUT * 10; i++)); do
            proc_alive "$pid" || break
            sleep 0.1
        done
        if proc_alive "$pid"; then
            warn "observer still running ${STOP_TIMEOUT} s after SIGINT; sending SIGTERM"
            kill -TERM "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                proc_alive "$pid" || break
                sleep 0.1
            done
        fi
        if proc_alive "$pid"; then
            warn "observer ignored SIGTERM; sending SIGKILL (no summary line will be written)"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    wait "$pid" 2>/dev/null || rc=$?
    # shellcheck disable=SC2086
    if [[ -n $kids ]] && any_alive $kids; then
        # shellcheck disable=SC2086
        kill -KILL $kids 2>/dev/null || true
    fi
    OBS_PID=""
    OBS_RUN=""
    # shellcheck disable=SC2034
    OBS_RC=$rc
    return 0
}

# child_pids PID: the direct children of PID, one per line (pgrep, else /proc).
child_pids() {
    local pid=$1
    if command -v pgrep >/dev/null 2>&1; then
        pgrep -P "$pid" 2>/dev/null || true
    else
        cat /proc/"$pid"/task/*/children 2>/dev/null | tr ' ' '\n' | sed '/^$/d' || true
    fi
}

# any_alive PID...: 0 if one of them is alive (and not a zombie).
any_alive() {
    local p
    for p in "$@"; do
        proc_alive "$p" && return 0
    done
    return 1
}

# resolve_cupti REPO_ROOT SCRATCH_FILE: find the CUPTI injection library and check
# that the observer has the `run` subcommand.  Sets CUPTI_LIB_PATH (absolute, or
# empty), CUPTI_ARGS (`--cupti-lib PATH` unless the library is next to the
# observer, where it finds it itself), OBS_RUN_HELP (yes | no (...)) and CUPTI_SKIP
# (empty, or why CUPTI runs cannot be made).  $CUPTI_LIB overrides the search.
# shellcheck disable=SC2034  # the variables are read by the scripts that source this file
resolve_cupti() {
    local root=$1 scratch=$2 c
    CUPTI_SKIP=""
    CUPTI_LIB_PATH=""
    CUPTI_ARGS=()
    OBS_RUN_HELP="not checked"
    if [[ -n ${CUPTI_LIB:-} ]]; then
        for c in "$CUPTI_LIB" "$PWD/$CUPTI_LIB" "$root/$CUPTI_LIB"; do
            if [[ -f $c ]]; then
                CUPTI_LIB_PATH=$(cd "$(dirname "$c")" && pwd)/$(basename "$c")
                break
            fi
        done
        if [[ -n $CUPTI_LIB_PATH ]]; then
            CUPTI_ARGS=(--cupti-lib "$CUPTI_LIB_PATH")
        else
            CUPTI_SKIP="CUPTI_LIB=$CUPTI_LIB not found"
        fi
    elif [[ -f $(dirname "$OBSERVER")/libgpu_observer_cupti.so ]]; then
        CUPTI_LIB_PATH=$(dirname "$OBSERVER")/libgpu_observer_cupti.so
    elif [[ -f $root/.gpu-bundle/libgpu_observer_cupti.so ]]; then
        CUPTI_LIB_PATH=$root/.gpu-bundle/libgpu_observer_cupti.so
        CUPTI_ARGS=(--cupti-lib "$CUPTI_LIB_PATH")
    else
        CUPTI_SKIP="no libgpu_observer_cupti.so next to the observer or in .gpu-bundle/; set CUPTI_LIB"
    fi
    if timeout 30 "$OBSERVER" run --help >"$scratch" 2>&1; then
        OBS_RUN_HELP="yes"
    else
        OBS_RUN_HELP="no ('gpu-observer run --help' failed: $(head -c 160 "$scratch" | tr '\n' ' '))"
        [[ -n $CUPTI_SKIP ]] || CUPTI_SKIP="the observer has no 'run' subcommand (older build?)"
    fi
    return 0
}

# start_observer_run JSONL ERRFILE LOGFILE [observer options...] -- CMD [ARGS...]
# Runs `$OBSERVER run --format jsonl --output JSONL [options] -- CMD ARGS` in the
# background: the observer attaches, prints its ready line, starts CMD (with
# CUDA_INJECTION64_PATH set), and exits with CMD's exit status after its summary.
# stdout (CMD's) goes to LOGFILE, stderr (the observer's and CMD's) to ERRFILE.
# Environment for the observer and CMD: prefix with OBS_ENV=(VAR=value ...).
# Waits for the ready line (READY_TIMEOUT s). Returns 1 if the observer exited
# without it (OBS_RC set) or never printed it (then it is stopped). An observer
# that printed it and already exited (a short CMD) is a success.
start_observer_run() {
    local jsonl=$1 err=$2 wlog=$3
    shift 3
    local -a opts=()
    while (($#)) && [[ $1 != -- ]]; do
        opts+=("$1")
        shift
    done
    [[ ${1:-} == -- ]] || die "start_observer_run: no -- before the command"
    shift
    rm -f "$jsonl" "$err"
    set -m
    env ${OBS_ENV[@]+"${OBS_ENV[@]}"} "$OBSERVER" run --format jsonl --output "$jsonl" "${opts[@]}" -- "$@" \
        </dev/null >"$wlog" 2>"$err" &
    OBS_PID=$!
    OBS_RUN=1
    set +m
    await_ready "observer (run)" "$err" "$READY_TIMEOUT" rc
}

# wait_observer_run TIMEOUT_S: wait for the run-mode observer to exit by itself;
# OBS_RC gets its exit status (its command's). After TIMEOUT_S s the command and
# then the observer are stopped (stop_observer) and 1 is returned.
wait_observer_run() {
    await_exit "$1" "observed command still running after $1 s; stopping it"
}

_on_exit() {
    local rc=$?
    set +e
    if [[ -n $OBS_PID ]]; then
        log "cleanup: stopping observer pid $OBS_PID"
        stop_observer
    fi
    # optional per-script hook (packing artifacts), run on every exit path
    if declare -F on_exit_hook >/dev/null; then
        on_exit_hook
    fi
    exit "$rc"
}

# pack_dir SRC_DIR TARBALL [MAX_BYTES]: tar.gz SRC_DIR; if larger than
# MAX_BYTES (default 15 MiB), pack again without raw/gzipped JSONL.
pack_dir() {
    local src=$1 tgz=$2 max=${3:-15728640} size
    command -v tar >/dev/null 2>&1 || {
        warn "tar not found; artifacts left in $src"
        return 0
    }
    tar -C "$src" -czf "$tgz" . 2>/dev/null || {
        warn "packing $src failed"
        return 0
    }
    size=$(stat -c %s "$tgz" 2>/dev/null || echo 0)
    if ((size > max)); then
        tar -C "$src" -czf "$tgz" --exclude='*.jsonl' --exclude='*.jsonl.gz' . 2>/dev/null || true
        log "artifacts over $((max / 1048576)) MiB: packed without observer JSONL (kept in $src)"
    fi
}

install_traps() {
    trap _on_exit EXIT
    trap 'log "interrupted"; exit 130' INT
    trap 'log "terminated"; exit 143' TERM
}
