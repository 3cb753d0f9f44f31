//! `--perfetto FILE`: the trace of a known workload, decoded by tests/perfetto/decode.py with
//! Perfetto's own protos (PyPI `perfetto`, installed by `cargo xtask test`), checked against
//! the JSON lines the same run wrote and the workload's own record of its calls.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use gpu_observer_tests::*;
use serde_json::Value;

/// The decoder's JSON summary of a trace (it fails the test on any sequence or interning error).
fn decode(trace: &Path) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("perfetto/decode.py");
    let pythonpath = std::env::var_os("GPU_OBSERVER_PYTHONPATH")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/python"));
    let out = Command::new("python3")
        .arg(&script)
        .arg(trace)
        .env("PYTHONPATH", &pythonpath)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "decode.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["errors"], Value::Array(vec![]), "{:#}", v["errors"]);
    assert_eq!(v["torn_tail_bytes"], 0);
    assert_eq!(v["clock"]["primary"], 3);
    v
}

fn tracks(v: &Value) -> impl Iterator<Item = &Value> {
    v["tracks"].as_object().unwrap().values()
}

fn count_of(map: &Value, key: &str) -> u64 {
    map.get(key).and_then(Value::as_u64).unwrap_or(0)
}

fn api_of(e: &Value) -> String {
    e["api"].as_str().unwrap_or("?").to_string()
}

