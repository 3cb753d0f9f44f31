//! The bottleneck verdict end to end: the fake libcuda, the fake CUPTI and the fake NVML driven
//! with scripted timings (the workload's `loop` command, tests/fixtures/README.md) so that each
//! class is unambiguous, and the class and the numbers that decided it asserted — in the
//! `verdict` lines and in the summary's whole-run verdict.
//!
//! Windows: a verdict covers the last 10 s, or everything since the process was first sampled
//! while less than 10 s have been seen — so in these short tests every window starts at the
//! process's first sample (the first tick after the first snapshot, every 250 ms, that lists
//! it) and the whole run ends at the final snapshot. Where a test asserts exact counts it makes
//! one marker call first and waits for the first `verdict` line (two samples taken after the
//! marker) before the scripted loop, so the whole run holds the loop's calls and nothing else.
//!
//! GPU busy time: from the fake CUPTI under `run` (a kernel runs 1 µs per grid block; the
//! union of the intervals, exact), or from the fake NVML's per-process SM utilization (the
//! scripted percentage, every sample).

use std::{ffi::OsStr, path::Path, time::Duration};

use gpu_observer_tests::*;
use serde_json::Value;

/// The `verdict` lines of one process, in the order written.
fn verdict_lines(cap: &Captured, pid: u32) -> Vec<&Value> {
    cap.of_type("verdict").filter(|v| v["pid"] == pid).collect()
}

/// A number of a verdict's evidence.
fn num(v: &Value, key: &str) -> f64 {
    v["evidence"][key]
        .as_f64()
        .unwrap_or_else(|| panic!("evidence.{key} is not a number: {v}"))
}

/// The window of a verdict, in seconds.
fn window_s(v: &Value) -> f64 {
    v["window_ns"].as_u64().unwrap_or_else(|| panic!("no window_ns: {v}")) as f64 / 1e9
}

/// `ok loop ITERATIONS ELAPSED_US` → (iterations, elapsed µs).
fn loop_done(reply: &str) -> (u64, u64) {
    let mut f = reply.split_whitespace().skip(2).map(|n| n.parse::<u64>().unwrap());
    match (f.next(), f.next()) {
        (Some(it), Some(us)) if it > 0 => (it, us),
        _ => panic!("unexpected loop reply {reply:?}"),
    }
}

/// The last `verdict` line of the process and its whole-run verdict both have `class`, with
/// that class's hint; returns the whole-run verdict.
fn assert_class<'a>(cap: &'a Captured, pid: u32, class: &str) -> &'a Value {
    let lines = verdict_lines(cap, pid);
    let last = lines
        .last()
        .unwrap_or_else(|| panic!("no verdict line for {pid}; stderr:\n{}", cap.stderr.join("\n")));
    assert_eq!(last["class"], class, "last verdict line; all: {lines:#?}");
    let whole = &cap.process_summary(pid)["verdict"];
    assert_eq!(whole["class"], class, "whole-run verdict {whole}; lines: {lines:#?}");
    assert_eq!(whole["hint"], last["hint"], "{whole}");
    whole
}

/// `gpu-observer run` of the workload with the fake CUPTI (records flushed every 50 ms), its
/// fake libcuda attached up front, no NVML.
fn run_with_cupti(dir: &Path, lib: &Path, env: &[(&str, &str)]) -> RunAgent {
    let cupti = fixtures().join("libcupti.so.13");
    let mut all: Vec<(&str, &OsStr)> = vec![
        ("GPU_OBSERVER_CUPTI_PATH", cupti.as_os_str()),
        ("GPU_OBSERVER_CUPTI_FLUSH_MS", "50".as_ref()),
    ];
    all.extend(env.iter().map(|(k, v)| (*k, v.as_ref())));
    let mut r = RunAgent::start(
        dir,
        &["--interval-ms", "100", "--no-nvml", "--libcuda", lib.to_str().unwrap()],
        &all,
    );
    r.cmd(&format!("load {}", lib.display()));
    r
}

