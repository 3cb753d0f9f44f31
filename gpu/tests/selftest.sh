#!/usr/bin/env bash
# No-GPU self-test of the validation tooling: the package gpu/gpucheck (its one JSON-lines
# reader; compare, compare_ground_truth, compare_cupti, make_report, bench_report,
# bench_cupti_report, compare_nvml, compare_verdicts, compare_anomalies, compare_late) on synthetic JSONL, the observer lifecycle
# in lib.sh (all-process and `run` mode) against tests/fake_observer.py, and bench_cupti.sh,
# validate_nvml.sh, validate_verdicts.sh and validate_late_attach.sh end to end with the fakes, and
# bench_fleet.py's series analysis on a planted series.
# Run: bash gpu/tests/selftest.sh
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
GPU=$(cd "$HERE/.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$GPU${PYTHONPATH:+:$PYTHONPATH}" # `"$PY" -m gpucheck.MODULE`, as lib.sh does
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
    "$PY" -m gpucheck.compare --workload "$p.json" --events "$p.jsonl" --name "$n" \
        --section-out "$T/$n.section.md" --result-out "$T/$n.result.json" "$@" >"$T/$n.out" 2>&1 || rc=$?
    echo "$rc"
}

# --- gpucheck.jsonl: the one JSON-lines reader (every script reads observer output through it).
# Expected: what the comparers' own readers did before (a torn last line or a non-JSON line is
# counted and skipped, reading goes on; a JSON value that is not an object is skipped; blank
# lines are not counted as lines); new: a line over the bound (16 Mi characters; 1000 here) is
# dropped without being held whole, and counted as bad.
jt() { "$PY" "$HERE/jsonl_test.py" "$1" "$T" 2>&1; }
check "jsonl: torn last line -> counted bad, the lines before it read" \
    "yield 1,2,3; lines 4 bad 1 oversize 0 not_object 0 blank 0 filtered 0" "$(jt torn)"
check "jsonl: torn last line of a gzipped file" \
    "yield 1,2; lines 3 bad 1 oversize 0 not_object 0 blank 0 filtered 0" "$(jt torn_gz)"
check "jsonl: non-JSON lines -> counted bad, reading goes on" \
    "yield 1,2; lines 4 bad 2 oversize 0 not_object 0 blank 0 filtered 0" "$(jt not_json)"
check "jsonl: JSON values that are not objects -> skipped, counted" \
    "yield 1,2; lines 5 bad 0 oversize 0 not_object 3 blank 0 filtered 0" "$(jt not_object)"
check "jsonl: blank lines -> not lines" \
    "yield 1,2; lines 2 bad 0 oversize 0 not_object 0 blank 3 filtered 0" "$(jt blank)"
check "jsonl: oversize lines -> dropped, counted bad; the next line read; the bound itself fits" \
    "yield 1,2,6; lines 5 bad 2 oversize 2 not_object 0 blank 0 filtered 0" "$(jt oversize)"
check "jsonl: a 3 MiB line under the default bound -> read" \
    "yield 1,2,3; lines 3 bad 0 oversize 0 not_object 0 blank 0 filtered 0" "$(jt long)"
check "jsonl: pre-filter -> only matching lines parsed, every line counted" \
    "yield 1,3; lines 5 bad 1 oversize 0 not_object 0 blank 0 filtered 2" "$(jt filter)"
check "jsonl: undecodable bytes replaced, not an error" \
    "yield 1,2,3; lines 3 bad 0 oversize 0 not_object 0 blank 0 filtered 0 | kernel 'k\ufffd\ufffd'" "$(jt bad_bytes)"
check "jsonl: truncated gzip stream -> EOFError, as before" EOFError "$(jt truncated_gz)"
check "jsonl: missing file -> FileNotFoundError" FileNotFoundError "$(jt missing)"

# --- gpucheck.compare
"$PY" "$HERE/synth.py" copies "$T/c1"
check "copies exact" 0 "$(cmp_rc "$T/c1" c1)"
check "copies section has bytes row" 0 "$(has "HtoD bytes" "$T/c1.section.md")"
check "copies section has API histogram" 0 "$(has cuLaunchKernel "$T/c1.section.md")"
{ cat "$T/c1.jsonl"; echo "not json"; printf '{"type": "launch", "pid": 4242, "ts_n'; } >"$T/c1torn.jsonl"
cp "$T/c1.json" "$T/c1torn.json"
check "copies with a garbage line and a torn last line -> pass, both counted" "0 0" \
    "$(cmp_rc "$T/c1torn" c1torn) $(has "WARN: 2 unparsable JSONL lines" "$T/c1torn.out")"

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