#[test]
fn a_run_trace_has_every_call_ioctl_and_kernel_with_flows_between_them() {
    let _g = serial();
    require_root();
    let dir = scratch("perfetto-run");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let trace = dir.join("trace.pftrace");
    let mut r = RunAgent::with_cupti_args(
        &dir,
        &lib,
        &["--trace-all", "--perfetto", trace.to_str().unwrap()],
        &[("FAKE_CUDA_SYNC_US", "0")],
    );
    let pid = r.pid;
    let exp = dir.join("expected.jsonl");
    r.cmd("init");
    r.cmd(&format!("run 1 2 {}", exp.display()));
    let cap = r.finish();
    let err = cap.stderr.join("\n");
    assert!(err.contains("perfetto: wrote "), "{err}");
    assert!(!err.contains("left out"), "{err}");
    let v = decode(&trace);

    let mine: Vec<&Value> = cap.events.iter().filter(|e| e["pid"] == pid).collect();
    // The process and one thread track per thread that made a call, under it.
    let procs: Vec<&Value> = tracks(&v).filter(|t| t["kind"] == "process").collect();
    assert_eq!(procs.len(), 1, "{procs:?}");
    assert_eq!(
        (procs[0]["pid"].as_u64(), procs[0]["name"].as_str()),
        (Some(u64::from(pid)), Some("cuda_workload"))
    );
    let proc_uuid = procs[0]["uuid"].clone();
    let threads: HashMap<u64, &Value> = tracks(&v)
        .filter(|t| t["kind"] == "thread")
        .map(|t| (t["tid"].as_u64().unwrap(), t))
        .collect();
    let mut tids: Vec<u64> = mine
        .iter()
        .filter(|e| {
            [
                "launch",
                "ioctl",
                "init",
                "memcpy",
                "memset",
                "alloc",
                "free",
                "sync",
                "module",
                "symbol",
                "host_func",
            ]
            .contains(&e["type"].as_str().unwrap())
        })
        .map(|e| e["tid"].as_u64().unwrap())
        .collect();
    tids.sort_unstable();
    tids.dedup();
    let mut got_tids: Vec<u64> = threads.keys().copied().collect();
    got_tids.sort_unstable();
    assert_eq!(got_tids, tids);
    for t in threads.values() {
        assert_eq!((t["pid"].as_u64(), &t["parent"]), (Some(u64::from(pid)), &proc_uuid));
        assert_eq!(
            (t["unclosed"].as_u64(), t["unmatched_ends"].as_u64()),
            (Some(0), Some(0)),
            "{t:#}"
        );
    }

    // Per thread: a slice per returned call, an instant per launch, a slice per ioctl nested
    // directly under the call that issued it: the same counts as the JSON lines.
    let mut launches = 0;
    for (&tid, t) in &threads {
        let of_tid: Vec<&&Value> = mine.iter().filter(|e| e["tid"] == tid).collect();
        let mut slices: HashMap<String, u64> = HashMap::new();
        let mut instants: HashMap<String, u64> = HashMap::new();
        let mut nested: HashMap<String, u64> = HashMap::new();
        for e in &of_tid {
            match e["type"].as_str().unwrap() {
                "launch" => *instants.entry(api_of(e)).or_default() += 1,
                "ioctl" => {
                    let name = e["name"]
                        .as_str()
                        .map_or_else(|| format!("ioctl {}", e["cmd"].as_str().unwrap()), str::to_string);
                    *slices.entry(name.clone()).or_default() += 1;
                    if let Some(p) = e["parent_api"].as_str() {
                        *nested.entry(format!("{p} > {name}")).or_default() += 1;
                    }
                }
                "init" | "memcpy" | "memset" | "alloc" | "free" | "sync" | "module" | "symbol" | "host_func" => {
                    assert_ne!(e["abandoned"], true);
                    *slices.entry(api_of(e)).or_default() += 1;
                }
                _ => {}
            }
        }
        launches += instants.values().sum::<u64>();
        let as_map =
            |m: &HashMap<String, u64>| -> Value { m.iter().map(|(k, n)| (k.clone(), Value::from(*n))).collect() };
        assert_eq!(t["names"], as_map(&slices), "thread {tid}");
        assert_eq!(t["instants"], as_map(&instants), "thread {tid}");
        let got_nested: HashMap<String, u64> = t["nested"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| slices.keys().any(|s| k.ends_with(&format!(" > {s}"))) && !k.starts_with("NV_ESC"))
            .filter(|(k, _)| !instants.keys().any(|i| k.ends_with(&format!(" > {i}"))))
            .map(|(k, n)| (k.clone(), n.as_u64().unwrap()))
            .filter(|(k, _)| nested.contains_key(k))
            .collect();
        assert_eq!(got_nested, nested, "thread {tid}");
    }
    // cuInit's three RM controls are inside it.
    let init_tid = mine
        .iter()
        .find(|e| e["type"] == "init" && e["api"] == "cuInit")
        .unwrap()["tid"]
        .as_u64()
        .unwrap();
    assert_eq!(count_of(&threads[&init_tid]["nested"], "cuInit > NV_ESC_RM_CONTROL"), 3);
    let expected = expected_calls(&exp);
    let expected_launches = expected
        .iter()
        .filter(|e| is_launch(e["api"].as_str().unwrap()))
        .count() as u64;
    assert_eq!(launches, expected_launches);

    // GPU work: a track per stream under the process, as many slices as CUPTI records.
    let gpu: Vec<&Value> = tracks(&v)
        .filter(|t| t["kind"] == "track" && t["name"].as_str().unwrap_or("").starts_with("GPU "))
        .collect();
    assert!(!gpu.is_empty());
    for t in &gpu {
        assert_eq!(
            (
                t["unclosed"].as_u64(),
                t["unmatched_ends"].as_u64(),
                t["max_depth"].as_u64()
            ),
            (Some(0), Some(0), Some(1)),
            "{t:#}"
        );
        if !t["name"].as_str().unwrap().contains("(overlap") {
            assert_eq!(t["parent"], proc_uuid);
        }
    }
    let gpu_slices: u64 = gpu.iter().map(|t| t["slices"].as_u64().unwrap()).sum();
    let records: Vec<&&Value> = mine
        .iter()
        .filter(|e| ["gpu_kernel", "gpu_memcpy", "gpu_memset"].contains(&e["type"].as_str().unwrap()))
        .collect();
    assert_eq!(gpu_slices, records.len() as u64);
    let kernels: u64 = gpu
        .iter()
        .map(|t| {
            t["names"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| !k.starts_with("mem"))
                .map(|(_, n)| n.as_u64().unwrap())
                .sum::<u64>()
        })
        .sum();
    assert_eq!(
        kernels,
        mine.iter().filter(|e| e["type"] == "gpu_kernel").count() as u64
    );
    assert!(kernels > 0);

    // Every joined record ends the flow its launch (or copy, memset) began.
    let joined = records
        .iter()
        .filter(|e| !e["launch_ts_ns"].is_null() && e["api"].as_str().is_some_and(|a| !a.starts_with("cuGraphLaunch")))
        .count() as u64;
    assert!(joined > 0);
    assert_eq!(v["flows"]["terminated"].as_u64(), Some(joined), "{:#}", v["flows"]);
    assert_eq!(v["flows"]["unmatched_terminations"], 0);
}

