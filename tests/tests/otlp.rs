//! Issue 6: OTLP export end to end. The agent observes a fake-libcuda workload with exactly
//! known calls (and a fake NVML) and exports over gRPC or HTTP/protobuf to an in-process
//! receiver, which must get exactly the spans and metrics those calls make; with the
//! collector down, the agent must run on, count what it could not send, and exit on time.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use gpu_observer_tests::{
    otlp::{Receiver, attr, points},
    *,
};
use serde_json::Value;

fn fake_nvml() -> String {
    fixtures().join("nvml/libnvidia-ml.so.1").display().to_string()
}

/// Runs the workload's scripted calls under an agent exporting to `endpoint`.
fn run_exported(name: &str, endpoint: &str, protocol: &str) -> (Captured, Vec<Value>, u32) {
    let dir = scratch(name);
    let mut w = Workload::loaded(&dir);
    let nvml = fake_nvml();
    let agent = Agent::start(
        &dir,
        &[
            "--pid",
            &w.pid.to_string(),
            "--otlp-endpoint",
            endpoint,
            "--otlp-protocol",
            protocol,
            "--otlp-interval-ms",
            "500",
            "--otlp-max-spans-per-sec",
            "0",
            "--nvml-lib",
            &nvml,
        ],
    );
    agent.wait_stderr("attached", Duration::from_secs(10));
    let exp = dir.join("expected.jsonl");
    w.cmd(&format!("run 1 1 {}", exp.display()));
    let pid = w.pid;
    w.exit();
    let cap = agent.finish();
    assert!(cap.status.success(), "{:?}", cap.stderr);
    (cap, expected_calls(&exp), pid)
}

/// API spans by name, ioctl spans, and the roots, of one process.
fn check_spans(rx: &Receiver, cap: &Captured, expected: &[Value], pid: u32) {
    let spans = rx.spans();
    assert!(!spans.is_empty(), "no spans received");
    let (res, _) = &spans[0];
    assert_eq!(attr(res, "service.name").as_deref(), Some("gpu-observer"));
    assert!(attr(res, "gpu.tracing.backends").is_some_and(|b| b.contains("uprobes")));
    assert!(attr(res, "host.name").is_some());

    let roots: HashMap<Vec<u8>, &opentelemetry_proto::tonic::trace::v1::Span> = spans
        .iter()
        .map(|(_, s)| s)
        .filter(|s| s.parent_span_id.is_empty())
        .map(|s| (s.span_id.clone(), s))
        .collect();
    for r in roots.values() {
        assert_eq!(r.name, "process cuda_workload");
        assert_eq!(attr(&r.attributes, "process.pid"), Some(pid.to_string()));
    }
    let is_ioctl = |s: &opentelemetry_proto::tonic::trace::v1::Span| attr(&s.attributes, "ioctl.cmd").is_some();
    // One span per call the workload made, named by its entry point, under its window's root.
    let mut got: BTreeMap<String, usize> = BTreeMap::new();
    let by_id: HashMap<Vec<u8>, &opentelemetry_proto::tonic::trace::v1::Span> =
        spans.iter().map(|(_, s)| (s.span_id.clone(), s)).collect();
    for (_, s) in spans
        .iter()
        .filter(|(_, s)| !s.parent_span_id.is_empty() && !is_ioctl(s))
    {
        *got.entry(s.name.clone()).or_default() += 1;
        let root = roots.get(&s.parent_span_id).expect("API span under a root");
        assert_eq!(root.trace_id, s.trace_id);
        assert!(s.start_time_unix_nano >= root.start_time_unix_nano && s.end_time_unix_nano <= root.end_time_unix_nano);
    }
    let mut want: BTreeMap<String, usize> = BTreeMap::new();
    for e in expected {
        *want.entry(e["api"].as_str().unwrap().to_string()).or_default() += 1;
    }
    // cuInit is not part of the scripted run's record but the agent saw it (load + init).
    let observed_extra: BTreeMap<String, usize> = got
        .iter()
        .filter(|(k, _)| !want.contains_key(*k))
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    let got_scripted: BTreeMap<String, usize> = got.into_iter().filter(|(k, _)| want.contains_key(k)).collect();
    assert_eq!(got_scripted, want, "spans per entry point vs the calls made");
    let jsonl_extra = cap
        .events
        .iter()
        .filter(|e| e["pid"] == pid && e["api"].is_string() && is_event(e) && e["type"] != "ioctl")
        .filter(|e| !want.contains_key(e["api"].as_str().unwrap()))
        .count();
    assert_eq!(
        observed_extra.values().sum::<usize>(),
        jsonl_extra,
        "{observed_extra:?}"
    );

    // Every ioctl the agent saw, as a span; those made inside a returning call under it.
    let ioctls: Vec<&opentelemetry_proto::tonic::trace::v1::Span> =
        spans.iter().map(|(_, s)| s).filter(|s| is_ioctl(s)).collect();
    let jsonl_ioctls = cap.count(|e| e["type"] == "ioctl" && e["pid"] == pid);
    assert!(jsonl_ioctls > 0);
    assert_eq!(ioctls.len(), jsonl_ioctls);
    let mut under_calls = 0;
    for io in &ioctls {
        let parent = by_id.get(&io.parent_span_id).expect("ioctl span has a parent");
        if !parent.parent_span_id.is_empty() {
            // Under a call: inside it, on its thread.
            assert!(io.start_time_unix_nano >= parent.start_time_unix_nano);
            assert!(io.start_time_unix_nano <= parent.end_time_unix_nano);
            assert_eq!(attr(&io.attributes, "thread.id"), attr(&parent.attributes, "thread.id"));
            assert_eq!(
                attr(&io.attributes, "gpu.cuda.api").as_deref(),
                Some(parent.name.as_str())
            );
            under_calls += 1;
        }
    }
    let in_returning_calls = cap
        .count(|e| e["type"] == "ioctl" && e["pid"] == pid && e["parent_api"].as_str().is_some_and(|a| !is_launch(a)));
    assert_eq!(under_calls, in_returning_calls);
}

