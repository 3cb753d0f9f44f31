//! Issue 4 end to end: the CUPTI injection library loaded by the (fake) driver at cuInit, fake
//! CUPTI records with known correlation ids and timestamps, the hooks probed by real eBPF
//! programs, the agent's join — exact values.

use std::{
    collections::{BTreeMap, HashMap},
    process::Command,
    time::{Duration, Instant},
};

use gpu_observer_common::cupti;
use gpu_observer_tests::*;
use serde_json::Value;

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn by_type<'a>(cap: &'a Captured, ty: &'a str, pid: u32) -> Vec<&'a Value> {
    cap.of_type(ty).filter(|e| e["pid"] == pid).collect()
}

/// Every GPU line joined to exactly the uprobe event of its call, with the fake's timings.
fn assert_joined(cap: &Captured, pid: u32) {
    let calls: HashMap<(u64, u64), &Value> = cap
        .events
        .iter()
        .filter(|e| e["pid"] == pid && matches!(e["type"].as_str(), Some("launch" | "memcpy" | "memset")))
        .map(|e| ((e["tid"].as_u64().unwrap(), e["ts_ns"].as_u64().unwrap()), e))
        .collect();
    let mut claimed: BTreeMap<(u64, u64), usize> = BTreeMap::new();
    let mut corr_ids = BTreeMap::new();
    for g in cap
        .events
        .iter()
        .filter(|e| e["pid"] == pid && e["type"].as_str().is_some_and(|t| t.starts_with("gpu_")))
    {
        let key = (g["tid"].as_u64().unwrap(), g["launch_ts_ns"].as_u64().expect("joined"));
        let call = calls.get(&key).unwrap_or_else(|| panic!("{g} joined to no call"));
        *claimed.entry(key).or_default() += 1;
        *corr_ids.entry(g["correlation_id"].as_u64().unwrap()).or_insert(0) += 1;
        assert_eq!(g["api"], call["api"], "{g}");
        let (start, end) = (g["gpu_start_ns"].as_u64().unwrap(), g["gpu_end_ns"].as_u64().unwrap());
        let api_start = g["cupti_api_start_ns"].as_u64().unwrap();
        let api_end = g["cupti_api_end_ns"].as_u64().unwrap();
        // The fake stamps its API record inside the call, after the uprobe's entry.
        assert!(api_start >= key.1 && api_start - key.1 < 5_000_000, "{g}");
        assert_eq!(g["queue_delay_ns"].as_u64(), Some(start - key.1), "{g}");
        assert_eq!(g["gpu_duration_ns"].as_u64(), Some(end - start));
        match g["type"].as_str().unwrap() {
            "gpu_kernel" if g["graph_id"].is_null() => {
                // Fake timing: 1 µs after the call returned, 1 µs per block in x.
                assert_eq!(start, api_end + 1000, "{g}");
                assert_eq!(end - start, 1000 * call["grid"][0].as_u64().unwrap(), "{g}");
                assert_eq!((&g["grid"], &g["block"]), (&call["grid"], &call["block"]), "{g}");
                assert_eq!(g["dynamic_shared_mem_bytes"], call["shared_mem_bytes"], "{g}");
                assert_eq!(
                    (
                        g["registers_per_thread"].as_u64(),
                        g["static_shared_mem_bytes"].as_u64()
                    ),
                    (Some(32), Some(256))
                );
                let occ = g["occupancy"].as_f64().expect("occupancy from the device attributes");
                assert!(occ > 0.0 && occ <= 1.0, "{g}");
                assert_eq!(g["attributes"]["gpu.backend"], "cuda");
                assert_eq!(g["attributes"]["gpu.cuda.sm_count"], 132);
                assert_eq!(g["attributes"]["gpu.kernel"], g["kernel"]);
            }
            "gpu_kernel" => {
                assert_eq!((g["graph_id"].as_u64(), end - start), (Some(42), 2000), "{g}");
                assert!(g["kernel"].as_str().unwrap().starts_with("graph_kernel_"), "{g}");
            }
            "gpu_memcpy" => {
                assert_eq!(g["bytes"], call["bytes"], "{g}");
                let want = match call["direction"].as_str().unwrap() {
                    _ if call["api"].as_str().unwrap().starts_with("cuMemcpyPeer") => "ptop",
                    _ if call["api"].as_str().unwrap().contains("HtoD") => "htod",
                    _ if call["api"].as_str().unwrap().contains("DtoH") => "dtoh",
                    _ if call["api"].as_str().unwrap().contains("DtoD") => "dtod",
                    _ => "unknown",
                };
                assert_eq!(g["copy_kind"], want, "{g}");
                assert_eq!(g["attributes"]["gpu_transfer.bytes"], call["bytes"]);
            }
            "gpu_memset" => assert_eq!(g["bytes"], call["bytes"], "{g}"),
            other => panic!("unexpected {other}"),
        }
    }
    // Every GPU-work call got its record(s): one each, three per graph launch.
    for (key, call) in &calls {
        let want = if call["api"].as_str().unwrap().starts_with("cuGraphLaunch") {
            3
        } else {
            1
        };
        assert_eq!(claimed.get(key).copied().unwrap_or(0), want, "{call}");
    }
    assert!(
        corr_ids.values().all(|&n| n == 1 || n == 3),
        "correlation ids are per call"
    );
}

