//! The bottleneck verdict end to end: a process that launches tiny kernels as fast as one
//! thread can, under `run` with the fake CUPTI, is judged `launch_bound` — in `verdict` lines
//! and in its summary — with the numbers that decided it.

use gpu_observer_tests::*;
use serde_json::Value;

#[test]
fn a_tight_launch_loop_of_tiny_kernels_is_launch_bound() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-launch");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut r = RunAgent::start(
        &dir,
        &["--interval-ms", "100", "--no-nvml", "--libcuda", lib.to_str().unwrap()],
        &[
            ("GPU_OBSERVER_CUPTI_PATH", fixtures().join("libcupti.so.13").as_os_str()),
            ("GPU_OBSERVER_CUPTI_FLUSH_MS", "50".as_ref()),
            // 50 µs of CPU a launch: ~20 000 launches/s from one saturated thread.
            ("FAKE_CUDA_LAUNCH_SPIN_NS", "50000".as_ref()),
        ],
    );
    let pid = r.pid;
    r.cmd(&format!("load {}", lib.display()));
    r.cmd("init");
    // ~1 µs kernels (the fake CUPTI's: 1 µs per grid block), as fast as one thread launches
    // them (50 µs of CPU each): ~5 s, many ticks.
    r.cmd("burst 100000");
    let cap = r.finish();
    let err = cap.stderr.join("\n");
    let lines = &cap.events;
    let verdicts: Vec<&Value> = lines
        .iter()
        .filter(|l| l["type"] == "verdict" && l["pid"] == pid)
        .collect();
    assert!(!verdicts.is_empty(), "no verdict line; stderr:\n{err}");
    let launch_bound: Vec<&&Value> = verdicts.iter().filter(|v| v["class"] == "launch_bound").collect();
    assert!(!launch_bound.is_empty(), "verdicts: {verdicts:?}");
    for v in launch_bound {
        let e = &v["evidence"];
        assert!(e["gpu_busy"].as_f64().unwrap() < 0.5, "{v}");
        assert!(e["launch_thread_cpu"].as_f64().unwrap() >= 0.8, "{v}");
        assert!(
            e["mean_kernel_ns"].as_u64().unwrap() < e["mean_launch_interval_ns"].as_u64().unwrap(),
            "{v}"
        );
        assert!(v["hint"].as_str().unwrap().contains("CUDA graphs"), "{v}");
    }
    let summary = lines
        .iter()
        .find(|l| l["type"] == "summary" && l["scope"] == "process" && l["pid"] == pid)
        .unwrap();
    assert_eq!(summary["verdict"]["class"], "launch_bound", "{}", summary["verdict"]);
}

#[test]
fn without_cupti_nvml_says_how_busy_the_gpu_is_and_a_busy_gpu_is_gpu_bound() {
    let _g = serial();
    require_root();
    let dir = scratch("verdict-nvml");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = Workload::start_with_env(&[("FAKE_CUDA_LAUNCH_SPIN_NS", "50000")]);
    w.cmd(&format!("load {}", lib.display()));
    w.cmd("init");
    // The fake NVML says the process keeps the SMs 90 % busy.
    let procs = dir.join("procs.txt");
    std::fs::write(&procs, format!("{} 0 1048576 90\n", w.pid)).unwrap();
    let agent = Agent::start_with_env(
        &dir,
        &[
            "--pid",
            &w.pid.to_string(),
            "--interval-ms",
            "100",
            "--nvml-lib",
            fixtures().join("nvml/libnvidia-ml.so.1").to_str().unwrap(),
            "--nvml-interval-ms",
            "50",
        ],
        &[("FAKE_NVML_PROCS", procs.to_str().unwrap())],
    );
    agent.wait_stderr("attached", std::time::Duration::from_secs(10));
    assert!(w.cmd("burst 60000").starts_with("ok"));
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let verdicts: Vec<&Value> = cap
        .of_type("verdict")
        .filter(|v| v["pid"] == pid && v["evidence"]["gpu_busy_source"] == "nvml")
        .collect();
    assert!(
        !verdicts.is_empty(),
        "no NVML-based verdict: {:?}",
        cap.of_type("verdict").collect::<Vec<_>>()
    );
    for v in &verdicts {
        assert_eq!(v["class"], "gpu_bound", "{v}");
        let busy = v["evidence"]["gpu_busy"].as_f64().unwrap();
        assert!((busy - 0.9).abs() < 0.01, "{v}");
    }
}
