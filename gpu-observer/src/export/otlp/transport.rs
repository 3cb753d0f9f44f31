//! How spans and metrics reach the collector: which endpoints are given and whether they are
//! collector URLs, the protocol, the per-signal endpoint and timeout of both exporters, the
//! exporters' runtime, the retries of a span export and the counting of every export.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use anyhow::{Context, Result};
use opentelemetry_otlp::{MetricExporter, Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::{
    error::OTelSdkResult,
    metrics::{Temporality, data::ResourceMetrics, exporter::PushMetricExporter},
    trace::{SpanData, SpanExporter as _},
};

use super::{Config, Counters};

/// The exporter's runtime, shut down in the background when dropped: the agent's main task
/// runs inside another runtime, where a blocking drop panics — on every path, the error
/// returns of [`super::start`] included.
pub(super) struct BackgroundRuntime(Option<tokio::runtime::Runtime>);

impl BackgroundRuntime {
    /// One worker thread, named `otlp-io`.
    pub(super) fn start() -> Result<Self> {
        Ok(Self(Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("otlp-io")
                .enable_all()
                .build()
                .context("cannot start the OTLP runtime")?,
        )))
    }

    #[expect(clippy::expect_used, reason = "the runtime is taken out only by Drop")]
    pub(super) fn handle(&self) -> tokio::runtime::Handle {
        self.0.as_ref().expect("taken only on drop").handle().clone()
    }
}

impl Drop for BackgroundRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// With an explicit endpoint over HTTP the signal's path is ours to add (the environment's
/// endpoint gets it from the library).
fn signal_endpoint(cfg: &Config, path: &str) -> Option<String> {
    let e = cfg.endpoint.as_ref()?;
    Some(if cfg.grpc || e.ends_with(path) {
        e.clone()
    } else {
        format!("{}{path}", e.trim_end_matches('/'))
    })
}

/// Protocol, timeout and (when given) the signal's endpoint, on either transport's builder.
fn configure<B: WithExportConfig>(b: B, cfg: &Config, path: &str) -> B {
    let protocol = if cfg.grpc { Protocol::Grpc } else { Protocol::HttpBinary };
    let b = b.with_protocol(protocol).with_timeout(cfg.timeout);
    match signal_endpoint(cfg, path) {
        Some(ep) => b.with_endpoint(ep),
        None => b,
    }
}

// Both signals, either transport: the same protocol, timeout and endpoint. Errors here are
// configuration errors.

/// The span exporter.
pub(super) fn span_exporter(cfg: &Config) -> Result<SpanExporter> {
    if cfg.grpc {
        configure(SpanExporter::builder().with_tonic(), cfg, "/v1/traces").build()
    } else {
        configure(SpanExporter::builder().with_http(), cfg, "/v1/traces").build()
    }
    .context("OTLP span exporter")
}

/// The metric exporter.
pub(super) fn metric_exporter(cfg: &Config) -> Result<MetricExporter> {
    if cfg.grpc {
        configure(MetricExporter::builder().with_tonic(), cfg, "/v1/metrics").build()
    } else {
        configure(MetricExporter::builder().with_http(), cfg, "/v1/metrics").build()
    }
    .context("OTLP metric exporter")
}

/// Exports one batch of spans in up to `attempts` tries, 200 ms before the second and four
/// times longer before each next; counts the spans exported, each failed try, and the spans of
/// a batch whose last try failed (dropped).
pub(super) fn export_spans(
    exp: &SpanExporter,
    rt: &tokio::runtime::Handle,
    grpc: bool,
    batch: Vec<SpanData>,
    attempts: u32,
    counters: &Counters,
) {
    let n = batch.len() as u64;
    let mut delay = Duration::from_millis(200);
    for attempt in 1..=attempts {
        // gRPC runs on the exporter's tokio runtime; the HTTP client blocks and must not.
        let r = if grpc {
            rt.block_on(exp.export(batch.clone()))
        } else {
            futures_executor::block_on(exp.export(batch.clone()))
        };
        match r {
            Ok(()) => {
                counters.spans_exported.fetch_add(n, Ordering::Relaxed);
                return;
            }
            Err(e) => {
                counters.trace_failures.fetch_add(1, Ordering::Relaxed);
                if attempt == attempts {
                    eprintln!("gpu-observer: OTLP trace export failed ({e}); {n} spans dropped");
                    counters.spans_dropped.fetch_add(n, Ordering::Relaxed);
                } else {
                    std::thread::sleep(delay);
                    delay *= 4;
                }
            }
        }
    }
}

