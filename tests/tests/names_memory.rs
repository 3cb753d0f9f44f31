//! Issue 3 end to end: kernel names, where copies go, leaks, sync and ioctl accounting — real
//! eBPF programs against the fake libcuda, exact values.

use std::{collections::BTreeMap, time::Duration};

use gpu_observer_tests::*;
use serde_json::Value;

fn started(dir: &std::path::Path, env: &[(&str, &str)]) -> (Workload, Agent) {
    started_with(dir, env, Agent::start, &[])
}

fn started_with(
    dir: &std::path::Path,
    env: &[(&str, &str)],
    start: fn(&std::path::Path, &[&str]) -> Agent,
    args: &[&str],
) -> (Workload, Agent) {
    let lib = fresh_lib(dir, "libcuda.so.1");
    let mut w = Workload::start_with_env(env);
    w.cmd(&format!("load {}", lib.display()));
    let pid = w.pid.to_string();
    let agent = start(dir, &[&["--pid", pid.as_str()], args].concat());
    agent.wait_stderr("attached", Duration::from_secs(10));
    (w, agent)
}

#[test]
fn launches_are_named_through_modules_libraries_and_kernels() {
    let _g = serial();
    require_root();
    let dir = scratch("names");
    let (mut w, agent) = started(&dir, &[]);
    let exp = dir.join("names.jsonl");
    assert_eq!(w.cmd(&format!("names {}", exp.display())), "ok names _Z9scale_vecPffj");
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let expected = expected_calls(&exp);
    let launches: Vec<&Value> = cap.of_type("launch").filter(|e| e["pid"] == pid).collect();
    assert_eq!(launches.len(), expected.len());
    for (want, got) in expected.iter().zip(&launches) {
        assert_eq!(got["function"], want["function"], "{got}");
        assert_eq!(got["kernel_mangled"], want["kernel_mangled"], "{got}");
    }
    let mut by_kernel: BTreeMap<String, usize> = BTreeMap::new();
    for l in &launches {
        *by_kernel
            .entry(l["kernel"].as_str().unwrap_or("<unresolved>").to_string())
            .or_default() += 1;
    }
    let want: BTreeMap<String, usize> = [
        ("scale_vec(float*, float, unsigned int)", 3),
        ("write_value", 2),
        ("void foo::kernel<float>(float*, int)", 5),
        ("<unresolved>", 1),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_string(), n))
    .collect();
    assert_eq!(by_kernel, want);

    // The naming calls themselves, with the handles they produced.
    let symbols: Vec<&Value> = cap.of_type("symbol").collect();
    let apis: Vec<&str> = symbols.iter().map(|s| s["api"].as_str().unwrap()).collect();
    assert_eq!(
        apis,
        [
            "cuModuleGetFunction",
            "cuModuleGetFunction",
            "cuLibraryGetKernel",
            "cuKernelGetFunction",
            "cuFuncGetName"
        ]
    );
    assert_eq!(symbols[0]["name"], "_Z9scale_vecPffj");
    assert_eq!(symbols[0]["kernel"], "scale_vec(float*, float, unsigned int)");
    assert_eq!(symbols[3]["name"], Value::Null, "cuKernelGetFunction passes no name");
    assert_eq!(symbols[3]["kernel"], "void foo::kernel<float>(float*, int)");
    assert_eq!(symbols[3]["owner"], symbols[2]["handle"]);
    assert_eq!(
        symbols[4]["name"], "_Z9scale_vecPffj",
        "cuFuncGetName's out-string is read"
    );
    assert_eq!(symbols[4]["handle"], symbols[0]["handle"]);
    let modules: Vec<&str> = cap.of_type("module").map(|m| m["api"].as_str().unwrap()).collect();
    assert_eq!(
        modules,
        [
            "cuModuleLoadData",
            "cuLibraryLoadData",
            "cuModuleUnload",
            "cuLibraryUnload"
        ]
    );
    let s = cap.process_summary(pid);
    assert_eq!(
        (s["named_launches"].as_u64(), s["unresolved_launches"].as_u64()),
        (Some(10), Some(1))
    );
}