/// The agent with the fake NVML saying each (pid, SM %) of `procs` runs on device 0 with that
/// SM utilization; `--pid` the first one when `follow`, else every process (the fake libcuda
/// `lib` attached up front).
fn nvml_agent(dir: &Path, procs: &[(u32, u32)], follow: bool, lib: &Path) -> Agent {
    let file = dir.join("procs.txt");
    let rows: String = procs
        .iter()
        .map(|(pid, sm)| format!("{pid} 0 1048576 {sm}\n"))
        .collect();
    std::fs::write(&file, rows).unwrap();
    let nvml = fixtures().join("nvml/libnvidia-ml.so.1");
    let first = procs[0].0.to_string();
    let mut args = vec![
        "--interval-ms",
        "100",
        "--nvml-lib",
        nvml.to_str().unwrap(),
        "--nvml-interval-ms",
        "50",
    ];
    if follow {
        args.extend(["--pid", &first]);
    } else {
        args.extend(["--libcuda", lib.to_str().unwrap()]);
    }
    let agent = Agent::start_with_env(dir, &args, &[("FAKE_NVML_PROCS", file.to_str().unwrap())]);
    if follow {
        agent.wait_stderr("attached", Duration::from_secs(10));
    }
    agent
}

/// A workload (extra environment `env`) that has loaded `lib` and called `init` — before any
/// agent runs, so none of that is observed.
fn initialized_workload(lib: &Path, env: &[(&str, &str)]) -> Workload {
    let mut w = Workload::start_with_env(env);
    w.cmd(&format!("load {}", lib.display()));
    w.cmd("init");
    w
}

/// Whether a line is a `verdict` line of `pid`: the first one is written once the process has
/// been sampled twice since its first observed call.
fn is_verdict_of(pid: u32) -> impl Fn(&Value) -> bool {
    move |l| l["type"] == "verdict" && l["pid"] == pid
}

const FIRST_VERDICT_WITHIN: Duration = Duration::from_secs(20);

#[test]
fn a_tight_launch_loop_of_tiny_kernels_is_launch_bound() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-launch");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    // 50 µs of CPU a launch: ~20 000 launches/s from one saturated thread.
    let mut r = run_with_cupti(&dir, &lib, &[("FAKE_CUDA_LAUNCH_SPIN_NS", "50000")]);
    let pid = r.pid;
    r.cmd("init");
    // ~1 µs kernels (the fake CUPTI's: 1 µs per grid block), as fast as one thread launches
    // them (50 µs of CPU each): ~5 s, many ticks.
    r.cmd("burst 100000");
    let cap = r.finish();
    let err = cap.stderr.join("\n");
    let verdicts = verdict_lines(&cap, pid);
    assert!(!verdicts.is_empty(), "no verdict line; stderr:\n{err}");
    let launch_bound: Vec<&&Value> = verdicts.iter().filter(|v| v["class"] == "launch_bound").collect();
    assert!(!launch_bound.is_empty(), "verdicts: {verdicts:?}");
    for v in launch_bound {
        assert!(num(v, "gpu_busy") < 0.5, "{v}");
        assert!(num(v, "launch_thread_cpu") >= 0.8, "{v}");
        assert!(num(v, "mean_kernel_ns") < num(v, "mean_launch_interval_ns"), "{v}");
        assert!(v["hint"].as_str().unwrap().contains("CUDA graphs"), "{v}");
    }
    let summary = cap.process_summary(pid);
    assert_eq!(summary["verdict"]["class"], "launch_bound", "{}", summary["verdict"]);
}

#[test]
fn without_cupti_nvml_says_how_busy_the_gpu_is_and_a_busy_gpu_is_gpu_bound() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-nvml");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = initialized_workload(&lib, &[("FAKE_CUDA_LAUNCH_SPIN_NS", "50000")]);
    // The fake NVML says the process keeps the SMs 90 % busy.
    let agent = nvml_agent(&dir, &[(w.pid, 90)], true, &lib);
    w.cmd("burst 60000");
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let verdicts: Vec<&Value> = verdict_lines(&cap, pid)
        .into_iter()
        .filter(|v| v["evidence"]["gpu_busy_source"] == "nvml")
        .collect();
    assert!(
        !verdicts.is_empty(),
        "no NVML-based verdict: {:?}",
        cap.of_type("verdict").collect::<Vec<_>>()
    );
    for v in &verdicts {
        assert_eq!(v["class"], "gpu_bound", "{v}");
        assert!((num(v, "gpu_busy") - 0.9).abs() < 0.01, "{v}");
    }
}