/// The per-process metrics equal the agent's own totals; NVML's come from the fake.
fn check_metrics(rx: &Receiver, cap: &Captured, pid: u32) {
    let summary = cap.process_summary(pid);
    let of_pid = |name: &str| -> Vec<(Vec<opentelemetry_proto::tonic::common::v1::KeyValue>, f64)> {
        let (_, m) = rx.metric(name).unwrap_or_else(|| panic!("no metric {name}"));
        points(&m)
            .into_iter()
            .filter(|(a, _)| attr(a, "process.pid") == Some(pid.to_string()))
            .collect()
    };
    let launches = of_pid("gpu.cuda.launches");
    assert_eq!(launches.len(), 1);
    assert_eq!(launches[0].1, summary["launches"].as_f64().unwrap());
    for (a, v) in of_pid("gpu.cuda.memcpy.bytes") {
        let dir = attr(&a, "gpu_transfer.direction").unwrap();
        assert_eq!(v, summary["memcpy"][&dir]["bytes"].as_f64().unwrap(), "{dir}");
    }
    let sync = of_pid("gpu.cuda.sync.duration");
    assert_eq!(sync[0].1, summary["sync"]["duration_ns"].as_f64().unwrap() / 1e9);
    let ioctls = of_pid("gpu.cuda.ioctl.count");
    assert_eq!(ioctls[0].1, summary["ioctl"]["count"].as_f64().unwrap());

    let (res, util) = rx.metric("hw.gpu.utilization").expect("NVML metrics");
    assert_eq!(attr(&res, "gpu.driver.version").as_deref(), Some("580.65.06"));
    assert_eq!(attr(&res, "gpu.cuda.driver.version").as_deref(), Some("13.0"));
    let general: Vec<_> = points(&util)
        .into_iter()
        .filter(|(a, _)| attr(a, "hw.gpu.task").as_deref() == Some("general"))
        .map(|(a, _)| attr(&a, "hw.id").unwrap())
        .collect();
    assert_eq!(general.len(), 2, "both fake GPUs");
    let (_, limit) = rx.metric("hw.gpu.memory.limit").unwrap();
    let l: HashMap<String, f64> = points(&limit)
        .into_iter()
        .map(|(a, v)| (attr(&a, "hw.id").unwrap(), v))
        .collect();
    assert_eq!(l["GPU-fake-0000"], (80u64 << 30) as f64);
    assert_eq!(l["GPU-fake-0001"], (96u64 << 30) as f64);
    let (_, events) = rx.metric("gpu_observer.events").unwrap();
    assert_eq!(points(&events)[0].1, cap.total()["events"].as_f64().unwrap());

    let o = &cap.total()["otlp"];
    assert_eq!(o["spans_dropped"], 0, "{o}");
    assert_eq!(o["trace_export_failures"], 0, "{o}");
    assert_eq!(
        o["spans_exported"].as_u64(),
        Some(rx.spans().len() as u64),
        "{o} {:?}",
        cap.stderr
    );
    assert!(o["metric_exports"].as_u64().unwrap() >= 1, "{o}");
}

