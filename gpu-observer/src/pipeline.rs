//! The reader: drains the ring buffer on a short timer (records are submitted without
//! wakeups), decodes, correlates, hands the results to the sinks and publishes snapshots.
//!
//! [`Pipeline`] is the work, with no thread and no ring of its own: the reader thread
//! ([`Reader`]) feeds it ring-buffer records, and replays, tests and the throughput benchmark
//! feed it recorded ones. It owns the correlator outright; everything else reads the
//! snapshots it publishes or asks over the request channel. Nothing here blocks the eBPF
//! side: if this thread falls behind, the ring fills and the eBPF programs count what they drop.

use std::{
    os::fd::AsRawFd,
    sync::{Arc, mpsc},
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result, anyhow};
use aya::maps::{MapData, RingBuf};

use crate::{
    analyze::{
        anomaly::{self, Detector, Finding},
        window::ProcessVerdict,
    },
    clock::monotonic_ns,
    correlate::{Correlator, CuptiChange, cupti_join::GpuActivity, nvtx::NvtxRange},
    decode::{Body, Event, decode},
    export::{AnomalyLine, LeakReport, Sink},
    nvml::{self, Hub, LineReceiver},
    snapshot::{AgentStats, Publisher, Snapshot},
};

/// How often the ring is drained when no wakeup comes (the eBPF side wakes us at half full).
const POLL_INTERVAL: Duration = Duration::from_millis(10);
const FLUSH_INTERVAL_NS: u64 = 200_000_000;
/// How often processes whose memory changed get a `memory` line, and GPU records that waited
/// too long for their launch's API record go out unjoined.
const MEMORY_INTERVAL_NS: u64 = 1_000_000_000;
const PUBLISH_INTERVAL_NS: u64 = crate::snapshot::INTERVAL.as_nanos() as u64;
/// Records decoded before they are correlated and written together.
pub const BATCH: usize = 4096;
/// Records drained before the timers run again (~20 ms of decoding at the baseline's rate).
const DRAIN_MAX: usize = 16 * BATCH;

/// The context of a sink's error: which output failed.
fn failed(s: &dyn Sink) -> String {
    format!("writing {} failed", s.describe())
}

/// What a finished pipeline gives back: its sinks (for the summary) and the last snapshot.
pub type Finished = (Vec<Box<dyn Sink>>, Arc<Snapshot>);

/// What the main task asks of the reader.
pub enum Request {
    /// Write a leak report for every live process, and reply with a fresh snapshot.
    DumpLeaks(tokio::sync::oneshot::Sender<Arc<Snapshot>>),
    /// The latest drops and attach counts, for the next snapshots.
    Agent(AgentStats),
    /// Verdicts to write (the main task judges windows from the snapshots).
    Verdicts(u64, Vec<ProcessVerdict>),
    /// What `--gpu-timing` did to a process, to write.
    GpuTiming(crate::export::GpuTimingNote),
    /// A capture window opened or closed (fleet mode), to write.
    Capture(crate::observe::capture::Edge),
    /// Drain what is left, publish the last snapshot, and give the sinks back.
    Stop,
}

/// decode → correlate → sinks, and the snapshots.
pub struct Pipeline {
    corr: Correlator,
    sinks: Vec<Box<dyn Sink>>,
    publisher: Publisher,
    nvml: Arc<Hub>,
    nvml_lines: Option<LineReceiver>,
    agent: Arc<AgentStats>,
    batch: Vec<Event>,
    exited: Vec<u32>,
    gpu: Vec<GpuActivity>,
    changes: Vec<CuptiChange>,
    nvtx: Vec<NvtxRange>,
    detector: Detector,
    findings: Vec<(anomaly::Source, Finding)>,
    decode_errors: u64,
    last_flush: u64,
    last_memory: u64,
    last_publish: u64,
    /// The last batch: launches still waiting for a name go out.
    finishing: bool,
}