/// A metric exporter that counts its exports and failures.
pub(super) struct Counting<E> {
    pub(super) inner: E,
    pub(super) counters: Arc<Counters>,
}

impl<E: PushMetricExporter> PushMetricExporter for Counting<E> {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let r = self.inner.export(metrics).await;
        let c = if r.is_ok() {
            &self.counters.metric_exports
        } else {
            &self.counters.metric_failures
        };
        c.fetch_add(1, Ordering::Relaxed);
        r
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}

/// The standard variables that name a collector (OpenTelemetry's exporter specification).
const ENDPOINT_VARS: [&str; 3] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
];

/// The collector endpoints given, with where each came from: the flag, then the standard
/// variables that are set and not empty.
fn endpoints_given(flag: Option<&str>) -> Vec<(String, String)> {
    let vars = ENDPOINT_VARS.iter().filter_map(|v| {
        std::env::var(v)
            .ok()
            .filter(|s| !s.is_empty())
            .map(|s| (v.to_string(), s))
    });
    flag.map(|f| ("--otlp-endpoint".to_string(), f.to_string()))
        .into_iter()
        .chain(vars)
        .collect()
}

/// Whether OTLP export was asked for: the flag, or the standard environment.
pub fn wanted(endpoint: Option<&str>) -> bool {
    !endpoints_given(endpoint).is_empty()
}

/// Checks every endpoint the exporters would use — the flag and the standard variables — at
/// start-up, before anything is attached: the exporters' own parse errors come late and, inside
/// the agent's runtime, used to end in a panic that hid them.
pub fn check_endpoints(flag: Option<&str>) -> Result<()> {
    for (source, url) in endpoints_given(flag) {
        check_endpoint(&url).map_err(|why| {
            anyhow::anyhow!(
                "{source} {url:?} is not a collector URL: {why}; give one like http://localhost:4317 (gRPC) or http://localhost:4318 (HTTP/protobuf)"
            )
        })?;
    }
    Ok(())
}

fn check_endpoint(url: &str) -> std::result::Result<(), String> {
    let uri: http::Uri = url.trim().parse().map_err(|e| format!("{e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => return Err(format!("the scheme must be http or https, not {other}")),
        None => return Err("it has no scheme (http:// or https://)".into()),
    }
    match uri.host() {
        Some(h) if !h.is_empty() => Ok(()),
        _ => Err("it names no host".into()),
    }
}

/// gRPC unless `--otlp-protocol` or `OTEL_EXPORTER_OTLP_PROTOCOL` says HTTP/protobuf.
pub fn grpc(flag: Option<&str>) -> Result<bool> {
    let p = match flag {
        Some(p) => p.to_string(),
        None => std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL").unwrap_or_else(|_| "grpc".into()),
    };
    match p.as_str() {
        "grpc" => Ok(true),
        "http/protobuf" | "http" => Ok(false),
        other => anyhow::bail!("OTLP protocol `{other}` is not supported: use grpc or http/protobuf"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_endpoints_get_the_signal_path_grpc_ones_do_not() {
        let mut cfg = Config {
            endpoint: Some("http://collector:4318".into()),
            grpc: false,
            interval: Duration::from_secs(1),
            queue: 1,
            timeout: Duration::from_secs(1),
            command_line: false,
            threshold_ns: 0,
            trace_all: false,
            max_spans_per_sec: 0,
        };
        assert_eq!(
            signal_endpoint(&cfg, "/v1/traces").as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        cfg.endpoint = Some("http://c:4318/v1/metrics".into());
        assert_eq!(
            signal_endpoint(&cfg, "/v1/metrics").as_deref(),
            Some("http://c:4318/v1/metrics")
        );
        cfg.grpc = true;
        cfg.endpoint = Some("http://c:4317".into());
        assert_eq!(signal_endpoint(&cfg, "/v1/traces").as_deref(), Some("http://c:4317"));
        assert!(grpc(Some("http/protobuf")).is_ok_and(|g| !g));
        assert!(grpc(Some("http/json")).is_err());
    }
}