#[test]
fn grpc_export_carries_every_call_its_ioctls_and_the_metrics() {
    let _g = serial();
    require_root();
    let rx = Receiver::grpc();
    let (cap, expected, pid) = run_exported("otlp-grpc", &rx.endpoint(), "grpc");
    check_spans(&rx, &cap, &expected, pid);
    check_metrics(&rx, &cap, pid);
}

#[test]
fn http_protobuf_export_carries_the_same() {
    let _g = serial();
    require_root();
    let rx = Receiver::http();
    let (cap, expected, pid) = run_exported("otlp-http", &rx.endpoint(), "http/protobuf");
    check_spans(&rx, &cap, &expected, pid);
    check_metrics(&rx, &cap, pid);
}

#[test]
fn a_collector_that_is_down_costs_counted_drops_and_nothing_else() {
    let _g = serial();
    require_root();
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let start = Instant::now();
    let (cap, expected, pid) = run_exported("otlp-down", &format!("http://127.0.0.1:{port}"), "grpc");
    // The agent's own output is whole, and it finished on time.
    let got = cap.count(|e| {
        e["pid"] == pid && is_event(e) && e["api"].is_string() && expected.iter().any(|x| x["api"] == e["api"])
    });
    assert_eq!(got, expected.len());
    assert!(start.elapsed() < Duration::from_secs(40), "{:?}", start.elapsed());
    let o = &cap.total()["otlp"];
    assert_eq!(o["spans_exported"], 0, "{o}");
    assert!(o["spans_dropped"].as_u64().unwrap() > 0, "{o}");
    assert!(o["trace_export_failures"].as_u64().unwrap() >= 1, "{o}");
    assert!(o["metric_export_failures"].as_u64().unwrap() >= 1, "{o}");
    assert!(
        cap.stderr.iter().any(|l| l.contains("OTLP trace export failed")),
        "{:?}",
        cap.stderr
    );
}

#[test]
fn format_none_exports_over_otlp_and_writes_nothing_locally() {
    let _g = serial();
    require_root();
    let rx = Receiver::grpc();
    let dir = scratch("otlp-none");
    let mut w = Workload::loaded(&dir);
    let agent = Agent::start(
        &dir,
        &[
            "--pid",
            &w.pid.to_string(),
            "--otlp-endpoint",
            &rx.endpoint(),
            "--otlp-max-spans-per-sec",
            "0",
            "--format",
            "none",
        ],
    );
    agent.wait_stderr("attached", Duration::from_secs(10));
    let exp = dir.join("expected.jsonl");
    w.cmd(&format!("run 1 1 {}", exp.display()));
    w.exit();
    let cap = agent.finish();
    assert!(cap.status.success(), "{:?}", cap.stderr);
    assert!(cap.events.is_empty(), "nothing written locally");
    let launches = expected_calls(&exp)
        .iter()
        .filter(|e| e["api"].as_str().is_some_and(is_launch))
        .count();
    let spans = rx.spans();
    let got = spans.iter().filter(|(_, s)| is_launch(&s.name)).count();
    assert_eq!(got, launches);
    assert!(
        cap.stderr.iter().any(|l| l.contains("spans exported, 0 dropped")),
        "{:?}",
        cap.stderr
    );
}