impl Pipeline {
    /// `nvml_lines`: the NVML samples to write (when a sink wants them).
    pub fn new(
        corr: Correlator,
        sinks: Vec<Box<dyn Sink>>,
        nvml: Arc<Hub>,
        nvml_lines: Option<LineReceiver>,
        publisher: Publisher,
        anomalies: anomaly::Config,
        now_ns: u64,
    ) -> Self {
        Self {
            corr,
            sinks,
            publisher,
            nvml,
            nvml_lines,
            agent: Arc::new(AgentStats::default()),
            batch: Vec::with_capacity(BATCH),
            exited: Vec::new(),
            gpu: Vec::new(),
            changes: Vec::new(),
            nvtx: Vec::new(),
            detector: Detector::new(anomalies),
            findings: Vec::new(),
            decode_errors: 0,
            last_flush: now_ns,
            last_memory: now_ns,
            last_publish: 0,
            finishing: false,
        }
    }

    /// One ring-buffer record; the batch is correlated and written when full.
    pub fn record(&mut self, bytes: &[u8]) -> Result<()> {
        match decode(bytes) {
            Ok(ev) => self.batch.push(ev),
            Err(_) => self.decode_errors += 1,
        }
        if self.batch.len() == BATCH {
            self.end_batch()?;
        }
        Ok(())
    }

    /// Correlates the records decoded so far and hands them to the sinks.
    pub fn end_batch(&mut self) -> Result<()> {
        let corr = &mut self.corr;
        corr.decode_errors += std::mem::take(&mut self.decode_errors);
        for ev in &mut self.batch {
            corr.observe(ev);
            if matches!(ev.body, Body::ProcessExit) {
                self.exited.push(ev.pid);
            }
        }
        corr.settle_held(&mut self.batch, if self.finishing { u64::MAX } else { monotonic_ns() });
        std::mem::swap(&mut self.gpu, &mut corr.gpu_out);
        std::mem::swap(&mut self.changes, &mut corr.cupti_changes);
        std::mem::swap(&mut self.nvtx, &mut corr.nvtx_out);
        self.detector.batch(&mut self.batch, &mut self.gpu, &mut self.findings);
        note_findings(&mut self.publisher, &self.batch, &self.gpu, &self.findings);
        let mode = self.detector.config().mode;
        let now = if self.exited.is_empty() { 0 } else { monotonic_ns() };
        for s in &mut self.sinks {
            (|| -> Result<()> {
                for c in &self.changes {
                    s.cupti_state(c)?;
                }
                for ev in &self.batch {
                    s.event(ev)?;
                }
                for a in &self.gpu {
                    s.gpu(a)?;
                }
                for r in &self.nvtx {
                    s.nvtx(r)?;
                }
                write_findings(&mut **s, &self.batch, &self.gpu, &self.findings, mode)?;
                // A process that exited: what it never freed.
                for pid in &self.exited {
                    if let Some(p) = self.corr.procs.get(pid) {
                        s.leaks(&LeakReport {
                            ts_ns: now,
                            pid: p.pid,
                            comm: &p.comm,
                            exited: p.exited,
                            leaks: &p.leaks(),
                        })?;
                    }
                }
                Ok(())
            })()
            .with_context(|| failed(&**s))?;
        }
        self.changes.clear();
        self.nvtx.clear();
        self.findings.clear();
        self.exited.clear();
        self.batch.clear();
        self.gpu.clear();
        Ok(())
    }

    /// The timers: unjoined GPU records, memory lines, NVML samples, flushes, snapshots.
    /// `stopping`: everything now (the end of the run).
    pub fn tick(&mut self, now_ns: u64, stopping: bool) -> Result<()> {
        let memory_due = stopping || now_ns.saturating_sub(self.last_memory) >= MEMORY_INTERVAL_NS;
        if memory_due {
            // GPU records that waited too long for their launch's API record go out unjoined
            // (all of them at the end).
            self.corr.expire_gpu(if stopping { u64::MAX } else { now_ns });
            std::mem::swap(&mut self.gpu, &mut self.corr.gpu_out);
            // Judged like the joined ones: an unjoined kernel is no less slow.
            self.detector.batch(&mut [], &mut self.gpu, &mut self.findings);
            note_findings(&mut self.publisher, &[], &self.gpu, &self.findings);
            self.memory(now_ns, false)?;
            self.last_memory = now_ns;
            self.gpu.clear();
            self.findings.clear();
        }
        self.nvml_lines()?;
        if stopping || now_ns.saturating_sub(self.last_flush) >= FLUSH_INTERVAL_NS {
            for s in &mut self.sinks {
                s.flush().with_context(|| failed(&**s))?;
            }
            self.last_flush = now_ns;
        }
        if stopping || now_ns.saturating_sub(self.last_publish) >= PUBLISH_INTERVAL_NS {
            self.publish(now_ns, stopping);
        }
        Ok(())
    }

