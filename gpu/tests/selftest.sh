#!/usr/bin/env bash
# No-GPU self-test of the validation tooling: compare.py / make_report.py /
# bench_report.py on synthetic JSONL, and the observer lifecycle in lib.sh
# against tests/fake_observer.py.  Run: bash gpu/tests/selftest.sh
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
GPU=$(cd "$HERE/.." && pwd)
PY=${PYTHON:-python3}
T=$(mktemp -d /tmp/gpu-selftest.XXXXXX)
trap 'rm -rf "$T"' EXIT
pass=0
fail=0

check() { # description expected-rc actual-rc
    if [[ $2 == "$3" ]]; then
        pass=$((pass + 1))
        echo "ok   - $1"
    else
        fail=$((fail + 1))
        echo "FAIL - $1 (expected rc $2, got $3)"
    fi
}

has() { # pattern file... -> 0 if every file contains pattern
    local pat=$1 f
    shift
    for f in "$@"; do
        grep -q -- "$pat" "$f" 2>/dev/null || { echo 1; return; }
    done
    echo 0
}

cmp_rc() { # prefix name [extra compare args]
    local p=$1 n=$2 rc=0
    shift 2
    "$PY" "$GPU/compare.py" --workload "$p.json" --events "$p.jsonl" --name "$n" \
        --section-out "$T/$n.section.md" --result-out "$T/$n.result.json" "$@" >"$T/$n.out" 2>&1 || rc=$?
    echo "$rc"
}

# --- compare.py
"$PY" "$HERE/synth.py" copies "$T/c1"
check "copies exact" 0 "$(cmp_rc "$T/c1" c1)"
check "copies section has bytes row" 0 "$(has "HtoD bytes" "$T/c1.section.md")"
check "copies section has API histogram" 0 "$(has cuLaunchKernel "$T/c1.section.md")"

"$PY" "$HERE/synth.py" copies "$T/c2" --ptds
check "copies ptds exact" 0 "$(cmp_rc "$T/c2" c2)"
check "ptds build lists _ptsz launch API" 0 "$(has cuLaunchKernel_ptsz "$T/c2.out")"

"$PY" "$HERE/synth.py" copies "$T/c3" --drop-launch 1
check "copies missing one launch -> fail" 1 "$(cmp_rc "$T/c3" c3)"

"$PY" "$HERE/synth.py" copies "$T/c4" --unknown-dir 2
check "copies with unknown direction -> fail" 1 "$(cmp_rc "$T/c4" c4)"

"$PY" "$HERE/synth.py" copies "$T/c5" --pid-offset 1000
check "pid mismatch, comm fallback -> pass" 0 "$(cmp_rc "$T/c5" c5 --comm-hint copies_kernels)"
check "pid fallback warned" 0 "$(has "falling back" "$T/c5.out")"
check "pid mismatch without hint -> fail" 1 "$(cmp_rc "$T/c5" c5b)"

"$PY" "$HERE/synth.py" torch "$T/t1"
check "torch exact (A and B)" 0 "$(cmp_rc "$T/t1" t1 --comm-hint python)"
check "summary dropped reported" 0 "$(has "dropped=3" "$T/t1.out")"
check "phase A self-check shown" 0 "$(has "consistent with the expected" "$T/t1.section.md")"

"$PY" "$HERE/synth.py" torch "$T/t2" --memset-extra 2
check "torch extra memset is informational" 0 "$(cmp_rc "$T/t2" t2)"

"$PY" "$HERE/synth.py" torch "$T/t3" --drop-launch 3
check "torch phase A missing launches -> fail" 1 "$(cmp_rc "$T/t3" t3)"

gzip -k "$T/t1.jsonl"
rc=0
"$PY" "$GPU/compare.py" --workload "$T/t1.json" --events "$T/t1.jsonl.gz" --name t1gz >/dev/null || rc=$?
check "gzip input" 0 "$rc"

rc=0
"$PY" "$GPU/compare.py" --workload "$T/nope.json" --events "$T/t1.jsonl" --name x >/dev/null 2>&1 || rc=$?
check "missing workload json -> rc 2" 2 "$rc"

# --- make_report.py
rc=0
"$PY" "$GPU/make_report.py" env --out "$T/env.json" --nvcc /nonexistent --python "$PY" >/dev/null || rc=$?
check "make_report env without GPU tools" 0 "$rc"
rc=0
"$PY" "$GPU/make_report.py" assemble --env "$T/env.json" --out "$T/VALIDATION.md" --dir "$T" \
    c1 c2 t1 missing_run >/dev/null || rc=$?
check "make_report assemble" 0 "$rc"
check "report marks missing run" 0 "$(has "NOT RUN" "$T/VALIDATION.md")"
check "report contains phase B row" 0 "$(has phaseB "$T/VALIDATION.md")"

# --- bench_report.py
"$PY" "$HERE/synth.py" bench "$T/b" --drop-launch 5
rc=0
"$PY" "$GPU/bench_report.py" --base1 "$T/b.base.json" --with "$T/b.json" --base2 "$T/b.base.json" \
    --events "$T/b.jsonl" --env "$T/env.json" --out "$T/BENCH.md" --summary-json "$T/bs.json" >"$T/b.out" || rc=$?
check "bench_report" 0 "$rc"
check "bench_report counts captured launches" 0 "$(has "3763 / 3768" "$T/BENCH.md")"
check "bench_report has submit overhead" 0 "$(has "submit: overhead per launch call | 0.600" "$T/BENCH.md")"

# --- lib.sh observer lifecycle with the fake observer
lifecycle() { # mode -> prints start-rc stop-rc summary-present
    (
        # shellcheck source=SCRIPTDIR/../lib.sh
        source "$GPU/lib.sh"
        READY_TIMEOUT=3
        STOP_TIMEOUT=2
        OBSERVER="$HERE/fake_observer.py"
        export FAKE_MODE=$1
        install_traps
        src=0
        start_observer "$T/life_$1.jsonl" "$T/life_$1.err" >"$T/life_$1.log" 2>&1 || src=$?
        sleep 0.3
        stop_observer >>"$T/life_$1.log" 2>&1
        sum=0
        grep -q '"summary"' "$T/life_$1.jsonl" 2>/dev/null && sum=1
        echo "$src ${OBS_RC:-none} $sum"
    )
}
chmod +x "$HERE/fake_observer.py"
check "lifecycle normal: ready, SIGINT, rc 0, summary" "0 0 1" "$(lifecycle normal)"
check "lifecycle die_early: start fails" "1 none 0" "$(lifecycle die_early)"
r=$(lifecycle ignore_int)
check "lifecycle ignore_int: escalates to SIGKILL" "0 137 0" "$r"
r=$(lifecycle never_ready)
check "lifecycle never_ready: start fails, process stopped" "1" "${r%% *}"

# trap kills the observer when the script exits without stopping it
(
    # shellcheck source=SCRIPTDIR/../lib.sh
    source "$GPU/lib.sh"
    OBSERVER="$HERE/fake_observer.py"
    READY_TIMEOUT=3
    install_traps
    start_observer "$T/trap.jsonl" "$T/trap.err" >/dev/null
    echo "$OBS_PID" >"$T/trap.pid"
    exit 0
) >/dev/null 2>&1 || true
p=$(cat "$T/trap.pid")
alive=0
[[ -d /proc/$p ]] && alive=1
check "EXIT trap stopped the observer" 0 "$alive"
check "EXIT trap stop wrote summary" 0 "$(has '"summary"' "$T/trap.jsonl")"

echo "$pass passed, $fail failed"
((fail == 0))
