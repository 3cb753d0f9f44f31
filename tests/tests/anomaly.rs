//! Issue 14: the anomaly detector end to end. Under `run` with the fake CUPTI, a steady loop
//! of 2 µs kernels with one planted 20 µs run (10×, still under the 100 µs threshold) gives
//! exactly one `anomaly` line, and that kernel's `gpu_kernel` line is written although
//! duration sampling leaves out every other one. Without CUPTI, a slow copy and synchronize
//! among steady ones are flagged by their calls' own times.

use gpu_observer_tests::*;
use serde_json::Value;

#[test]
fn one_planted_slow_kernel_among_a_steady_loop_is_flagged_and_written() {
    let _g = serial();
    require_root();
    let dir = scratch("anomaly-kernel");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut r = RunAgent::with_cupti(&dir, &lib, &[]);
    let pid = r.pid;
    r.cmd("init");
    let passes = |reply: String| -> u64 {
        assert!(reply.starts_with("ok loop "), "{reply}");
        reply.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    // Steady 2 µs kernels (the fake CUPTI: 1 µs per grid block), then one of the same name
    // and shape that runs 10× longer (20 µs), then steady again.
    let before = passes(r.cmd("loop 300 launch:2:steady_kernel sleep:200"));
    r.cmd("cupti_slowdown 10");
    assert_eq!(passes(r.cmd("loop 0 launch:2:steady_kernel")), 1);
    r.cmd("cupti_slowdown 1");
    let after = passes(r.cmd("loop 300 launch:2:steady_kernel sleep:200"));
    assert!(before >= 64, "{before} passes: too few to warm up");
    let cap = r.finish();
    let err = cap.stderr.join("\n");
    let anomalies: Vec<&Value> = cap.of_type("anomaly").filter(|a| a["pid"] == pid).collect();
    assert_eq!(anomalies.len(), 1, "{anomalies:?}\n{err}");
    let a = anomalies[0];
    assert_eq!(a["what"], "kernel", "{a}");
    assert_eq!(a["key"], "steady_kernel", "{a}");
    assert_eq!(a["unit"], "ns", "{a}");
    assert_eq!(a["observed"].as_f64(), Some(20_000.0), "{a}");
    assert_eq!(a["typical"].as_f64(), Some(2_000.0), "{a}");
    assert_eq!(a["mode"], "robust", "{a}");
    // ln(10) over the scale floor (0.02): 115 robust deviations.
    assert!(a["deviation"].as_f64().unwrap() > 100.0, "{a}");
    // Only the anomalous kernel is written: the steady ones are under the threshold.
    let kernels: Vec<&Value> = cap
        .of_type("gpu_kernel")
        .filter(|k| k["pid"] == pid && k["kernel"] == "steady_kernel")
        .collect();
    assert_eq!(kernels.len(), 1, "{kernels:?}");
    assert_eq!(kernels[0]["gpu_duration_ns"], 20_000);
    // Every kernel still counted.
    let total = cap.total();
    assert_eq!(total["anomalies"]["flagged"], 1, "{}", total["anomalies"]);
    assert_eq!(
        total["anomalies"]["checked"].as_u64(),
        Some(before + 1 + after),
        "{}",
        total["anomalies"]
    );
}

/// Without CUPTI, the calls' own times: a loop of 256 KiB synchronous copies (2 ms at
/// 128 MB/s) and 2 ms synchronizes, then one pass where the copy takes 128× and the synchronize
/// 125× longer. Exactly three findings: the copy's time, its bandwidth, and the synchronize —
/// and every value counted as checked. (Real sleeps, on a busy 2-core CI machine: a 2 ms sleep
/// has been seen waking 4 ms late. With the threshold at 100 robust deviations, a value must
/// be ≥ e^(100 × 0.02) = 7.4× typical to flag, and ~125× is ≥ 100 deviations as long as the
/// loop's spread (MAD × 1.4826) stays under 4.8 %.)
#[test]
fn a_slow_copy_and_a_slow_synchronize_among_steady_ones_are_flagged_by_their_calls() {
    let _g = serial();
    require_root();
    let dir = scratch("anomaly-calls");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let args = ["--libcuda", lib.to_str().unwrap(), "--no-nvml"];
    let agent = Agent::start(
        &dir,
        &[&args[..], &["--anomaly-threshold", "100", "--anomaly-warmup", "16"]].concat(),
    );
    let mut w = Workload::start();
    w.cmd(&format!("load {}", lib.display()));
    let pid = w.pid;
    w.cmd("init");
    w.cmd("timing 2000 128");
    let passes = |reply: String| -> u64 {
        assert!(reply.starts_with("ok loop "), "{reply}");
        reply.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    let before = passes(w.cmd("loop 120 htod:262144 sync"));
    assert!(before >= 20, "{before} passes: too few to warm up");
    w.cmd("timing 250000 1");
    assert_eq!(passes(w.cmd("loop 0 htod:262144 sync")), 1);
    w.cmd("timing 2000 128");
    let after = passes(w.cmd("loop 40 htod:262144 sync"));
    w.exit();
    let cap = agent.stop();
    let anomalies: Vec<&Value> = cap.of_type("anomaly").filter(|a| a["pid"] == pid).collect();
    let keys: Vec<(String, String)> = anomalies
        .iter()
        .map(|a| (a["what"].as_str().unwrap().to_string(), a["key"].to_string()))
        .collect();
    assert_eq!(
        keys,
        [
            (
                "call".to_string(),
                r#"{"api":"cuMemcpyHtoD_v2","size_class":19}"#.to_string()
            ),
            (
                "bandwidth".to_string(),
                r#"{"direction":"cpu_to_gpu","size_class":19,"measured":"call"}"#.to_string()
            ),
            (
                "call".to_string(),
                r#"{"api":"cuStreamSynchronize","size_class":0}"#.to_string()
            ),
        ],
        "{anomalies:?}"
    );
    // The planted copy slept 262 ms (1 MB/s), the synchronize 250 ms; typical: ~2 ms each.
    let (copy, bw, sync) = (anomalies[0], anomalies[1], anomalies[2]);
    assert!(copy["observed"].as_f64().unwrap() >= 262_144_000.0, "{copy}");
    assert!(copy["typical"].as_f64().unwrap() < 5_000_000.0, "{copy}");
    assert_eq!(bw["unit"], "B/s");
    assert!(bw["observed"].as_f64().unwrap() <= 1.0e6, "{bw}");
    assert!(bw["typical"].as_f64().unwrap() > 10.0e6, "{bw}");
    assert!(sync["observed"].as_f64().unwrap() >= 250_000_000.0, "{sync}");
    // The flagged calls are written (they are over 100 µs anyway) and marked.
    let total = cap.total();
    assert_eq!(total["anomalies"]["flagged"], 3, "{}", total["anomalies"]);
    // Each pass: the copy's time, its bandwidth, the synchronize's time.
    assert_eq!(
        total["anomalies"]["checked"].as_u64(),
        Some(3 * (before + 1 + after)),
        "{}",
        total["anomalies"]
    );
}