/// Issue 13: `gpu.cuda.time` — wall time a process held a context on each GPU NVML lists it
/// on, under its verdict's class, with no pid label. The fake NVML lists the workload on both
/// fake GPUs at 90 % SM, so its windows are gpu_bound and both GPUs get the same seconds.
#[test]
fn gpu_time_by_class_counts_each_gpu_a_process_holds_and_names_no_pid() {
    let _g = serial();
    require_root();
    let rx = Receiver::grpc();
    let dir = scratch("otlp-gpu-time");
    let mut w = Workload::loaded(&dir);
    let procs = dir.join("procs.txt");
    std::fs::write(&procs, format!("{0} 0 1048576 90\n{0} 1 1048576 90\n", w.pid)).unwrap();
    let started = Instant::now();
    let agent = Agent::start_with_env(
        &dir,
        &[
            "--pid",
            &w.pid.to_string(),
            "--interval-ms",
            "100",
            "--nvml-lib",
            &fake_nvml(),
            "--nvml-interval-ms",
            "50",
            "--otlp-endpoint",
            &rx.endpoint(),
            "--otlp-interval-ms",
            "500",
            "--otlp-max-spans-per-sec",
            "0",
        ],
        // Both GPUs 90 % busy: the process is alone on them, so that is its busy time.
        &[
            ("FAKE_NVML_PROCS", procs.to_str().unwrap()),
            ("FAKE_NVML_GPU_UTIL", "90,90"),
        ],
    );
    agent.wait_stderr("attached", Duration::from_secs(10));
    // Calls for 3 s (the fake's launches cost nothing: a sleep paces them).
    for _ in 0..30 {
        assert!(w.cmd("burst 100").starts_with("ok"));
        std::thread::sleep(Duration::from_millis(100));
    }
    w.exit();
    let cap = agent.finish();
    let elapsed = started.elapsed().as_secs_f64();
    assert!(cap.status.success(), "{:?}", cap.stderr);
    let (_, m) = rx.metric("gpu.cuda.time").expect("gpu.cuda.time exported");
    let pts = points(&m);
    let mut by_gpu: BTreeMap<String, f64> = BTreeMap::new();
    let mut gpu_bound: BTreeMap<String, f64> = BTreeMap::new();
    for (a, v) in &pts {
        assert_eq!(attr(a, "process.pid"), None, "no pid label: {a:?}");
        let gpu = attr(a, "hw.id").unwrap();
        let class = attr(a, "gpu.bottleneck").unwrap();
        *by_gpu.entry(gpu.clone()).or_default() += v;
        if class == "gpu_bound" {
            *gpu_bound.entry(gpu).or_default() += v;
        }
    }
    let gpus: Vec<&str> = by_gpu.keys().map(String::as_str).collect();
    assert_eq!(gpus, ["GPU-fake-0000", "GPU-fake-0001"], "{pts:?}");
    // The same ticks are counted on both GPUs, in the same order: the same sums.
    assert_eq!(by_gpu["GPU-fake-0000"], by_gpu["GPU-fake-0001"], "{pts:?}");
    assert_eq!(gpu_bound["GPU-fake-0000"], gpu_bound["GPU-fake-0001"], "{pts:?}");
    // Held at most as long as the agent ran; gpu_bound for most of the 3 s of calls.
    assert!(by_gpu["GPU-fake-0000"] <= elapsed, "{pts:?} in {elapsed} s");
    assert!(gpu_bound["GPU-fake-0000"] >= 2.0, "{pts:?}");
}

/// A double attribute's value.
fn double(attrs: &[opentelemetry_proto::tonic::common::v1::KeyValue], key: &str) -> f64 {
    use opentelemetry_proto::tonic::common::v1::any_value::Value as V;
    match attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
    {
        Some(V::DoubleValue(d)) => *d,
        other => panic!("{key}: not a double: {other:?}"),
    }
}

type Span = opentelemetry_proto::tonic::trace::v1::Span;
type SpanEvent = opentelemetry_proto::tonic::trace::v1::span::Event;

