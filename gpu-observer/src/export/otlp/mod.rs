//! OTLP export: traces and metrics to an OpenTelemetry Collector (gRPC or HTTP/protobuf)
//! through opentelemetry-otlp.
//!
//! Traces: one trace per process per window (`--otlp-interval-ms`, 1 s): a root span
//! `process <comm>` covering the window, and under it a span per CUDA call (launch, copy,
//! memset, alloc, sync) with its ioctls as child spans, and the GPU kernels/copies CUPTI timed.
//! Windows rather than sync-to-sync steps: a long-lived server or a process that never syncs
//! would otherwise make one unbounded trace, and a fixed window bounds what a backend holds
//! open per trace.
//!
//! Nothing here may slow the ring-buffer reader: it hands events over through a bounded
//! channel (`try_send`; a full queue is a counted drop), and a thread of its own builds and
//! exports the spans, with a timeout per export, retries with backoff, and a deadline at exit.
//! Metrics are observable instruments read from the correlator and the NVML hub by the SDK's
//! periodic reader; the one histogram (kernel GPU time) is recorded by the export thread.

mod metrics;

use std::{
    borrow::Cow,
    collections::{HashMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
        mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use gpu_observer_common::api::Family;
use opentelemetry::{
    InstrumentationScope, KeyValue, Value,
    metrics::Histogram,
    trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState},
};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::{
    Resource,
    error::OTelSdkResult,
    metrics::{PeriodicReader, SdkMeterProvider, Temporality, data::ResourceMetrics, exporter::PushMetricExporter},
    trace::{SpanData, SpanEvents, SpanExporter, SpanLinks},
};

use crate::{
    clock::{WallClock, monotonic_ns},
    correlate::cupti_join::GpuActivity,
    decode::{Body, Event},
    export::attributes,
    nvml,
    procinfo::ProcInfo,
    snapshot::Snapshots,
};

/// Kernel names that get their own label on the GPU-time histogram; the rest are `other`.
const TOP_KERNELS: usize = 20;
/// Spans per export request.
const BATCH: usize = 512;
/// Ioctls held per thread until the call they were made in returns.
const IOCTLS_PER_THREAD: usize = 64;
/// Ioctls held over all threads: a span with its attributes is about 1 KiB, so thousands of
/// threads blocked inside calls cannot make this grow past ~4 MiB. Past it an ioctl goes out
/// at once under its window's root (`ioctls_unparented`).
const IOCTLS_PENDING: usize = 4096;
/// Trace windows open at once (one per process with recent events). Past it the oldest window
/// is closed early (`windows_closed_early`): its process's next span opens a new trace.
const MAX_WINDOWS: usize = 4096;
/// Distinct kernel names remembered for the GPU-time histogram's labels, and their bytes;
/// kernels past either are labelled `other`.
const KERNEL_LABELS: usize = 4096;
const KERNEL_LABEL_BYTES: usize = 256 << 10;
/// Process attribute sets cached, and their bytes; past either the cache is emptied (they are
/// read again from /proc when next needed).
const PROC_ATTRS_ENTRIES: usize = 4096;
const PROC_ATTRS_BYTES: usize = 4 << 20;

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
    /// ([`IOCTLS_PER_THREAD`]) or global ([`IOCTLS_PENDING`]) wait was full.
    pub ioctls_unparented: AtomicU64,
    /// Trace windows closed before their interval ended because [`MAX_WINDOWS`] were open.
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

/// The exporter's runtime, shut down in the background when dropped: the agent's main task
/// runs inside another runtime, where a blocking drop panics — on every path, the error
/// returns of [`start`] included.
struct BackgroundRuntime(Option<tokio::runtime::Runtime>);

impl Drop for BackgroundRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
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

/// Resource: who exports. `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` are read by the SDK.
fn resource(backends: &str, driver: Option<String>, cuda: Option<String>) -> Resource {
    let mut attrs = vec![KeyValue::new("gpu.tracing.backends", backends.to_string())];
    let node = std::env::var("K8S_NODE_NAME").ok().filter(|n| !n.is_empty());
    // In a pod the UTS hostname is the pod's name: the node's name (downward API) is the host's.
    // OTEL_RESOURCE_ATTRIBUTES wins over both.
    let from_env = std::env::var("OTEL_RESOURCE_ATTRIBUTES").unwrap_or_default();
    if !from_env.split(',').any(|kv| kv.trim_start().starts_with("host.name=")) {
        attrs.push(KeyValue::new(
            "host.name",
            node.clone().unwrap_or_else(|| ProcInfo::host().hostname()),
        ));
    }
    if let Some(node) = node {
        attrs.push(KeyValue::new("k8s.node.name", node));
    }
    if let Some(d) = driver {
        attrs.push(KeyValue::new("gpu.driver.version", d));
    }
    if let Some(c) = cuda {
        attrs.push(KeyValue::new("gpu.cuda.driver.version", c));
    }
    let mut b = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        b = b.with_service_name("gpu-observer");
    }
    b.with_attributes(attrs).build()
}

