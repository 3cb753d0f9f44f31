//! The span thread: turns the events and GPU records the reader hands over into spans — one
//! trace per process per window, a root span for the process, a span per CUDA call with its
//! ioctls under it, a span per GPU kernel or copy — samples them as configured, and exports
//! them in batches. It also records the kernel GPU-time histogram, and hangs the anomaly
//! detector's findings on the spans of the calls and records they flag (`gpu.anomaly` events)
//! and counts them (`gpu.anomalies`).

use std::{
    borrow::Cow,
    collections::{HashMap, VecDeque},
    sync::PoisonError,
    sync::{
        Arc,
        atomic::Ordering,
        mpsc::{Receiver, RecvTimeoutError},
    },
    time::{Duration, Instant},
};

use gpu_observer_common::api::Family;
use opentelemetry::{
    InstrumentationScope, KeyValue, Value,
    metrics::Histogram,
    trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState},
};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};

use super::{
    Config, Counters, Item,
    anomalies::{self, Flag, SharedTally, SpanKey},
    resource::SharedProcAttrs,
    transport,
};
use crate::{
    analyze::gpu_time::Pod,
    clock::{WallClock, monotonic_ns},
    correlate::cupti_join::GpuActivity,
    decode::{Body, Event},
    export::attributes,
};

/// Kernel names that get their own label on the GPU-time histogram; the rest are `other`.
const TOP_KERNELS: usize = 20;
/// Spans per export request.
const BATCH: usize = 512;
/// Ioctls held per thread until the call they were made in returns.
pub(super) const IOCTLS_PER_THREAD: usize = 64;
/// Ioctls held over all threads: a span with its attributes is about 1 KiB, so thousands of
/// threads blocked inside calls cannot make this grow past ~4 MiB. Past it an ioctl goes out
/// at once under its window's root (`ioctls_unparented`).
pub(super) const IOCTLS_PENDING: usize = 4096;
/// Trace windows open at once (one per process with recent events). Past it the oldest window
/// is closed early (`windows_closed_early`): its process's next span opens a new trace.
pub(super) const MAX_WINDOWS: usize = 4096;
/// Distinct kernel names remembered for the GPU-time histogram's labels, and their bytes;
/// kernels past either are labelled `other`.
const KERNEL_LABELS: usize = 4096;
const KERNEL_LABEL_BYTES: usize = 256 << 10;
/// How long the span of a flagged call waits for its findings. They come right after their
/// batch's events and GPU records; only a finding the queue had no room for (counted) leaves a
/// span waiting this long, after which it goes out as it is.
pub(super) const HOLD: Duration = Duration::from_secs(1);
/// Spans waiting for their findings; past it the oldest goes out as it is (its findings are
/// then counted `anomalies_unattached`). A reader batch is at most 4096 records.
const MAX_HELD: usize = 4096;

/// One process's current trace window.
struct Window {
    trace_id: TraceId,
    root: SpanId,
    start_ns: u64,
    end_ns: u64,
    comm: String,
    spans: u64,
}

/// The span of a flagged call or GPU record, waiting for its findings.
struct Held {
    at: SpanKey,
    span: SpanData,
    /// Its process's pod, read when the span was built (the process may be gone by the time
    /// the findings come: they follow the batch's events, its exit among them).
    pod: Option<Arc<Pod>>,
    since: Instant,
}

/// A pending ioctl, waiting for its call's span.
struct PendingIoctl {
    pid: u32,
    ts_ns: u64,
    span: SpanData,
}

/// The span thread's state: open windows, ioctls waiting for their call, the batch to export.
pub(super) struct Spans {
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
    /// Spans of flagged calls and records waiting for their findings, in the order they were
    /// built — the order their findings come in.
    held: VecDeque<Held>,
    anomalies: SharedTally,
}