    /// Memory lines of processes whose memory changed (and the GPU records in `self.gpu`);
    /// with `leaks`, a leak report of every live process.
    fn memory(&mut self, now_ns: u64, leaks: bool) -> Result<()> {
        let samples = self.corr.memory_samples();
        let live: Vec<(u32, &str, Vec<crate::correlate::Leak>)> = if leaks {
            self.corr
                .sorted()
                .into_iter()
                .filter(|p| !p.exited)
                .map(|p| (p.pid, p.comm.as_str(), p.leaks()))
                .collect()
        } else {
            Vec::new()
        };
        let mode = self.detector.config().mode;
        for s in &mut self.sinks {
            (|| -> Result<()> {
                for a in &self.gpu {
                    s.gpu(a)?;
                }
                write_findings(&mut **s, &[], &self.gpu, &self.findings, mode)?;
                for m in &samples {
                    let comm = self.corr.procs.get(&m.pid).map_or("", |p| p.comm.as_str());
                    s.memory(now_ns, m, comm)?;
                }
                for (pid, comm, l) in &live {
                    s.leaks(&LeakReport {
                        ts_ns: now_ns,
                        pid: *pid,
                        comm,
                        exited: false,
                        leaks: l,
                    })?;
                }
                Ok(())
            })()
            .with_context(|| failed(&**s))?;
        }
        Ok(())
    }

    fn nvml_lines(&mut self) -> Result<()> {
        let Some(rx) = &self.nvml_lines else { return Ok(()) };
        let mut lines = rx.try_iter().peekable();
        if lines.peek().is_none() {
            return Ok(());
        }
        let view = self.nvml.view();
        for (line, comm) in lines {
            for s in &mut self.sinks {
                s.nvml(&line, comm.as_deref(), &view.devices)
                    .with_context(|| failed(&**s))?;
            }
        }
        Ok(())
    }

    fn publish(&mut self, now_ns: u64, last: bool) -> Arc<Snapshot> {
        self.last_publish = now_ns;
        self.publisher.publish(
            &mut self.corr,
            self.nvml.view(),
            self.agent.clone(),
            (self.detector.config(), self.detector.counts()),
            now_ns,
            last,
        )
    }

    /// A request from the main task; `true` for [`Request::Stop`].
    pub fn request(&mut self, r: Request) -> Result<bool> {
        match r {
            Request::Stop => return Ok(true),
            Request::Agent(a) => self.agent = Arc::new(a),
            Request::GpuTiming(n) => {
                for s in &mut self.sinks {
                    s.gpu_timing(&n).with_context(|| failed(&**s))?;
                }
            }
            Request::Capture(e) => {
                for s in &mut self.sinks {
                    s.capture(&e).with_context(|| failed(&**s))?;
                }
            }
            Request::Verdicts(ts_ns, vs) => {
                for s in &mut self.sinks {
                    for v in &vs {
                        s.verdict(ts_ns, v).with_context(|| failed(&**s))?;
                    }
                }
            }
            Request::DumpLeaks(reply) => {
                let now = monotonic_ns();
                self.end_batch()?;
                self.memory(now, true)?;
                self.last_memory = now;
                // The main task may have stopped waiting: nothing to do then.
                let _ = reply.send(self.publish(now, false));
            }
        }
        Ok(false)
    }

    /// The end of the run: everything pending goes out, the last snapshot is published, and
    /// the sinks come back for the summary.
    pub fn finish(mut self, now_ns: u64) -> Result<Finished> {
        self.finishing = true;
        self.end_batch()?;
        self.tick(now_ns, true)?;
        let last = self.publish(now_ns, true);
        for s in &mut self.sinks {
            s.close();
        }
        Ok((self.sinks, last))
    }

