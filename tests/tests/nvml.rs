//! Issue 5 end to end: the agent samples a fake libnvidia-ml (tests/fixtures/fake_nvml.c, two
//! devices with scripted values) and writes exactly those values: device descriptions,
//! per-sample device metrics, per-process memory and utilization joined to the observed
//! process, Xid events, summaries — and absent metrics stay absent.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use gpu_observer_tests::*;
use serde_json::{Value, json};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn fake_nvml(variant: &str) -> PathBuf {
    fixtures().join(variant).join("libnvidia-ml.so.1")
}

/// Waits until the agent's output holds `n` device samples of each of the two fake devices.
fn wait_for_samples(dir: &Path, n: usize) {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(dir.join("out.jsonl")).unwrap_or_default();
        let count = |d: u32| {
            text.lines()
                .filter(|l| l.contains("\"scope\":\"device\"") && l.contains(&format!("\"device\":{d},")))
                .count()
        };
        if count(0) >= n && count(1) >= n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "fewer than {n} NVML samples per device"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn nvml_lines<'a>(cap: &'a Captured, scope: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    cap.of_type("nvml").filter(move |e| e["scope"] == scope)
}

/// What the fake says device `i` is.
fn expected_info(i: u64) -> Value {
    json!({
        "device": i,
        "name": format!("Fake GPU {i}"),
        "uuid": format!("GPU-fake-{i:04}"),
        "vendor": "NVIDIA",
        "memory_total_bytes": (80 + 16 * i) * GIB,
        "compute_capability": "9.0",
        "driver_version": "580.65.06",
        "cuda_driver_version": "13.0",
        "pci_bus_id": format!("00000000:{i:02X}:00.0"),
        // Device 0 answers nvmlDeviceGetAttributes with NOT_SUPPORTED: 16896 cores / 128 per SM.
        "sm_count": if i == 0 { 132 } else { 114 },
        "max_clocks_mhz": {"graphics": 1980, "sm": 1980, "memory": 2619},
        "power_limit_watts": 700.0,
        "pcie_max_link": {"generation": 5, "width": 16},
    })
}

/// The k-th sample of device `i`, as fake_nvml.c scripts it (Xid 79 from the third sample of
/// device 0 on); memory is read every 500 ms, last in round `m`.
fn expected_sample(i: u64, k: u64, m: u64) -> Value {
    let total = (80 + 16 * i) * GIB;
    let used = (1 + i) * GIB + m * MIB;
    let mut v = json!({
        "type": "nvml",
        "scope": "device",
        "pid": null,
        "tid": null,
        "comm": null,
        "device": i,
        "uuid": format!("GPU-fake-{i:04}"),
        "name": format!("Fake GPU {i}"),
        "hw.gpu.utilization": {"general": ((10 * (i + 1) + k) % 101) as f64 / 100.0},
        "gpu.memory_controller.utilization": (5 * (i + 1)) as f64 / 100.0,
        "hw.gpu.memory.usage": used,
        "hw.gpu.memory.free": total - 512 * MIB - used,
        "hw.gpu.memory.reserved": 512 * MIB,
        "hw.gpu.memory.limit": total,
        "hw.gpu.memory.utilization": used as f64 / total as f64,
        "hw.power": (100_000 + 1000 * i + k) as f64 / 1000.0,
        "hw.gpu.power.limit": 700.0,
        "hw.temperature": 40 + i,
        "hw.gpu.clock": {"graphics": 1500 + i, "sm": 1600 + i, "memory": 2600 + i},
        "hw.gpu.pcie.link": {"generation": 5, "width": 16},
        "hw.gpu.throttle_reasons": [if i == 0 { "gpu_idle" } else { "sw_power_cap" }],
    });
    if i == 1 {
        // No PCIe byte counters: NVML's throughput call, read every 5 s and carried.
        v["hw.gpu.pcie.throughput"] = json!({"transmit": 2000 * 1024, "receive": 4000 * 1024});
    }
    if i == 0 {
        // Only device 0 has an encoder/decoder, a fan, ECC and Xid events.
        let m = v.as_object_mut().unwrap();
        m["hw.gpu.utilization"]["encoder"] = json!(0.07);
        m["hw.gpu.utilization"]["decoder"] = json!(0.03);
        m.insert("hw.fan.speed_ratio".into(), json!(0.3));
        m.insert(
            "hw.errors".into(),
            json!({"ecc_corrected": 2, "ecc_uncorrected": 0, "xid": u64::from(k >= 2)}),
        );
        if k >= 2 {
            m.insert("xid_last".into(), json!(79));
        }
    }
    v
}