/// Attributes of a process (pid, executable, command line when asked, Kubernetes identity),
/// computed once per pid; shared by the span thread and the metric callbacks.
pub struct ProcAttrs {
    info: ProcInfo,
    cache: HashMap<u32, Arc<Vec<KeyValue>>>,
    /// Bytes of the strings in `cache` (about).
    bytes: usize,
    command_line: bool,
}

pub type SharedProcAttrs = Arc<std::sync::Mutex<ProcAttrs>>;

impl ProcAttrs {
    pub fn new(command_line: bool) -> SharedProcAttrs {
        Arc::new(std::sync::Mutex::new(Self {
            info: ProcInfo::host(),
            cache: HashMap::new(),
            bytes: 0,
            command_line,
        }))
    }

    pub fn forget(&mut self, pid: u32) {
        if let Some(v) = self.cache.remove(&pid) {
            self.bytes = self.bytes.saturating_sub(attrs_bytes(&v));
        }
    }

    pub fn of(&mut self, pid: u32, comm: &str) -> Arc<Vec<KeyValue>> {
        if let Some(v) = self.cache.get(&pid) {
            return v.clone();
        }
        if self.cache.len() >= PROC_ATTRS_ENTRIES || self.bytes >= PROC_ATTRS_BYTES {
            self.cache = HashMap::new();
            self.bytes = 0;
        }
        let (cl, info) = (self.command_line, &self.info);
        let v = self
            .cache
            .entry(pid)
            .or_insert_with(|| {
                let exe = info.exe_name(pid).unwrap_or_else(|| comm.to_string());
                let mut v = vec![
                    KeyValue::new("process.pid", i64::from(pid)),
                    KeyValue::new("process.executable.name", exe),
                ];
                if cl && let Some((line, truncated)) = info.command_line(pid) {
                    v.push(KeyValue::new("process.command_line", line));
                    if truncated {
                        v.push(KeyValue::new("gpu_observer.command_line_truncated", true));
                    }
                }
                if let Some(c) = info.container(pid) {
                    v.push(KeyValue::new("container.id", c.id));
                    if let Some((pod, ns, container)) = c.pod {
                        v.push(KeyValue::new("k8s.pod.name", pod));
                        v.push(KeyValue::new("k8s.namespace.name", ns));
                        v.push(KeyValue::new("k8s.container.name", container));
                    }
                }
                Arc::new(v)
            })
            .clone();
        self.bytes += attrs_bytes(&v);
        v
    }
}

/// Bytes an attribute set holds (keys, values and their slots).
fn attrs_bytes(v: &[KeyValue]) -> usize {
    v.iter()
        .map(|kv| 64 + kv.key.as_str().len() + kv.value.as_str().len())
        .sum()
}