    /// Which sinks want NVML samples (the sampler only queues them then).
    pub fn wants_nvml(sinks: &[Box<dyn Sink>]) -> bool {
        sinks.iter().any(|s| s.wants_nvml())
    }
}

/// Hands the publisher each process's findings (about `batch`'s events and `gpu`'s records),
/// for the views: the live table, the summary, the verdict's evidence.
fn note_findings(
    publisher: &mut Publisher,
    batch: &[Event],
    gpu: &[GpuActivity],
    findings: &[(anomaly::Source, Finding)],
) {
    for (src, finding) in findings {
        let (ts_ns, pid) = match *src {
            anomaly::Source::Event(i) => (batch[i].ts_ns, batch[i].pid),
            anomaly::Source::Gpu(i) => (gpu[i].rec.start_ns, gpu[i].pid),
        };
        publisher.note_anomaly(pid, ts_ns, finding);
    }
}

/// Hands a sink the anomaly lines of `findings` (about `batch`'s events and `gpu`'s records),
/// after it had the events and records themselves.
fn write_findings(
    s: &mut dyn Sink,
    batch: &[Event],
    gpu: &[GpuActivity],
    findings: &[(anomaly::Source, Finding)],
    mode: anomaly::Mode,
) -> Result<()> {
    for (n, (src, finding)) in findings.iter().enumerate() {
        let (ts_ns, pid, tid, comm, flagged) = match *src {
            anomaly::Source::Event(i) => {
                let e = &batch[i];
                (e.ts_ns, e.pid, e.tid, &e.comm, crate::export::Flagged::Event(e))
            }
            anomaly::Source::Gpu(i) => {
                let a = &gpu[i];
                let tid = a.origin.as_ref().map_or(0, |o| o.tid);
                (a.rec.start_ns, a.pid, tid, &a.comm, crate::export::Flagged::Gpu(a))
            }
        };
        // The detector lists a call's findings together (its time, then its bandwidth): the
        // last is the one the next finding is not about.
        let last = findings.get(n + 1).is_none_or(|(next, _)| next != src);
        s.anomaly(&AnomalyLine {
            ts_ns,
            pid,
            tid,
            comm,
            finding,
            mode,
            flagged,
            last,
        })?;
    }
    Ok(())
}

/// A recording of raw ring-buffer records (`--record-ring`): [`RECORDING_MAGIC`], then per
/// record its length (u32, little endian) and its bytes. Replays, tests and the throughput
/// benchmark read it back with [`recorded`].
pub struct Recording {
    out: std::io::BufWriter<std::fs::File>,
    bytes: u64,
    /// Set when the cap was reached (said once) or a write failed.
    stopped: bool,
}

/// What a recording starts with.
pub const RECORDING_MAGIC: &[u8; 8] = b"GPUOREC1";
/// Recordings stop growing here (a busy node writes ~100 MB a minute).
const RECORDING_MAX: u64 = 1 << 30;

impl Recording {
    /// Creates the file the way `--output` is created (export/output.rs: refuses links and
    /// other users' files in shared directories).
    pub fn create(path: &std::path::Path) -> Result<Self> {
        use std::io::Write as _;
        let mut out = std::io::BufWriter::with_capacity(1 << 16, crate::export::output::create("--record-ring", path)?);
        out.write_all(RECORDING_MAGIC)?;
        Ok(Self {
            out,
            bytes: RECORDING_MAGIC.len() as u64,
            stopped: false,
        })
    }

    fn record(&mut self, item: &[u8]) {
        use std::io::Write as _;
        if self.stopped {
            return;
        }
        if self.bytes + 4 + item.len() as u64 > RECORDING_MAX {
            crate::say("note: --record-ring reached 1 GiB; recording stopped (observing goes on)");
            self.stopped = true;
            return;
        }
        let len = u32::try_from(item.len()).unwrap_or(u32::MAX);
        let w = self
            .out
            .write_all(&len.to_le_bytes())
            .and_then(|()| self.out.write_all(item));
        if let Err(e) = w {
            crate::say(format_args!(
                "warning: --record-ring: writing failed ({e}); recording stopped"
            ));
            self.stopped = true;
        }
        self.bytes += 4 + item.len() as u64;
    }

