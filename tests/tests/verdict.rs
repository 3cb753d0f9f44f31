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
//! union of the intervals, exact); without CUPTI from the fake NVML: the device's utilization
//! (FAKE_NVML_GPU_UTIL) when the process is alone on it (`nvml_device`), else the process's SM
//! utilization from FAKE_NVML_PROCS (`nvml`); both scripted, the same at every sample.

use std::{path::Path, time::Duration};

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

/// A pid the fake NVML lists on device 0 beside a test's processes, so that none of them has the
/// device to itself: the busy fraction is then NVML's per-process SM utilization (`nvml`).
/// A process alone on its device is judged by the device's utilization (`nvml_device`).
const SHARER: u32 = 1;

/// The agent with the fake NVML listing `procs` (pid, device, SM %) and each device's GPU
/// utilization scripted by `gpu_util` (FAKE_NVML_GPU_UTIL, "" for the fake's formula); `--pid`
/// `follow`, else every process (the fake libcuda `lib` attached up front).
fn nvml_agent(dir: &Path, procs: &[(u32, u32, u32)], gpu_util: &str, follow: Option<u32>, lib: &Path) -> Agent {
    let file = dir.join("procs.txt");
    let rows: String = procs
        .iter()
        .map(|(pid, dev, sm)| format!("{pid} {dev} 1048576 {sm}\n"))
        .collect();
    std::fs::write(&file, rows).unwrap();
    let nvml = fixtures().join("nvml/libnvidia-ml.so.1");
    let pid = follow.map(|p| p.to_string()).unwrap_or_default();
    let mut args = vec![
        "--interval-ms",
        "100",
        "--nvml-lib",
        nvml.to_str().unwrap(),
        "--nvml-interval-ms",
        "50",
    ];
    if follow.is_some() {
        args.extend(["--pid", &pid]);
    } else {
        args.extend(["--libcuda", lib.to_str().unwrap()]);
    }
    let agent = Agent::start_with_env(
        dir,
        &args,
        &[
            ("FAKE_NVML_PROCS", file.to_str().unwrap()),
            ("FAKE_NVML_GPU_UTIL", gpu_util),
        ],
    );
    if let Some(pid) = follow {
        agent.wait_stderr("attached", Duration::from_secs(10));
        // NVML lists the process before its first observed call: a window whose first sample
        // has no listing cannot tell it was alone on its GPU, and is judged by the process's
        // own SM samples for as long as that sample starts its windows (the whole run here).
        agent.wait_line(
            |l| l["type"] == "nvml" && l["scope"] == "process" && l["pid"] == pid,
            Duration::from_secs(20),
        );
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

/// The evidence's copies in one direction: (count, bytes, GB/s).
fn copies(v: &Value, dir: &str) -> (u64, u64, Option<f64>) {
    let c = &v["evidence"]["copies"][dir];
    (
        c["count"].as_u64().unwrap_or_else(|| panic!("no copies.{dir}: {v}")),
        c["bytes"].as_u64().unwrap(),
        c["gb_per_s"].as_f64(),
    )
}

/// The evidence's top kernels: (name, count, GPU ns), each exact.
fn top_kernels(v: &Value) -> Vec<(String, u64, u64)> {
    v["evidence"]["top_kernels"]
        .as_array()
        .unwrap_or_else(|| panic!("no top_kernels: {v}"))
        .iter()
        .map(|k| {
            assert_eq!(k["exact"], true, "{v}");
            (
                k["name"].as_str().unwrap().to_string(),
                k["count"].as_u64().unwrap(),
                k["gpu_ns"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// What every verdict says whatever its class: the idle fraction is the busy one's complement,
/// the call rate is the calls over the window, and the host is CPU-busy from half a core.
fn assert_consistent(v: &Value) {
    let e = &v["evidence"];
    match e["gpu_busy"].as_f64() {
        Some(busy) => assert!((num(v, "gpu_idle") - (1.0 - busy)).abs() <= 1e-4, "{v}"),
        None => assert_eq!(e["gpu_idle"], Value::Null, "{v}"),
    }
    let calls = e["calls"].as_u64().unwrap() as f64;
    assert!(
        (num(v, "calls_per_s") * window_s(v) - calls).abs() <= 0.05 * window_s(v) + 1e-6,
        "{v}"
    );
    let host = if num(v, "process_cpu") >= 0.5 {
        "cpu_busy"
    } else {
        "waiting"
    };
    assert_eq!(e["host"], host, "{v}");
}

/// Runs the workload's main thread at nice -10. The launch rule reads the launching thread's
/// CPU time over the wall time; the scenario is a thread saturated by its own launches, and
/// on a loaded 2-core machine one at nice 0 gets ~40 % of a core (seen with two other
/// CPU-bound processes), which is a starved thread, not a launch-bound one.
fn favour(pid: u32) {
    // SAFETY: setpriority has no memory arguments; `pid` is our child's thread id (the main
    // thread's id is the process id).
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, pid, -10) };
    assert_eq!(rc, 0, "setpriority({pid}): {}", std::io::Error::last_os_error());
}

#[test]
fn a_tight_launch_loop_of_tiny_kernels_is_launch_bound() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-launch");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    // 200 µs of CPU a launch: ~5000 launches/s from one saturated thread (few enough that the
    // agent, on the same 2 cores, leaves that thread its core).
    let mut r = RunAgent::with_cupti(&dir, &lib, &[("FAKE_CUDA_LAUNCH_SPIN_NS", "200000")]);
    let pid = r.pid;
    r.cmd("init");
    favour(pid);
    // ~1 µs kernels (the fake CUPTI's: 1 µs per grid block), as fast as one thread launches
    // them: ~6 s, many ticks. (The whole run's thread CPU comes out up to ~0.35 s short: the
    // CPU time of a sample is read at its tick, up to a snapshot interval after the sample's
    // time, and an exited process keeps its last reading; 6 s keeps that under 6 %.)
    r.cmd("burst 30000");
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
    let v = &cap.process_summary(pid)["verdict"];
    assert_eq!(v["class"], "launch_bound", "{v}");
    assert_consistent(v);
    // The GPU idles: host_bound holds next; the host is busy launching.
    assert_eq!(v["secondary"], "host_bound", "{v}");
    assert_eq!(v["evidence"]["host"], "cpu_busy", "{v}");
    // Every kernel is the unnamed 1 µs one.
    let top = top_kernels(v);
    assert_eq!(top.len(), 1, "{v}");
    assert_eq!(top[0].0, "fake_kernel", "{v}");
    assert_eq!(top[0].2, top[0].1 * 1000, "{v}");
    assert!(top[0].1 <= 30_000, "{v}");
    assert_eq!(v["evidence"]["mean_kernel_ns"], 1000, "{v}");
}

/// The same tight loop without CUPTI, the process alone on a GPU that NVML says is 5 % busy:
/// the GPU busy time per launch stands in for the kernel time.
#[test]
fn without_cupti_a_tight_launch_loop_on_an_idle_gpu_is_launch_bound_by_busy_time_per_launch() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-launch-nvml");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = initialized_workload(&lib, &[("FAKE_CUDA_LAUNCH_SPIN_NS", "200000")]);
    let pid = w.pid;
    favour(pid);
    let agent = nvml_agent(&dir, &[(pid, 0, 50)], "5", Some(pid), &lib);
    w.cmd("burst 30000");
    w.exit();
    let cap = agent.finish();
    let v = assert_class(&cap, pid, "launch_bound");
    assert_consistent(v);
    assert_eq!(v["secondary"], "host_bound", "{v}");
    // The device's utilization, not the process's 50 % SM samples: it has the GPU to itself.
    assert_eq!(v["evidence"]["gpu_busy_source"], "nvml_device", "{v}");
    assert_eq!(num(v, "gpu_busy"), 0.05, "{v}");
    assert_eq!(v["evidence"]["mean_kernel_ns"], Value::Null, "{v}");
    assert!(num(v, "launch_thread_cpu") >= 0.8, "{v}");
    let (per_launch, interval) = (num(v, "busy_ns_per_launch"), num(v, "mean_launch_interval_ns"));
    assert!(per_launch < interval, "{v}");
    // 5 % of the time between launches.
    assert!((per_launch - 0.05 * interval).abs() <= 1.0, "{v}");
    assert_eq!(v["evidence"]["top_kernels"], serde_json::json!([]), "{v}");
}

/// A tight launch loop on a GPU that NVML says this process keeps 90 % busy (its per-process SM
/// samples: another process shares the device) is gpu_bound.
#[test]
fn without_cupti_nvml_says_how_busy_the_gpu_is_and_a_busy_gpu_is_gpu_bound() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-nvml");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = initialized_workload(&lib, &[("FAKE_CUDA_LAUNCH_SPIN_NS", "50000")]);
    let pid = w.pid;
    let agent = nvml_agent(&dir, &[(pid, 0, 90), (SHARER, 0, 0)], "", Some(pid), &lib);
    w.cmd("burst 60000");
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
    let v = assert_class(&cap, pid, "gpu_bound");
    assert_consistent(v);
    assert_eq!(v["evidence"]["gpu_busy_source"], "nvml", "{v}");
    assert_eq!(num(v, "gpu_busy"), 0.9, "{v}");
    assert_eq!(v["secondary"], Value::Null, "{v}");
}

/// A 30 ms and a 10 ms kernel, each followed by a sleep 50 µs longer than it runs: the kernels
/// never overlap, and the GPU is busy ~99 % of the loop while the launching thread sleeps.
#[test]
fn kernels_that_keep_the_gpu_busy_are_gpu_bound_by_cupti() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-gpu-cupti");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut r = RunAgent::with_cupti(&dir, &lib, &[]);
    let pid = r.pid;
    r.cmd("init");
    let (iterations, _) =
        loop_done(&r.cmd("loop 3000 launch:30000:big_kernel sleep:30050 launch:10000:small_kernel sleep:10050"));
    let cap = r.finish();
    let v = assert_class(&cap, pid, "gpu_bound");
    assert_consistent(v);
    assert_eq!(v["secondary"], Value::Null, "{v}");
    assert_eq!(v["evidence"]["gpu_busy_source"], "cupti", "{v}");
    let busy = num(v, "gpu_busy");
    assert!((0.7..=1.0).contains(&busy), "{v}");
    assert!(v["hint"].as_str().unwrap().contains("top kernels"), "{v}");
    // The top kernels, by GPU time: every run of each took exactly its 30 or 10 ms; they
    // alternate, so the window holds as many of each, give or take one, and at most a pass's.
    let top = top_kernels(v);
    assert_eq!(top.len(), 2, "{v}");
    let ((big, nb, big_ns), (small, ns, small_ns)) = (&top[0], &top[1]);
    assert_eq!((big.as_str(), small.as_str()), ("big_kernel", "small_kernel"), "{v}");
    assert_eq!((*big_ns, *small_ns), (nb * 30_000_000, ns * 10_000_000), "{v}");
    assert!(
        nb.abs_diff(*ns) <= 1 && *nb <= iterations && *ns <= iterations,
        "{iterations}: {v}"
    );
    // Their mean, and — as they never overlap — the busy time is their GPU time.
    let gpu_ns = (big_ns + small_ns) as f64;
    assert!(
        (num(v, "mean_kernel_ns") - gpu_ns / (nb + ns) as f64).abs() <= 0.5,
        "{v}"
    );
    assert!((busy - gpu_ns / (window_s(v) * 1e9)).abs() <= 1e-4, "{v}");
    // The launching thread sleeps: the host waits.
    assert!(num(v, "launch_thread_cpu") < 0.5, "{v}");
    assert_eq!(v["evidence"]["host"], "waiting", "{v}");
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
    let mut r = RunAgent::with_cupti(&dir, &lib, &[("FAKE_CUDA_SYNC_US", "2000")]);
    let pid = r.pid;
    r.cmd("burst 1");
    r.wait_line(is_verdict_of(pid), FIRST_VERDICT_WITHIN);
    r.cmd("init");
    let (iterations, elapsed_us) = loop_done(&r.cmd("loop 3000 launch:1 sync"));
    let cap = r.finish();
    let v = assert_class(&cap, pid, "sync_bound");
    assert_consistent(v);
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
    assert_eq!(
        top_kernels(v),
        [("fake_kernel".to_string(), iterations, iterations * 1000)],
        "{v}"
    );
    assert!(
        (num(v, "gpu_busy") - iterations as f64 * 1e3 / (w * 1e9)).abs() <= 1e-4,
        "{v}"
    );
    assert!(num(v, "launch_thread_cpu") < 0.5, "{v}");
    assert_eq!(v["evidence"]["host"], "waiting", "{v}");
    assert!(v["hint"].as_str().unwrap().contains("synchronizations"), "{v}");
}

/// Copies of 1 MiB each way from pageable (malloc) memory at 1000 MB/s (the fake libcuda's
/// FAKE_CUDA_COPY_MB_PER_S: each copy sleeps ~1.05 ms), back to back, the process alone on a GPU
/// NVML says is 10 % busy, on a PCIe 5.0 x16 link. The whole run holds the loop's copies alone:
/// exact counts.
#[test]
fn copies_that_take_most_of_the_time_are_transfer_bound() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-transfer");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = initialized_workload(&lib, &[("FAKE_CUDA_COPY_MB_PER_S", "1000")]);
    let pid = w.pid;
    let agent = nvml_agent(&dir, &[(pid, 0, 50)], "10", Some(pid), &lib);
    // The marker: one launch, then two samples before the loop.
    w.cmd("burst 1");
    agent.wait_line(is_verdict_of(pid), FIRST_VERDICT_WITHIN);
    let (iterations, elapsed_us) = loop_done(&w.cmd("loop 2500 htod:1048576 dtoh:1048576"));
    w.exit();
    let cap = agent.finish();
    let v = assert_class(&cap, pid, "transfer_bound");
    assert_consistent(v);
    // NVML's 10 %: the GPU is idle enough for host_bound to hold next; the host waits.
    assert_eq!(v["secondary"], "host_bound", "{v}");
    assert_eq!(v["evidence"]["gpu_busy_source"], "nvml_device", "{v}");
    assert_eq!(num(v, "gpu_busy"), 0.1, "{v}");
    assert_eq!(v["evidence"]["host"], "waiting", "{v}");
    // Exactly the loop's calls: 2 copies an iteration, 1 MiB each way, all pageable.
    assert_eq!(v["evidence"]["calls"], 2 * iterations, "{v}");
    assert_eq!(num(v, "launches_per_s"), 0.0, "{v}");
    let (up, down) = (copies(v, "cpu_to_gpu"), copies(v, "gpu_to_cpu"));
    assert_eq!((up.0, up.1), (iterations, iterations * 1_048_576), "{v}");
    assert_eq!((down.0, down.1), (iterations, iterations * 1_048_576), "{v}");
    for dir in ["gpu_to_gpu", "unknown"] {
        assert_eq!(copies(v, dir), (0, 0, None), "{v}");
    }
    assert_eq!(num(v, "pageable_share"), 1.0, "{v}");
    // Each copy sleeps at least its bytes' time at 1 GB/s: at most 1 GB/s achieved each way.
    for (_, _, rate) in [up, down] {
        let rate = rate.unwrap_or_else(|| panic!("no rate: {v}"));
        assert!(rate > 0.25 && rate <= 1.0005, "{v}");
    }
    // PCIe 5.0 x16: 32 GT/s × 16 lanes × 128/130, in bytes.
    assert_eq!(num(v, "link_gb_per_s"), 63.015, "{v}");
    // The copies' time: at least their nominal time, at most the loop's.
    let (window_ns, copy) = (window_s(v) * 1e9, num(v, "copy_fraction"));
    assert!(copy >= 0.5, "{v}");
    assert!(copy >= (2 * iterations * 1_048_576) as f64 / window_ns - 1e-4, "{v}");
    assert!(copy <= elapsed_us as f64 * 1e3 / window_ns + 1e-4, "{v}");
    assert!(v["hint"].as_str().unwrap().contains("pinned host memory"), "{v}");
    // The summary's copy counters agree.
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
/// between tiny launches, alone on a GPU NVML says is 5 % busy.
#[test]
fn a_starved_gpu_beside_a_busy_cpu_is_host_bound_cpu_busy() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-host-cpu");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = initialized_workload(&lib, &[]);
    let pid = w.pid;
    let agent = nvml_agent(&dir, &[(pid, 0, 50)], "5", Some(pid), &lib);
    loop_done(&w.cmd("loop 2500 spinners:2 launch:1 sleep:10000"));
    w.exit();
    let cap = agent.finish();
    let v = assert_class(&cap, pid, "host_bound");
    assert_consistent(v);
    assert_eq!(v["secondary"], Value::Null, "{v}");
    assert_eq!(v["evidence"]["gpu_busy_source"], "nvml_device", "{v}");
    assert_eq!(num(v, "gpu_busy"), 0.05, "{v}");
    // The process keeps a CPU busy; the launching thread does not.
    assert_eq!(v["evidence"]["host"], "cpu_busy", "{v}");
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
    let mut r = RunAgent::with_cupti(&dir, &lib, &[]);
    let pid = r.pid;
    r.cmd("init");
    let (iterations, _) = loop_done(&r.cmd("loop 2500 launch:100 sleep:10000"));
    let cap = r.finish();
    let v = assert_class(&cap, pid, "host_bound");
    assert_consistent(v);
    assert_eq!(v["secondary"], Value::Null, "{v}");
    assert_eq!(v["evidence"]["gpu_busy_source"], "cupti", "{v}");
    assert_eq!(v["evidence"]["host"], "waiting", "{v}");
    assert!(num(v, "process_cpu") < 0.3, "{v}");
    assert!(num(v, "launch_thread_cpu") < 0.3, "{v}");
    // The busy time is the 100 µs kernels': at most one an iteration, never overlapping.
    assert_eq!(v["evidence"]["mean_kernel_ns"], 100_000, "{v}");
    let top = top_kernels(v);
    assert_eq!(top.len(), 1, "{v}");
    let (name, count, gpu_ns) = &top[0];
    assert_eq!((name.as_str(), *gpu_ns), ("fake_kernel", count * 100_000), "{v}");
    assert!(*count <= iterations, "{iterations}: {v}");
    let busy = num(v, "gpu_busy");
    assert!(busy > 0.0 && busy < 0.3, "{v}");
    assert!((busy - *gpu_ns as f64 / (window_s(v) * 1e9)).abs() <= 1e-4, "{v}");
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
        assert_consistent(l);
        assert_eq!(l["class"], "idle", "{l}");
        assert_eq!(l["secondary"], Value::Null, "{l}");
        let e = &l["evidence"];
        assert_eq!((&e["calls"], &e["calls_per_s"]), (&0.into(), &0.0.into()), "{l}");
        assert_eq!((&e["gpu_busy"], &e["gpu_idle"]), (&Value::Null, &Value::Null), "{l}");
        assert_eq!(e["gpu_busy_source"], Value::Null, "{l}");
        assert_eq!(e["host"], "waiting", "{l}");
        assert_eq!(
            (&e["pageable_share"], &e["link_gb_per_s"]),
            (&Value::Null, &Value::Null),
            "{l}"
        );
        assert_eq!(e["top_kernels"], serde_json::json!([]), "{l}");
        assert_eq!(l["hint"], "no CUDA work in the window", "{l}");
    }
    assert!(window_s(v) >= 0.4, "{v}");
}

