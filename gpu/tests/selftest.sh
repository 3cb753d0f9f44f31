#!/usr/bin/env bash
# No-GPU self-test of the validation tooling: compare.py / compare_ground_truth.py /
# make_report.py / bench_report.py on synthetic JSONL, and the observer lifecycle in
# lib.sh against tests/fake_observer.py.  Run: bash gpu/tests/selftest.sh
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

# --- kernel names (issue 3)
check "copies section names the kernel" 0 "$(has "add_k(unsigned int const\*, unsigned int\*, unsigned int, unsigned long)" "$T/c1.section.md")"
"$PY" "$HERE/synth.py" copies "$T/c6" --null-names 1
check "copies with one unnamed launch -> fail" 1 "$(cmp_rc "$T/c6" c6)"
check "phase B named and matched (whitespace-normalised)" 0 "$(has "names matching the profiler: 270/270" "$T/t1.out")"
"$PY" "$HERE/synth.py" torch "$T/t4" --null-names 2
check "phase B 2/270 unnamed (99.3%) -> pass" 0 "$(cmp_rc "$T/t4" t4)"
"$PY" "$HERE/synth.py" torch "$T/t5" --null-names 3
check "phase B 3/270 unnamed (98.9%) -> fail" 1 "$(cmp_rc "$T/t5" t5)"
"$PY" "$HERE/synth.py" torch "$T/t6" --rename 3
check "phase B 3 names not the profiler's -> fail" 1 "$(cmp_rc "$T/t6" t6)"
check "unmatched names are listed" 0 "$(has "renamed_kernel_0" "$T/t6.section.md")"
"$PY" "$HERE/synth.py" torch "$T/t7" --style-names
check "phase B demangler-style differences -> fail (strict)" 1 "$(cmp_rc "$T/t7" t7)"
check "style-blind match shown" 0 "$(has "blind to demangler style: 100.0%" "$T/t7.out")"
check "divergence point shown" 0 "$(has "observer has \`(unsigned long)4>" "$T/t7.out")"
check "phase A names are informational" 0 "$(has "launch names seen by the profiler self-check" "$T/t1.section.md")"

# --- compare_ground_truth.py
gt_rc() { # prefix name [extra compare args]
    local p=$1 n=$2 rc=0
    shift 2
    "$PY" "$GPU/compare_ground_truth.py" --workload "$p.json" --events "$p.jsonl" --name "$n" \
        --section-out "$T/$n.section.md" --result-out "$T/$n.result.json" "$@" >"$T/$n.out" 2>&1 || rc=$?
    echo "$rc"
}
"$PY" "$HERE/synth.py" ground "$T/g1"
check "ground truth exact" 0 "$(gt_rc "$T/g1" g1)"
check "ground truth: unprobed APIs informational" 0 "$(has "not probed by the observer" "$T/g1.section.md")"
check "ground truth: leak reported twice counts once" 0 "$(has "leak \`cuMemAlloc_v2\` count | 1 | 1 | ok" "$T/g1.section.md")"
check "ground truth: demangled name checked" 0 "$(has "scale_vec(float\*, float, unsigned int)" "$T/g1.section.md")"
check "ground truth: builtin API list when api.rs is missing" 0 "$(gt_rc "$T/g1" g1b --api-table /nonexistent/api.rs)"
check "ground truth: builtin list said so" 0 "$(has "built-in list" "$T/g1b.out")"
g=0
for fault in "--drop-api cuMemcpy" "--drop-api cuModuleGetFunction" "--drop-api cuModuleLoadData" \
    "--null-names 1" "--unknown-dir 1" "--wrong-host 1" "--no-leak" "--extra-leak" \
    "--no-failed-result" "--wrong-stream 1"; do
    g=$((g + 1))
    # shellcheck disable=SC2086  # the fault is two words on purpose
    "$PY" "$HERE/synth.py" ground "$T/gf$g" $fault
    check "ground truth $fault -> fail" 1 "$(gt_rc "$T/gf$g" "gf$g")"
done
"$PY" "$HERE/synth.py" ground "$T/g2" --pid-offset 9
check "ground truth: pid fallback by comm -> pass" 0 "$(gt_rc "$T/g2" g2)"
check "ground truth: pid fallback warned" 0 "$(has "falling back" "$T/g2.out")"
rc=0
"$PY" "$GPU/compare_ground_truth.py" --workload "$T/t1.json" --events "$T/g1.jsonl" --name bad >/dev/null 2>&1 || rc=$?
check "ground truth: wrong workload JSON -> rc 2" 2 "$rc"

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
    g1 c1 c2 t1 missing_run >/dev/null || rc=$?
check "make_report assemble" 0 "$rc"
check "report marks missing run" 0 "$(has "NOT RUN" "$T/VALIDATION.md")"
check "report contains phase B row" 0 "$(has phaseB "$T/VALIDATION.md")"
check "report has the ground-truth row" 0 "$(has "| g1 | window | PASS | 12 / 12 | 18 / 18 | named 100.0% (12/12) |" "$T/VALIDATION.md")"
check "report shows phase B name match" 0 "$(has "= profiler 100.00% (270/270)" "$T/VALIDATION.md")"

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

# lib.sh helpers used by the ground-truth run
helpers() (
    # shellcheck source=SCRIPTDIR/../lib.sh
    source "$GPU/lib.sh"
    f=$T/wline.log
    : >"$f"
    (sleep 0.3; echo "cuda-ground-truth: waiting for x" >>"$f") &
    r1=0; wait_for_line "$f" "waiting for" 5 || r1=$?
    r2=0; wait_for_line "$f" "never printed" 1 || r2=$?
    sleep 0.2 &
    p=$!
    t0=$SECONDS
    r3=0; wait_for_line "$f" "never printed" 30 "$p" || r3=$?
    wait "$p" 2>/dev/null
    quick=$((SECONDS - t0 < 5))
    cp /bin/true "$T/exe"
    e1=$(cd "$T" && resolve_exe exe /nonexistent)
    e2=$(resolve_exe exe "$T")
    e3=$(resolve_exe nope "$T")
    [[ $e1 == "$T/exe" && $e2 == "$T/exe" && -z $e3 ]] && ex=ok || ex="bad:$e1:$e2:$e3"
    echo "$r1 $r2 $r3 $quick $ex"
)
check "wait_for_line / resolve_exe" "0 1 1 1 ok" "$(helpers)"

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