/// A 30 ms and a 10 ms kernel, each followed by a sleep 50 µs longer than it runs: the kernels
/// never overlap, and the GPU is busy ~99 % of the loop while the launching thread sleeps.
#[test]
fn kernels_that_keep_the_gpu_busy_are_gpu_bound_by_cupti() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-gpu-cupti");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut r = run_with_cupti(&dir, &lib, &[]);
    let pid = r.pid;
    r.cmd("init");
    let (iterations, _) =
        loop_done(&r.cmd("loop 3000 launch:30000:big_kernel sleep:30050 launch:10000:small_kernel sleep:10050"));
    let cap = r.finish();
    let v = assert_class(&cap, pid, "gpu_bound");
    assert_eq!(v["secondary"], Value::Null, "{v}");
    assert_eq!(v["evidence"]["gpu_busy_source"], "cupti", "{v}");
    let busy = num(v, "gpu_busy");
    assert!((0.7..=1.0).contains(&busy), "{v}");
    assert!(v["hint"].as_str().unwrap().contains("top kernels"), "{v}");
    // Kernels of 30 and 10 ms alternate: their mean is 20 ms, off by at most 10 ms over the
    // number of kernels in the window when it holds one big kernel more or fewer.
    let mean = num(v, "mean_kernel_ns");
    assert!((mean - 20e6).abs() <= 10e6 / (iterations as f64), "{v}");
    // The kernels never overlap, so the busy time is their GPU time: a whole number of them,
    // at most the 2 a loop iteration launched.
    let kernels = busy * window_s(v) * 1e9 / mean;
    assert!(
        kernels <= (2 * iterations) as f64 + 0.5,
        "{kernels} kernels, {iterations} iterations: {v}"
    );
    // The launching thread sleeps.
    assert!(num(v, "launch_thread_cpu") < 0.5, "{v}");
    // Every verdict line at least 2 s long sees the loop: gpu_bound.
    for l in verdict_lines(&cap, pid).iter().filter(|l| window_s(l) >= 2.0) {
        assert_eq!(l["class"], "gpu_bound", "{l}");
    }
}

/// One 1 µs kernel and one stream sync blocking 2 ms (FAKE_CUDA_SYNC_US), over and over: ~450
/// syncs/s, ~95 % of the time blocked, the GPU busy ~0.05 %. A marker launch is sampled before
/// `init` and the loop, so the whole run holds exactly init's 2 calls and the loop's.
#[test]
fn a_sync_after_every_tiny_kernel_is_sync_bound() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-sync");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut r = run_with_cupti(&dir, &lib, &[("FAKE_CUDA_SYNC_US", "2000")]);
    let pid = r.pid;
    r.cmd("burst 1");
    r.wait_line(is_verdict_of(pid), FIRST_VERDICT_WITHIN);
    r.cmd("init");
    let (iterations, elapsed_us) = loop_done(&r.cmd("loop 3000 launch:1 sync"));
    let cap = r.finish();
    let v = assert_class(&cap, pid, "sync_bound");
    // The GPU is idle too: host_bound holds next.
    assert_eq!(v["secondary"], "host_bound", "{v}");
    assert_eq!(v["evidence"]["gpu_busy_source"], "cupti", "{v}");
    // cuInit, cuDevicePrimaryCtxRetain, then a launch and a sync an iteration.
    assert_eq!(v["evidence"]["calls"], 2 * iterations + 2, "{v}");
    let (w, syncs_per_s, blocked) = (window_s(v), num(v, "syncs_per_s"), num(v, "sync_blocked"));
    // Rates are written with one decimal.
    assert!(
        (syncs_per_s * w - iterations as f64).abs() <= 0.05 * w + 0.01,
        "{iterations}: {v}"
    );
    assert!(
        (num(v, "launches_per_s") * w - iterations as f64).abs() <= 0.05 * w + 0.01,
        "{v}"
    );
    // A sync blocks at least 2 ms: at most 500 a second, and each adds 2 ms blocked; all of
    // them at most the loop's time.
    assert!((100.0..=500.0).contains(&syncs_per_s), "{v}");
    assert!(blocked >= 0.3, "{v}");
    assert!(blocked >= (iterations * 2_000_000) as f64 / (w * 1e9) - 1e-4, "{v}");
    assert!(blocked <= elapsed_us as f64 / (w * 1e6) + 1e-4, "{v}");
    // 1 µs kernels, exactly, one an iteration, never overlapping: the busy time is theirs.
    assert_eq!(v["evidence"]["mean_kernel_ns"], 1000, "{v}");
    assert!(
        (num(v, "gpu_busy") - iterations as f64 * 1e3 / (w * 1e9)).abs() <= 1e-4,
        "{v}"
    );
    assert!(num(v, "launch_thread_cpu") < 0.5, "{v}");
    assert!(v["hint"].as_str().unwrap().contains("synchronizations"), "{v}");
}

