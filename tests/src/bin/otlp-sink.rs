//! A stand-alone OTLP receiver for checking an export on a machine without a collector (the
//! GPU machine): receives for a while, then writes what it decoded as JSON.
//!
//! usage: otlp-sink grpc|http PORT SECONDS OUT.json  (also stops on SIGTERM/SIGINT)

use std::{
    collections::BTreeMap,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use gpu_observer_tests::otlp::{Receiver, attr, histogram_points, points};
use serde_json::{Value, json};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Attributes as strings, by key.
fn attr_map(a: &[opentelemetry_proto::tonic::common::v1::KeyValue]) -> BTreeMap<String, String> {
    a.iter()
        .map(|kv| (kv.key.clone(), attr(a, &kv.key).unwrap_or_default()))
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: otlp-sink grpc|http PORT SECONDS OUT.json");
        std::process::exit(2);
    }
    let (port, secs): (u16, u64) = (args[2].parse().expect("port"), args[3].parse().expect("seconds"));
    let rx = match args[1].as_str() {
        "grpc" => Receiver::grpc_on(port),
        "http" => Receiver::http_on(port),
        other => {
            eprintln!("otlp-sink: unknown protocol {other}");
            std::process::exit(2);
        }
    };
    // SAFETY: installs an async-signal-safe handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    eprintln!("otlp-sink: listening on {}", rx.addr);
    let start = Instant::now();
    while !STOP.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let spans = rx.spans();
    let mut by_name: BTreeMap<String, u64> = BTreeMap::new();
    let mut traces = std::collections::BTreeSet::new();
    for (_, s) in &spans {
        let name = if s.name.starts_with("gpu_kernel ") {
            "gpu_kernel <name>".to_string()
        } else {
            s.name.clone()
        };
        *by_name.entry(name).or_default() += 1;
        traces.insert(s.trace_id.clone());
    }
    let resource = spans.first().map(|(r, _)| attr_map(r)).unwrap_or_default();
    let sample: Vec<Value> = spans
        .iter()
        .filter(|(_, s)| s.name.starts_with("gpu_kernel") || s.name.starts_with("cuLaunch"))
        .take(5)
        .map(|(_, s)| {
            let a = attr_map(&s.attributes);
            json!({"name": s.name, "start": s.start_time_unix_nano, "end": s.end_time_unix_nano, "attributes": a})
        })
        .collect();
    // Every gpu.anomaly span event (issue 14), with the span it is on.
    let anomaly_events: Vec<Value> = spans
        .iter()
        .flat_map(|(_, s)| s.events.iter().map(move |e| (s, e)))
        .filter(|(_, e)| e.name == "gpu.anomaly")
        .map(|(s, e)| {
            let a = attr_map(&e.attributes);
            json!({"span": s.name, "span_start": s.start_time_unix_nano, "time": e.time_unix_nano, "attributes": a})
        })
        .collect();
    let mut metrics = BTreeMap::new();
    let reqs = rx.got.metrics.lock().unwrap().len();
    for name in [
        "gpu.cuda.launches",
        "gpu.cuda.memcpy.bytes",
        "gpu.cuda.sync.duration",
        "gpu.cuda.kernel.duration",
        "hw.gpu.utilization",
        "hw.gpu.memory.usage",
        "hw.power",
        "gpu_observer.events",
        "gpu_observer.dropped",
        "gpu.anomalies",
    ] {
        if let Some((_, m)) = rx.metric(name) {
            let attrs = attr_map;
            let mut p: Vec<Value> = points(&m)
                .into_iter()
                .map(|(a, v)| json!({"attributes": attrs(&a), "value": v}))
                .collect();
            p.extend(
                histogram_points(&m)
                    .into_iter()
                    .map(|(a, n, sum)| json!({"attributes": attrs(&a), "count": n, "sum": sum})),
            );
            metrics.insert(name.to_string(), json!({"unit": m.unit, "points": p}));
        }
    }
    let out = json!({
        "trace_requests": rx.got.traces.lock().unwrap().len(),
        "metric_requests": reqs,
        "spans": spans.len(),
        "traces": traces.len(),
        "spans_by_name": by_name,
        "resource": resource,
        "sample_spans": sample,
        "metrics": metrics,
        "anomaly_events": anomaly_events,
    });
    std::fs::write(&args[4], serde_json::to_string_pretty(&out).unwrap()).expect("write the result");
    eprintln!(
        "otlp-sink: {} spans in {} traces, {} metric requests",
        spans.len(),
        traces.len(),
        reqs
    );
}