/// The received spans' `gpu.anomaly` events are exactly the JSON `anomaly` lines: as many, and
/// each line the one event with its numbers, at the start of the span it is on. Returns each
/// line's span and event, in the lines' order.
fn events_of<'a>(spans: &'a [Span], lines: &[&Value]) -> Vec<(&'a Span, &'a SpanEvent)> {
    let events: Vec<(&Span, &SpanEvent)> = spans
        .iter()
        .flat_map(|s| s.events.iter().map(move |e| (s, e)))
        .collect();
    assert_eq!(events.len(), lines.len(), "{lines:?}\n{events:?}");
    // The JSON line rounds observed and typical to 0.1, deviation to 0.01.
    let tenth = |v: f64| format!("{v:.1}");
    let mut out = Vec::new();
    for l in lines {
        let observed = tenth(l["observed"].as_f64().unwrap());
        let same: Vec<&(&Span, &SpanEvent)> = events
            .iter()
            .filter(|(_, e)| tenth(double(&e.attributes, "gpu.anomaly.observed")) == observed)
            .collect();
        assert_eq!(same.len(), 1, "{l}: {same:?}");
        let (s, e) = *same[0];
        let a = &e.attributes;
        assert_eq!(e.name, "gpu.anomaly");
        assert_eq!(e.time_unix_nano, s.start_time_unix_nano, "{l}");
        assert_eq!(attr(a, "gpu.anomaly.what").as_deref(), l["what"].as_str(), "{l}");
        let key = match &l["key"] {
            Value::String(kernel) => kernel.clone(),
            k => k["api"].as_str().or(k["direction"].as_str()).unwrap().to_string(),
        };
        assert_eq!(attr(a, "gpu.anomaly.key"), Some(key), "{l}");
        assert_eq!(
            attr(a, "gpu.anomaly.size_class"),
            l["key"].get("size_class").map(Value::to_string),
            "{l}"
        );
        assert_eq!(attr(a, "gpu.anomaly.unit").as_deref(), l["unit"].as_str(), "{l}");
        assert_eq!(attr(a, "gpu.anomaly.mode").as_deref(), l["mode"].as_str(), "{l}");
        assert_eq!(
            tenth(double(a, "gpu.anomaly.typical")),
            tenth(l["typical"].as_f64().unwrap()),
            "{l}"
        );
        let deviation = double(a, "gpu.anomaly.deviation");
        assert_eq!(
            format!("{deviation:.2}"),
            format!("{:.2}", l["deviation"].as_f64().unwrap()),
            "{l}"
        );
        out.push((s, e));
    }
    out
}

/// `gpu.anomalies`: a monotonic counter in `{anomaly}`, labelled by what and mode only (no pid,
/// no kernel; no pod here: not in a container), counting the JSON lines by what.
fn check_anomaly_counter(rx: &Receiver, lines: &[&Value]) {
    let (_, m) = rx.metric("gpu.anomalies").expect("gpu.anomalies exported");
    assert_eq!(m.unit, "{anomaly}");
    match &m.data {
        Some(opentelemetry_proto::tonic::metrics::v1::metric::Data::Sum(s)) => assert!(s.is_monotonic),
        other => panic!("not a counter: {other:?}"),
    }
    let mut counted: BTreeMap<(String, String), f64> = BTreeMap::new();
    for (a, v) in points(&m) {
        let mut keys: Vec<&str> = a.iter().map(|kv| kv.key.as_str()).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["gpu.anomaly.mode", "gpu.anomaly.what"], "{a:?}");
        let what = attr(&a, "gpu.anomaly.what").unwrap();
        counted.insert((what, attr(&a, "gpu.anomaly.mode").unwrap()), v);
    }
    let mut want: BTreeMap<(String, String), f64> = BTreeMap::new();
    for l in lines {
        let key = (
            l["what"].as_str().unwrap().to_string(),
            l["mode"].as_str().unwrap().to_string(),
        );
        *want.entry(key).or_default() += 1.0;
    }
    assert_eq!(counted, want);
}