/// Copies of 1 MiB each way from pageable (malloc) memory at 1000 MB/s (the fake libcuda's
/// FAKE_CUDA_COPY_MB_PER_S: each copy sleeps ~1.05 ms), back to back; NVML says the SMs are 10 %
/// busy. The whole run holds the loop's copies alone: exact counts.
#[test]
fn copies_that_take_most_of_the_time_are_transfer_bound() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-transfer");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = initialized_workload(&lib, &[("FAKE_CUDA_COPY_MB_PER_S", "1000")]);
    let pid = w.pid;
    let agent = nvml_agent(&dir, &[(pid, 10)], true, &lib);
    // The marker: one launch, then two samples before the loop.
    w.cmd("burst 1");
    agent.wait_line(is_verdict_of(pid), FIRST_VERDICT_WITHIN);
    let (iterations, elapsed_us) = loop_done(&w.cmd("loop 2500 htod:1048576 dtoh:1048576"));
    w.exit();
    let cap = agent.finish();
    let v = assert_class(&cap, pid, "transfer_bound");
    // NVML's 10 %: the GPU is idle enough for host_bound to hold next.
    assert_eq!(v["secondary"], "host_bound", "{v}");
    assert_eq!(v["evidence"]["gpu_busy_source"], "nvml", "{v}");
    assert_eq!(num(v, "gpu_busy"), 0.1, "{v}");
    // Exactly the loop's calls: 2 copies an iteration.
    assert_eq!(v["evidence"]["calls"], 2 * iterations, "{v}");
    assert_eq!(num(v, "launches_per_s"), 0.0, "{v}");
    // Each copy takes at least 1 048 576 ns (1 MiB at 1000 MB/s); all of them at most the
    // loop's time.
    let (window_ns, copy) = (window_s(v) * 1e9, num(v, "copy_fraction"));
    assert!(copy >= 0.5, "{v}");
    assert!(copy >= (2 * iterations * 1_048_576) as f64 / window_ns - 1e-4, "{v}");
    assert!(copy <= elapsed_us as f64 * 1e3 / window_ns + 1e-4, "{v}");
    assert!(v["hint"].as_str().unwrap().contains("pinned host memory"), "{v}");
    // The summary's copy counters agree: every byte each way, all pageable.
    let m = &cap.process_summary(pid)["memcpy"];
    for dir in ["cpu_to_gpu", "gpu_to_cpu"] {
        assert_eq!(m[dir]["count"], iterations, "{m}");
        assert_eq!(m[dir]["bytes"], iterations * 1_048_576, "{m}");
    }
    assert_eq!(
        (m["pageable"].as_u64(), m["pinned"].as_u64()),
        (Some(2 * iterations), Some(0)),
        "{m}"
    );
}

/// Host work on other threads (two spinning threads) while the launching thread sleeps 10 ms
/// between tiny launches; NVML says the SMs are 5 % busy.
#[test]
fn a_starved_gpu_beside_a_busy_cpu_is_host_bound_cpu_busy() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-host-cpu");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = initialized_workload(&lib, &[]);
    let pid = w.pid;
    let agent = nvml_agent(&dir, &[(pid, 5)], true, &lib);
    loop_done(&w.cmd("loop 2500 spinners:2 launch:1 sleep:10000"));
    w.exit();
    let cap = agent.finish();
    let v = assert_class(&cap, pid, "host_bound");
    assert_eq!(v["secondary"], Value::Null, "{v}");
    assert_eq!(v["evidence"]["gpu_busy_source"], "nvml", "{v}");
    assert_eq!(num(v, "gpu_busy"), 0.05, "{v}");
    // The process keeps a CPU busy; the launching thread does not.
    assert!(num(v, "process_cpu") >= 0.5, "{v}");
    assert!(num(v, "launch_thread_cpu") < 0.3, "{v}");
    assert!(v["hint"].as_str().unwrap().contains("the GPU waits for the CPU"), "{v}");
}

/// A 100 µs kernel every ~10 ms, the process asleep in between: the GPU busy ~1 %, no CPU.
#[test]
fn a_starved_gpu_beside_an_idle_cpu_is_host_bound_waiting() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-host-wait");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut r = run_with_cupti(&dir, &lib, &[]);
    let pid = r.pid;
    r.cmd("init");
    let (iterations, _) = loop_done(&r.cmd("loop 2500 launch:100 sleep:10000"));
    let cap = r.finish();
    let v = assert_class(&cap, pid, "host_bound");
    assert_eq!(v["secondary"], Value::Null, "{v}");
    assert_eq!(v["evidence"]["gpu_busy_source"], "cupti", "{v}");
    assert_eq!(v["evidence"]["mean_kernel_ns"], 100_000, "{v}");
    // The busy time is the 100 µs kernels': at most one an iteration.
    let busy = num(v, "gpu_busy");
    assert!(busy > 0.0 && busy < 0.3, "{v}");
    assert!(
        busy * window_s(v) <= iterations as f64 * 100e-6 + 1e-4 * window_s(v),
        "{v}"
    );
    assert!(num(v, "process_cpu") < 0.3, "{v}");
    assert!(num(v, "launch_thread_cpu") < 0.3, "{v}");
}