/// A metric exporter that counts its exports and failures.
struct Counting<E> {
    inner: E,
    counters: Arc<Counters>,
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

/// Starts the exporter: builds both OTLP exporters (errors here are configuration errors),
/// the metric instruments and the span thread.
pub fn start(cfg: Config, snapshots: Snapshots, gpus: &nvml::View, backends: &str) -> Result<Otlp> {
    let rt = BackgroundRuntime(Some(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("otlp-io")
            .enable_all()
            .build()
            .context("cannot start the OTLP runtime")?,
    ));
    let handle = rt.0.as_ref().expect("just built").handle().clone();
    let _guard = handle.enter();
    let (driver, cuda) = gpus
        .devices
        .first()
        .map(|d| (d.driver_version.clone(), d.cuda_driver_version.clone()))
        .unwrap_or_default();
    let res = resource(backends, driver, cuda);
    // Both signals, either transport: the same protocol, timeout and endpoint.
    let mut spans = if cfg.grpc {
        configure(
            opentelemetry_otlp::SpanExporter::builder().with_tonic(),
            &cfg,
            "/v1/traces",
        )
        .build()
    } else {
        configure(
            opentelemetry_otlp::SpanExporter::builder().with_http(),
            &cfg,
            "/v1/traces",
        )
        .build()
    }
    .context("OTLP span exporter")?;
    spans.set_resource(&res);
    let counters = Arc::new(Counters::default());
    let metrics = if cfg.grpc {
        configure(
            opentelemetry_otlp::MetricExporter::builder().with_tonic(),
            &cfg,
            "/v1/metrics",
        )
        .build()
    } else {
        configure(
            opentelemetry_otlp::MetricExporter::builder().with_http(),
            &cfg,
            "/v1/metrics",
        )
        .build()
    }
    .context("OTLP metric exporter")?;
    let reader = PeriodicReader::builder(Counting {
        inner: metrics,
        counters: counters.clone(),
    })
    .with_interval(cfg.interval)
    .build();
    let meters = SdkMeterProvider::builder()
        .with_resource(res)
        .with_reader(reader)
        .build();
    let procs = ProcAttrs::new(cfg.command_line);
    let kernel_time = metrics::register(&meters, &snapshots, &counters, &procs);
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

/// One process's current trace window.
struct Window {
    trace_id: TraceId,
    root: SpanId,
    start_ns: u64,
    end_ns: u64,
    comm: String,
    spans: u64,
    /// Token bucket for `max_spans_per_sec`: spans left in the current second.
    budget: u64,
    budget_second: u64,
}

/// A pending ioctl, waiting for its call's span.
struct PendingIoctl {
    pid: u32,
    ts_ns: u64,
    span: SpanData,
}

struct Spans {
    cfg: Config,
    counters: Arc<Counters>,
    clock: WallClock,
    windows: HashMap<u32, Window>,
    ioctls: HashMap<u32, VecDeque<PendingIoctl>>,
    /// Ioctls in `ioctls`, all threads.
    ioctls_pending: usize,
    batch: Vec<SpanData>,
    procs: SharedProcAttrs,
    scope: InstrumentationScope,
    seq: u64,
    kernel_time: Histogram<f64>,
    /// GPU ns per kernel name, for the histogram's top-N label set.
    kernel_ns: HashMap<Arc<str>, u64>,
    /// Bytes of the names in `kernel_ns`.
    kernel_ns_bytes: usize,
    top: Vec<Arc<str>>,
    last_top: Instant,
}

impl Spans {
    fn new(cfg: Config, counters: Arc<Counters>, kernel_time: Histogram<f64>, procs: SharedProcAttrs) -> Self {
        Self {
            cfg,
            counters,
            clock: WallClock::now(),
            windows: HashMap::new(),
            ioctls: HashMap::new(),
            ioctls_pending: 0,
            batch: Vec::with_capacity(BATCH),
            procs,
            scope: InstrumentationScope::builder("gpu-observer")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            seq: 0,
            kernel_time,
            kernel_ns: HashMap::new(),
            kernel_ns_bytes: 0,
            top: Vec::new(),
            last_top: Instant::now(),
        }
    }

    fn run(mut self, rx: &Receiver<Item>, exp: &opentelemetry_otlp::SpanExporter, rt: &tokio::runtime::Handle) {
        let mut last_export = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(item) => self.take(item),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            let now = monotonic_ns();
            self.close_windows(now, false);
            if self.batch.len() >= BATCH || last_export.elapsed() >= Duration::from_secs(1) {
                self.export(exp, rt, 3);
                last_export = Instant::now();
            }
        }
        // Exit: ioctls whose call never returned go under their window's root, then every window
        // still open; one attempt each (the collector may be gone).
        let pending: Vec<PendingIoctl> = self.ioctls.drain().flat_map(|(_, q)| q).collect();
        self.ioctls_pending = 0;
        for p in pending {
            self.orphan(p.pid, p.span);
        }
        self.close_windows(u64::MAX, true);
        self.export(exp, rt, 1);
    }

    fn export(&mut self, exp: &opentelemetry_otlp::SpanExporter, rt: &tokio::runtime::Handle, attempts: u32) {
        if self.batch.is_empty() {
            return;
        }
        let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(BATCH));
        let n = batch.len() as u64;
        let mut delay = Duration::from_millis(200);
        for attempt in 1..=attempts {
            // gRPC runs on the exporter's tokio runtime; the HTTP client blocks and must not.
            let r = if self.cfg.grpc {
                rt.block_on(exp.export(batch.clone()))
            } else {
                futures_executor::block_on(exp.export(batch.clone()))
            };
            match r {
                Ok(()) => {
                    self.counters.spans_exported.fetch_add(n, Ordering::Relaxed);
                    return;
                }
                Err(e) => {
                    self.counters.trace_failures.fetch_add(1, Ordering::Relaxed);
                    if attempt == attempts {
                        eprintln!("gpu-observer: OTLP trace export failed ({e}); {n} spans dropped");
                        self.counters.spans_dropped.fetch_add(n, Ordering::Relaxed);
                    } else {
                        std::thread::sleep(delay);
                        delay *= 4;
                    }
                }
            }
        }
    }