#[test]
fn handles_named_before_the_observer_attached_are_unresolved_and_counted() {
    let _g = serial();
    require_root();
    let dir = scratch("unresolved");
    let mut w = Workload::loaded(&dir);
    // Names fetched before any observer: the launches after attach cannot be named.
    let early = dir.join("early.jsonl");
    w.cmd(&format!("names {}", early.display()));
    let agent = Agent::start(&dir, &["--pid", &w.pid.to_string()]);
    agent.wait_stderr("attached", Duration::from_secs(10));
    let exp = dir.join("expected.jsonl");
    w.cmd(&format!("run 1 2 {}", exp.display()));
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let s = cap.process_summary(pid);
    // 6 kernel launches a round (graph launches are not kernels), none named.
    assert_eq!(
        (s["named_launches"].as_u64(), s["unresolved_launches"].as_u64()),
        (Some(0), Some(12))
    );
    assert!(cap.of_type("launch").all(|l| l["kernel"].is_null()));
}

#[test]
fn copies_get_direction_and_host_memory_from_tracked_allocations() {
    let _g = serial();
    require_root();
    let dir = scratch("directions");
    let (mut w, agent) = started(&dir, &[("FAKE_CUDA_SYNC_US", "3000")]);
    w.cmd("init");
    let exp = dir.join("directions.jsonl");
    w.cmd(&format!("directions {}", exp.display()));
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let expected = expected_calls(&exp);
    let copies: Vec<&Value> = cap.of_type("memcpy").filter(|e| e["pid"] == pid).collect();
    assert_eq!(copies.len(), expected.len());
    for (want, got) in expected.iter().zip(&copies) {
        for k in ["api", "tid", "bytes", "direction", "host_memory"] {
            assert_eq!(got[k], want[k], "{k}: expected {want}, got {got}");
        }
    }
    let s = cap.process_summary(pid);
    // Generic/peer copies resolved from allocations: all but the host-to-host one.
    assert_eq!(s["memcpy"]["inferred"], 8);
    assert_eq!(
        (s["memcpy"]["pinned"].as_u64(), s["memcpy"]["pageable"].as_u64()),
        (Some(5), Some(4))
    );

    // Leaks: the managed block and one device block were never freed.
    let leaks: Vec<(String, String, u64, u64)> = cap
        .of_type("leak")
        .filter(|l| l["pid"] == pid)
        .map(|l| {
            assert_eq!(l["process_exited"], true);
            (
                l["api"].as_str().unwrap().to_string(),
                l["memory"].as_str().unwrap().to_string(),
                l["count"].as_u64().unwrap(),
                l["bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        leaks,
        vec![
            ("cuMemAllocManaged".into(), "managed".into(), 1, 65536),
            ("cuMemAlloc_v2".into(), "device".into(), 1, 12345),
        ]
    );
    assert_eq!(s["outstanding"]["device"], 12345);
    assert_eq!(s["outstanding"]["managed"], 65536);
    assert_eq!(
        s["outstanding"]["host_pinned"], 0,
        "pinned block freed, registration undone"
    );
    assert_eq!(s["leaks"].as_array().unwrap().len(), 2);
    // The memory timeline ends at the outstanding bytes.
    let last_mem = cap
        .of_type("memory")
        .filter(|m| m["pid"] == pid)
        .last()
        .expect("memory samples");
    assert_eq!(
        (last_mem["device_bytes"].as_u64(), last_mem["managed_bytes"].as_u64()),
        (Some(12345), Some(65536))
    );

    // Sync accounting per stream, event and context (3 ms each in the fake).
    let by: BTreeMap<String, (u64, u64)> = s["sync"]["by_target"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                format!(
                    "{} {}",
                    t["kind"].as_str().unwrap(),
                    t["handle"].as_str().unwrap_or("-")
                ),
                (t["count"].as_u64().unwrap(), t["duration_ns"].as_u64().unwrap()),
            )
        })
        .collect();
    let counts: BTreeMap<&str, u64> = by.iter().map(|(k, v)| (k.as_str(), v.0)).collect();
    assert_eq!(
        counts,
        [
            ("context -", 1),
            ("event 0xe1", 2),
            ("stream 0x51", 3),
            ("stream 0x52", 1)
        ]
        .into_iter()
        .collect()
    );
    for (k, (n, ns)) in &by {
        assert!(*ns >= n * 3_000_000, "{k}: {ns} ns for {n} syncs of 3 ms");
    }
    let total: u64 = by.values().map(|v| v.1).sum();
    assert_eq!(s["sync"]["duration_ns"].as_u64().unwrap(), total);
    let fraction = s["sync"]["wall_fraction"].as_f64().unwrap();
    assert!(fraction > 0.0 && fraction <= 1.0, "{fraction}");
    // Syncs of 3 ms are over the 100 µs threshold: marked slow.
    assert!(cap.of_type("sync").all(|e| e["is_slow"] == true));
    assert!(cap.of_type("memcpy").all(|e| e["is_slow"] == false));
}

#[test]
fn ioctls_are_named_and_accounted_per_call_and_command() {
    let _g = serial();
    require_root();
    let dir = scratch("ioctl-names");
    let (mut w, agent) = started(&dir, &[("FAKE_CUDA_SYNC_US", "0")]);
    w.cmd("init");
    w.cmd(&format!("run 1 4 {}", dir.join("e.jsonl").display()));
    // Alive while the agent reads /proc/<pid>/fd for the device names.
    w.cmd("sleep 300");
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    for e in cap.of_type("ioctl") {
        let want = match e["cmd"].as_str().unwrap() {
            "0xc020462a" => Value::from("NV_ESC_RM_CONTROL"),
            "0xc030462b" => Value::from("NV_ESC_RM_ALLOC"),
            // 0x25 on /dev/null: not the uvm device, and not an 'F' ioctl.
            "0x25" => Value::Null,
            other => panic!("unexpected ioctl {other}"),
        };
        assert_eq!(e["name"], want, "{e}");
        assert_eq!(e["device"], "/dev/null");
    }
    let s = cap.process_summary(pid);
    let by_api = &s["ioctl"]["by_api"];
    assert_eq!(by_api["cuInit"]["count"], 3);
    assert_eq!(by_api["cuDevicePrimaryCtxRetain"]["count"], 2);
    assert_eq!(by_api["cuMemAlloc_v2"]["count"], 8);
    assert_eq!(by_api["cuStreamSynchronize"]["count"], 4);
    let top: BTreeMap<String, u64> = s["ioctl"]["top_commands"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap_or(c["cmd"].as_str().unwrap()).to_string(),
                c["count"].as_u64().unwrap(),
            )
        })
        .collect();
    let want: BTreeMap<String, u64> = [
        ("NV_ESC_RM_CONTROL", 3 + 5 * 4),
        ("NV_ESC_RM_ALLOC", 2 + 4),
        ("0x25", 4),
    ]
    .into_iter()
    .map(|(k, n)| (k.into(), n))
    .collect();
    assert_eq!(top, want);
}