/// One call, then none: every window since the process was first sampled is idle, and so is
/// the whole run.
#[test]
fn a_process_that_stops_calling_is_idle() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-idle");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = Workload::start();
    w.cmd(&format!("load {}", lib.display()));
    let pid = w.pid;
    let agent = Agent::start(&dir, &["--pid", &pid.to_string(), "--interval-ms", "100", "--no-nvml"]);
    agent.wait_stderr("attached", Duration::from_secs(10));
    w.cmd("burst 1");
    let first = agent.wait_line(is_verdict_of(pid), FIRST_VERDICT_WITHIN);
    assert_eq!(first["class"], "idle", "{first}");
    w.cmd("sleep 500");
    w.exit();
    let cap = agent.finish();
    let v = assert_class(&cap, pid, "idle");
    for l in verdict_lines(&cap, pid).into_iter().chain([v]) {
        assert_eq!(l["class"], "idle", "{l}");
        assert_eq!(l["secondary"], Value::Null, "{l}");
        assert_eq!(l["evidence"]["calls"], 0, "{l}");
        assert_eq!(l["evidence"]["gpu_busy"], Value::Null, "{l}");
        assert_eq!(l["evidence"]["gpu_busy_source"], Value::Null, "{l}");
        assert_eq!(l["hint"], "no CUDA work in the window", "{l}");
    }
    assert!(window_s(v) >= 0.4, "{v}");
}

/// Processes that make ~1000 tiny launches a second for 2 s, observed at once (no `--pid`),
/// each with its NVML SM utilization (`cases`: SM %, class): the last verdict line and the
/// whole run of each have the class, the busy fraction is NVML's and nothing else holds.
fn nvml_busy_cases(name: &str, cases: &[(u32, &str)]) {
    let dir = scratch(name);
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut ws: Vec<Workload> = cases.iter().map(|_| initialized_workload(&lib, &[])).collect();
    let procs: Vec<(u32, u32)> = ws.iter().zip(cases).map(|(w, (sm, _))| (w.pid, *sm)).collect();
    let agent = nvml_agent(&dir, &procs, false, &lib);
    std::thread::scope(|s| {
        for w in ws.iter_mut() {
            s.spawn(move || loop_done(&w.cmd("loop 2000 launch:1 sleep:1000")));
        }
    });
    for w in ws {
        w.exit();
    }
    let cap = agent.stop();
    for ((pid, sm), (_, class)) in procs.into_iter().zip(cases) {
        let v = assert_class(&cap, pid, class);
        assert_eq!(v["evidence"]["gpu_busy_source"], "nvml", "{v}");
        assert_eq!(num(v, "gpu_busy"), f64::from(sm) / 100.0, "{sm} %: {v}");
        assert_eq!(v["secondary"], Value::Null, "{sm} %: {v}");
    }
}

/// Just past each busy threshold of the table: 71 % is gpu_bound, 69 % and 31 % are mixed (no
/// rule holds: nothing else goes on), 29 % is host_bound.
#[test]
fn nvml_busy_just_past_each_threshold() {
    let _g = serial();
    require_root();
    nvml_busy_cases(
        "verdict-past-bounds",
        &[(71, "gpu_bound"), (69, "mixed"), (31, "mixed"), (29, "host_bound")],
    );
}

/// Exactly on the thresholds: gpu_bound holds at 70 % busy, host_bound no longer at 30 %.
///
/// Fails today: analyze/window.rs turns NVML's mean percentage into busy nanoseconds with a
/// truncating cast (`(pct / 100.0 * window_ns as f64) as u64`), so unless the window's length
/// in ns is a multiple of 10 the busy fraction comes out a hair under 0.70 (judged `mixed`) or
/// under 0.30 (judged `host_bound`), while the line still says `"gpu_busy":0.7` / `0.3`.
#[test]
#[ignore = "analyze/window.rs truncates NVML busy time: 70 % is judged mixed, 30 % host_bound"]
fn nvml_busy_exactly_on_each_threshold() {
    let _g = serial();
    require_root();
    nvml_busy_cases("verdict-on-bounds", &[(70, "gpu_bound"), (30, "mixed")]);
}