/// Issue 14: anomalies over OTLP. The planted slow kernel of tests/anomaly.rs (a 20 µs run of
/// a steady 2 µs kernel of the same name and shape, under the fake CUPTI) is one `gpu.anomaly`
/// event on its own `gpu_kernel` span — observed its duration there — with the numbers of its
/// JSON `anomaly` line, and `gpu.anomalies` counts it once. At one span a second (the launches
/// take each second's), the span rate limit is what would have dropped it.
#[test]
fn a_planted_slow_kernel_is_an_event_on_its_gpu_span_and_counted_once() {
    let _g = serial();
    require_root();
    let rx = Receiver::grpc();
    let dir = scratch("otlp-anomaly-kernel");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let endpoint = rx.endpoint();
    let mut r = RunAgent::with_cupti_args(
        &dir,
        &lib,
        &["--otlp-endpoint", &endpoint, "--otlp-max-spans-per-sec", "1"],
        &[],
    );
    let pid = r.pid;
    r.cmd("init");
    for script in [
        "loop 300 launch:2:steady_kernel sleep:200",
        "cupti_slowdown 10",
        "loop 0 launch:2:steady_kernel",
        "cupti_slowdown 1",
        "loop 300 launch:2:steady_kernel sleep:200",
    ] {
        let reply = r.cmd(script);
        assert!(reply.starts_with("ok "), "{reply}");
    }
    let cap = r.finish();
    let err = cap.stderr.join("\n");
    let lines: Vec<&Value> = cap.of_type("anomaly").filter(|a| a["pid"] == pid).collect();
    assert_eq!(lines.len(), 1, "{lines:?}\n{err}");
    let slow: Vec<&Value> = cap
        .of_type("gpu_kernel")
        .filter(|k| k["pid"] == pid && k["gpu_duration_ns"] == 20_000)
        .collect();
    assert_eq!(slow.len(), 1, "{slow:?}");

    let spans: Vec<Span> = rx.spans().into_iter().map(|(_, s)| s).collect();
    let found = events_of(&spans, &lines);
    let (span, e) = found[0];
    assert_eq!(span.name, "gpu_kernel steady_kernel");
    assert_eq!(
        attr(&span.attributes, "gpu.cuda.correlation_id"),
        Some(slow[0]["correlation_id"].to_string())
    );
    let took = span.end_time_unix_nano - span.start_time_unix_nano;
    assert_eq!(took, 20_000);
    // At the kernel's GPU start, with exactly these attributes.
    assert_eq!(e.time_unix_nano, span.start_time_unix_nano);
    let keys: Vec<&str> = e.attributes.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "gpu.anomaly.what",
            "gpu.anomaly.key",
            "gpu.anomaly.observed",
            "gpu.anomaly.typical",
            "gpu.anomaly.unit",
            "gpu.anomaly.deviation",
            "gpu.anomaly.mode"
        ]
    );
    let a = &e.attributes;
    assert_eq!(attr(a, "gpu.anomaly.what").as_deref(), Some("kernel"));
    assert_eq!(attr(a, "gpu.anomaly.key").as_deref(), Some("steady_kernel"));
    assert_eq!(attr(a, "gpu.anomaly.unit").as_deref(), Some("ns"));
    assert_eq!(attr(a, "gpu.anomaly.mode").as_deref(), Some("robust"));
    assert_eq!(double(a, "gpu.anomaly.observed"), took as f64);
    // The series keeps ln(value) as f32: typical is 2 µs to f32 precision.
    assert_eq!(format!("{:.1}", double(a, "gpu.anomaly.typical")), "2000.0");
    // ln(10) over the robust scale's floor (0.02): 115 deviations.
    assert!((double(a, "gpu.anomaly.deviation") - 10f64.ln() / 0.02).abs() < 0.01);
    check_anomaly_counter(&rx, &lines);
    let o = &cap.total()["otlp"];
    assert_eq!(o["anomalies_dropped"], 0, "{o}");
    assert_eq!(o["anomalies_unattached"], 0, "{o}");
    assert!(
        o["spans_sampled_out"].as_u64().unwrap() > 0,
        "the rate limit left spans out: {o}"
    );
}

