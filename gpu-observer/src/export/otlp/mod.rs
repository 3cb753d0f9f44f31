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
//! the export thread, and so are the totals of the anomaly counter.
//!
//! Anomalies (analyze/anomaly.rs) reach the span thread after the events and GPU records of
//! their batch, as the reader hands them to every sink; the span thread holds the span of a
//! flagged call or record until its findings come, and hangs each on it as a `gpu.anomaly`
//! event (`anomalies`).
//!
//! Here: the configuration, the counters, the reader's [`Sender`] and the running [`Otlp`].
//! `spans` builds the spans, `metrics` registers the instruments, `resource` says who exports
//! and about which process, `transport` reaches the collector.

mod anomalies;
mod metrics;
mod resource;
mod sample;
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
use crate::{
    correlate::cupti_join::GpuActivity,
    decode::Event,
    export::{AnomalyLine, Flagged},
    nvml,
    snapshot::Snapshots,
};

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

#[cfg(test)]
impl Config {
    /// The defaults the unit tests run with: a 100 µs threshold, the given span budget.
    pub(super) fn for_tests(max_spans_per_sec: u64) -> Self {
        Self {
            endpoint: None,
            grpc: true,
            interval: Duration::from_secs(10),
            queue: 1,
            timeout: Duration::from_secs(1),
            command_line: false,
            threshold_ns: 100_000,
            trace_all: false,
            max_spans_per_sec,
        }
    }
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
    /// Findings the queue had no room for: neither a span event nor counted in `gpu.anomalies`.
    pub anomalies_dropped: AtomicU64,
    /// Findings whose span was not there to carry their event (its call was lost to a full
    /// queue or over the span rate, or its span waited past [`spans::HOLD`] or behind 4 096
    /// others and went out without it); still counted in `gpu.anomalies`.
    pub anomalies_unattached: AtomicU64,
    /// Keys of `gpu.anomalies` forgotten for newer ones ([`anomalies::MAX_KEYS`]).
    pub anomaly_keys_evicted: AtomicU64,
}

/// What the reader thread hands over.
enum Item {
    /// An event to make a span of, or a process's exit.
    Event(Event),
    /// A GPU record: for the kernel-time histogram, and a span when the flag says so.
    Gpu(GpuActivity, bool),
    /// A call sampled out that had ioctls: the span thread drops the ones it holds for it.
    SampledOut {
        tid: u32,
        start_ns: u64,
        end_ns: u64,
    },
    Anomaly(anomalies::Flag),
}

/// The running exporter.
pub struct Otlp {
    tx: Option<SyncSender<Item>>,
    pub counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
    meters: SdkMeterProvider,
    /// The sampling every sender starts with.
    sampler: sample::Sampler,
    /// Its own runtime (tonic needs one).
    _rt: BackgroundRuntime,
}

/// The reader thread's handle: hands events over, never blocks.
#[derive(Clone)]
pub struct Sender {
    /// `None` once closed: the span thread ends when every sender is gone.
    tx: Option<SyncSender<Item>>,
    counters: Arc<Counters>,
    sampler: sample::Sampler,
}

impl crate::export::Sink for Sender {
    fn describe(&self) -> String {
        "OTLP spans".into()
    }

    /// Never fails: a full queue is a counted drop.
    fn event(&mut self, ev: &Event) -> Result<()> {
        if let Some(item) = self.sampler.route(ev, &self.counters) {
            self.offer(item);
        }
        Ok(())
    }

    fn gpu(&mut self, a: &GpuActivity) -> Result<()> {
        if let Some(item) = self.sampler.route_gpu(a, &self.counters) {
            self.offer(item);
        }
        Ok(())
    }

    fn anomaly(&mut self, a: &AnomalyLine<'_>) -> Result<()> {
        let at = match a.flagged {
            Flagged::Event(ev) => anomalies::SpanKey::of_event(ev),
            Flagged::Gpu(g) => anomalies::SpanKey::of_gpu(g),
        };
        let flag = anomalies::Flag {
            at,
            comm: *a.comm,
            ts_ns: a.ts_ns,
            finding: a.finding.clone(),
            mode: a.mode,
            last: a.last,
        };
        if self
            .tx
            .as_ref()
            .is_none_or(|tx| tx.try_send(Item::Anomaly(flag)).is_err())
        {
            self.counters.anomalies_dropped.fetch_add(1, Ordering::Relaxed);
        }
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
            "anomalies_dropped": g(&self.anomalies_dropped),
            "anomalies_unattached": g(&self.anomalies_unattached),
            "anomaly_keys_evicted": g(&self.anomaly_keys_evicted),
        })
    }
}

impl Otlp {
    pub fn sender(&self) -> Option<Sender> {
        Some(Sender {
            tx: Some(self.tx.clone()?),
            counters: self.counters.clone(),
            sampler: self.sampler.clone(),
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
    let tally = anomalies::SharedTally::default();
    let kernel_time = metrics::register(&meters, &snapshots, gpu_time, &counters, &procs, &tally);
    let (tx, rx) = sync_channel(cfg.queue);
    let sampler = sample::Sampler::new(&cfg);
    let c = counters.clone();
    let thread = std::thread::Builder::new().name("otlp-export".into()).spawn({
        let handle = handle.clone();
        move || Spans::new(cfg, c, kernel_time, procs, tally).run(&rx, &spans, &handle)
    })?;
    drop(_guard);
    Ok(Otlp {
        tx: Some(tx),
        counters,
        thread: Some(thread),
        meters,
        sampler,
        _rt: rt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        analyze::anomaly::{Finding, Mode, What},
        decode::Body,
        export::Sink as _,
    };

    #[test]
    fn a_finding_names_its_calls_span_and_one_the_queue_has_no_room_for_is_counted() {
        let (tx, rx) = sync_channel(1);
        let counters = Arc::new(Counters::default());
        let cfg = Config::for_tests(0);
        let mut s = Sender {
            tx: Some(tx),
            counters: counters.clone(),
            sampler: sample::Sampler::new(&cfg),
        };
        let ev = Event {
            ts_ns: 5_000,
            pid: 10,
            tid: 11,
            comm: *b"train\0\0\0\0\0\0\0\0\0\0\0",
            api: None,
            body: Body::ProcessExit,
        };
        let finding = Finding {
            what: What::Call {
                api: "cuStreamSynchronize",
                size: 0,
            },
            observed: 9e5,
            typical: 1e5,
            deviation: 40.0,
        };
        let line = AnomalyLine {
            ts_ns: ev.ts_ns,
            pid: ev.pid,
            tid: ev.tid,
            comm: &ev.comm,
            finding: &finding,
            mode: Mode::Robust,
            flagged: Flagged::Event(&ev),
            last: true,
        };
        s.anomaly(&line).unwrap();
        // The queue (of one) is full now.
        s.anomaly(&line).unwrap();
        assert_eq!(counters.anomalies_dropped.load(Ordering::Relaxed), 1);
        assert_eq!(
            counters.spans_dropped.load(Ordering::Relaxed),
            0,
            "a finding is not a span"
        );
        let Ok(Item::Anomaly(f)) = rx.try_recv() else {
            panic!("no finding queued")
        };
        assert_eq!(
            f.at,
            anomalies::SpanKey::Call {
                pid: 10,
                tid: 11,
                ts_ns: 5_000
            }
        );
        assert_eq!(
            (f.ts_ns, f.last, f.mode, &f.finding),
            (5_000, true, Mode::Robust, &finding)
        );
    }
}
