//! Issue 14: the anomaly detector end to end. Under `run` with the fake CUPTI, a steady loop
//! of 2 µs kernels with one planted 20 µs run (10×, still under the 100 µs threshold) gives
//! exactly one `anomaly` line, and that kernel's `gpu_kernel` line is written although
//! duration sampling leaves out every other one.

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
    // Steady 2 µs kernels (the fake CUPTI: 1 µs per grid block), then one of 20 µs, then
    // steady again.
    let before = passes(r.cmd("loop 300 launch:2:steady_kernel sleep:200"));
    assert_eq!(passes(r.cmd("loop 0 launch:20:steady_kernel")), 1);
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