#[test]
fn cupti_records_join_their_launches_with_exact_gpu_times() {
    join_test(&[]);
}

/// A CUPTI without per-API switches: whole DRIVER/RUNTIME kinds, the same join.
#[test]
fn the_join_also_works_with_whole_api_kinds() {
    join_test(&[("FAKE_CUPTI_NO_API_FILTER", "1")]);
}

fn join_test(env: &[(&'static str, &'static str)]) {
    let _g = serial();
    require_root();
    let dir = scratch("cupti-join");
    let mut w = Workload::with_cupti(&dir, env);
    let agent = Agent::start(&dir, &["--pid", &w.pid.to_string()]);
    agent.wait_stderr("attached", Duration::from_secs(10));
    // cuInit loads the injection library; the agent finds it and probes its hooks.
    w.cmd("init");
    agent.wait_stderr("CUPTI active", Duration::from_secs(10));
    let exp = dir.join("expected.jsonl");
    w.cmd(&format!("run 2 2 {}", exp.display()));
    let stats = cupti_stats(&mut w);
    if env.is_empty() {
        assert_eq!(stats["enabled_kinds"], serde_json::json!([1, 2, 10, 12]), "{stats}");
        assert_eq!(stats["driver_apis"].as_u64(), Some(cupti::DRIVER_CBIDS.len() as u64));
        assert_eq!(stats["runtime_apis"].as_u64(), Some(cupti::RUNTIME_CBIDS.len() as u64));
    } else {
        assert_eq!(
            stats["enabled_kinds"],
            serde_json::json!([1, 2, 4, 5, 10, 12]),
            "{stats}"
        );
        assert_eq!(
            (stats["driver_apis"].as_u64(), stats["runtime_apis"].as_u64()),
            (Some(0), Some(0))
        );
    }
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let launches = by_type(&cap, "launch", pid);
    assert!(!launches.is_empty());
    assert_joined(&cap, pid);
    let s = cap.process_summary(pid);
    let c = &s["cupti"];
    assert_eq!(c["state"], "active", "{s}");
    let gpu_lines = cap
        .events
        .iter()
        .filter(|e| e["pid"] == pid && e["type"].as_str().is_some_and(|t| t.starts_with("gpu_")))
        .count() as u64;
    assert_eq!(c["joined"].as_u64(), Some(gpu_lines));
    assert_eq!(
        (c["unjoined"].as_u64(), c["api_unmatched"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(c["cupti_dropped"], 0);
    let active = cap.of_type("cupti").find(|e| e["pid"] == pid).expect("cupti line");
    assert_eq!(active["state"], "active");
}

#[test]
fn without_an_observer_the_injection_library_collects_nothing() {
    let _g = serial();
    require_root();
    let dir = scratch("cupti-gate");
    let mut w = Workload::with_cupti(&dir, &[]);
    w.cmd("init");
    let exp = dir.join("before.jsonl");
    w.cmd(&format!("run 1 1 {}", exp.display()));
    std::thread::sleep(Duration::from_millis(300));
    let idle = cupti_stats(&mut w);
    assert_eq!(
        (idle["enable_calls"].as_u64(), idle["records"].as_u64()),
        (Some(0), Some(0)),
        "{idle}"
    );
    assert_eq!(idle["timestamp_callback"], true, "clock registered at init: {idle}");
    assert_eq!(idle["thread_id_type"], 1);

    // An observer attaches: the kernel raises the semaphore, the library enables CUPTI.
    let agent = Agent::start(&dir, &["--pid", &w.pid.to_string()]);
    agent.wait_stderr("CUPTI active", Duration::from_secs(10));
    let on = cupti_stats(&mut w);
    assert_eq!(on["enabled_kinds"], serde_json::json!([1, 2, 10, 12]), "{on}");
    assert_eq!(
        on["driver_apis"].as_u64(),
        Some(cupti::DRIVER_CBIDS.len() as u64),
        "{on}"
    );

    // It goes: back to nothing.
    let cap = agent.stop();
    assert!(cap.status.success());
    wait_for("CUPTI disabled", Duration::from_secs(3), || {
        let s = cupti_stats(&mut w);
        s["enabled_kinds"] == serde_json::json!([]) && s["driver_apis"] == 0
    });
    let off = cupti_stats(&mut w);
    assert_eq!(off["disable_calls"].as_u64(), Some(4), "{off}");
    assert_eq!(
        (off["driver_apis"].as_u64(), off["runtime_apis"].as_u64()),
        (Some(0), Some(0)),
        "{off}"
    );
    let records = off["records"].as_u64().unwrap();
    w.cmd(&format!("run 1 1 {}", dir.join("after.jsonl").display()));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        cupti_stats(&mut w)["records"].as_u64(),
        Some(records),
        "nothing recorded unobserved"
    );
    w.exit();
}

#[test]
fn cupti_busy_falls_back_to_uprobes_and_says_so() {
    let _g = serial();
    require_root();
    let dir = scratch("cupti-busy");
    let mut w = Workload::with_cupti(&dir, &[("FAKE_CUPTI_BUSY", "1")]);
    let agent = Agent::start(&dir, &["--pid", &w.pid.to_string()]);
    agent.wait_stderr("attached", Duration::from_secs(10));
    w.cmd("init");
    agent.wait_stderr("in use by another profiler", Duration::from_secs(10));
    let exp = dir.join("expected.jsonl");
    w.cmd(&format!("run 1 1 {}", exp.display()));
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let line = cap.of_type("cupti").find(|e| e["pid"] == pid).expect("cupti line");
    assert_eq!(
        (line["state"].as_str(), line["cupti_result"].as_u64()),
        (Some("busy"), Some(39))
    );
    // Uprobes still see every launch.
    let launches_made = expected_calls(&exp)
        .iter()
        .filter(|e| e["api"].as_str().is_some_and(is_launch))
        .count();
    assert_eq!(by_type(&cap, "launch", pid).len(), launches_made);
    assert_eq!(cap.count(|e| e["type"] == "gpu_kernel"), 0);
    let s = cap.process_summary(pid);
    assert_eq!(
        (s["cupti"]["state"].as_str(), s["cupti"]["kernels"].as_u64()),
        (Some("busy"), Some(0))
    );
}

#[test]
fn run_starts_the_program_with_the_injection_library_and_returns_its_status() {
    let _g = serial();
    require_root();
    let dir = scratch("cupti-run");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut r = RunAgent::start(
        &dir,
        // A libcuda outside the usual driver paths: attached before the program starts.
        &[
            "--trace-all",
            "--interval-ms",
            "100",
            "--libcuda",
            lib.to_str().unwrap(),
        ],
        &[
            ("GPU_OBSERVER_CUPTI_PATH", fake_cupti().as_os_str()),
            ("GPU_OBSERVER_CUPTI_FLUSH_MS", "50".as_ref()),
            ("FAKE_CUDA_SYNC_US", "0".as_ref()),
        ],
    );
    let pid = r.pid;
    let exp = dir.join("expected.jsonl");
    r.cmd(&format!("load {}", lib.display()));
    r.cmd("init");
    r.cmd(&format!("run 1 2 {}", exp.display()));
    let cap = r.finish();
    let err = cap.stderr.join("\n");
    assert!(err.contains(&format!("started pid {pid}")), "{err}");
    assert!(!by_type(&cap, "gpu_kernel", pid).is_empty(), "{err}");
    assert_joined(&cap, pid);
    assert_eq!(cap.process_summary(pid)["cupti"]["state"], "active");
    // Every event is the started program's: run observes only it.
    assert!(
        cap.events
            .iter()
            .filter(|e| !e["pid"].is_null())
            .all(|e| e["pid"] == pid)
    );
}

#[test]
fn run_exits_with_the_status_of_the_program() {
    let _g = serial();
    require_root();
    let status = Command::new(observer_bin())
        .args([
            "--format",
            "jsonl",
            "--output",
            "/dev/null",
            "--interval-ms",
            "100",
            "run",
            "--no-cupti",
            "--",
        ])
        .args(["/bin/sh", "-c", "exit 7"])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(7));
    let missing = Command::new(observer_bin())
        .args([
            "run",
            "--cupti-lib",
            "/nonexistent/libgpu_observer_cupti.so",
            "--",
            "/bin/true",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success() && err.contains("--cupti-lib") && err.contains("--no-cupti"),
        "{err}"
    );
}

#[test]
fn the_rate_limit_counts_every_record_it_holds_back() {
    let _g = serial();
    require_root();
    let dir = scratch("cupti-rate");
    let mut w = Workload::with_cupti(&dir, &[("GPU_OBSERVER_CUPTI_RATE_LIMIT", "20")]);
    let agent = Agent::start(&dir, &["--pid", &w.pid.to_string()]);
    agent.wait_stderr("attached", Duration::from_secs(10));
    w.cmd("init");
    agent.wait_stderr("CUPTI active", Duration::from_secs(10));
    w.cmd(&format!("run 2 2 {}", dir.join("expected.jsonl").display()));
    // Let the library flush (every 50 ms here) and report its counters (every second).
    std::thread::sleep(Duration::from_millis(1500));
    let delivered = cupti_stats(&mut w)["records"].as_u64().unwrap();
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let c = &cap.process_summary(pid)["cupti"];
    let (forwarded, limited) = (c["forwarded"].as_u64().unwrap(), c["rate_limited"].as_u64().unwrap());
    assert!(limited > 0 && forwarded >= 20, "{c}");
    assert_eq!(
        forwarded + limited,
        delivered,
        "every record CUPTI delivered is forwarded or counted: {c}"
    );
    // Records held back leave their partners unjoined, counted, not silently lost.
    assert_eq!(
        c["joined"].as_u64().unwrap() + c["unjoined"].as_u64().unwrap(),
        c["kernels"].as_u64().unwrap() + c["memcpys"].as_u64().unwrap() + c["memsets"].as_u64().unwrap()
    );
}

/// A process that carries the injection library by other means (a DaemonSet-injected
/// environment) is found by the all-process scan and joined like any other.
#[test]
fn an_injected_process_is_picked_up_in_all_process_mode() {
    let _g = serial();
    require_root();
    let dir = scratch("cupti-all");
    let mut w = Workload::with_cupti(&dir, &[]);
    w.cmd("init");
    let agent = Agent::start(&dir, &[]);
    agent.wait_stderr(
        &format!("pid {} (cuda_workload): CUPTI active", w.pid),
        Duration::from_secs(10),
    );
    w.cmd(&format!("run 1 2 {}", dir.join("expected.jsonl").display()));
    let pid = w.pid;
    w.exit();
    std::thread::sleep(Duration::from_millis(300));
    let cap = agent.stop();
    assert!(!by_type(&cap, "gpu_kernel", pid).is_empty());
    assert_joined(&cap, pid);
    assert_eq!(cap.process_summary(pid)["cupti"]["unjoined"], 0);
}