impl Spans {
    pub(super) fn new(
        cfg: Config,
        counters: Arc<Counters>,
        kernel_time: Histogram<f64>,
        procs: SharedProcAttrs,
        anomalies: SharedTally,
    ) -> Self {
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
            held: VecDeque::new(),
            anomalies,
        }
    }

    pub(super) fn run(
        mut self,
        rx: &Receiver<Item>,
        exp: &opentelemetry_otlp::SpanExporter,
        rt: &tokio::runtime::Handle,
    ) {
        let mut last_export = Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(item) => self.take(item),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if !self.held.is_empty() {
                self.release_held(Some(Instant::now()));
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
        self.release_held(None);
        self.close_windows(u64::MAX, true);
        self.export(exp, rt, 1);
    }

    fn export(&mut self, exp: &opentelemetry_otlp::SpanExporter, rt: &tokio::runtime::Handle, attempts: u32) {
        if self.batch.is_empty() {
            return;
        }
        let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(BATCH));
        transport::export_spans(exp, rt, self.cfg.grpc, batch, attempts, &self.counters);
    }

    fn ids(&mut self) -> u64 {
        self.seq = self.seq.wrapping_add(1);
        // Unique per run: the sequence under a per-run random high part.
        self.seq ^ (u64::from(std::process::id()) << 40) ^ (self.clock.mono_ns.rotate_left(17))
    }

    fn new_span_id(&mut self) -> SpanId {
        SpanId::from_bytes(self.ids().max(1).to_be_bytes())
    }

    /// The window for `pid` at `ts`, opening one (and closing the old) as needed. Whether the
    /// span is wanted was decided before the queue (`sample`).
    fn window(&mut self, pid: u32, comm: &str, ts: u64) -> (TraceId, SpanId) {
        let interval = self.cfg.interval.as_nanos() as u64;
        if self.windows.get(&pid).is_some_and(|w| ts >= w.start_ns + interval)
            && let Some(w) = self.windows.remove(&pid)
        {
            self.emit_root(pid, w);
        }
        if let Some(w) = self.windows.get_mut(&pid) {
            w.spans += 1;
            return (w.trace_id, w.root);
        }
        if self.windows.len() >= MAX_WINDOWS
            && let Some(oldest) = self.windows.iter().min_by_key(|(_, w)| w.start_ns).map(|(p, _)| *p)
            && let Some(w) = self.windows.remove(&oldest)
        {
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
                spans: 1,
            },
        );
        (trace_id, root)
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
            let Some(w) = self.windows.remove(&pid) else { continue };
            self.emit_root(pid, w);
        }
    }

    fn emit_root(&mut self, pid: u32, w: Window) {
        let mut attrs = (*self
            .procs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .of(pid, &w.comm))
        .clone();
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
            Item::Gpu(a, span) => self.gpu(&a, span),
            Item::SampledOut { tid, start_ns, end_ns } => self.drop_ioctls(tid, start_ns, end_ns),
            Item::Anomaly(f) => self.anomaly(&f),
        }
    }

    /// The pod of a process, for the anomaly counter.
    fn pod(&self, pid: u32, comm: &str) -> Option<Arc<Pod>> {
        anomalies::pod_of(&self.procs.lock().unwrap_or_else(PoisonError::into_inner).of(pid, comm))
    }

    /// The span of a flagged call or record: held until its findings come.
    fn hold(&mut self, at: SpanKey, comm: &str, span: SpanData) {
        if self.held.len() >= MAX_HELD
            && let Some(h) = self.held.pop_front()
        {
            self.batch.push(h.span);
        }
        let pod = self.pod(at.pid(), comm);
        self.held.push_back(Held {
            at,
            span,
            pod,
            since: Instant::now(),
        });
    }

    /// Held spans go out: those held past [`HOLD`] at `now`, or all (`None`, at exit).
    fn release_held(&mut self, now: Option<Instant>) {
        while let Some(h) = self.held.front() {
            if now.is_some_and(|now| now.duration_since(h.since) < HOLD) {
                break;
            }
            if let Some(h) = self.held.pop_front() {
                self.batch.push(h.span);
            }
        }
    }

    /// A finding: counted, and an event on its span (which goes out after its last finding).
    fn anomaly(&mut self, f: &Flag) {
        let pos = self.held.iter().position(|h| h.at == f.at);
        let pod = match pos {
            Some(p) => self.held[p].pod.clone(),
            None => self.pod(f.at.pid(), &crate::rules::comm(&f.comm)),
        };
        let key = anomalies::Key {
            what: f.finding.what.kind(),
            mode: f.mode.name(),
            pod,
        };
        if self.anomalies.lock().unwrap_or_else(PoisonError::into_inner).count(key) {
            self.counters.anomaly_keys_evicted.fetch_add(1, Ordering::Relaxed);
        }
        let Some(p) = pos else {
            self.counters.anomalies_unattached.fetch_add(1, Ordering::Relaxed);
            return;
        };
        // Findings come in the order their spans were held: those held before this one will
        // get no more (theirs found the queue full, counted in `anomalies_dropped`).
        for h in self.held.drain(..p) {
            self.batch.push(h.span);
        }
        let event = anomalies::span_event(&f.finding, f.mode, self.clock.wall(f.ts_ns));
        if let Some(h) = self.held.front_mut() {
            h.span.events.events.push(event);
        }
        if f.last
            && let Some(h) = self.held.pop_front()
        {
            self.batch.push(h.span);
        }
    }

    fn event(&mut self, ev: Event) {
        let comm = ev.comm().to_string();
        match &ev.body {
            Body::Ioctl(io) => {
                let (trace, _root) = self.window(ev.pid, &comm, ev.ts_ns);
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
                let (trace, root) = self.window(ev.pid, &comm, ev.ts_ns);
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
                let (trace, root) = self.window(ev.pid, &comm, ev.ts_ns);
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
                if c.anomalous {
                    self.hold(SpanKey::of_event(&ev), &comm, span);
                } else {
                    self.batch.push(span);
                }
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
                self.procs.lock().unwrap_or_else(PoisonError::into_inner).forget(ev.pid);
            }
            Body::Gpu(_) | Body::GpuName { .. } | Body::MarkerName { .. } => {}
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

    /// The ioctls of a call sampled out (fast, or its process over its span rate): they go
    /// with it, and are counted with it (`spans_sampled_out`).
    fn drop_ioctls(&mut self, tid: u32, start: u64, end: u64) {
        if let Some(q) = self.ioctls.get_mut(&tid) {
            let before = q.len();
            q.retain(|p| p.ts_ns < start || p.ts_ns > end);
            let dropped = before - q.len();
            self.ioctls_pending -= dropped;
            self.counters
                .spans_sampled_out
                .fetch_add(dropped as u64, Ordering::Relaxed);
            if q.is_empty() {
                self.ioctls.remove(&tid);
            }
        }
    }

    /// A GPU record: its kernel time to the histogram; a span when `span` (`sample`).
    fn gpu(&mut self, a: &GpuActivity, span: bool) {
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
        if !span {
            return;
        }
        let (trace, root) = self.window(a.pid, &comm, a.rec.start_ns);
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
        if a.anomalous {
            self.hold(SpanKey::of_gpu(a), &comm, span);
        } else {
            self.batch.push(span);
        }
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
        let mut attrs = (*self.procs.lock().unwrap_or_else(PoisonError::into_inner).of(pid, comm)).clone();
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

#[cfg(test)]
mod tests {
    use gpu_observer_common::api;
    use opentelemetry::metrics::MeterProvider as _;

    use super::*;
    use crate::export::otlp::sample::Sampler;
    use crate::{
        analyze::anomaly::{Finding, Mode, What},
        decode::{Call, Ioctl, KernelName},
        export::otlp::resource::ProcAttrs,
    };

    const COPY: &str = "cuMemcpyHtoD_v2";

    /// The span thread with the reader's sampling in front, as the agent runs them.
    struct Fed {
        s: Spans,
        smp: Sampler,
    }

    impl Fed {
        fn event(&mut self, ev: Event) {
            if let Some(item) = self.smp.route(&ev, &self.s.counters.clone()) {
                self.s.take(item);
            }
        }

        fn gpu(&mut self, a: &GpuActivity) {
            if let Some(item) = self.smp.route_gpu(a, &self.s.counters.clone()) {
                self.s.take(item);
            }
        }
    }

    impl std::ops::Deref for Fed {
        type Target = Spans;
        fn deref(&self) -> &Spans {
            &self.s
        }
    }

    impl std::ops::DerefMut for Fed {
        fn deref_mut(&mut self) -> &mut Spans {
            &mut self.s
        }
    }

    fn spans(max_spans_per_sec: u64) -> Fed {
        let cfg = Config::for_tests(max_spans_per_sec);
        let h = opentelemetry_sdk::metrics::SdkMeterProvider::default()
            .meter("test")
            .f64_histogram("t")
            .build();
        Fed {
            smp: Sampler::new(&cfg),
            s: Spans::new(
                cfg,
                Arc::new(Counters::default()),
                h,
                ProcAttrs::new(false),
                SharedTally::default(),
            ),
        }
    }

    fn ev(ts_ns: u64, body: Body) -> Event {
        Event {
            ts_ns,
            // No such process: its attributes fall back to the comm.
            pid: u32::MAX,
            tid: 7,
            comm: *b"train\0\0\0\0\0\0\0\0\0\0\0",
            api: api::by_id(api::id_of(COPY).unwrap()),
            body,
        }
    }

    fn ioctl(ts_ns: u64) -> Event {
        ev(
            ts_ns,
            Body::Ioctl(Ioctl {
                fd: 3,
                cmd: 0x2a,
                arg: 0,
                duration_ns: 10,
                ret: 0,
                parent: api::by_id(api::id_of(COPY).unwrap()),
                name: None,
                device: None,
            }),
        )
    }

    fn copy(ts_ns: u64, duration_ns: u64, abandoned: bool) -> Event {
        let spec = api::by_id(api::id_of(COPY).unwrap()).unwrap();
        ev(
            ts_ns,
            Body::Call(Call {
                bytes: Some(16),
                ioctl_count: 1,
                ioctl_ns: 10,
                abandoned,
                ..Call::returned(spec, duration_ns)
            }),
        )
    }

    fn sampled_out(s: &Spans) -> u64 {
        s.counters.spans_sampled_out.load(Ordering::Relaxed)
    }

    #[test]
    fn a_fast_call_is_sampled_out_with_its_ioctls_and_both_are_counted() {
        let mut s = spans(0);
        s.event(ioctl(1_000));
        assert_eq!(s.ioctls_pending, 1);
        s.event(copy(900, 200, false));
        assert_eq!(sampled_out(&s), 2);
        assert_eq!(s.ioctls_pending, 0);
        assert!(s.batch.is_empty());
    }

    #[test]
    fn a_call_over_the_span_rate_takes_its_ioctls_with_it_counted() {
        // The ioctl takes the second's one span; the call finds none left.
        let mut s = spans(1);
        s.event(ioctl(1_000));
        s.event(copy(900, 200_000, false));
        assert_eq!(sampled_out(&s), 2);
        assert_eq!(s.ioctls_pending, 0);
        assert!(s.batch.is_empty());
    }

    fn flagged_copy(ts_ns: u64, duration_ns: u64) -> Event {
        let mut e = copy(ts_ns, duration_ns, false);
        if let Body::Call(c) = &mut e.body {
            c.anomalous = true;
        }
        e
    }

    fn finding(what: What, observed: f64) -> Finding {
        Finding {
            what,
            observed,
            typical: observed / 10.0,
            deviation: 115.0,
        }
    }

    fn call_what() -> What {
        What::Call { api: COPY, size: 5 }
    }

    fn bandwidth_what() -> What {
        What::Bandwidth {
            direction: api::Direction::CpuToGpu,
            size: 5,
            on_gpu: false,
        }
    }

    /// The finding the reader sends after the batch for the call `ev`.
    fn flag(ev: &Event, what: What, last: bool) -> Flag {
        let Body::Call(c) = &ev.body else { unreachable!() };
        Flag {
            at: SpanKey::of_event(ev),
            comm: ev.comm,
            ts_ns: ev.ts_ns,
            finding: finding(what, c.duration_ns as f64),
            mode: Mode::Robust,
            last,
        }
    }

    fn event_whats(span: &SpanData) -> Vec<String> {
        span.events
            .iter()
            .map(|e| {
                assert_eq!(e.name, "gpu.anomaly");
                let kv = e
                    .attributes
                    .iter()
                    .find(|kv| kv.key.as_str() == "gpu.anomaly.what")
                    .unwrap();
                kv.value.as_str().into_owned()
            })
            .collect()
    }

    fn tally(s: &Spans) -> Vec<(&'static str, &'static str, u64)> {
        let mut v = Vec::new();
        s.anomalies.lock().unwrap().each(|k, n| v.push((k.what, k.mode, n)));
        v.sort();
        v
    }

    #[test]
    fn a_flagged_calls_span_waits_for_its_last_finding_and_carries_each_as_an_event() {
        let mut s = spans(0);
        // Fast (sampled by duration) but flagged: kept, and held for its findings.
        let ev = flagged_copy(5_000, 200);
        s.event(ev.clone());
        s.event(copy(9_000, 200_000, false));
        assert_eq!((s.held.len(), s.batch.len()), (1, 1), "the other copy goes out at once");
        s.anomaly(&flag(&ev, call_what(), false));
        assert_eq!(s.held.len(), 1, "a bandwidth finding may follow");
        s.anomaly(&flag(&ev, bandwidth_what(), true));
        assert!(s.held.is_empty());
        let span = s.batch.last().unwrap();
        assert_eq!(span.name, COPY);
        assert_eq!(event_whats(span), ["call", "bandwidth"]);
        // At the call's start.
        assert!(span.events.iter().all(|e| e.timestamp == s.clock.wall(5_000)));
        assert_eq!(span.start_time, s.clock.wall(5_000));
        assert_eq!(tally(&s), [("bandwidth", "robust", 1), ("call", "robust", 1)]);
        let c = &s.counters;
        assert_eq!(sampled_out(&s), 0);
        assert_eq!(c.anomalies_unattached.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_flagged_gpu_record_gets_its_event_by_correlation_id_and_gpu_start() {
        let mut s = spans(0);
        let kernel = |corr: u32, start: u64, end: u64, anomalous: bool| GpuActivity {
            pid: u32::MAX,
            comm: *b"train\0\0\0\0\0\0\0\0\0\0\0",
            rec: gpu_observer_common::cupti::GpuRecord {
                kind: gpu_observer_common::cupti::GpuRecordKind::Kernel as u32,
                correlation_id: corr,
                start_ns: start,
                end_ns: end,
                ..Default::default()
            },
            origin: None,
            kernel: Some(Arc::new(KernelName::new("steady_kernel"))),
            occupancy: None,
            sm_count: None,
            nvtx: None,
            anomalous,
        };
        // A graph launch: two kernels of one correlation id, the second flagged.
        s.gpu(&kernel(42, 1_000, 3_000, false));
        let slow = kernel(42, 4_000, 24_000, true);
        s.gpu(&slow);
        assert_eq!((s.held.len(), s.batch.len()), (1, 0), "the fast one is sampled out");
        s.anomaly(&Flag {
            at: SpanKey::of_gpu(&slow),
            comm: slow.comm,
            ts_ns: 4_000,
            finding: finding(
                What::Kernel {
                    name: slow.kernel.clone().unwrap(),
                    grid: [0; 3],
                    block: [0; 3],
                },
                20_000.0,
            ),
            mode: Mode::Robust,
            last: true,
        });
        assert_eq!(s.batch.len(), 1);
        let span = &s.batch[0];
        assert_eq!(span.name, "gpu_kernel steady_kernel");
        assert_eq!(span.start_time, s.clock.wall(4_000));
        assert_eq!(event_whats(span), ["kernel"]);
        assert_eq!(span.events[0].timestamp, s.clock.wall(4_000));
        assert_eq!(tally(&s), [("kernel", "robust", 1)]);
    }

    #[test]
    fn a_flagged_call_over_the_span_rate_uses_the_anomaly_allowance_and_past_it_is_counted() {
        // One span a second: the first copy takes it.
        let mut s = spans(1);
        s.event(copy(1_000, 200_000, false));
        let first = flagged_copy(2_000, 200_000);
        s.event(first.clone());
        assert_eq!((s.batch.len(), s.held.len(), sampled_out(&s)), (1, 1, 0));
        // The allowance (as many again) is spent too: the next flagged one is left out, counted,
        // and so is an ordinary one.
        let second = flagged_copy(3_000, 200_000);
        s.event(second.clone());
        s.event(copy(4_000, 200_000, false));
        assert_eq!((s.batch.len(), s.held.len(), sampled_out(&s)), (1, 1, 2));
        s.anomaly(&flag(&first, call_what(), true));
        s.anomaly(&flag(&second, call_what(), true));
        // Both counted; the second had no span to carry its event.
        assert_eq!(tally(&s), [("call", "robust", 2)]);
        assert_eq!(s.counters.anomalies_unattached.load(Ordering::Relaxed), 1);
        assert_eq!(s.batch.len(), 2);
        assert_eq!(event_whats(&s.batch[1]), ["call"]);
        // The next second: both budgets are whole again.
        let next = flagged_copy(1_000_002_000, 200_000);
        s.event(copy(1_000_001_000, 200_000, false));
        s.event(next);
        assert_eq!((s.batch.len(), s.held.len(), sampled_out(&s)), (3, 1, 2));
    }

    #[test]
    fn a_held_span_whose_findings_were_lost_goes_out_with_the_next_ones_or_after_the_hold() {
        let mut s = spans(0);
        let (a, b, c) = (
            flagged_copy(1_000, 50),
            flagged_copy(2_000, 50),
            flagged_copy(3_000, 50),
        );
        for e in [&a, &b, &c] {
            s.event(e.clone());
        }
        assert_eq!(s.held.len(), 3);
        // a's finding found the queue full: b's comes, and a (before it) gets none now.
        s.anomaly(&flag(&b, call_what(), true));
        assert_eq!(s.held.len(), 1);
        assert_eq!(s.batch.len(), 2);
        assert!(s.batch[0].events.is_empty());
        assert_eq!(event_whats(&s.batch[1]), ["call"]);
        // c's finding never comes: c waits HOLD, then goes out as it is.
        s.release_held(Some(Instant::now()));
        assert_eq!(s.held.len(), 1);
        s.release_held(Some(Instant::now() + HOLD));
        assert!(s.held.is_empty());
        assert_eq!(s.batch.len(), 3);
        assert!(s.batch[2].events.is_empty());
    }

    #[test]
    fn an_abandoned_call_is_always_kept() {
        // No duration to sample by (0 < the threshold), as JSON lines writes it.
        let mut s = spans(0);
        s.event(copy(900, 0, true));
        assert_eq!(sampled_out(&s), 0);
        assert_eq!(s.batch.len(), 1);
        assert_eq!(s.batch[0].name, COPY);
    }
}