#[test]
fn an_all_process_trace_has_nvml_counters_and_process_tracks() {
    let _g = serial();
    require_root();
    let dir = scratch("perfetto-all");
    let mut w = Workload::loaded(&dir);
    let pid = w.pid;
    let procs = dir.join("procs.txt");
    std::fs::write(&procs, format!("{pid} 1 1048576 42\n")).unwrap();
    let trace = dir.join("trace.pftrace");
    let nvml = fixtures().join("nvml").join("libnvidia-ml.so.1");
    let agent = Agent::start_with_env(
        &dir,
        &[
            "--perfetto",
            trace.to_str().unwrap(),
            "--nvml-lib",
            nvml.to_str().unwrap(),
            "--nvml-interval-ms",
            "50",
        ],
        &[("FAKE_NVML_PROCS", procs.to_str().unwrap())],
    );
    agent.wait_stderr("attached", Duration::from_secs(10));
    w.cmd("init");
    w.cmd(&format!("run 1 1 {}", dir.join("expected.jsonl").display()));
    // A few NVML rounds, with the process listed.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        let text = std::fs::read_to_string(dir.join("out.jsonl")).unwrap_or_default();
        if text.lines().filter(|l| l.contains("\"scope\":\"process\"")).count() >= 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    w.exit();
    std::thread::sleep(Duration::from_millis(300));
    let cap = agent.stop();
    let v = decode(&trace);

    // The workload's process and threads, as in a run.
    let proc_track = tracks(&v)
        .find(|t| t["kind"] == "process" && t["pid"] == pid)
        .expect("the workload's process track");
    assert_eq!(proc_track["name"], "cuda_workload");
    let calls = cap
        .events
        .iter()
        .filter(|e| e["pid"] == pid && e["type"] == "sync")
        .count() as u64;
    let slices: u64 = tracks(&v)
        .filter(|t| t["kind"] == "thread" && t["pid"] == pid)
        .map(|t| {
            t["names"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.contains("ynchronize"))
                .map(|(_, n)| n.as_u64().unwrap())
                .sum::<u64>()
        })
        .sum();
    assert!(calls > 0);
    assert_eq!(slices, calls);

    // NVML: per GPU a track, its counters under it, every sample's value as the JSON lines
    // have it (the fake's formula: utilization (10 (i+1) + n) % 101, power 100 W + 1000 i + n mW).
    for dev in 0..2u64 {
        let gpu = tracks(&v)
            .find(|t| t["name"] == format!("GPU {dev} Fake GPU {dev}"))
            .unwrap_or_else(|| panic!("GPU {dev}: {:#}", v["tracks"]));
        let child = |name: &str| {
            tracks(&v)
                .find(|t| t["parent"] == gpu["uuid"] && t["name"] == name)
                .unwrap_or_else(|| panic!("{name} of GPU {dev}"))
        };
        let samples: Vec<&Value> = cap
            .of_type("nvml")
            .filter(|e| e["scope"] == "device" && e["device"] == dev)
            .collect();
        assert!(samples.len() >= 2);
        let util: Vec<f64> = (0..samples.len() as u64)
            .map(|n| ((10 * (dev + 1) + n) % 101) as f64)
            .collect();
        let power: Vec<f64> = (0..samples.len() as u64)
            .map(|n| (100_000 + 1000 * dev + n) as f64 / 1000.0)
            .collect();
        let values = |t: &Value| -> Vec<f64> {
            t["counters"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        assert_eq!(values(child("GPU utilization")), util);
        assert_eq!(values(child("Power")), power);
        assert_eq!(child("Power")["unit_name"], "W");
        let mem = child("Memory used");
        assert_eq!(mem["unit"], 3);
        let used: Vec<f64> = samples
            .iter()
            .map(|s| s["hw.gpu.memory.usage"].as_f64().unwrap())
            .collect();
        assert_eq!(values(mem), used);
    }
    // The process's SM utilization on GPU 1, under its process track.
    let sm = tracks(&v)
        .find(|t| t["parent"] == proc_track["uuid"] && t["name"] == "SM utilization (GPU 1)")
        .expect("the process's SM counter");
    let counters = sm["counters"].as_array().unwrap();
    assert!(!counters.is_empty());
    assert!(counters.iter().all(|c| c.as_f64() == Some(42.0)), "{counters:?}");
}