/// A workload with the fake libcuda loaded, and the agent observing it (`--pid`) with the fake
/// NVML `variant`, sampling every 50 ms; `procs` gives fake_nvml.c's process lines for the
/// workload's pid.
fn observe(
    name: &str,
    variant: &str,
    procs: impl Fn(u32) -> String,
    env: &[(&str, &str)],
) -> (PathBuf, Workload, Agent) {
    let dir = scratch(name);
    let w = Workload::loaded(&dir);
    let file = dir.join("procs.txt");
    std::fs::write(&file, procs(w.pid)).unwrap();
    let nvml = fake_nvml(variant);
    let mut env = env.to_vec();
    env.push(("FAKE_NVML_PROCS", file.to_str().unwrap()));
    let agent = Agent::start_with_env(
        &dir,
        &[
            "--pid",
            &w.pid.to_string(),
            "--nvml-lib",
            nvml.to_str().unwrap(),
            "--nvml-interval-ms",
            "50",
        ],
        &env,
    );
    agent.wait_stderr("attached", Duration::from_secs(10));
    (dir, w, agent)
}

#[test]
fn nvml_samples_reach_the_output_with_exact_values() {
    let _g = serial();
    require_root();
    // The observed workload on device 1; another process (pid 1) on device 0 that --pid keeps
    // out of the lines.
    let (dir, mut w, agent) = observe(
        "nvml-values",
        "nvml",
        |pid| format!("{pid} 1 {} 42\n1 0 {MIB} 7\n", 3 * GIB),
        &[("FAKE_NVML_XID", "79:2")],
    );
    agent.wait_stderr("NVML", Duration::from_secs(10));
    w.cmd("init");
    // Past two 500 ms rounds.
    wait_for_samples(&dir, 12);
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    assert!(
        cap.stderr
            .iter()
            .any(|l| l.contains("2 device(s) [0 Fake GPU 0, 1 Fake GPU 1]")),
        "{:?}",
        cap.stderr
    );

    // Each device described once, before its samples.
    let infos: Vec<&Value> = nvml_lines(&cap, "info").collect();
    assert_eq!(infos.len(), 2);
    for (i, info) in infos.iter().enumerate() {
        let mut got = (*info).clone();
        let m = got.as_object_mut().unwrap();
        for k in ["type", "scope", "ts_ns", "pid", "tid", "comm"] {
            m.remove(k);
        }
        assert_eq!(got, expected_info(i as u64));
    }

    // The rounds each tier was due in: the sampler's own rule, on the rounds' timestamps.
    let rounds: Vec<u64> = nvml_lines(&cap, "device")
        .filter(|e| e["device"] == 0)
        .map(|e| e["ts_ns"].as_u64().unwrap())
        .collect();
    let due = |period_ms: u64| -> Vec<usize> {
        let (period, slack) = (period_ms * 1_000_000, period_ms * 50_000);
        let mut last: Option<u64> = None;
        (0..rounds.len())
            .filter(|&k| {
                let t = rounds[k];
                let due = last.is_none_or(|l| t + slack >= l + period);
                if due {
                    last = Some(t);
                }
                due
            })
            .collect()
    };
    let medium = due(500);
    assert!(medium.len() >= 2, "two 500 ms rounds: {medium:?}");

    // Every device sample, in order, with the scripted values; absent metrics absent.
    let mut samples = 0;
    for i in 0..2u64 {
        let lines: Vec<&Value> = nvml_lines(&cap, "device").filter(|e| e["device"] == i).collect();
        assert!(lines.len() >= 12, "device {i}: {} samples", lines.len());
        for (k, line) in lines.iter().enumerate() {
            let mut got = (*line).clone();
            let m = got.as_object_mut().unwrap();
            m.remove("ts_ns");
            if i == 0 {
                // PCIe byte counters, read every 5 s: in this short run, once (1e6 / 2e6 bytes),
                // so no rate yet (the rate is `pcie_rate`'s, unit-tested in the agent).
                let io = m.remove("hw.gpu.io").expect("device 0 has PCIe counters");
                assert_eq!(io, json!({"transmit": 1_000_000, "receive": 2_000_000}));
                assert!(m.get("hw.gpu.pcie.throughput").is_none());
            } else {
                assert!(m.get("hw.gpu.io").is_none(), "device 1 has no PCIe counters");
            }
            let last_medium = *medium.iter().rev().find(|&&r| r <= k).unwrap() as u64;
            assert_eq!(got, expected_sample(i, k as u64, last_medium), "device {i} sample {k}");
        }
        // Both devices are sampled in one round: the same timestamps, ascending.
        let ts: Vec<u64> = lines.iter().map(|l| l["ts_ns"].as_u64().unwrap()).collect();
        assert!(ts.windows(2).all(|w| w[0] < w[1]));
        samples = lines.len();
    }
    let ts = |d: u64| -> Vec<u64> {
        nvml_lines(&cap, "device")
            .filter(|e| e["device"] == d)
            .map(|e| e["ts_ns"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(ts(0), ts(1));

    // Per-process lines: only the observed pid, on device 1, every 500 ms round.
    let procs: Vec<&Value> = nvml_lines(&cap, "process").collect();
    for p in &procs {
        let mut got = (*p).clone();
        got.as_object_mut().unwrap().remove("ts_ns");
        assert_eq!(
            got,
            json!({
                "type": "nvml", "scope": "process", "pid": pid, "tid": null,
                "comm": "cuda_workload", "device": 1, "uuid": "GPU-fake-0001",
                "hw.gpu.memory.usage": 3 * GIB,
                "hw.gpu.utilization": {"general": 0.42, "encoder": 0.0, "decoder": 0.0},
                "gpu.memory_controller.utilization": 0.21,
            })
        );
    }

    // The process summary says which GPU it used, how much memory, how busy.
    let s = cap.process_summary(pid);
    assert_eq!(
        s["nvml"],
        json!({"devices": [1], "memory_bytes": 3 * GIB, "memory_max_bytes": 3 * GIB,
               "sm_utilization_mean": 0.42, "sm_utilization_max": 0.42}),
        "{s}"
    );

    // Device summaries over the whole run.
    for i in 0..2u64 {
        let d = cap
            .events
            .iter()
            .find(|e| e["type"] == "summary" && e["scope"] == "device" && e["device"] == i)
            .expect("device summary");
        let n = samples as u64;
        assert_eq!(d["samples"].as_u64(), Some(n), "{d}");
        assert_eq!(d["uuid"], format!("GPU-fake-{i:04}"));
        assert_eq!(d["hw.gpu.memory.limit"].as_u64(), Some((80 + 16 * i) * GIB));
        // The last 500 ms read.
        let used_max = (1 + i) * GIB + *medium.last().unwrap() as u64 * MIB;
        assert_eq!(d["hw.gpu.memory.usage"]["max"].as_u64(), Some(used_max), "{d}");
        assert_eq!(
            d["hw.temperature"],
            json!({"mean": 40.0 + i as f64, "max": 40.0 + i as f64})
        );
        // Device 1 is power-capped in every sample; device 0 only idle (not counted).
        assert_eq!(d["throttled_samples"].as_u64(), Some(if i == 1 { n } else { 0 }));
    }

    // The sampler's own account: state, rounds, every query timed.
    let proc_ts: Vec<u64> = procs.iter().map(|p| p["ts_ns"].as_u64().unwrap()).collect();
    let medium_ts: Vec<u64> = medium.iter().map(|&k| rounds[k]).collect();
    assert_eq!(proc_ts, medium_ts, "process lines on the 500 ms rounds");

    let t = &cap.total()["nvml"];
    assert_eq!(t["state"], "active", "{t}");
    assert_eq!(t["devices"], 2);
    assert_eq!(t["interval_ms"], 50);
    assert_eq!(t["lines_dropped"], 0);
    assert_eq!(t["samples"].as_u64(), Some(samples as u64));
    let q = &t["query_ns"];
    assert_eq!(
        q["nvmlDeviceGetUtilizationRates"]["count"].as_u64(),
        Some(2 * samples as u64)
    );
    assert_eq!(q["nvmlDeviceGetUtilizationRates"]["errors"], 0);
    let n = |ms| due(ms).len() as u64;
    // Device 1's NOT_SUPPORTED encoder (a 500 ms query) is asked once, then never again.
    assert_eq!(q["nvmlDeviceGetEncoderUtilization"]["errors"], 1);
    assert_eq!(q["nvmlDeviceGetEncoderUtilization"]["count"].as_u64(), Some(n(500) + 1));
    // Memory every 500 ms; temperature every 2 s; the PCIe counters every 5 s on both (device
    // 1 says NOT_SUPPORTED once); per-process utilization and, on device 1 only, the 20 ms-
    // blocking throughput call every 10 s.
    assert_eq!(q["nvmlDeviceGetMemoryInfo_v2"]["count"].as_u64(), Some(2 * n(500)));
    assert_eq!(q["nvmlDeviceGetTemperature"]["count"].as_u64(), Some(2 * n(2000)));
    assert_eq!(
        q["nvmlDeviceGetFieldValues(pcie bytes)"]["count"].as_u64(),
        Some(n(5000) + 1),
        "{q}"
    );
    assert_eq!(
        q["nvmlDeviceGetProcessUtilization"]["count"].as_u64(),
        Some(2 * n(10000)),
        "{q}"
    );
    assert_eq!(
        q["nvmlDeviceGetPcieThroughput(tx)"]["count"].as_u64(),
        Some(n(10000)),
        "{q}"
    );
    assert!(t["sampler_cpu_ns"].as_u64().unwrap() > 0);
    assert!(t["sampler_wall_ns"].as_u64().unwrap() >= t["sampler_cpu_ns"].as_u64().unwrap());
}

#[test]
fn older_drivers_give_process_memory_through_the_v3_call() {
    let _g = serial();
    require_root();
    let (dir, mut w, agent) = observe("nvml-old", "nvml-old", |pid| format!("{pid} 0 {} 5\n", 5 * MIB), &[]);
    w.cmd("init");
    // Two 500 ms rounds: two process lines.
    wait_for_samples(&dir, 12);
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let procs: Vec<&Value> = nvml_lines(&cap, "process").collect();
    assert!(procs.len() >= 2);
    for p in procs {
        assert_eq!(
            (p["pid"].as_u64(), p["device"].as_u64()),
            (Some(u64::from(pid)), Some(0))
        );
        assert_eq!(p["hw.gpu.memory.usage"].as_u64(), Some(5 * MIB), "{p}");
    }
    let q = &cap.total()["nvml"]["query_ns"]["nvmlDeviceGetRunningProcessDetailList"];
    assert_eq!(q["errors"], 0, "the fallback is not an error: {q}");
}

#[test]
fn without_nvml_the_observer_says_so_and_observes_the_rest() {
    let _g = serial();
    require_root();
    let dir = scratch("nvml-none");
    let mut w = Workload::loaded(&dir);
    let missing = dir.join("no-such-libnvidia-ml.so.1");
    let agent = Agent::start(
        &dir,
        &["--pid", &w.pid.to_string(), "--nvml-lib", missing.to_str().unwrap()],
    );
    agent.wait_stderr("attached", Duration::from_secs(10));
    agent.wait_stderr("NVML unavailable", Duration::from_secs(10));
    let exp = dir.join("expected.jsonl");
    w.cmd(&format!("run 1 1 {}", exp.display()));
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let line = cap.stderr.iter().find(|l| l.contains("NVML unavailable")).unwrap();
    assert!(
        line.contains(&format!("cannot load {}", missing.display())) && line.contains("everything else runs"),
        "{line}"
    );
    // The CUDA side is whole; NVML's is absent, not zero.
    let expected = expected_calls(&exp).len();
    assert_eq!(
        cap.count(|e| is_event(e) && e["pid"] == pid && e["api"].is_string()),
        expected
    );
    assert_eq!(cap.of_type("nvml").count(), 0);
    assert_eq!(cap.process_summary(pid)["nvml"], Value::Null);
    let t = &cap.total()["nvml"];
    assert_eq!(
        (t["state"].as_str(), t["samples"].as_u64()),
        (Some("unavailable"), Some(0))
    );
    assert!(t["message"].as_str().unwrap().contains("cannot load"), "{t}");
}

fn devices_cmd(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(observer_bin())
        .arg("devices")
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run gpu-observer devices");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn devices_lists_every_gpu_as_a_table_and_as_json() {
    let nvml = fake_nvml("nvml");
    let lib = nvml.to_str().unwrap();
    let (code, out, err) = devices_cmd(&["--nvml-lib", lib, "--format", "json"], &[]);
    assert_eq!(code, 0, "{err}");
    let got: Value = serde_json::from_str(&out).expect("devices --format json is JSON");
    let want: Vec<Value> = (0..2)
        .map(|i| {
            let mut v = expected_info(i);
            let m = v.as_object_mut().unwrap();
            let d = m.remove("device").unwrap();
            let mut ordered = serde_json::Map::new();
            ordered.insert("index".into(), d);
            ordered.extend(m.clone());
            Value::Object(ordered)
        })
        .collect();
    assert_eq!(got, Value::Array(want));

    let (code, out, err) = devices_cmd(&["--nvml-lib", lib], &[]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "driver 580.65.06, CUDA 13.0");
    assert_eq!(lines.len(), 4, "{out}");
    for (i, sms, mib) in [(0, "132", "81920 MiB"), (1, "114", "98304 MiB")] {
        let row = lines[2 + i];
        for want in [
            &format!("Fake GPU {i}"),
            &format!("GPU-fake-000{i}"),
            sms,
            mib,
            "1980/2619",
            "gen5 x16",
        ] {
            assert!(row.contains(want), "row {i} lacks {want}: {row}");
        }
    }

    // NVML present but no driver: the reason, exit status 1, no panic.
    let (code, out, err) = devices_cmd(&["--nvml-lib", lib], &[("FAKE_NVML_INIT", "9")]);
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(err.contains("the NVIDIA kernel driver is not"), "{err}");
}