# --- gpucheck.compare_ground_truth
gt_rc() { # prefix name [extra compare args]
    local p=$1 n=$2 rc=0
    shift 2
    "$PY" -m gpucheck.compare_ground_truth --workload "$p.json" --events "$p.jsonl" --name "$n" \
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
"$PY" -m gpucheck.compare_ground_truth --workload "$T/t1.json" --events "$T/g1.jsonl" --name bad >/dev/null 2>&1 || rc=$?
check "ground truth: wrong workload JSON -> rc 2" 2 "$rc"

gzip -k "$T/t1.jsonl"
rc=0
"$PY" -m gpucheck.compare --workload "$T/t1.json" --events "$T/t1.jsonl.gz" --name t1gz >/dev/null || rc=$?
check "gzip input" 0 "$rc"

rc=0
"$PY" -m gpucheck.compare --workload "$T/nope.json" --events "$T/t1.jsonl" --name x >/dev/null 2>&1 || rc=$?
check "missing workload json -> rc 2" 2 "$rc"

# --- gpucheck.make_report
rc=0
"$PY" -m gpucheck.make_report env --out "$T/env.json" --nvcc /nonexistent --python "$PY" >/dev/null || rc=$?
check "make_report env without GPU tools" 0 "$rc"
rc=0
"$PY" -m gpucheck.make_report assemble --env "$T/env.json" --out "$T/VALIDATION.md" --dir "$T" \
    g1 c1 c2 t1 missing_run >/dev/null || rc=$?
check "make_report assemble" 0 "$rc"
check "report marks missing run" 0 "$(has "NOT RUN" "$T/VALIDATION.md")"
check "report contains phase B row" 0 "$(has phaseB "$T/VALIDATION.md")"
check "report has the ground-truth row" 0 "$(has "| g1 | window | PASS | 12 / 12 | 18 / 18 | named 100.0% (12/12) |" "$T/VALIDATION.md")"
check "report shows phase B name match" 0 "$(has "= profiler 100.00% (270/270)" "$T/VALIDATION.md")"

# --- gpucheck.bench_report
"$PY" "$HERE/synth.py" bench "$T/b" --drop-launch 5
rc=0
"$PY" -m gpucheck.bench_report --base1 "$T/b.base.json" --with "$T/b.json" --base2 "$T/b.base.json" \
    --events "$T/b.jsonl" --env "$T/env.json" --out "$T/BENCH.md" --summary-json "$T/bs.json" >"$T/b.out" || rc=$?
check "bench_report" 0 "$rc"
check "bench_report counts captured launches" 0 "$(has "3763 / 3768" "$T/BENCH.md")"
check "bench_report has submit overhead" 0 "$(has "submit: overhead per launch call | 0.600" "$T/BENCH.md")"

# --- gpucheck.compare_cupti (CUPTI records of runs under `gpu-observer run`)
cu_rc() { # prefix name [extra compare args]
    local p=$1 n=$2 rc=0
    shift 2
    "$PY" -m gpucheck.compare_cupti --workload "$p.json" --events "$p.jsonl" --name "$n" \
        --section-out "$T/$n.section.md" --result-out "$T/$n.result.json" "$@" >"$T/$n.out" 2>&1 || rc=$?
    echo "$rc"
}
"$PY" "$HERE/synth.py" cupti_torch "$T/ct1"
check "cupti torch: joined, timestamps, counts -> pass" 0 "$(cu_rc "$T/ct1" cupti_ct1)"
check "cupti torch: delta distribution shown" 0 "$(has "abs(launch_ts_ns − cupti_api_start_ns): n=50 min 700 ns, median 900 ns" "$T/cupti_ct1.section.md")"
check "cupti torch: queue delay shown" 0 "$(has "queue delay (gpu_start_ns − launch_ts_ns)" "$T/cupti_ct1.section.md")"
check "cupti torch: profiler skipped is informational" 0 "$(has "profiler not run" "$T/cupti_ct1.section.md")"
check "cupti torch: graph kernels set aside" 0 "$(has "| gpu_kernel (not in a graph) = uprobe launch events (not cuGraphLaunch\*) | 270 | 270 |" "$T/cupti_ct1.section.md")"
check "cupti torch: state from the summary" 0 "$(has "CUPTI state (per-process summary) | active | active" "$T/cupti_ct1.section.md")"
check "cupti torch: delta by the API record CUPTI timed" 0 "$(has "\`cudaLaunchKernel\` median" "$T/cupti_ct1.section.md")"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct1b" --top-kernels
check "cupti torch: top kernels of the summary block" 00 "$(cu_rc "$T/ct1b" cupti_ct1b)$(has "top kernels by GPU time: kernel=k7" "$T/cupti_ct1b.section.md")"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct2" --unjoined 1
check "cupti torch: one unjoined gpu_kernel -> fail" 1 "$(cu_rc "$T/ct2" cupti_ct2)"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct3" --ts-off 1
check "cupti torch: CUPTI API timestamp 6 us off -> fail" 1 "$(cu_rc "$T/ct3" cupti_ct3)"
check "cupti torch: the line over tolerance is listed" 0 "$(has "over tolerance" "$T/cupti_ct3.section.md")"
# the >= 99 % criterion on phase B's 272 lines: 2 off (99.3 %) passes, 3 off (98.9 %) fails
"$PY" "$HERE/synth.py" cupti_torch "$T/ct3b" --ts-off-last 2
check "cupti torch: 2 of 272 lines 6 us late -> pass (>= 99 %)" 0 "$(cu_rc "$T/ct3b" cupti_ct3b)"
check "cupti torch: the criterion row" 0 "$(has "| ≥ 270 of 272 | 270 |" "$T/cupti_ct3b.section.md")"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct3c" --ts-off-last 3
check "cupti torch: 3 of 272 lines 6 us late -> fail (< 99 %)" 1 "$(cu_rc "$T/ct3c" cupti_ct3c)"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct3d" --early-last 3
check "cupti torch: 3 driver-timed lines CUPTI stamped first -> fail" 1 "$(cu_rc "$T/ct3d" cupti_ct3d)"
check "cupti torch: CUPTI-first lines counted" 0 "$(has "CUPTI API start precedes the uprobe stamp | 0 | 3" "$T/cupti_ct3d.section.md")"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct4" --drop-gpu-kernel 1
check "cupti torch: missing gpu_kernel -> fail" 1 "$(cu_rc "$T/ct4" cupti_ct4)"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct5" --state busy
check "cupti torch: state busy -> fail" 1 "$(cu_rc "$T/ct5" cupti_ct5)"
check "cupti torch: busy state line shown" 0 "$(has "state=busy" "$T/cupti_ct5.out")"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct6" --warmup-outlier
check "cupti torch: 8 us outlier in warm-up only -> pass (whole run informational)" 0 "$(cu_rc "$T/ct6" cupti_ct6)"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct7" --with-profiler
check "cupti torch: phase B vs recorded profiler counts -> pass" 0 "$(cu_rc "$T/ct7" cupti_ct7)"
check "cupti torch: profiler row strict" 0 "$(has "gpu_kernel = torch.profiler kernels (recorded by the workload) | 272 | 272" "$T/cupti_ct7.section.md")"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct8" --no-cupti-block
check "cupti torch: state from the cupti line without a summary block" 0 "$(cu_rc "$T/ct8" cupti_ct8)"
check "cupti torch: state source said" 0 "$(has "last \`cupti\` line" "$T/cupti_ct8.section.md")"
"$PY" "$HERE/synth.py" cupti_torch "$T/ct9" --pid-offset 7
check "cupti torch: pid fallback by comm -> pass" 0 "$(cu_rc "$T/ct9" cupti_ct9 --comm-hint python)"
check "cupti torch: pid fallback warned" 0 "$(has "falling back" "$T/cupti_ct9.out")"
"$PY" "$HERE/synth.py" cupti_ground "$T/cg1"
check "cupti ground truth -> pass" 0 "$(cu_rc "$T/cg1" cupti_cg1)"
check "cupti ground truth: names with counts" 0 "$(has "gpu_kernel named \`scale_vec(float\*, float, unsigned int)\` | 4 | 4" "$T/cupti_cg1.section.md")"
check "cupti ground truth: memcpy vs the workload" 0 "$(has "gpu_memcpy = copies the workload made | 22 | 22" "$T/cupti_cg1.section.md")"
check "ground truth under run: CUPTI lines are not calls (uprobe checks pass)" 0 "$(gt_rc "$T/cg1" cupti_cg1_uprobes)"
g=0
for fault in "--unjoined 1" "--ts-off 1" "--drop-gpu-kernel 1" "--state busy" "--state failed"; do
    g=$((g + 1))
    # shellcheck disable=SC2086  # the fault is two words on purpose
    "$PY" "$HERE/synth.py" cupti_ground "$T/cgf$g" $fault
    check "cupti ground truth $fault -> fail" 1 "$(cu_rc "$T/cgf$g" "cupti_cgf$g")"
done
gzip -k "$T/ct1.jsonl"
rc=0
"$PY" -m gpucheck.compare_cupti --workload "$T/ct1.json" --events "$T/ct1.jsonl.gz" --name ctgz >/dev/null || rc=$?
check "cupti: gzip input" 0 "$rc"
rc=0
"$PY" -m gpucheck.compare_cupti --workload "$T/nope.json" --events "$T/ct1.jsonl" --name x >/dev/null 2>&1 || rc=$?
check "cupti: missing workload json -> rc 2" 2 "$rc"
rc=0
"$PY" -m gpucheck.compare_cupti --workload "$T/ct1.json" --events "$T/c1.jsonl" --name cnone >"$T/cnone.out" 2>&1 || rc=$?
check "cupti: a run without CUPTI lines -> fail" 1 "$rc"
check "cupti: no gpu_kernel warned" 0 "$(has "no gpu_kernel line" "$T/cnone.out")"
# the same comparison in the report
cp "$T/cupti_ct1.result.json" "$T/cupti_torch_loop.result.json"
cp "$T/cupti_ct1.section.md" "$T/cupti_torch_loop.section.md"
cp "$T/cupti_ct5.result.json" "$T/cupti_busy.result.json"
printf 'cupti_missing\tSKIPPED (the observer has no run subcommand (older build?))\n' >"$T/cstatus.tsv"
rc=0
"$PY" -m gpucheck.make_report assemble --env "$T/env.json" --out "$T/VALIDATION_CUPTI.md" --dir "$T" \
    --status-file "$T/cstatus.tsv" --results-json "$T/vc.json" \
    g1 t1 cupti_torch_loop cupti_busy cupti_missing >/dev/null || rc=$?
check "make_report assemble with CUPTI runs" 0 "$rc"
check "report: CUPTI table row" 0 "$(has "| cupti_ct1 | phaseA | PASS | 50 / 50 | 50 (100.0%) | 50/50 | 900 ns / 1.1 µs / 1.1 µs | 100 / 100 |" "$T/VALIDATION_CUPTI.md")"
check "report: CUPTI whole-run row with state" 0 "$(has "322 / state active" "$T/VALIDATION_CUPTI.md")"
check "report: failing CUPTI run" 0 "$(has "322 / state busy" "$T/VALIDATION_CUPTI.md")"
check "report: skipped CUPTI run with its reason" 0 "$(has "older build" "$T/VALIDATION_CUPTI.md")"
check "report: CUPTI section heading" 0 "$(has "## CUPTI: GPU-side records" "$T/VALIDATION_CUPTI.md")"
check "report: overall FAIL with a failing CUPTI run" 0 "$(has "Overall: \*\*FAIL" "$T/VALIDATION_CUPTI.md")"
rc=0
"$PY" -m gpucheck.make_report assemble --env "$T/env.json" --out "$T/VALIDATION_C2.md" --dir "$T" \
    g1 cupti_torch_loop >/dev/null || rc=$?
check "report: all CUPTI checks pass -> overall PASS" 0 "$(has "Overall: \*\*PASS" "$T/VALIDATION_C2.md")"

# --- gpucheck.bench_cupti_report
"$PY" "$HERE/synth.py" bench_cupti "$T/bc1"
rc=0
"$PY" -m gpucheck.bench_cupti_report report --dir "$T/bc1.d" --plan "$T/bc1.d/plan.tsv" \
    --env "$T/env.json" --out "$T/BENCH_CUPTI.md" --summary-json "$T/bcs.json" >"$T/bc1.out" || rc=$?
check "bench_cupti_report" 0 "$rc"
check "bench_cupti_report: CUPTI overhead and target met" 0 "$(has "CUPTI mode overhead: +3.00% (MET" "$T/BENCH_CUPTI.md")"
check "bench_cupti_report: profiler ratio" 0 "$(has "| 1.280x | +28.00% |" "$T/BENCH_CUPTI.md")"
check "bench_cupti_report: CPU issue share" 0 "$(has "CPU issue time without observer: 3.500 ms of 5.000 ms per step (70%): GPU-bound" "$T/BENCH_CUPTI.md")"
check "bench_cupti_report: kernels per step from uprobes" 0 "$(has "uprobe launch events per timed step (uprobes runs): 412.0" "$T/BENCH_CUPTI.md")"
check "bench_cupti_report: CUPTI block per run" 0 "$(has "| active | 95000 / 95000 / 0 | 0 / 0 / 40 |" "$T/BENCH_CUPTI.md")"
"$PY" "$HERE/synth.py" bench_cupti "$T/bc2" --cupti-slow --drop-run --state busy
"$PY" -m gpucheck.bench_cupti_report report --dir "$T/bc2.d" --plan "$T/bc2.d/plan.tsv" \
    --out "$T/BENCH_CUPTI2.md" >/dev/null 2>&1 || true
check "bench_cupti_report: target not met" 0 "$(has "(NOT MET" "$T/BENCH_CUPTI2.md")"
check "bench_cupti_report: missing run listed" 0 "$(has "runs without a result: r2_profiler" "$T/BENCH_CUPTI2.md")"
check "bench_cupti_report: CUPTI not active warned" 0 "$(has "CUPTI state in the CUPTI-mode runs: busy" "$T/BENCH_CUPTI2.md")"
"$PY" -c 'import json,sys; w=json.load(open(sys.argv[1])); json.dump({"pid": 4242, "window_start_ns": w["phaseA"]["start_ns"], "window_end_ns": w["phaseB"]["end_ns"]}, open(sys.argv[2], "w"))' \
    "$T/ct1.json" "$T/ext_w.json"
"$PY" -m gpucheck.bench_cupti_report extract --events "$T/ct1.jsonl.gz" --workload "$T/ext_w.json" \
    --out "$T/ext.obs.json" >/dev/null
check "bench_cupti_report extract: launches in window, CUPTI block" 0 "$(has '"launches_in_window": 321' "$T/ext.obs.json")$(has '"state": "active"' "$T/ext.obs.json" | tr -d 0)"
"$PY" -m gpucheck.bench_cupti_report extract --events "$T/nonexistent.jsonl" --out "$T/ext2.obs.json" >/dev/null
check "bench_cupti_report extract without output" 0 "$(has '"error"' "$T/ext2.obs.json")"

# --- lib.sh observer lifecycle with the fake observer
lifecycle() { # mode -> prints start-rc stop-rc summary-present
    (
        # shellcheck source=SCRIPTDIR/../lib.sh
        source "$GPU/lib.sh"
        READY_TIMEOUT=3
        STOP_TIMEOUT=2
        OBSERVER="$HERE/fake_observer.py"
        # shellcheck disable=SC2030
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

# --- run mode: `gpu-observer run -- CMD` (start_observer_run / wait_observer_run)
runlife() { # case -> prints "start-rc wait-rc OBS_RC summary-present cmd-gone"
    (
        # shellcheck source=SCRIPTDIR/../lib.sh
        source "$GPU/lib.sh"
        READY_TIMEOUT=3
        STOP_TIMEOUT=3
        OBSERVER="$HERE/fake_observer.py"
        install_traps
        local c=$1 src=0 wrc=0 j="$T/run_$1.jsonl"
        local -a cmd=(true)
        local to=10
        # shellcheck disable=SC2031,SC2016  # FAKE_MODE: this subshell's; '$X': the command's shell
        case $c in
        exit3) cmd=(sh -c 'exit 3') ;;
        hang)
            cmd=(sleep 30)
            to=1
            ;;
        die) export FAKE_MODE=die_early ;;
        env) cmd=(sh -c 'test "$SELFTEST_X" = 42 && test -n "$CUDA_INJECTION64_PATH"') ;;
        esac
        # shellcheck disable=SC2030
        OBS_ENV=(SELFTEST_X=42)
        start_observer_run "$j" "$T/run_$c.err" "$T/run_$c.log" --trace-all -- "${cmd[@]}" \
            >"$T/run_$c.out" 2>&1 || src=$?
        OBS_ENV=()
        local kids=""
        [[ -z $OBS_PID ]] || { sleep 0.3; kids=$(child_pids "$OBS_PID"); }
        [[ $c != hang || -n $kids ]] || kids=missing
        wait_observer_run "$to" >>"$T/run_$c.out" 2>&1 || wrc=$?
        sum=0
        grep -q '"scope": "process"' "$j" 2>/dev/null && sum=1
        gone=1
        # shellcheck disable=SC2086
        [[ $kids == missing ]] || ! any_alive $kids || gone=0
        [[ $kids != missing ]] || gone=nokids
        echo "$src $wrc ${OBS_RC:-none} $sum $gone"
    )
}
check "run mode: command exits 0 -> observer rc 0, summary" "0 0 0 1 1" "$(runlife ok)"
check "run mode: command exit status passed on" "0 0 3 1 1" "$(runlife exit3)"
check "run mode: environment and injection path reach the command" "0 0 0 1 1" "$(runlife env)"
check "run mode: hung command stopped after the timeout" "0 1 143 1 1" "$(runlife hang)"
check "run mode: observer dies before ready" "1 0 3 0 1" "$(runlife die)"
check "run mode: ready line and --trace-all passed" 0 "$(has '"trace_all": true' "$T/run_ok.jsonl")"
rcu=$(
    # shellcheck source=SCRIPTDIR/../lib.sh
    source "$GPU/lib.sh"
    OBSERVER="$HERE/fake_observer.py"
    # shellcheck disable=SC2030
    CUPTI_LIB=""
    resolve_cupti "$T/noroot" "$T/rh1.txt"
    a="$CUPTI_SKIP|$OBS_RUN_HELP"
    CUPTI_LIB="$HERE/synth.py"
    resolve_cupti "$T/noroot" "$T/rh2.txt"
    b="$CUPTI_SKIP|${CUPTI_ARGS[*]}"
    export FAKE_NO_RUN=1
    resolve_cupti "$T/noroot" "$T/rh3.txt"
    echo "$a#$b#$CUPTI_SKIP"
)
check "resolve_cupti: no library found" 0 "$([[ $rcu == "no libgpu_observer_cupti.so"*"|yes#"* ]] && echo 0 || echo "1 ($rcu)")"
check "resolve_cupti: CUPTI_LIB passed as --cupti-lib" 0 "$([[ $rcu == *"#|--cupti-lib $HERE/synth.py#"* ]] && echo 0 || echo "1 ($rcu)")"
check "resolve_cupti: observer without run" 0 "$([[ $rcu == *"#the observer has no 'run' subcommand"* ]] && echo 0 || echo "1 ($rcu)")"

# EXIT trap in run mode: the observer and its command are stopped
(
    # shellcheck source=SCRIPTDIR/../lib.sh
    source "$GPU/lib.sh"
    OBSERVER="$HERE/fake_observer.py"
    READY_TIMEOUT=3
    STOP_TIMEOUT=3
    install_traps
    start_observer_run "$T/trap_run.jsonl" "$T/trap_run.err" "$T/trap_run.log" -- sleep 45 >/dev/null 2>&1
    sleep 0.5
    echo "$OBS_PID $(child_pids "$OBS_PID")" >"$T/trap_run.pid"
    exit 0
) >/dev/null 2>&1 || true
read -r op cp_ <"$T/trap_run.pid" || true
alive=0
[[ -n ${op:-} && -d /proc/$op ]] && alive=1
[[ -n ${cp_:-} && -d /proc/$cp_ ]] && alive=$((alive + 2))
check "EXIT trap stopped the run-mode observer and its command" 0 "$alive"
check "EXIT trap (run mode): summary written" 0 "$(has '"scope": "total"' "$T/trap_run.jsonl")"

# --- bench_cupti.sh end to end with the fake observer and workload
bench_cupti_e2e() { # name [env...] -> rc
    local n=$1 rc=0
    shift
    env "$@" OBSERVER="$HERE/fake_observer.py" BENCH_WORKLOAD="$HERE/fake_train_bench.py" \
        CUPTI_LIB="$HERE/synth.py" ALLOW_NO_GPU=1 ALLOW_NONROOT=1 READY_TIMEOUT=5 STOP_TIMEOUT=5 \
        ROUNDS=1 STEPS=20 WORK_DIR="$T/$n.work" PYTHON="$PY" \
        bash "$GPU/bench_cupti.sh" "$T/$n.out" >"$T/$n.log" 2>&1 || rc=$?
    echo "$rc"
}
check "bench_cupti.sh end to end (fakes)" 0 "$(bench_cupti_e2e bce1)"
check "bench_cupti.sh: report in the output dir" 0 "$(has "CUPTI mode overhead: +2.00% (MET" "$T/bce1.out/BENCH_CUPTI.md")"
check "bench_cupti.sh: at most 8 files out" 0 "$(($(find "$T/bce1.out" -type f | wc -l) <= 8 ? 0 : 1))"
check "bench_cupti.sh: summary json" 0 "$(has '"target_met": true' "$T/bce1.out/bench-cupti-summary.json")"
check "bench_cupti.sh: rotated order, CUPTI block of the run" 0 "$(has "| 1 | cupti | \`r1_cupti\` | 0 |" "$T/bce1.out/BENCH_CUPTI.md")"
check "bench_cupti.sh: profiler activities described (default cuda)" 0 "$(has "(d) torch.profiler, CUDA activities only" "$T/bce1.out/BENCH_CUPTI.md")"
check "bench_cupti.sh: no JSONL left" 0 "$(find "$T/bce1.work" -name '*.jsonl' | wc -l)"
check "bench_cupti.sh: a failing run -> rc 1, report still written" 1 "$(bench_cupti_e2e bce2 FAKE_TRAIN_FAIL=profiler)"
check "bench_cupti.sh: PROFILER_ACTIVITIES=cpu,cuda" 0 "$(bench_cupti_e2e bce4 PROFILER_ACTIVITIES=cpu,cuda MODES="base profiler")"
check "bench_cupti.sh: CPU + CUDA profiler described" 0 "$(has "(d) torch.profiler, CPU + CUDA activities" "$T/bce4.out/BENCH_CUPTI.md")"
check "bench_cupti.sh: failing run listed" 0 "$(has "runs without a result: r1_profiler" "$T/bce2.out/BENCH_CUPTI.md")"
check "bench_cupti.sh: observer without run -> rc 1" 1 "$(bench_cupti_e2e bce3 FAKE_NO_RUN=1)"
check "bench_cupti.sh: says why" 0 "$(has "no 'run' subcommand" "$T/bce3.log")"

# --- NVML sampling: gpucheck.compare_nvml on synthetic scenarios, validate_nvml.sh with the fakes
NV_FAKE="$HERE/fake_nvml_observer.py"
chmod +x "$NV_FAKE"
nv_st() { # check-id results.json -> that check's status
    "$PY" -c 'import json,sys
r=json.load(open(sys.argv[2]))
print(next((c["status"] for c in r["checks"] if c["id"]==sys.argv[1]), "missing"))' "$1" "$2" 2>/dev/null || echo error
}
nv_rc() { # name gpus [fault...] -> gpucheck.compare_nvml report rc on a synthetic scenario in $T/nv_NAME
    local n=$1 g=$2 d="$T/nv_$1" f
    shift 2
    local -a fa=()
    for f in "$@"; do fa+=(--fault "$f"); done
    "$PY" "$NV_FAKE" synth "$d" --gpus "$g" ${fa[@]+"${fa[@]}"} >/dev/null
    nv_report "$d" "$g"
}
nv_report() { # dir gpus -> gpucheck.compare_nvml report rc on the scenario in dir (R.md, R.json)
    local d=$1 g=$2 rc=0 f
    local -a wl=()
    for f in "$d"/wl*.result.json; do wl+=(--workload "$f"); done
    "$PY" -m gpucheck.compare_nvml report --smi-static "$d/smi_static.json" \
        --devices-json "$d/devices.json" --devices-rc 0 --devices-table "$d/devices.txt" --devices-table-rc 0 \
        --active-events "$d/run.jsonl" --captures "$d/run.captures.jsonl" "${wl[@]}" \
        --expected-workloads "$g" --idle-events "$d/idle.jsonl" \
        --md-out "$d/R.md" --json-out "$d/R.json" >"$d/out.txt" 2>&1 || rc=$?
    echo "$rc"
}
check "nvml: synthetic 2 GPUs, all consistent -> pass" 0 "$(nv_rc ok 2)"
check "nvml: report says PASS" 0 "$(has "Overall: \*\*PASS" "$T/nv_ok/R.md")"
check "nvml: pci bus id domain/case normalised" PASS "$(nv_st devices.fields "$T/nv_ok/R.json")"
check "nvml: diff distribution reported" 0 "$(has "diffs (MiB): +0.50 ×15" "$T/nv_ok/R.md")"
cp -r "$T/nv_ok" "$T/nv_torn"
printf '{"type": "nvml", "scope": "device", "uuid": "GPU-' >>"$T/nv_torn/run.jsonl"
printf 'not json\n{"seq": 99, "query": "gpu", "t0' >>"$T/nv_torn/run.captures.jsonl"
check "nvml: torn last lines (observer output, captures) -> pass, the line counted" "0 0" \
    "$(nv_report "$T/nv_torn" 2) $(has '"lines": 325,' "$T/nv_torn/R.json")"
check "nvml: memory off by 3 MiB -> fail" 1 "$(nv_rc memoff 1 mem_off_mib=3)"
check "nvml: ... device memory check fails" FAIL "$(nv_st run.dev_memory "$T/nv_memoff/R.json")"
check "nvml: ... process memory check fails" FAIL "$(nv_st run.proc_memory "$T/nv_memoff/R.json")"
check "nvml: memory 0.4 MiB off (device diff +0.9 MiB) -> pass" 0 "$(nv_rc memnear 1 mem_off_mib=0.4)"
check "nvml: a pid on the wrong GPU -> fail" 1 "$(nv_rc wrongdev 2 wrong_device=1)"
check "nvml: ... attribution check fails" FAIL "$(nv_st run.proc_device "$T/nv_wrongdev/R.json")"
check "nvml: ... and says where" 0 "$(has "lines on other GPUs" "$T/nv_wrongdev/out.txt")"
check "nvml: memory key absent in every other sample -> pass (not read as 0)" 0 \
    "$(nv_rc dropkey 1 drop_key=hw.gpu.memory.usage)"
check "nvml: memory key absent everywhere -> fail as absent" 1 "$(nv_rc absentkey 1 absent_key=hw.gpu.memory.usage)"
check "nvml: ... reported as absent, not as a difference" 0 "$(has "metric absent in all 80 samples" "$T/nv_absentkey/out.txt")"
check "nvml: power absent (GPU without the metric) -> pass, shown absent" 0 \
    "$(nv_rc nopower 1 absent_key=hw.power)$(has "\`hw.power\` | 0/80 (absent)" "$T/nv_nopower/R.md" | tr -d 0)"
check "nvml: utilization absent everywhere -> fail" 1 "$(nv_rc noutil 1 absent_key=hw.gpu.utilization)"
check "nvml: ... process utilization check fails" FAIL "$(nv_st run.proc_util "$T/nv_noutil/R.json")"
check "nvml: ratios in percent -> fail" 1 "$(nv_rc percent 1 percent=1)"
check "nvml: 150 ms interval -> fail" 1 "$(nv_rc slow 1 interval_ms=150)"
check "nvml: 115 ms interval -> pass" 0 "$(nv_rc slowish 1 interval_ms=115)"
check "nvml: state unavailable -> fail" 1 "$(nv_rc state 1 state=unavailable)"
check "nvml: sampler 0.2% of a core -> fail" 1 "$(nv_rc cpu 1 cpu_ratio=0.002)"
check "nvml: ... idle run cost checked too" FAIL "$(nv_st idle.cpu "$T/nv_cpu/R.json")"
check "nvml: query mean 1.5 ms -> fail" 1 "$(nv_rc query 1 query_mean_ns=1500000)"
check "nvml: devices name differs -> fail" 1 "$(nv_rc devname 1 dev_field=name:Wrong)"
check "nvml: devices without power limit -> fail" 1 "$(nv_rc devdrop 1 dev_drop=power_limit_watts)"
check "nvml: ... says absent" 0 "$(has "absent in the observer's output" "$T/nv_devdrop/R.md")"
check "nvml: memory never stable -> fail (nothing compared)" 1 "$(nv_rc unstable 1 unstable=1)"
check "nvml: ... skipped as unstable" 0 "$(has "15 unstable" "$T/nv_unstable/out.txt")"
check "nvml: nvidia-smi per-process memory N/A -> fail" 1 "$(nv_rc smina 1 smi_proc_na=1)"
check "nvml: no device summary -> fail" 1 "$(nv_rc nosum 1 no_dev_summary=1)"
rc=0
"$PY" -m gpucheck.compare_nvml report --smi-static "$T/nv_ok/smi_static.json" --md-out "$T/nv_none.md" \
    --active-events "$T/nonexistent.jsonl" --captures "$T/nonexistent.cap" >"$T/nv_none.out" 2>&1 || rc=$?
check "nvml: no observer output -> fail, report still written" "1 0" "$rc $(has "NOT RUN" "$T/nv_none.md")"
# the helpers against the fake nvidia-smi
mkdir -p "$T/nvbin"
ln -sf "$NV_FAKE" "$T/nvbin/nvidia-smi"
ln -sf "$NV_FAKE" "$T/nvbin/fake_nvml_alloc.py"
rc=0
printf 'CUDA Version                              : 13.0\n' >"$T/nvq.txt"
FAKE_GPUS=2 FAKE_NVML_STATE="$T/nvstate0" FAKE_SMI_NO_RESERVED=1 NVIDIA_SMI="$T/nvbin/nvidia-smi" \
    "$PY" -m gpucheck.compare_nvml smi-static --out "$T/nv_static.json" --q-text "$T/nvq.txt" >"$T/nv_static.out" 2>&1 || rc=$?
check "nvml smi-static: field-by-field fallback when a field is rejected" "0 0 0" \
    "$rc $(has '"memory.reserved": "Field' "$T/nv_static.json") $(has '"cuda_version": "13.0"' "$T/nv_static.json")"
check "nvml smi-static: the fields of both GPUs" 0 "$(has '"clocks.max.memory": "2619"' "$T/nv_static.json")"
rc=0
FAKE_NVML_STATE="$T/nvstate0" NVIDIA_SMI="$T/nvbin/nvidia-smi" \
    "$PY" -m gpucheck.compare_nvml capture --out "$T/nv_cap.jsonl" --duration 0.5 --interval 0.2 >/dev/null 2>&1 || rc=$?
check "nvml capture: gpu and apps queries with monotonic times" "0 0 0" \
    "$rc $(has '"query": "gpu"' "$T/nv_cap.jsonl") $(has '"query": "apps"' "$T/nv_cap.jsonl")"
nv_norm=$("$PY" -c 'from gpucheck import compare_nvml as c
print(c.norm_pci("0000:1b:00.0") == c.norm_pci("00000000:1B:00.0") == "00000000:1B:00.0",
      c.num("[N/A]") is None, c.num("700.00 W") == 700.0, c.norm_cap("9.0") == "9.0")')
check "nvml: pci/N/A/unit normalisation" "True True True True" "$nv_norm"
# validate_nvml.sh end to end with the fake observer, nvidia-smi and workload
nv_e2e() { # name [env...] -> rc
    local n=$1 rc=0
    shift
    env "$@" PATH="$T/nvbin:$PATH" OBSERVER="$NV_FAKE" NVML_WORKLOAD="$T/nvbin/fake_nvml_alloc.py" \
        FAKE_NVML_STATE="$T/$n.state" ACTIVE_DURATION=2 IDLE_DURATION=1 CAPTURE_INTERVAL=0.2 \
        READY_TIMEOUT=5 STOP_TIMEOUT=5 WL_READY_TIMEOUT=20 WORK_DIR="$T/$n.work" PYTHON="$PY" \
        bash "$GPU/validate_nvml.sh" "$T/$n.out" >"$T/$n.log" 2>&1 || rc=$?
    echo "$rc"
}
check "validate_nvml.sh end to end (fakes, 2 GPUs)" 0 "$(nv_e2e nve1 FAKE_GPUS=2)"
check "validate_nvml.sh: three files out" 3 "$(find "$T/nve1.out" -type f | wc -l | tr -d ' ')"
check "validate_nvml.sh: report and results" "0 0" \
    "$(has "Overall: \*\*PASS" "$T/nve1.out/NVML-VALIDATION.md") $(has '"overall": "PASS"' "$T/nve1.out/nvml-results.json")"
check "validate_nvml.sh: one workload per GPU" 0 "$(has "run.workloads_ready  PASS     2 / 2" "$T/nve1.log")"
check "validate_nvml.sh: no workload left running" 0 "$(find "$T/nve1.state" -name '*.json' | wc -l | tr -d ' ')"
check "validate_nvml.sh: memory 3 MiB off -> rc 1" 1 "$(nv_e2e nve2 FAKE_NVML_FAULTS=mem_off_mib=3)"
check "validate_nvml.sh: without torch -> rc 1, reported as not run" "1 0" \
    "$(nv_e2e nve3 FAKE_NO_TORCH=1) $(has "PyTorch with CUDA not usable" "$T/nve3.out/NVML-VALIDATION.md")"
check "validate_nvml.sh: observer fails to start -> rc 1, report written" "1 0" \
    "$(nv_e2e nve4 FAKE_NVML_FAULTS=die_early=1) $(has "did not start" "$T/nve4.out/NVML-VALIDATION.md")"

# --- bottleneck verdicts (issue 13): gpucheck.compare_verdicts on synthetic scenarios
# (tests/fake_verdicts.py synth), then validate_verdicts.sh end to end with the fakes.
VF="$HERE/fake_verdicts.py"
chmod +x "$VF"
mkdir -p "$T/vd"
vd_rc() { # name kind mode [fault...] [-- extra check args] -> compare_verdicts check rc ($T/vd/NAME.*)
    local n=$1 k=$2 m=$3 rc=0
    shift 3
    local -a fa=() xa=()
    while (($#)); do
        if [[ $1 == -- ]]; then
            shift
            xa=("$@")
            break
        fi
        fa+=(--fault "$1")
        shift
    done
    "$PY" "$VF" synth "$T/vd" "$n" --kind "$k" --mode "$m" ${fa[@]+"${fa[@]}"}
    "$PY" -m gpucheck.compare_verdicts check --events "$T/vd/$n.jsonl" --workload "$T/vd/$n.json" \
        --name "$n" --kind "$k" --mode "$m" --terminal "$T/vd/$n.term.txt" \
        --result-out "$T/vd/$n.result.json" ${xa[@]+"${xa[@]}"} >"$T/vd/$n.out" 2>&1 || rc=$?
    echo "$rc"
}
vd_get() { # name expression (of the result r) -> its value
    "$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' \
        "$T/vd/$1.result.json" "$2" 2>/dev/null || echo error
}
check "verdicts: launch under run (CUPTI) -> pass" 0 "$(vd_rc launch_c launch cupti)"
check "verdicts: the console row" 0 "$(has "launch_c: PASS  expected launch_bound; pid 4242, 3 verdict lines, observed 14.5 s" "$T/vd/launch_c.out")"
check "verdicts: majority and end over the full-length span (9 s after the first sample to the exit)" 0 \
    "$(has "full-length windows (5.5 s): majority launch_bound (100%), at the end launch_bound; whole run launch_bound (then host_bound)" "$T/vd/launch_c.out")"
check "verdicts: the 10 s line is the explicit full-length one, and decides the evidence" \
    "['launch_bound'] 12.0 10.0" "$(vd_get launch_c 'r["full"]["explicit_full_lines"], r["full"]["deciding"]["t_s"], r["full"]["deciding"]["window_s"]' | tr -d '(),')"
check "verdicts: the evidence shown" 0 \
    "$(has "busy 22.0% (cupti), launches/s 140,000, kernel/interval µs 1.8 / 7.1, thread CPU 99%, process CPU 102%, host cpu_busy, syncs/s 10, blocked 2%, copies 0% \[none (link 63)\]" "$T/vd/launch_c.out")"
check "verdicts: sync under --pid (NVML) -> pass" 0 "$(vd_rc sync_p sync pid)"
check "verdicts: no line of its own in the span: the 8.5 s line's class holds to the exit" \
    "[] sync_bound 5.5 8.5" "$(vd_get sync_p 'r["full"]["explicit_full_lines"], r["full"]["majority"], r["full"]["span_s"], r["full"]["deciding"]["window_s"]' | tr -d "(),'")"
check "verdicts: the terminal summary's verdict line parsed" "sync_bound launch_bound" \
    "$(vd_get sync_p 'r["terminal"]["class"], r["terminal"]["secondary"]' | tr -d "(),'")"
check "verdicts: cpu, all processes, host cpu_busy -> pass" 0 "$(vd_rc cpu_a cpu all)"
check "verdicts: the launch loop without CUPTI is host_bound -> fail" 1 "$(vd_rc launch_a launch all)"
check "verdicts: ... why: no kernel times without CUPTI" 0 \
    "$(has "why: launch_bound needs: GPU busy 22% < 50% (holds); launching thread CPU 99% ≥ 80% (holds); mean kernel time unknown (only CUPTI gives kernel times: without it launch_bound cannot hold)" "$T/vd/launch_a.out")"
check "verdicts: an earlier rule that holds -> why says it comes first" "1 0" \
    "$(vd_rc sync_l sync cupti -- --expect launch_bound) $(has "why: sync_bound is tried before launch_bound" "$T/vd/sync_l.out")"
check "verdicts: sleep under run, host waiting -> pass" 0 "$(vd_rc sleep_c sleep cupti)"
check "verdicts: train is informational" "0 INFO" "$(vd_rc train_a train all) $(vd_get train_a 'r["status"]')"
check "verdicts: gemm never gpu_bound -> fail" 1 "$(vd_rc wc gemm all wrong_class)"
check "verdicts: ... majority and end both named" "0 0" \
    "$(has "FAIL: majority of the full-length span is mixed (100%), expected gpu_bound" "$T/vd/wc.out") $(has "FAIL: class at the end is mixed, expected gpu_bound" "$T/vd/wc.out")"
check "verdicts: mixed at the end (the majority still launch_bound) -> fail" 1 "$(vd_rc fe launch cupti flip_end)"
check "verdicts: ... time by class over the span" "{'launch_bound': 5.0, 'mixed': 0.5} 0.9091" \
    "$(vd_get fe 'r["full"]["time_by_class_s"], r["full"]["majority_share"]' | tr -d '()' | sed 's/}, /} /')"
check "verdicts: ... the end named" 0 "$(has "FAIL: class at the end is mixed, expected launch_bound" "$T/vd/fe.out")"
check "verdicts: process observed 7.5 s -> fail (no full-length window)" 1 "$(vd_rc sh sync pid short)"
check "verdicts: ... says so" 0 "$(has "FAIL: no full-length window: pid 4242 observed 7.5 s (needs ≥ 9 s; run the workload longer)" "$T/vd/sh.out")"
check "verdicts: no verdict line for the pid -> fail" "1 0" "$(vd_rc nl cpu all no_lines) $(has "FAIL: no verdict line for pid 4242" "$T/vd/nl.out")"
check "verdicts: host_bound with the wrong host -> fail" "1 0" \
    "$(vd_rc wh cpu pid wrong_host) $(has "FAIL: evidence.host waiting at t=8.5 s, expected cpu_busy" "$T/vd/wh.out")"
check "verdicts: host_bound without evidence.host -> fail" "1 0" \
    "$(vd_rc nh sleep cupti no_host) $(has "FAIL: evidence.host (absent) at t=2.0 s, expected waiting" "$T/vd/nh.out")"
check "verdicts: evidence without the newer members -> pass, shown absent" "0 0" \
    "$(vd_rc of gemm cupti old_fields) $(has "host (absent), syncs/s 56, blocked 2%, copies 0% \[(absent)\]" "$T/vd/of.out")"
check "verdicts: lines under another pid -> python process by comm, pass" "0 0" \
    "$(vd_rc po transfer all pid_offset) $(has "falling back to pid 4249" "$T/vd/po.out")"
check "verdicts: no process_exit line -> the end from the whole-run window, pass" "0 0 14.5" \
    "$(vd_rc ne gemm pid no_exit) $(has "end taken from the whole-run window" "$T/vd/ne.out") $(vd_get ne 'r["observed_s"]')"
check "verdicts: a torn last line -> counted, pass" "0 0" \
    "$(vd_rc tn sync cupti torn) $(has "1 unusable JSONL line(s) skipped" "$T/vd/tn.out")"
check "verdicts: summary without a whole-run verdict -> pass" "0 None" \
    "$(vd_rc nv gemm all no_verdict_summary) $(vd_get nv 'r["whole_run"].get("class")')"
check "verdicts: --expect overrides the class and host" 0 "$(vd_rc wh2 cpu pid wrong_host -- --expect host_bound:waiting)"
check "verdicts: --expect none -> informational" "0 INFO" "$(vd_rc wc2 gemm all wrong_class -- --expect none) $(vd_get wc2 'r["status"]')"
check "verdicts: --expect of an unknown class -> rc 2" 2 "$(vd_rc bad gemm all -- --expect fast)"
check "verdicts: the workload failed -> fail" "1 0" \
    "$(vd_rc wf gemm cupti -- --workload-rc 1) $(has "FAIL: workload exit status 1" "$T/vd/wf.out")"
rc=0
"$PY" -m gpucheck.compare_verdicts check --events "$T/vd/nonexistent.jsonl" --name gone --kind gemm \
    --mode all --result-out "$T/vd/gone.result.json" >"$T/vd/gone.out" 2>&1 || rc=$?
check "verdicts: unreadable observer output -> rc 2, a FAIL result" "2 FAIL" "$rc $(vd_get gone 'r["status"]')"
printf 'gemm_pid\tgemm\tpid\tNOT RUN (time budget 390 s)\n' >"$T/vd/status.tsv"
rc=0
"$PY" -m gpucheck.compare_verdicts report --env "$T/env.json" --status-file "$T/vd/status.tsv" \
    --out "$T/vd/V1.md" --json-out "$T/vd/V1.json" "$T/vd/launch_c.result.json" "$T/vd/sync_p.result.json" \
    "$T/vd/wh.result.json" "$T/vd/train_a.result.json" >"$T/vd/V1.out" 2>&1 || rc=$?
check "verdicts report: a failing and a not-run row -> rc 1" 1 "$rc"
check "verdicts report: overall" 0 "$(has "Overall: \*\*FAIL\*\* — 5 runs: 2 pass, 2 fail or not run, 1 informational." "$T/vd/V1.md")"
check "verdicts report: the verdict row" 0 \
    "$(has "| sync | \`--pid\` (NVML) | sync_bound | sync_bound (100% of 5.5 s) / sync_bound | sync_bound (then launch_bound) | \*\*PASS\*\* |" "$T/vd/V1.md")"
check "verdicts report: the failing row with its reason" 0 \
    "$(has "| cpu | \`--pid\` (NVML) | host_bound, host cpu_busy | host_bound (100% of 5.5 s) / host_bound | host_bound | \*\*FAIL\*\* (evidence.host waiting at t=8.5 s, expected cpu_busy) |" "$T/vd/V1.md")"
check "verdicts report: the not-run row" 0 "$(has "| gemm | \`--pid\` (NVML) | gpu_bound | - | - | \*\*NOT RUN (time budget 390 s)\*\* |" "$T/vd/V1.md")"
check "verdicts report: evidence row" 0 \
    "$(has "| launch | cupti | t=12.0 s, 10.0 s | launch_bound (then host_bound) | 22.0% (cupti) | 140,000 | 1.8 / 7.1 | 99% / 102% | cpu_busy | 10 | 2% | 0% | none (link 63) | - |" "$T/vd/V1.md")"
check "verdicts report: the terminal capture" 0 "$(has "  verdict       sync_bound (then launch_bound) over 14.5 s: GPU busy 41.0% (nvml)" "$T/vd/V1.md")"
check "verdicts report: results json" 0 "$(has '"overall": "FAIL"' "$T/vd/V1.json")"
rc=0
"$PY" -m gpucheck.compare_verdicts report --out "$T/vd/V2.md" "$T/vd/launch_c.result.json" \
    "$T/vd/sync_p.result.json" >/dev/null 2>&1 || rc=$?
check "verdicts report: all pass -> rc 0" "0 0" "$rc $(has "Overall: \*\*PASS\*\*" "$T/vd/V2.md")"
printf 'train_pid\ttrain\tpid\tNOT RUN (time budget 390 s)\n' >"$T/vd/status2.tsv"
rc=0
"$PY" -m gpucheck.compare_verdicts report --status-file "$T/vd/status2.tsv" --out "$T/vd/V3.md" \
    "$T/vd/launch_c.result.json" >/dev/null 2>&1 || rc=$?
check "verdicts report: an informational run the time budget left out does not fail" "0 0" \
    "$rc $(has "1 pass, 0 fail or not run, 0 informational, 1 informational not run." "$T/vd/V3.md")"
# validate_verdicts.sh end to end: the fake observer (run, all processes, --pid, terminal) and
# a fake bottleneck.py (the symlink's name makes fake_verdicts.py the workload).
ln -sf "$VF" "$T/fake_bottleneck.py"
vv_e2e() { # name [env...] -> rc
    local n=$1 rc=0
    shift
    env "$@" OBSERVER="$VF" BOTTLENECK_WORKLOAD="$T/fake_bottleneck.py" CUPTI_LIB="$HERE/synth.py" \
        ALLOW_NO_GPU=1 ALLOW_NONROOT=1 READY_TIMEOUT=5 STOP_TIMEOUT=5 WL_SECONDS=0.2 \
        WORK_DIR="$T/$n.work" PYTHON="$PY" bash "$GPU/validate_verdicts.sh" "$T/$n.out" >"$T/$n.log" 2>&1 || rc=$?
    echo "$rc"
}
vv_rows() { # name -> "NAME:STATUS ..." of its results json
    "$PY" -c 'import json,sys; print(" ".join(r["name"] + ":" + r["status"] for r in json.load(open(sys.argv[1]))["results"]))' \
        "$T/$1.out/verdicts-results.json" 2>/dev/null || echo error
}
check "validate_verdicts.sh end to end (fakes)" 0 "$(vv_e2e vv1 KINDS="gemm cpu")"
check "validate_verdicts.sh: three files out" 3 "$(find "$T/vv1.out" -type f | wc -l | tr -d ' ')"
check "validate_verdicts.sh: every row" "gemm_cupti:PASS gemm_all:PASS gemm_pid:PASS cpu_cupti:PASS cpu_all:PASS cpu_pid:PASS" "$(vv_rows vv1)"
check "validate_verdicts.sh: the terminal capture in the report" 0 "$(has "  verdict       host_bound over 14.5 s" "$T/vv1.out/VERDICTS.md")"
check "validate_verdicts.sh: no full JSONL left, the kept lines in the artifacts" "0 0" \
    "$([[ -e $T/vv1.work.jsonl ]] && echo 1 || echo 0) $(tar -tzf "$T/vv1.out/verdicts-artifacts.tar.gz" | grep -c 'cpu_pid.verdicts.jsonl$' | sed 's/^1$/0/')"
check "validate_verdicts.sh: a wrong host under --pid -> rc 1" 1 \
    "$(vv_e2e vv2 KINDS=cpu MODES=observed FAKE_VERDICT_FAULTS=cpu/pid=wrong_host)"
check "validate_verdicts.sh: ... that row only" "cpu_all:PASS cpu_pid:FAIL" "$(vv_rows vv2)"
check "validate_verdicts.sh: EXPECT overrides it" 0 \
    "$(vv_e2e vv3 KINDS=cpu MODES=observed FAKE_VERDICT_FAULTS=cpu/pid=wrong_host EXPECT=cpu/pid=host_bound:waiting)"
check "validate_verdicts.sh: a failing workload -> rc 1, SKIP leaves a run out" "1 gemm_cupti:FAIL" \
    "$(vv_e2e vv4 KINDS=gemm SKIP=gemm/observed FAKE_WORKLOAD_FAIL=gemm) $(vv_rows vv4)"
check "validate_verdicts.sh: ... says why" 0 "$(has "workload exit status 1" "$T/vv4.out/VERDICTS.md")"

# --- anomalies (issue 14): gpucheck.compare_anomalies on synthetic runs. A planted run: 3
# windows, a kernel finding in each (and a synchronize in the first: a consequence), one
# finding outside (a false positive among 10 000 checked: 0.01 %).
mkdir -p "$T/an"
an_run() { # name: writes $T/an/NAME.{json,jsonl}; the findings' (ts, what) pairs follow
    local n=$1
    shift
    "$PY" - "$T/an/$n" "$@" <<'PYEOF'
import json, sys
base, pairs = sys.argv[1], sys.argv[2:]
wins = [{"index": 999 + 1000 * i, "start_ns": 1000 * (i + 1), "end_ns": 1000 * (i + 1) + 500} for i in range(3)]
json.dump({"pid": 7, "planted": wins}, open(base + ".json", "w"))
with open(base + ".jsonl", "w") as f:
    for p in pairs:
        ts, what = p.split(":")
        f.write(json.dumps({"type": "anomaly", "pid": 7, "ts_ns": int(ts), "what": what}, separators=(",", ":")) + "\n")
    f.write(json.dumps({"type": "anomaly", "pid": 8, "ts_ns": 5, "what": "kernel"}, separators=(",", ":")) + "\n")  # another process
    f.write(json.dumps({"type": "summary", "scope": "total", "anomalies": {"checked": 10000, "flagged": len(pairs) + 1}}, separators=(",", ":")) + "\n")  # as the observer writes
PYEOF
}
an_rc() { # name expect-kind [max-fp-rate]
    local rc=0
    "$PY" -m gpucheck.compare_anomalies --name "$1" --events "$T/an/$1.jsonl" --workload "$T/an/$1.json" \
        --expect-kind "$2" --max-fp-rate "${3:-0.001}" --row-out "$T/an/$1.row.json" >"$T/an/$1.out" 2>&1 || rc=$?
    echo "$rc"
}
an_row() { "$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["planted_flagged"], r["in_planted_windows"], r["false_positives"], r["pass"])' "$T/an/$1.row.json"; }
an_run ok 1100:kernel 1400:call 2100:kernel 3200:kernel 9000:call
check "compare_anomalies: every planted window flagged, 1 false positive in 10 000 -> pass" 0 "$(an_rc ok kernel)"
check "compare_anomalies: ... planted 3, 4 findings in windows, 1 false positive (other pids ignored)" "3 4 1 True" "$(an_row ok)"
an_run miss 1100:kernel 2100:call 3200:kernel
check "compare_anomalies: a window with only a call finding when a kernel is expected -> rc 1" 1 "$(an_rc miss kernel)"
check "compare_anomalies: ... says how many were missed" 0 "$(has "1 of 3 planted outliers not flagged" "$T/an/miss.out")"
an_run copies 1100:call 2100:bandwidth 3200:call
check "compare_anomalies: a planted copy is flagged by a call or bandwidth finding -> pass" 0 "$(an_rc copies copy)"
an_run noisy 1100:kernel 2100:kernel 3200:kernel 5:call 6:call 7:call
check "compare_anomalies: 3 false positives in 10 000 over a 0.02 % bound -> rc 1" 1 "$(an_rc noisy kernel 0.0002)"
check "compare_anomalies: no summary -> rc 2" 2 "$(head -n 2 "$T/an/ok.jsonl" >"$T/an/cut.jsonl"; cp "$T/an/ok.json" "$T/an/cut.json"; an_rc cut kernel)"

# --- late GPU timing (issue 17): gpucheck.compare_late on synthetic runs (tests/late_synth.py:
# a job's steps, its reference run and a late observer's lines, with faults), then
# validate_late_attach.sh end to end with the fake observer and fake jobs (tests/fake_late_job.py).
mkdir -p "$T/late"
lt_rc() { # name [fault...] -> compare_late check rc ($T/late/NAME.*)
    local n=$1 rc=0 f
    shift
    local -a fa=()
    for f in "$@"; do fa+=(--fault "$f"); done
    "$PY" "$HERE/late_synth.py" "$T/late/$n" ${fa[@]+"${fa[@]}"} >/dev/null
    "$PY" -m gpucheck.compare_late check --name "$n" --steps "$T/late/$n.steps.jsonl" \
        --reference "$T/late/$n.ref.jsonl" --events "$T/late/$n.jsonl" --workload-rc 0 --observer-rc 0 \
        --gpu-timing-for 3 --result-out "$T/late/$n.result.json" --section-out "$T/late/$n.md" \
        >"$T/late/$n.out" 2>&1 || rc=$?
    echo "$rc"
}
lt_st() { # name check-id -> that check's status
    "$PY" -c 'import json,sys; r=json.load(open(sys.argv[1]))
print(next((c["status"] for c in r["checks"] if c["id"] == sys.argv[2]), "missing"))' "$T/late/$1.result.json" "$2" 2>/dev/null || echo error
}
check "late: consistent run -> pass" 0 "$(lt_rc ok)"
check "late: ... every strict check passes" "PASS PASS PASS PASS PASS PASS PASS" \
    "$(for c in attach withdraw pause gpu.joined names.window steps.after result.final_loss; do lt_st ok $c; done | tr '\n' ' ' | sed 's/ $//')"
check "late: ... join and naming counts shown" "0 0" \
    "$(has "GPU records joined (\`launch_ts_ns\` not null) | 100 % | 100.00 % (321/321) | PASS" "$T/late/ok.md") $(has "launches in the window (CUPTI active → withdrawn; not graph launches) named | 100 % | 100.00 % (" "$T/late/ok.md")"
check "late: ... pause, after/before ratio and the reference shown" "0 0 0" \
    "$(has "| 900 µs | PASS" "$T/late/ok.md") $(has "1.0000 (10.060 ms / 10.060 ms; 308 / 241 steps)" "$T/late/ok.md") $(has "final loss = the reference run's | 0.012345678901234567 | 0.012345678901234567 | PASS" "$T/late/ok.md")"
check "late: ... after-withdraw naming, diverted time and summary are informational" "INFO INFO INFO" \
    "$(lt_st ok names.after) $(lt_st ok diverted) $(lt_st ok summary.names)"
check "late: one GPU record not joined -> fail" "1 FAIL" "$(lt_rc unjoined unjoined) $(lt_st unjoined gpu.joined)"
check "late: ... the share shown" 0 "$(has "99.69 % (320/321)" "$T/late/unjoined.md")"
check "late: one unnamed launch in the window -> fail" "1 FAIL" "$(lt_rc unnamed unnamed) $(lt_st unnamed names.window)"
check "late: ... listed" 0 "$(has "unnamed launch in the window: cuLaunchKernel" "$T/late/unnamed.out")"
check "late: an unnamed launch after the withdraw -> pass, shown" "0 INFO 0" \
    "$(lt_rc unnamed_after unnamed_after) $(lt_st unnamed_after names.after) $(has "99.48 % (190/191)" "$T/late/unnamed_after.md")"
check "late: hijack pause 25 ms -> fail" "1 FAIL" "$(lt_rc pause pause) $(lt_st pause pause)"
check "late: steps 8 % slower after the withdraw -> fail" "1 FAIL" "$(lt_rc ratio ratio) $(lt_st ratio steps.after)"
check "late: steps 4 % slower after the withdraw -> pass" "0 PASS" "$(lt_rc ratio_small ratio_small) $(lt_st ratio_small steps.after)"
check "late: final loss one ulp off the reference -> fail" "1 FAIL PASS" \
    "$(lt_rc loss loss) $(lt_st loss result.final_loss) $(lt_st loss result.params_checksum)"
check "late: parameter checksum off -> fail" "1 FAIL" "$(lt_rc checksum checksum) $(lt_st checksum result.params_checksum)"
check "late: injection refused -> fail with the reason" "1 FAIL 0" \
    "$(lt_rc refused refused) $(lt_st refused attach) $(has "refused: ptrace_denied" "$T/late/refused.md")"
check "late: no withdrawn line -> fail" "1 FAIL" "$(lt_rc nowd no_withdraw) $(lt_st nowd withdraw)"
check "late: no cupti lines -> the window from the gpu_timing lines, pass" "0 0" \
    "$(lt_rc nocl no_cupti_lines) $(has "no \`cupti\` line with state active" "$T/late/nocl.md")"
check "late: already_loaded -> no hijack, pass" "0 0" "$(lt_rc al already_loaded) $(has "n/a (library already loaded" "$T/late/al.md")"
check "late: only graph launches in the window -> fail (nothing to name)" "1 FAIL" \
    "$(lt_rc go graph_unnamed_only) $(lt_st go names.window)"
check "late: a 40 ms step at the attach -> shown, pass" "0 0" \
    "$(lt_rc sa slow_attach_step) $(has "longest step within 1 s of the attach | - | 40.000 ms (step 301" "$T/late/sa.md")"
rc=0
"$PY" -m gpucheck.compare_late check --name gone --steps "$T/late/ok.steps.jsonl" --reference "$T/late/ok.ref.jsonl" \
    --events "$T/late/nonexistent.jsonl" --result-out "$T/late/gone.result.json" >"$T/late/gone.out" 2>&1 || rc=$?
check "late: unreadable observer output -> rc 2, a FAIL result" "2 0" "$rc $(has '"status": "FAIL"' "$T/late/gone.result.json")"
rc=0
"$PY" -m gpucheck.compare_late check --name noref --steps "$T/late/ok.steps.jsonl" --reference "$T/late/nonexistent.jsonl" \
    --events "$T/late/ok.jsonl" --result-out "$T/late/noref.result.json" >"$T/late/noref.out" 2>&1 || rc=$?
check "late: no reference run -> fail" "1 FAIL" "$rc $(lt_st noref result)"
lr_rc() { # out-name status-text [--require-all] result-names... -> compare_late report rc
    local n=$1 st=$2 rc=0 r
    shift 2
    local -a args=() res=()
    if [[ ${1:-} == --require-all ]]; then
        args+=(--require-all)
        shift
    fi
    for r in "$@"; do res+=("$T/late/$r.result.json"); done
    printf '%s' "$st" >"$T/late/$n.status.tsv"
    "$PY" -m gpucheck.compare_late report --status-file "$T/late/$n.status.tsv" --out "$T/late/$n.LATE.md" \
        --json-out "$T/late/$n.json" ${args[@]+"${args[@]}"} ${res[@]+"${res[@]}"} >"$T/late/$n.rout" 2>&1 || rc=$?
    echo "$rc"
}
check "late report: a pass and a job not run here -> rc 0" "0 0" \
    "$(lr_rc r1 "$(printf 'jax\tNOT RUN (JAX has no GPU)\n')" ok) $(has "Overall: \*\*PASS\*\* — 1 run(s) made: 1 pass, 0 fail; 1 without a result (jax: NOT RUN (JAX has no GPU))." "$T/late/r1.LATE.md")"
check "late report: the summary row" 0 \
    "$(has "| ok | 900 / 300 µs | 321/321 | 287/287 | 191/191 | 10.060 ms / 10.060 ms / 10.060 ms | 1.0000 | 0.012345678901234567 = ref | \*\*PASS\*\* |" "$T/late/r1.LATE.md")"
check "late report: ... --require-all -> rc 1" 1 "$(lr_rc r2 "$(printf 'jax\tNOT RUN (JAX has no GPU)\n')" --require-all ok)"
check "late report: a failing run -> rc 1, its reason in the row" "1 0" \
    "$(lr_rc r3 "" ok pause) $(has "\*\*FAIL\*\* (hijack pause (\`pause_us\`) ≤ 20000 µs: 25000 µs)" "$T/late/r3.LATE.md")"
check "late report: nothing run -> rc 1" 1 "$(lr_rc r4 "$(printf 'torch\tNOT RUN (x)\njax\tNOT RUN (y)\n')")"
rc=0
bash -n "$GPU/validate_late_attach.sh" || rc=$?
check "validate_late_attach.sh: bash syntax" 0 "$rc"
# validate_late_attach.sh end to end with the fakes (symlinks named for the jobs)
ln -sf "$HERE/fake_late_job.py" "$T/fake_late_torch.py"
ln -sf "$HERE/fake_late_job.py" "$T/fake_late_jax.py"
chmod +x "$HERE/fake_late_job.py"
la_e2e() { # name [env...] -> rc
    local n=$1 rc=0
    shift
    # the defaults first: the case's own settings ("$@") override them
    env OBSERVER="$HERE/fake_observer.py" LATE_TORCH_WORKLOAD="$T/fake_late_torch.py" \
        LATE_JAX_WORKLOAD="$T/fake_late_jax.py" ALLOW_NO_GPU=1 ALLOW_NONROOT=1 READY_TIMEOUT=5 STOP_TIMEOUT=5 \
        TORCH_STEPS=500 JAX_STEPS=500 ATTACH_AFTER_S=0.3 GPU_TIMING_FOR=0.6 OBS_LINGER_S=0.5 AFTER_SKIP_S=0.2 \
        WORK_DIR="$T/$n.work" PYTHON="$PY" "$@" bash "$GPU/validate_late_attach.sh" "$T/$n.out" >"$T/$n.log" 2>&1 || rc=$?
    echo "$rc"
}
la_rows() { # name -> "NAME:STATUS ..." of its results json
    "$PY" -c 'import json,sys; j=json.load(open(sys.argv[1]))
print(" ".join(r["name"] + ":" + r["status"] for r in j["results"] + j["not_run"]))' "$T/$1.out/late-results.json" 2>/dev/null || echo error
}
check "validate_late_attach.sh end to end (fakes; JAX not available)" 0 \
    "$(la_e2e le1 FAKE_LATE_SKIP=jax GPU_OBSERVER_CUPTI_PATH=/opt/fake/libcupti.so)"
check "validate_late_attach.sh: rows" "torch:PASS jax:NOT RUN (jax not available (fake))" "$(la_rows le1)"
check "validate_late_attach.sh: files out (report, results, artifacts, the observer's JSONL gzipped, its stderr)" \
    "LATE_ATTACH.md late-artifacts.tar.gz late-results.json torch.err torch.jsonl.gz" "$(find "$T/le1.out" -type f -printf '%f\n' | LC_ALL=C sort | tr '\n' ' ' | sed 's/ $//')"
check "validate_late_attach.sh: the observer stopped after the window, the job ran on" "0 0" \
    "$(has "stopping the observer (SIGINT), the job runs on" "$T/le1.log") $(has "… of which the observer gone" "$T/le1.out/LATE_ATTACH.md")"
check "validate_late_attach.sh: GPU_OBSERVER_CUPTI_PATH reaches the job, not the observer" "0 0" \
    "$(has '"gpu_observer_cupti_path": "/opt/fake/libcupti.so"' "$T/le1.work/torch.steps.jsonl") $(has "GPU_OBSERVER_CUPTI_PATH=(unset)" "$T/le1.out/torch.err")"
check "validate_late_attach.sh: the observer running until the job exits" 0 "$(la_e2e le2 WORKLOADS=jax OBS_LINGER_S=exit)"
check "validate_late_attach.sh: ... it ended with the job" "0 jax:PASS" "$(has "the observer ended with the job (rc=0)" "$T/le2.log") $(la_rows le2)"
check "validate_late_attach.sh: injection refused -> rc 1, the reason in the report" "1 0" \
    "$(la_e2e le3 WORKLOADS=torch TORCH_STEPS=300 FAKE_GPU_TIMING=refused) $(has "refused: ptrace_denied" "$T/le3.out/LATE_ATTACH.md")"
check "validate_late_attach.sh: an observer without --gpu-timing -> rc 1, said" "1 0" \
    "$(la_e2e le4 WORKLOADS=torch TORCH_STEPS=50 FAKE_NO_GPU_TIMING=1) $(has "the observer has no --gpu-timing --gpu-timing-for" "$T/le4.out/LATE_ATTACH.md")"

# --- fleet mode (issue 18): bench_fleet.py's series analysis on a planted series: 1 ms steps,
# 1.1 ms inside two windows; the in-window slowdown is 10 %, the 1 s rate steady but for the
# windows' seconds.
"$PY" - "$T/series-mlp-fleet-0.json" <<'PYEOF'
import json, sys
ends, t = [], 0
wins = [(3_000_000, 3_500_000), (7_000_000, 7_500_000)]
while t < 10_000_000:
    t += 1100 if any(o <= t < c for o, c in wins) else 1000
    ends.append(t)
edges = [x for o, c in wins for x in ([o, "open"], [c, "closed"])]
json.dump({"mode": "fleet", "round": 0, "fleet": "500ms,4s", "ends_us": ends, "edges_us": edges},
          open(sys.argv[1], "w"))
PYEOF
bf=$("$PY" -c 'import json, sys; sys.path.insert(0, sys.argv[1]); import bench_fleet as b; print(json.dumps(b.series_analysis(sys.argv[2])))' "$GPU" "$T/series-mlp-fleet-0.json")
check "bench_fleet.py series: the in-window slowdown measured (10 %)" 0 \
    "$(echo "$bf" | grep -q '"step_us_inside_windows": 1100.0, "step_us_outside_windows": 1000.0, "in_window_slowdown": 0.1}' && echo 0 || echo 1)"
check "bench_fleet.py series: the 1 s rate's spread seen" 0 \
    "$("$PY" -c 'import json, sys; x = json.loads(sys.argv[1]); sys.exit(0 if 0.005 < x["steps_per_s_cv_1s"] < 0.05 else 1)' "$bf" && echo 0 || echo 1)"

echo "$pass passed, $fail failed"
((fail == 0))