/// Processes that make ~1000 tiny launches a second for 2 s, observed at once (no `--pid`),
/// sharing device 0, each with its NVML SM utilization (`cases`: SM %, class): the last verdict
/// line and the whole run of each have the class, the busy fraction is NVML's per-process one
/// and nothing else holds.
fn nvml_busy_cases(name: &str, cases: &[(u32, &str)]) {
    let dir = scratch(name);
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut ws: Vec<Workload> = cases.iter().map(|_| initialized_workload(&lib, &[])).collect();
    let procs: Vec<(u32, u32, u32)> = ws.iter().zip(cases).map(|(w, (sm, _))| (w.pid, 0, *sm)).collect();
    let agent = nvml_agent(&dir, &procs, "", None, &lib);
    std::thread::scope(|s| {
        for w in ws.iter_mut() {
            s.spawn(move || loop_done(&w.cmd("loop 2000 launch:1 sleep:1000")));
        }
    });
    for w in ws {
        w.exit();
    }
    let cap = agent.stop();
    for ((pid, _, sm), (_, class)) in procs.into_iter().zip(cases) {
        let v = assert_class(&cap, pid, class);
        assert_consistent(v);
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
/// Exactly on the thresholds: 70 % is gpu_bound, 30 % is no longer host_bound (the busy fraction
/// stays NVML's percent / 100, not a round trip through nanoseconds that came out a hair under).
#[test]
fn nvml_busy_exactly_on_each_threshold() {
    let _g = serial();
    require_root();
    nvml_busy_cases("verdict-on-bounds", &[(70, "gpu_bound"), (30, "mixed")]);
}

/// Issue 14: a verdict's evidence names the anomalies of its window. One planted 20 µs run
/// among steady 2 µs kernels of the same name and shape (the fake CUPTI slowed 10× for one
/// launch, as in tests/tests/anomaly.rs), then kernels that keep the GPU busy, so the class
/// changes and a verdict line is written whose window holds the planted one (lines are
/// written once a window, or when the class changes). A marker call is sampled first, so the
/// first line's window ends before the loops and the whole run holds them all.
#[test]
fn a_verdict_counts_the_anomalies_of_its_window_and_names_the_most_severe() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-anomaly");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut r = RunAgent::with_cupti(&dir, &lib, &[]);
    let pid = r.pid;
    // Before `init`: no CUPTI yet, no kernel record.
    r.cmd("burst 1");
    r.wait_line(is_verdict_of(pid), FIRST_VERDICT_WITHIN);
    r.cmd("init");
    let (before, _) = loop_done(&r.cmd("loop 300 launch:2:steady_kernel sleep:200"));
    assert!(before >= 64, "{before} passes: too few to warm up");
    r.cmd("cupti_slowdown 10");
    loop_done(&r.cmd("loop 0 launch:2:steady_kernel"));
    r.cmd("cupti_slowdown 1");
    loop_done(&r.cmd("loop 3000 launch:30000:big_kernel sleep:30050"));
    let cap = r.finish();
    let anomalies: Vec<&Value> = cap.of_type("anomaly").filter(|a| a["pid"] == pid).collect();
    assert_eq!(anomalies.len(), 1, "{anomalies:?}");
    let planted = anomalies[0];
    // What the evidence says of it: the anomaly line's own fields, and when it ran.
    let worst = |v: &Value| {
        let w = &v["evidence"]["worst_anomaly"];
        for key in [
            "what",
            "key",
            "grid",
            "block",
            "observed",
            "typical",
            "unit",
            "deviation",
        ] {
            assert_eq!(w[key], planted[key], "{key}: {v}");
        }
        assert_eq!(w["ts_ns"], planted["ts_ns"], "{v}");
    };
    assert_eq!(planted["key"], "steady_kernel", "{planted}");
    assert_eq!(planted["observed"].as_f64(), Some(20_000.0), "{planted}");
    let lines = verdict_lines(&cap, pid);
    // The first window ended before the loops.
    assert_eq!(lines[0]["evidence"]["anomalies"], 0, "{}", lines[0]);
    assert_eq!(lines[0]["evidence"]["worst_anomaly"], Value::Null, "{}", lines[0]);
    // Every later window began at the first sample (less than 10 s was seen): once the
    // planted kernel's record was in, each holds it — the line that turned gpu_bound too, and
    // the last. The class is the kernels' (evidence only).
    let mut seen = 0;
    for l in &lines {
        let n = l["evidence"]["anomalies"].as_u64().unwrap();
        assert!(n == seen || (seen, n) == (0, 1), "{n} after {seen}: {l}");
        match n {
            0 => assert_eq!(l["evidence"]["worst_anomaly"], Value::Null, "{l}"),
            _ => worst(l),
        }
        seen = n;
    }
    assert_eq!(seen, 1, "{lines:#?}");
    assert!(
        lines
            .iter()
            .any(|l| l["class"] == "gpu_bound" && l["evidence"]["anomalies"] == 1),
        "{lines:#?}"
    );
    let whole = assert_class(&cap, pid, "gpu_bound");
    assert_eq!(whole["evidence"]["anomalies"], 1, "{whole}");
    worst(whole);
}
