//! Issue 16, NVTX: under `run` the injection library is the process's NVTX tool (the fake
//! workload's NVTX client loads it as NVTX does, and it hands the calls to the fake CUPTI);
//! CUPTI's marker records become ranges, and every kernel carries the ranges open on its
//! launching thread — exact names, kinds, depths and stacks.

use serde_json::Value;

use gpu_observer_tests::*;

/// The `nvtx` reply: the thread the ops ran on, and whether a tool took the NVTX calls.
fn nvtx(r: &mut RunAgent, ops: &str) -> (u64, bool) {
    let reply = r.cmd(ops);
    let mut it = reply.split_whitespace().skip(2);
    let tid = it
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("{reply}"));
    (tid, it.next() == Some("1"))
}

/// An `nvtx_range` line as compared: name, kind, thread, domain, depth, ended.
type Range<'a> = (String, String, u64, Option<&'a str>, Value, bool);

fn stacks(cap: &Captured, pid: u32) -> Vec<(String, Value)> {
    let mut v: Vec<(String, Value)> = cap
        .of_type("gpu_kernel")
        .filter(|k| k["pid"] == pid)
        .map(|k| (k["kernel"].as_str().unwrap().to_string(), k["nvtx"].clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn ranges_of_every_kind_and_each_kernels_stack_under_run() {
    let _g = serial();
    require_root();
    let dir = scratch("nvtx-run");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    // Every kernel line (the fake's kernels take 1 µs: duration sampling would leave them out).
    let mut r = RunAgent::with_cupti_args(&dir, &lib, &["--trace-all"], &[]);
    let pid = r.pid;
    r.cmd("init");
    let (main, injected) = nvtx(&mut r, "nvtx push:step push:forward launch:gemm pop launch:relu");
    assert!(injected, "the injection library was not the NVTX tool");
    assert_eq!(main, u64::from(pid));
    nvtx(&mut r, "nvtx start:epoch");
    let (worker, _) = nvtx(&mut r, "nvtx_thread push:worker launch:worker_kernel end pop");
    assert_ne!(worker, main);
    nvtx(
        &mut r,
        "nvtx pop mark:done dpush:NCCL:AllReduce launch:nccl_kernel dpop:NCCL launch:bare",
    );
    let cap = r.finish();
    let err = cap.stderr.join("\n");

    // Each kernel with the ranges open on its own thread when it was launched.
    assert_eq!(
        stacks(&cap, pid),
        [
            ("bare".to_string(), Value::Null),
            ("gemm".to_string(), serde_json::json!(["step", "forward"])),
            ("nccl_kernel".to_string(), serde_json::json!(["NCCL: AllReduce"])),
            ("relu".to_string(), serde_json::json!(["step"])),
            ("worker_kernel".to_string(), serde_json::json!(["worker"])),
        ],
        "{err}"
    );
    let gemm = cap.of_type("gpu_kernel").find(|k| k["kernel"] == "gemm").unwrap();
    assert_eq!(gemm["attributes"]["gpu.nvtx"], "step / forward", "{gemm}");

    // The ranges: pushes nest on their thread; the range started on the main thread and
    // ended on the worker is a process range; the mark is a point.
    let mut ranges: Vec<Range> = cap
        .of_type("nvtx_range")
        .filter(|l| l["pid"] == pid)
        .map(|l| {
            let (start, end) = (l["start_ns"].as_u64().unwrap(), l["end_ns"].as_u64());
            assert_eq!(l["ts_ns"].as_u64(), Some(start), "{l}");
            assert_eq!(l["duration_ns"].as_u64(), end.map(|e| e - start), "{l}");
            (
                l["name"].as_str().unwrap().to_string(),
                l["kind"].as_str().unwrap().to_string(),
                l["tid"].as_u64().unwrap(),
                l["domain"].as_str(),
                l["depth"].clone(),
                end.is_some(),
            )
        })
        .collect();
    ranges.sort_by(|a, b| a.0.cmp(&b.0));
    let t = |name: &str, kind: &str, tid: u64, domain: Option<&'static str>, depth: u64, ended: bool| -> Range {
        (
            name.to_string(),
            kind.to_string(),
            tid,
            domain,
            Value::from(depth),
            ended,
        )
    };
    assert_eq!(
        ranges,
        [
            t("AllReduce", "thread", main, Some("NCCL"), 0, true),
            t("done", "mark", main, None, 0, false),
            t("epoch", "process", main, None, 0, true),
            t("forward", "thread", main, None, 1, true),
            t("step", "thread", main, None, 0, true),
            t("worker", "thread", worker, None, 0, true),
        ],
        "{err}"
    );
    // A range holds what happened inside it: `forward` holds gemm's launch.
    let range = |name: &str| cap.of_type("nvtx_range").find(|l| l["name"] == name).unwrap();
    let (fs, fe) = (
        range("forward")["start_ns"].as_u64().unwrap(),
        range("forward")["end_ns"].as_u64().unwrap(),
    );
    let launch = gemm["launch_ts_ns"].as_u64().unwrap();
    assert!(fs < launch && launch < fe, "{fs} {launch} {fe}");

    let s = cap.process_summary(pid);
    let n = &s["cupti"]["nvtx"];
    assert_eq!(n["state"], "active", "{s}");
    assert_eq!(
        [
            &n["thread_ranges"],
            &n["process_ranges"],
            &n["marks"],
            &n["open_at_end"],
            &n["unmatched_ends"],
            &n["unnamed"],
            &n["evicted"],
            &n["gpu_records_with_stack"]
        ],
        [4, 1, 1, 0, 0, 0, 0, 4],
        "{n}"
    );
}

#[test]
fn nvtx_kept_for_another_tool_is_said_and_records_nothing() {
    let _g = serial();
    require_root();
    let dir = scratch("nvtx-other");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut r = RunAgent::with_cupti_args(
        &dir,
        &lib,
        &["--trace-all"],
        &[("NVTX_INJECTION64_PATH", "/nonexistent/libother.so")],
    );
    let pid = r.pid;
    r.cmd("init");
    let (_, injected) = nvtx(&mut r, "nvtx push:step launch:gemm pop");
    assert!(!injected);
    let cap = r.finish();
    let err = cap.stderr.join("\n");
    assert!(
        err.contains("NVTX_INJECTION64_PATH=/nonexistent/libother.so is kept"),
        "{err}"
    );
    assert_eq!(cap.of_type("nvtx_range").count(), 0);
    assert_eq!(stacks(&cap, pid), [("gemm".to_string(), Value::Null)]);
    let n = &cap.process_summary(pid)["cupti"]["nvtx"];
    assert_eq!(n["state"], "not_loaded", "{n}");
    assert_eq!(n["thread_ranges"], 0, "{n}");
}