/// Without CUPTI, the planted slow copy and synchronize of tests/anomaly.rs (one pass at 50×
/// the steady 1 ms, threshold 30): the copy's span carries two events — its time, then the
/// bandwidth its call measured — and the synchronize's one; observed is each call's time
/// there (its bandwidth: bytes over it). The steady calls really sleep: on a loaded machine one
/// may wake late enough to be flagged too, so the planted ones are found by their times, and
/// every line is checked as an event.
#[test]
fn a_slow_copy_and_synchronize_are_events_on_their_call_spans() {
    let _g = serial();
    require_root();
    let rx = Receiver::grpc();
    let dir = scratch("otlp-anomaly-calls");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let endpoint = rx.endpoint();
    let agent = Agent::start(
        &dir,
        &[
            "--libcuda",
            lib.to_str().unwrap(),
            "--no-nvml",
            "--anomaly-threshold",
            "30",
            "--anomaly-warmup",
            "16",
            "--otlp-endpoint",
            &endpoint,
        ],
    );
    let mut w = Workload::start();
    w.cmd(&format!("load {}", lib.display()));
    let pid = w.pid;
    for script in [
        "init",
        "timing 1000 64",
        "loop 80 htod:65536 sync",
        "timing 50000 1",
        "loop 0 htod:65536 sync",
        "timing 1000 64",
        "loop 40 htod:65536 sync",
    ] {
        let reply = w.cmd(script);
        assert!(reply.starts_with("ok "), "{reply}");
    }
    w.exit();
    let cap = agent.stop();
    let lines: Vec<&Value> = cap.of_type("anomaly").filter(|a| a["pid"] == pid).collect();
    let spans: Vec<Span> = rx.spans().into_iter().map(|(_, s)| s).collect();
    let found = events_of(&spans, &lines);
    // The planted ones: the copy slept 65 536 µs (1 MB/s), the synchronize 50 ms.
    let planted = |api: &str, at_least: f64| -> usize {
        let i: Vec<usize> = (0..lines.len())
            .filter(|i| lines[*i]["key"]["api"] == api && lines[*i]["observed"].as_f64().unwrap() >= at_least)
            .collect();
        assert_eq!(i.len(), 1, "{api}: {lines:?}");
        i[0]
    };
    let (c, y) = (
        planted("cuMemcpyHtoD_v2", 65_536_000.0),
        planted("cuStreamSynchronize", 50e6),
    );
    let bw: Vec<usize> = (0..lines.len())
        .filter(|i| lines[*i]["what"] == "bandwidth" && lines[*i]["ts_ns"] == lines[c]["ts_ns"])
        .collect();
    assert_eq!(bw.len(), 1, "{lines:?}");
    let ((copy, copy_took), (bw_span, bw), (sync, sync_took)) = (found[c], found[bw[0]], found[y]);
    assert_eq!(copy.name, "cuMemcpyHtoD_v2");
    assert_eq!(sync.name, "cuStreamSynchronize");
    // Both findings of the copy on its one span, in the order found.
    assert_eq!(bw_span.span_id, copy.span_id);
    let names: Vec<String> = copy
        .events
        .iter()
        .map(|e| attr(&e.attributes, "gpu.anomaly.what").unwrap())
        .collect();
    assert_eq!(names, ["call", "bandwidth"]);
    assert_eq!(sync.events.len(), 1);
    let took = |s: &Span| (s.end_time_unix_nano - s.start_time_unix_nano) as f64;
    assert_eq!(double(&copy_took.attributes, "gpu.anomaly.observed"), took(copy));
    assert_eq!(double(&sync_took.attributes, "gpu.anomaly.observed"), took(sync));
    assert_eq!(
        double(&bw.attributes, "gpu.anomaly.observed"),
        65_536.0 * 1e9 / took(copy)
    );
    check_anomaly_counter(&rx, &lines);
    let o = &cap.total()["otlp"];
    assert_eq!(o["anomalies_dropped"], 0, "{o}");
    assert_eq!(o["anomalies_unattached"], 0, "{o}");
}