    fn ids(&mut self) -> u64 {
        self.seq = self.seq.wrapping_add(1);
        // Unique per run: the sequence under a per-run random high part.
        self.seq ^ (u64::from(std::process::id()) << 40) ^ (self.clock.mono_ns.rotate_left(17))
    }

    fn new_span_id(&mut self) -> SpanId {
        SpanId::from_bytes(self.ids().max(1).to_be_bytes())
    }

    /// The window for `pid` at `ts`, opening one (and closing the old) as needed; `None` when
    /// the process is over its span rate.
    fn window(&mut self, pid: u32, comm: &str, ts: u64) -> Option<(TraceId, SpanId)> {
        let interval = self.cfg.interval.as_nanos() as u64;
        if let Some(w) = self.windows.get(&pid)
            && ts >= w.start_ns + interval
        {
            let w = self.windows.remove(&pid).expect("present");
            self.emit_root(pid, w);
        }
        if !self.windows.contains_key(&pid) {
            if self.windows.len() >= MAX_WINDOWS
                && let Some(oldest) = self.windows.iter().min_by_key(|(_, w)| w.start_ns).map(|(p, _)| *p)
            {
                let w = self.windows.remove(&oldest).expect("present");
                self.emit_root(oldest, w);
                self.counters.windows_closed_early.fetch_add(1, Ordering::Relaxed);
            }
            let hi = self.ids();
            let lo = self.ids();
            let trace_id = TraceId::from_bytes(((u128::from(hi) << 64) | u128::from(lo)).to_be_bytes());
            let root = self.new_span_id();
            self.windows.insert(
                pid,
                Window {
                    trace_id,
                    root,
                    start_ns: ts,
                    end_ns: ts,
                    comm: comm.to_string(),
                    spans: 0,
                    budget: self.cfg.max_spans_per_sec,
                    budget_second: ts / 1_000_000_000,
                },
            );
        }
        let w = self.windows.get_mut(&pid).expect("present");
        let second = ts / 1_000_000_000;
        if second != w.budget_second {
            w.budget_second = second;
            w.budget = self.cfg.max_spans_per_sec;
        }
        if self.cfg.max_spans_per_sec > 0 {
            if w.budget == 0 {
                self.counters.spans_sampled_out.fetch_add(1, Ordering::Relaxed);
                return None;
            }
            w.budget -= 1;
        }
        w.spans += 1;
        Some((w.trace_id, w.root))
    }

    fn extend_window(&mut self, pid: u32, end_ns: u64) {
        if let Some(w) = self.windows.get_mut(&pid) {
            w.end_ns = w.end_ns.max(end_ns);
        }
    }

    fn close_windows(&mut self, now: u64, all: bool) {
        let interval = self.cfg.interval.as_nanos() as u64;
        let done: Vec<u32> = self
            .windows
            .iter()
            // A second of slack past the window: events of it may still be in the queue.
            .filter(|(_, w)| all || now >= w.start_ns + interval + 1_000_000_000)
            .map(|(pid, _)| *pid)
            .collect();
        for pid in done {
            let w = self.windows.remove(&pid).expect("present");
            self.emit_root(pid, w);
        }
    }

