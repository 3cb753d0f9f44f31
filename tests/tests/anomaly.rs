//! Issue 14: the anomaly detector end to end. Under `run` with the fake CUPTI, a steady loop
//! of 2 µs kernels with one planted 20 µs run (10×, still under the 100 µs threshold) gives
//! exactly one `anomaly` line, and that kernel's `gpu_kernel` line is written although
//! duration sampling leaves out every other one. Without CUPTI, a slow copy and synchronize
//! among steady ones are flagged by their calls' own times.

use std::{
    io::Read,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

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

/// The terminal: the live table marks the process (`!1` in its ANOM column) and shows the
/// anomaly under the table, and the final summary counts it and names it — for a kernel whose
/// name carries terminal control sequences, a bidi override and 600 more characters, which are
/// shown escaped and cut to 80 characters (docs/SECURITY.md: names from observed processes
/// never reach the terminal raw). The process is found by `--pid`, carrying the injection
/// library in its environment; script(1) gives the observer a terminal.
#[test]
fn the_terminal_marks_the_process_and_shows_its_anomaly_with_a_hostile_name_escaped() {
    let _g = serial();
    require_root();
    let dir = scratch("anomaly-terminal");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let injection = observer_bin().with_file_name("libgpu_observer_cupti.so");
    let cupti = fixtures().join("libcupti.so.13");
    let env = [
        ("CUDA_INJECTION64_PATH", injection.to_str().unwrap()),
        ("GPU_OBSERVER_CUPTI_PATH", cupti.to_str().unwrap()),
        ("GPU_OBSERVER_CUPTI_FLUSH_MS", "50"),
    ];
    let mut w = Workload::start_with_env(&env);
    w.cmd(&format!("load {}", lib.display()));
    let pid = w.pid;
    // `--format terminal`: on a terminal the default is the dashboard (issue 15).
    let mut live = observer_on_script_pty(&format!("--format terminal --pid {pid} --no-nvml --interval-ms 100"));
    let screen: Arc<Mutex<Vec<u8>>> = Arc::default();
    let reader = {
        let (screen, mut out) = (screen.clone(), live.stdout.take().unwrap());
        std::thread::spawn(move || {
            let mut buf = [0u8; 65536];
            while let Ok(n) = out.read(&mut buf) {
                if n == 0 {
                    break;
                }
                screen.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let shown = || String::from_utf8_lossy(&screen.lock().unwrap()).into_owned();
    let wait_for = |needle: &str| {
        let start = Instant::now();
        while !shown().contains(needle) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no {needle:?} on the screen:\n{}",
                shown()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_for("attached");
    w.cmd("init");
    wait_for("CUPTI active");
    let name = format!("\x1b]0;pwn\x07\x1b[31mEVIL\x1b[0m\u{202e}{}", "K".repeat(600));
    let passes = |reply: String| -> u64 {
        assert!(reply.starts_with("ok loop "), "{reply}");
        reply.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    // Steady 2 µs kernels, one of the same name and shape 10× longer, steady again.
    let before = passes(w.cmd(&format!("loop 300 launch:2:{name} sleep:200")));
    assert!(before >= 64, "{before} passes: too few to warm up");
    w.cmd("cupti_slowdown 10");
    assert_eq!(passes(w.cmd(&format!("loop 0 launch:2:{name}"))), 1);
    w.cmd("cupti_slowdown 1");
    passes(w.cmd(&format!("loop 300 launch:2:{name} sleep:200")));
    // Under the table while the process lives; then it exits, and the observer with it.
    let line = format!("! pid {pid} kernel ");
    wait_for(&line);
    w.exit();
    let status = live.wait().unwrap();
    reader.join().unwrap();
    assert!(status.success(), "{status}");
    let screen = shown();

    // Nothing raw: the view's own escapes (cursor home, clear) are the only ones.
    let stripped = screen.replace("\x1b[H\x1b[2J", "");
    let bad: Vec<char> = stripped
        .chars()
        .filter(|&c| (c.is_control() && c != '\n' && c != '\r' && c != '\t') || c == '\u{202e}')
        .collect();
    assert!(bad.is_empty(), "raw control characters {bad:?}:\n{screen}");
    // The name escaped (41 characters shown), then its first Ks up to 80, then an ellipsis.
    let escaped = format!(r"\x1b]0;pwn\x07\x1b[31mEVIL\x1b[0m\u{{202e}}{}…", "K".repeat(39));
    let lines: Vec<&str> = stripped.lines().map(|l| l.trim_end_matches('\r')).collect();
    let anomaly = format!("{line}\"{escaped}\" 20.0 µs, typically 2.00 µs (115 dev), ");
    assert!(
        lines.iter().any(|l| l.starts_with(&anomaly) && l.ends_with(" s ago")),
        "no {anomaly:?}:\n{screen}"
    );
    let row = format!("{pid:>8} cuda_workload ");
    assert!(
        lines.iter().any(|l| l.starts_with(&row) && l.ends_with(" !1")),
        "no row {row:?} marked !1:\n{screen}"
    );
    // The final summary, after the last frame.
    let summary = &stripped[stripped.rfind("gpu-observer summary:").expect("a summary")..];
    assert!(summary.contains("\n  anomalies              1"), "{summary}");
    assert!(
        summary.contains(&format!(
            "\n    most severe kernel \"{escaped}\" 20.0 µs, typically 2.00 µs (115 dev)"
        )),
        "{summary}"
    );
}