#[test]
fn fast_calls_are_sampled_out_and_counted_unless_trace_all() {
    let _g = serial();
    require_root();
    let dir = scratch("sampling");
    // Syncs take 3 ms in the fake: always over a 2 ms threshold; copies take microseconds.
    let (mut w, agent) = started_with(
        &dir,
        &[("FAKE_CUDA_SYNC_US", "3000")],
        Agent::start_sampled,
        &["--threshold-us", "2000"],
    );
    w.cmd("init");
    let exp = dir.join("directions.jsonl");
    w.cmd(&format!("directions {}", exp.display()));
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    let copies = expected_calls(&exp).len() as u64;
    let total = cap.total();
    assert_eq!(
        (total["trace_all"].as_bool(), total["threshold_us"].as_u64()),
        (Some(false), Some(2000))
    );
    // Every sync is written (7 in this workload), none sampled out.
    let syncs: Vec<&Value> = cap.of_type("sync").filter(|e| e["pid"] == pid).collect();
    assert_eq!(syncs.len(), 7);
    assert!(syncs.iter().all(|e| e["duration_ns"].as_u64().unwrap() >= 2_000_000));
    assert_eq!(total["sampled_out"]["sync"], 0);
    // Copies: written only when slow, the rest counted; together exactly the calls made.
    let written: Vec<&Value> = cap.of_type("memcpy").filter(|e| e["pid"] == pid).collect();
    assert!(written.iter().all(|e| e["duration_ns"].as_u64().unwrap() >= 2_000_000));
    assert_eq!(
        written.len() as u64 + total["sampled_out"]["memcpy"].as_u64().unwrap(),
        copies
    );
    // The summaries still account for every call.
    let s = cap.process_summary(pid);
    let counted: u64 = ["cpu_to_gpu", "gpu_to_cpu", "gpu_to_gpu", "unknown"]
        .iter()
        .map(|d| s["memcpy"][d]["count"].as_u64().unwrap())
        .sum();
    assert_eq!(counted, copies, "{s}");
}