    fn finish(&mut self) {
        use std::io::Write as _;
        if let Err(e) = self.out.flush() {
            crate::say(format_args!("warning: --record-ring: writing failed ({e})"));
        }
    }
}

/// The records of a recording, in order; an error for a file that is not one (a truncated
/// last record is dropped: the agent may have been killed while writing it).
pub fn recorded(file: &[u8]) -> Result<impl Iterator<Item = &[u8]>> {
    let rest = file
        .strip_prefix(RECORDING_MAGIC.as_slice())
        .ok_or_else(|| anyhow!("not a gpu-observer ring recording (no {:?} header)", "GPUOREC1"))?;
    let mut at = 0usize;
    Ok(std::iter::from_fn(move || {
        let len = rest.get(at..at + 4)?;
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let item = rest.get(at + 4..at + 4 + len)?;
        at += 4 + len;
        Some(item)
    }))
}

/// The reader thread and how to reach it.
pub struct Reader {
    requests: mpsc::Sender<Request>,
    handle: JoinHandle<Result<Finished>>,
}

impl Reader {
    /// Starts draining `ring` into `pipe`. `failed` is notified when a sink fails, so the main
    /// task stops at once instead of at the next signal.
    pub fn spawn(
        ring: RingBuf<MapData>,
        pipe: Pipeline,
        recording: Option<Recording>,
        failed: Arc<tokio::sync::Notify>,
    ) -> Result<Self> {
        let (requests, rx) = mpsc::channel();
        let handle = std::thread::Builder::new().name("ring-reader".into()).spawn(move || {
            let r = run(ring, pipe, recording, &rx);
            if r.is_err() {
                // A permit is stored if the main task is not waiting yet: never lost.
                failed.notify_one();
            }
            r
        })?;
        Ok(Self { requests, handle })
    }

    /// Sends a request; false when the reader has already stopped (its error comes at [`Self::stop`]).
    pub fn ask(&self, r: Request) -> bool {
        self.requests.send(r).is_ok()
    }

    /// Stops after a last full drain; gives the sinks back, with the last snapshot.
    pub fn stop(self) -> Result<Finished> {
        let _ = self.requests.send(Request::Stop);
        self.handle.join().map_err(|_| anyhow!("ring reader thread panicked"))?
    }
}

fn run(
    mut ring: RingBuf<MapData>,
    mut pipe: Pipeline,
    mut recording: Option<Recording>,
    requests: &mpsc::Receiver<Request>,
) -> Result<Finished> {
    let fd = ring.as_raw_fd();
    loop {
        // Requests before draining: whatever was submitted before a stop is drained below.
        let mut stopping = false;
        loop {
            match requests.try_recv() {
                Ok(r) => {
                    if pipe.request(r)? {
                        stopping = true;
                        break;
                    }
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    stopping = true;
                    break;
                }
            }
        }
        if !stopping {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, POLL_INTERVAL.as_millis() as i32) };
        }
        // At most DRAIN_MAX records before the timers: a ring that never empties (a sustained
        // burst) must not hold back flushes, memory lines and snapshots.
        let mut drained = 0;
        while drained < DRAIN_MAX
            && let Some(item) = ring.next()
        {
            if let Some(r) = recording.as_mut() {
                r.record(&item);
            }
            pipe.record(&item)?;
            drained += 1;
        }
        pipe.end_batch()?;
        if stopping {
            if let Some(r) = recording.as_mut() {
                r.finish();
            }
            return pipe.finish(monotonic_ns());
        }
        pipe.tick(monotonic_ns(), false)?;
    }
}

/// The NVML channel for a run: samples are queued only when a sink writes them.
pub fn nvml_channel(sinks: &[Box<dyn Sink>]) -> (Option<nvml::LineSender>, Option<LineReceiver>) {
    if Pipeline::wants_nvml(sinks) {
        let (tx, rx) = nvml::lines();
        (Some(tx), Some(rx))
    } else {
        (None, None)
    }
}