    fn emit_root(&mut self, pid: u32, w: Window) {
        let mut attrs = (*self.procs.lock().expect("process attributes lock").of(pid, &w.comm)).clone();
        attrs.push(KeyValue::new("gpu_observer.spans", w.spans as i64));
        let span = self.span(
            w.trace_id,
            w.root,
            SpanId::INVALID,
            Cow::Owned(format!("process {}", w.comm)),
            (w.start_ns, w.end_ns.max(w.start_ns)),
            attrs,
        );
        self.batch.push(span);
    }

    fn span(
        &self,
        trace_id: TraceId,
        span_id: SpanId,
        parent: SpanId,
        name: Cow<'static, str>,
        (start, end): (u64, u64),
        attributes: Vec<KeyValue>,
    ) -> SpanData {
        SpanData {
            span_context: SpanContext::new(trace_id, span_id, TraceFlags::SAMPLED, false, TraceState::default()),
            parent_span_id: parent,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name,
            start_time: self.clock.wall(start),
            end_time: self.clock.wall(end),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: self.scope.clone(),
        }
    }

    fn take(&mut self, item: Item) {
        match item {
            Item::Event(ev) => self.event(ev),
            Item::Gpu(a) => self.gpu(&a),
        }
    }

    fn event(&mut self, ev: Event) {
        let comm = ev.comm().to_string();
        match &ev.body {
            Body::Ioctl(io) => {
                let Some((trace, _root)) = self.window(ev.pid, &comm, ev.ts_ns) else {
                    return;
                };
                let mut attrs = vec![
                    KeyValue::new("thread.id", i64::from(ev.tid)),
                    KeyValue::new("ioctl.cmd", format!("{:#x}", io.cmd)),
                    KeyValue::new("ioctl.fd", i64::from(io.fd)),
                    KeyValue::new("ioctl.ret", io.ret),
                ];
                if let Some(n) = io.name {
                    attrs.push(KeyValue::new("ioctl.name", n));
                }
                if let Some(p) = io.parent {
                    attrs.push(KeyValue::new("gpu.cuda.api", p.name));
                }
                let id = self.new_span_id();
                let name = Cow::Borrowed(io.name.unwrap_or("ioctl"));
                let end = ev.ts_ns + io.duration_ns;
                self.extend_window(ev.pid, end);
                // Parented when its call returns; a launch (entry-only) never does.
                let span = self.span(trace, id, SpanId::INVALID, name, (ev.ts_ns, end), attrs);
                let waits = io.parent.is_some_and(|p| p.family.has_return_probe());
                let room = self.ioctls_pending < IOCTLS_PENDING || self.ioctls.contains_key(&ev.tid);
                if waits && !room {
                    // Every thread's wait together is full: not parented, not lost.
                    self.counters.ioctls_unparented.fetch_add(1, Ordering::Relaxed);
                    self.orphan(ev.pid, span);
                } else if waits {
                    let q = self.ioctls.entry(ev.tid).or_default();
                    // The thread's own oldest makes room (its wait, or everyone's, is full).
                    let old = if q.len() == IOCTLS_PER_THREAD || self.ioctls_pending >= IOCTLS_PENDING {
                        q.pop_front()
                    } else {
                        None
                    };
                    q.push_back(PendingIoctl {
                        pid: ev.pid,
                        ts_ns: ev.ts_ns,
                        span,
                    });
                    self.ioctls_pending += 1;
                    if let Some(old) = old {
                        self.ioctls_pending -= 1;
                        self.counters.ioctls_unparented.fetch_add(1, Ordering::Relaxed);
                        self.orphan(old.pid, old.span);
                    }
                } else {
                    self.orphan(ev.pid, span);
                }
            }
            Body::Launch(l) => {
                let Some(api) = ev.api else { return };
                let Some((trace, root)) = self.window(ev.pid, &comm, ev.ts_ns) else {
                    return;
                };
                let mut attrs = vec![
                    KeyValue::new("thread.id", i64::from(ev.tid)),
                    KeyValue::new("gpu.backend", "cuda"),
                    KeyValue::new(
                        "gpu.cuda.grid_dim",
                        format!("[{},{},{}]", l.grid[0], l.grid[1], l.grid[2]),
                    ),
                    KeyValue::new(
                        "gpu.cuda.block_dim",
                        format!("[{},{},{}]", l.block[0], l.block[1], l.block[2]),
                    ),
                    KeyValue::new("gpu.cuda.shared_mem_bytes", i64::from(l.shared_mem_bytes)),
                    KeyValue::new("gpu.cuda.stream", format!("{:#x}", l.stream)),
                ];
                if let Some(k) = &l.kernel {
                    attrs.push(KeyValue::new("gpu.kernel", k.demangled.to_string()));
                }
                let id = self.new_span_id();
                self.extend_window(ev.pid, ev.ts_ns);
                let span = self.span(trace, id, root, Cow::Borrowed(api.name), (ev.ts_ns, ev.ts_ns), attrs);
                self.batch.push(span);
            }
            Body::Call(c) => {
                let Some(api) = ev.api else { return };
                let family = api.family;
                let timed = crate::rules::sampled_by_duration(family);
                let end = ev.ts_ns + c.duration_ns;
                // Adaptive sampling (seeds 000/003), as for JSON lines.
                if timed && !crate::rules::kept(c.duration_ns, self.cfg.threshold_ns, self.cfg.trace_all) {
                    self.counters.spans_sampled_out.fetch_add(1, Ordering::Relaxed);
                    self.drop_ioctls(ev.tid, ev.ts_ns, end);
                    return;
                }
                let Some((trace, root)) = self.window(ev.pid, &comm, ev.ts_ns) else {
                    self.drop_ioctls(ev.tid, ev.ts_ns, end);
                    return;
                };
                let mut attrs = vec![
                    KeyValue::new("thread.id", i64::from(ev.tid)),
                    KeyValue::new("gpu.cuda.result", i64::from(c.result)),
                    KeyValue::new("gpu.cuda.ioctl_count", i64::from(c.ioctl_count)),
                ];
                let is_slow = crate::rules::is_slow(c.duration_ns, self.cfg.threshold_ns);
                if family == Family::Memcpy {
                    let bytes = c.bytes.unwrap_or(0);
                    attrs.extend([
                        KeyValue::new("gpu_transfer.direction", c.direction.name()),
                        KeyValue::new("gpu_transfer.bytes", bytes as i64),
                        KeyValue::new("gpu_transfer.duration_us", (c.duration_ns / 1000) as i64),
                        KeyValue::new(
                            "gpu_transfer.bandwidth_mbps",
                            crate::rules::bandwidth_mbps(bytes, c.duration_ns),
                        ),
                        KeyValue::new("gpu_transfer.is_slow", is_slow),
                        KeyValue::new("gpu_transfer.threshold_us", (self.cfg.threshold_ns / 1000) as i64),
                    ]);
                } else if let Some(b) = c.bytes {
                    attrs.push(KeyValue::new("gpu.bytes", b as i64));
                }
                if timed {
                    attrs.push(KeyValue::new("gpu.is_slow", is_slow));
                }
                let id = self.new_span_id();
                self.extend_window(ev.pid, end);
                if c.result != 0 {
                    attrs.push(KeyValue::new("error.type", format!("CUresult {}", c.result)));
                }
                let mut span = self.span(trace, id, root, Cow::Borrowed(api.name), (ev.ts_ns, end), attrs);
                if c.result != 0 {
                    span.status = Status::error(format!("CUresult {}", c.result));
                }
                self.batch.push(span);
                // Its ioctls: the ones of this thread inside [entry, return].
                if let Some(mut q) = self.ioctls.remove(&ev.tid) {
                    self.ioctls_pending -= q.len();
                    let (mine, rest): (Vec<_>, Vec<_>) =
                        q.drain(..).partition(|p| p.ts_ns >= ev.ts_ns && p.ts_ns <= end);
                    self.ioctls_pending += rest.len();
                    // Threads with nothing pending hold no entry: the map stays as small as
                    // the set of threads inside a call.
                    if !rest.is_empty() {
                        self.ioctls.insert(ev.tid, rest.into());
                    }
                    for mut p in mine {
                        p.span.parent_span_id = id;
                        self.batch.push(p.span);
                    }
                }
            }
            Body::ProcessExit => {
                if let Some(w) = self.windows.remove(&ev.pid) {
                    self.emit_root(ev.pid, w);
                }
                self.procs.lock().expect("process attributes lock").forget(ev.pid);
            }
            Body::Gpu(_) | Body::GpuName { .. } => {}
        }
    }

