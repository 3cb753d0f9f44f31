//! OTLP export: traces and metrics to an OpenTelemetry Collector (gRPC or HTTP/protobuf)
//! through opentelemetry-otlp.
//!
//! Traces: one trace per process per window (`--otlp-interval-ms`, 10 s by default): a root
//! span `process <comm>` covering the window, and under it a span per CUDA call (launch, copy,
//! memset, alloc, sync) with its ioctls as child spans, and the GPU kernels/copies CUPTI timed.
//! Windows rather than sync-to-sync steps: a long-lived server or a process that never syncs
//! would otherwise make one unbounded trace, and a fixed window bounds what a backend holds
//! open per trace. Spans go out as they are built (batches of 512, or every second); a
//! window's root span goes out when the window closes.
//!
//! Nothing here may slow the ring-buffer reader: it hands events over through a bounded
//! channel (`try_send`; a full queue is a counted drop), and a thread of its own builds and
//! exports the spans, with a timeout per export, retries with backoff, and a deadline at exit.
//! Metrics are observable instruments read from the latest snapshot by the SDK's periodic
//! reader, every `--otlp-interval-ms` too; the one histogram (kernel GPU time) is recorded by
//! the export thread.
//!
//! Here: the configuration, the counters, the reader's [`Sender`] and the running [`Otlp`].
//! `spans` builds the spans, `metrics` registers the instruments, `resource` says who exports
//! and about which process, `transport` reaches the collector.

mod metrics;
mod resource;
mod spans;
mod transport;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
        mpsc::{SyncSender, sync_channel},
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::Result;
use opentelemetry_sdk::{
    metrics::{PeriodicReader, SdkMeterProvider},
    trace::SpanExporter as _,
};

pub use self::transport::{check_endpoints, grpc, wanted};
use self::{
    resource::{ProcAttrs, resource},
    spans::Spans,
    transport::{BackgroundRuntime, Counting},
};
use crate::{correlate::cupti_join::GpuActivity, decode::Event, nvml, snapshot::Snapshots};

#[derive(Clone, Debug)]
pub struct Config {
    /// `None`: the `OTEL_EXPORTER_OTLP_*` environment decides.
    pub endpoint: Option<String>,
    pub grpc: bool,
    /// Trace window and metric export interval.
    pub interval: Duration,
    pub queue: usize,
    pub timeout: Duration,
    pub command_line: bool,
    pub threshold_ns: u64,
    pub trace_all: bool,
    /// Spans per second a process may export; the rest are counted (`sampled_out`).
    pub max_spans_per_sec: u64,
}

/// What went where, for the summary and the self-metrics.
#[derive(Default)]
pub struct Counters {
    pub spans_exported: AtomicU64,
    /// Lost: events the queue had no room for (counted per event handed over, each of which
    /// would have made at most one span), and the spans of an export that failed for good.
    pub spans_dropped: AtomicU64,
    /// Fast calls or a process over its span rate, as configured.
    pub spans_sampled_out: AtomicU64,
    pub trace_failures: AtomicU64,
    pub metric_exports: AtomicU64,
    pub metric_failures: AtomicU64,
    /// Ioctl spans sent under their window's root, not their call, because the per-thread
    /// ([`spans::IOCTLS_PER_THREAD`]) or global ([`spans::IOCTLS_PENDING`]) wait was full.
    pub ioctls_unparented: AtomicU64,
    /// Trace windows closed before their interval ended because [`spans::MAX_WINDOWS`] were open.
    pub windows_closed_early: AtomicU64,
}

/// What the reader thread hands over.
enum Item {
    Event(Event),
    Gpu(GpuActivity),
}

/// The running exporter.
pub struct Otlp {
    tx: Option<SyncSender<Item>>,
    pub counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
    meters: SdkMeterProvider,
    /// Its own runtime (tonic needs one).
    _rt: BackgroundRuntime,
}