/// Under `run` with the fake CUPTI, a loop of 511-byte copies whose GPU records take 500 ns
/// each (the fake's `500 + bytes / 1000` ns), then one of 256 bytes — the same size class (9),
/// half the bandwidth on the GPU: that copy's `gpu_memcpy` span carries its finding, observed
/// its bytes over its duration there. Its series' values are all equal (the scale's 2 % floor):
/// ln(511/256) / 0.02 ≈ 34.6 robust deviations low. The copies' own calls are real and short:
/// a preempted one may be flagged too, so every line is checked as an event, not their number.
#[test]
fn a_slow_gpu_copy_is_an_event_on_its_gpu_memcpy_span() {
    let _g = serial();
    require_root();
    let rx = Receiver::grpc();
    let dir = scratch("otlp-anomaly-gpu-copy");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let endpoint = rx.endpoint();
    let mut r = RunAgent::with_cupti_args(
        &dir,
        &lib,
        &["--otlp-endpoint", &endpoint, "--otlp-max-spans-per-sec", "0"],
        &[],
    );
    let pid = r.pid;
    r.cmd("init");
    let passes = |reply: String| -> u64 {
        assert!(reply.starts_with("ok loop "), "{reply}");
        reply.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    let before = passes(r.cmd("loop 300 htod:511 sleep:200"));
    assert!(before >= 64, "{before} passes: too few to warm up");
    assert_eq!(passes(r.cmd("loop 0 htod:256")), 1);
    passes(r.cmd("loop 300 htod:511 sleep:200"));
    let cap = r.finish();
    let err = cap.stderr.join("\n");
    let lines: Vec<&Value> = cap.of_type("anomaly").filter(|a| a["pid"] == pid).collect();
    let on_gpu: Vec<usize> = (0..lines.len())
        .filter(|i| lines[*i]["key"]["measured"] == "gpu")
        .collect();
    assert_eq!(on_gpu.len(), 1, "{lines:?}\n{err}");
    let line = lines[on_gpu[0]];
    assert_eq!(
        line["key"].to_string(),
        r#"{"direction":"cpu_to_gpu","size_class":9,"measured":"gpu"}"#,
        "{line}"
    );
    let slow: Vec<&Value> = cap
        .of_type("gpu_memcpy")
        .filter(|m| m["pid"] == pid && m["bytes"] == 256)
        .collect();
    assert_eq!(slow.len(), 1, "{slow:?}");

    let spans: Vec<Span> = rx.spans().into_iter().map(|(_, s)| s).collect();
    let found = events_of(&spans, &lines);
    for (i, (s, _)) in found.iter().enumerate() {
        // A call's findings on its call's span, the GPU record's on its own.
        let want = if i == on_gpu[0] {
            "gpu_memcpy"
        } else {
            "cuMemcpyHtoD_v2"
        };
        assert_eq!(s.name, want, "{}", lines[i]);
    }
    let (span, e) = found[on_gpu[0]];
    assert_eq!(
        attr(&span.attributes, "gpu.cuda.correlation_id"),
        Some(slow[0]["correlation_id"].to_string())
    );
    assert_eq!(span.events.len(), 1);
    let took = span.end_time_unix_nano - span.start_time_unix_nano;
    assert_eq!(took, 500);
    let a = &e.attributes;
    assert_eq!(attr(a, "gpu.anomaly.key").as_deref(), Some("cpu_to_gpu"));
    assert_eq!(attr(a, "gpu.anomaly.size_class").as_deref(), Some("9"));
    assert_eq!(double(a, "gpu.anomaly.observed"), 256.0 * 1e9 / took as f64);
    // The series keeps ln(value) as f32: typical is 511 B / 500 ns to f32 precision.
    let typical = double(a, "gpu.anomaly.typical");
    assert!((typical / (511.0 * 1e9 / 500.0) - 1.0).abs() < 1e-5, "{typical}");
    let deviation = double(a, "gpu.anomaly.deviation");
    assert!((deviation - (511.0f64 / 256.0).ln() / 0.02).abs() < 0.01, "{deviation}");
    check_anomaly_counter(&rx, &lines);
    let o = &cap.total()["otlp"];
    assert_eq!(o["anomalies_dropped"], 0, "{o}");
    assert_eq!(o["anomalies_unattached"], 0, "{o}");
}