    /// An ioctl with no call to hang it under: under the window's root.
    fn orphan(&mut self, pid: u32, mut span: SpanData) {
        if let Some(w) = self.windows.get(&pid)
            && w.trace_id == span.span_context.trace_id()
        {
            span.parent_span_id = w.root;
        }
        self.batch.push(span);
    }

    fn drop_ioctls(&mut self, tid: u32, start: u64, end: u64) {
        if let Some(q) = self.ioctls.get_mut(&tid) {
            let before = q.len();
            q.retain(|p| p.ts_ns < start || p.ts_ns > end);
            self.ioctls_pending -= before - q.len();
            if q.is_empty() {
                self.ioctls.remove(&tid);
            }
        }
    }

    fn gpu(&mut self, a: &GpuActivity) {
        let d = a.duration_ns();
        let comm = crate::rules::comm(&a.comm).into_owned();
        if let Some(k) = a
            .kernel
            .as_ref()
            .filter(|_| a.kind() == Some(gpu_observer_common::cupti::GpuRecordKind::Kernel))
        {
            self.record_kernel(a.pid, &comm, &k.demangled, d);
        }
        let is_slow = crate::rules::is_slow(d, self.cfg.threshold_ns);
        if !crate::rules::kept(d, self.cfg.threshold_ns, self.cfg.trace_all) {
            self.counters.spans_sampled_out.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Some((trace, root)) = self.window(a.pid, &comm, a.rec.start_ns) else {
            return;
        };
        let mut attrs: Vec<KeyValue> = attributes::span_attributes(a, self.cfg.threshold_ns / 1000, is_slow)
            .into_iter()
            .map(|(k, v)| KeyValue::new(k, value(v)))
            .collect();
        attrs.push(KeyValue::new(
            "gpu.cuda.correlation_id",
            i64::from(a.rec.correlation_id),
        ));
        if let Some(q) = a.queue_delay_ns() {
            attrs.push(KeyValue::new("gpu.queue_delay_us", q as f64 / 1e3));
        }
        let name = match &a.kernel {
            Some(k) => Cow::Owned(format!("gpu_kernel {}", k.demangled)),
            None => Cow::Borrowed(match a.kind() {
                Some(gpu_observer_common::cupti::GpuRecordKind::Kernel) => "gpu_kernel",
                Some(gpu_observer_common::cupti::GpuRecordKind::Memset) => "gpu_memset",
                _ => "gpu_memcpy",
            }),
        };
        let id = self.new_span_id();
        self.extend_window(a.pid, a.rec.end_ns);
        let span = self.span(trace, id, root, name, (a.rec.start_ns, a.rec.end_ns), attrs);
        self.batch.push(span);
    }

    /// The kernel GPU-time histogram: its label is the kernel's name while it is among the
    /// `TOP_KERNELS` with the most GPU time, else `other` (bounded cardinality).
    fn record_kernel(&mut self, pid: u32, comm: &str, name: &str, ns: u64) {
        let key: Arc<str> = match self.kernel_ns.get_key_value(name) {
            Some((k, _)) => k.clone(),
            None if self.kernel_ns.len() < KERNEL_LABELS && self.kernel_ns_bytes + name.len() <= KERNEL_LABEL_BYTES => {
                self.kernel_ns_bytes += name.len();
                Arc::from(name)
            }
            None => Arc::from("other"),
        };
        *self.kernel_ns.entry(key.clone()).or_default() += ns;
        if self.last_top.elapsed() >= Duration::from_secs(5) || self.top.len() < TOP_KERNELS {
            let mut all: Vec<(&Arc<str>, &u64)> = self.kernel_ns.iter().collect();
            all.sort_by(|a, b| b.1.cmp(a.1));
            self.top = all.into_iter().take(TOP_KERNELS).map(|(k, _)| k.clone()).collect();
            self.last_top = Instant::now();
        }
        let label = if self.top.contains(&key) {
            key.to_string()
        } else {
            "other".to_string()
        };
        let mut attrs = (*self.procs.lock().expect("process attributes lock").of(pid, comm)).clone();
        attrs.push(KeyValue::new("gpu.kernel", label));
        self.kernel_time.record(ns as f64 / 1e9, &attrs);
    }
}

fn value(v: attributes::Value) -> Value {
    match v {
        attributes::Value::Str(s) => Value::from(s),
        attributes::Value::Int(i) => Value::I64(i),
        attributes::Value::Float(f) => Value::F64(f),
        attributes::Value::Bool(b) => Value::Bool(b),
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