/// The reader thread's handle: hands events over, never blocks.
#[derive(Clone)]
pub struct Sender {
    /// `None` once closed: the span thread ends when every sender is gone.
    tx: Option<SyncSender<Item>>,
    counters: Arc<Counters>,
}

impl crate::export::Sink for Sender {
    fn describe(&self) -> String {
        "OTLP spans".into()
    }

    /// Never fails: a full queue is a counted drop.
    fn event(&mut self, ev: &Event) -> Result<()> {
        self.offer(Item::Event(ev.clone()));
        Ok(())
    }

    fn gpu(&mut self, a: &GpuActivity) -> Result<()> {
        self.offer(Item::Gpu(a.clone()));
        Ok(())
    }

    fn close(&mut self) {
        self.tx = None;
    }
}

impl Sender {
    fn offer(&self, item: Item) {
        if self.tx.as_ref().is_none_or(|tx| tx.try_send(item).is_err()) {
            self.counters.spans_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Counters {
    /// The summary's `otlp` object.
    pub fn json(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "spans_exported": g(&self.spans_exported),
            "spans_dropped": g(&self.spans_dropped),
            "spans_sampled_out": g(&self.spans_sampled_out),
            "trace_export_failures": g(&self.trace_failures),
            "metric_exports": g(&self.metric_exports),
            "metric_export_failures": g(&self.metric_failures),
            "ioctls_unparented": g(&self.ioctls_unparented),
            "windows_closed_early": g(&self.windows_closed_early),
        })
    }
}

impl Otlp {
    pub fn sender(&self) -> Option<Sender> {
        Some(Sender {
            tx: Some(self.tx.clone()?),
            counters: self.counters.clone(),
        })
    }

    /// Exports what is queued and the last metrics, within about `deadline`. The senders
    /// handed out must be gone (the reader stopped) for the span thread to finish.
    pub fn shutdown(mut self, deadline: Duration) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            // The thread ends after one last export attempt, bounded by the exporter timeout.
            let _ = t.join();
        }
        let _ = self.meters.force_flush();
        let _ = self.meters.shutdown_with_timeout(deadline);
    }
}

/// Starts the exporter: builds both OTLP exporters (errors here are configuration errors),
/// the metric instruments and the span thread.
pub fn start(
    cfg: Config,
    snapshots: Snapshots,
    gpu_time: crate::analyze::gpu_time::Published,
    gpus: &nvml::View,
    backends: &str,
) -> Result<Otlp> {
    let rt = BackgroundRuntime::start()?;
    let handle = rt.handle();
    let _guard = handle.enter();
    let (driver, cuda) = gpus
        .devices
        .first()
        .map(|d| (d.driver_version.clone(), d.cuda_driver_version.clone()))
        .unwrap_or_default();
    let res = resource(backends, driver, cuda);
    let mut spans = transport::span_exporter(&cfg)?;
    spans.set_resource(&res);
    let counters = Arc::new(Counters::default());
    let reader = PeriodicReader::builder(Counting {
        inner: transport::metric_exporter(&cfg)?,
        counters: counters.clone(),
    })
    .with_interval(cfg.interval)
    .build();
    let meters = SdkMeterProvider::builder()
        .with_resource(res)
        .with_reader(reader)
        .build();
    let procs = ProcAttrs::new(cfg.command_line);
    let kernel_time = metrics::register(&meters, &snapshots, gpu_time, &counters, &procs);
    let (tx, rx) = sync_channel(cfg.queue);
    let c = counters.clone();
    let thread = std::thread::Builder::new().name("otlp-export".into()).spawn({
        let handle = handle.clone();
        move || Spans::new(cfg, c, kernel_time, procs).run(&rx, &spans, &handle)
    })?;
    drop(_guard);
    Ok(Otlp {
        tx: Some(tx),
        counters,
        thread: Some(thread),
        meters,
        _rt: rt,
    })
}
