//! `--perfetto FILE`: a Perfetto trace (open it in ui.perfetto.dev), streamed while observing.
//!
//! Tracks: a process track per pid, a thread track per thread under it (CUDA calls as slices,
//! launches as instants, the ioctls inside the calls as nested slices, NVTX push/pop ranges),
//! a track per (device, context, stream) under the process for the work CUPTI saw run (with
//! "overlap" lanes for records a stream ran or delivered overlapping), an "NVTX ranges" track
//! for process-wide ranges, and per GPU a track with NVML's counters. A flow arrow joins each
//! launch (or copy/memset call) to the GPU work it queued: its id is derived from what both
//! sides know (pid, thread, the call's entry time), so the launch's packet can carry it before
//! the GPU record exists.
//!
//! Memory stays bounded however long the run: per-process state goes at the process's exit
//! (and is capped in count), the interning table starts over when full (writer.rs), and nothing
//! is kept per event.

mod proto;
mod writer;

use std::{
    collections::{HashMap, HashSet},
    fs::File,
    io::{self, BufWriter, Write},
    path::Path,
};

use anyhow::Result;
use gpu_observer_common::{
    api::Family,
    cupti::{CuptiState, GpuRecordKind},
};

use self::{
    proto::{
        CounterDescriptor, ProcessDescriptor, TYPE_COUNTER, TYPE_INSTANT, TYPE_SLICE_BEGIN, ThreadDescriptor,
        TrackDescriptor, UNIT_SIZE_BYTES,
    },
    writer::{Key, Writer, uuid},
};
use crate::{
    analyze::{anomaly::What, verdict::Class, window::ProcessVerdict},
    correlate::{
        CuptiChange, MemorySample,
        cupti_join::GpuActivity,
        nvtx::{NvtxKind, NvtxRange},
    },
    decode::{Body, Event},
    export::{AnomalyLine, Flagged, Sink, Summary},
    nvml::{DeviceInfo, Line},
};

/// Processes with state here at once (their tracks, lanes, CUPTI flag); past this an arbitrary
/// one is let go (its descriptors are written again if it comes back).
const MAX_PROCS: usize = 4096;
/// Tracks remembered per process (threads, streams, lanes, counters).
const MAX_TRACKS_PER_PROC: usize = 8192;
/// Streams (device, context, stream) with lanes per process; records of more are not placed.
const MAX_STREAMS: usize = 1024;
/// Lanes of a stream or of the NVTX track: the track itself and three "overlap" tracks.
const LANES: usize = 4;

/// Slices a lane remembers to test new ones against (the oldest by start go first). Records
/// arrive out of order by up to CUPTI's flush period: a stream's records of two threads come in
/// different buffers (seen on the H100: a PyTorch step's autograd thread).
const LANE_MEMORY: usize = 4096;

/// Where slices go on a track whose slices may overlap: the first lane where the slice meets
/// none of the slices the lane holds, whatever order they came in. Slices that do not meet
/// nest correctly on one track however trace_processor orders them.
#[derive(Debug, Default)]
struct Lanes {
    /// Per lane: start → end of the slices placed (zero-length slices count as 1 ns).
    lanes: Vec<std::collections::BTreeMap<u64, u64>>,
}

impl Lanes {
    fn place(&mut self, start: u64, end: u64) -> Option<usize> {
        let end = end.max(start.saturating_add(1));
        let free = |l: &std::collections::BTreeMap<u64, u64>| {
            l.range(..=start).next_back().is_none_or(|(_, &e)| e <= start)
                && l.range(start..).next().is_none_or(|(&s, _)| s >= end)
        };
        let i = match self.lanes.iter().position(free) {
            Some(i) => i,
            None if self.lanes.len() < LANES => {
                self.lanes.push(Default::default());
                self.lanes.len() - 1
            }
            None => return None,
        };
        let l = &mut self.lanes[i];
        l.insert(start, end);
        if l.len() > LANE_MEMORY {
            l.pop_first();
        }
        Some(i)
    }
}

#[derive(Default)]
struct Proc {
    /// CUPTI is active (or GPU records came): launches carry flow ids.
    cupti: bool,
    class: Option<Class>,
    /// Track uuids written for it, forgotten at its exit.
    tracks: HashSet<u64>,
    streams: HashMap<(u32, u32, u32), Lanes>,
    nvtx: Lanes,
}

/// What the sink wrote and left out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub events: u64,
    /// Left out because of `--perfetto-max-mb`.
    pub left_out: u64,
    /// GPU records and NVTX ranges that overlapped more than the lanes hold.
    pub unplaced: u64,
}

pub struct PerfettoSink<W: Write = BufWriter<File>> {
    w: Writer<W>,
    path: String,
    procs: HashMap<u32, Proc>,
    /// NVML GPU and counter tracks written (a few per GPU).
    nvml_tracks: HashSet<u64>,
    scratch: String,
    pub stats: Stats,
}

/// The flow joining a call that queued GPU work to that work: both sides know the process, the
/// calling thread and the call's entry time (the GPU record through its joined origin).
pub fn flow_id(pid: u32, tid: u32, launch_ts_ns: u64) -> u64 {
    uuid("flow", &[u64::from(pid), u64::from(tid), launch_ts_ns])
}

fn process_track(pid: u32) -> u64 {
    uuid("process", &[u64::from(pid)])
}

fn thread_track(pid: u32, tid: u32) -> u64 {
    uuid("thread", &[u64::from(pid), u64::from(tid)])
}

fn stream_track(pid: u32, device: u32, context: u32, stream: u32, lane: usize) -> u64 {
    uuid(
        "gpu-stream",
        &[
            u64::from(pid),
            u64::from(device),
            u64::from(context),
            u64::from(stream),
            lane as u64,
        ],
    )
}

fn nvtx_track(pid: u32, lane: usize) -> u64 {
    uuid("nvtx", &[u64::from(pid), lane as u64])
}

/// A comm as a name ("?" when empty).
fn comm_name(comm: &[u8; 16]) -> String {
    let c = crate::rules::comm(comm);
    if c.is_empty() { "?".into() } else { c.into_owned() }
}

/// NVML's device counters: name, unit, the value of a sample.
type Metric = (&'static str, Unit, fn(&crate::nvml::DeviceSample) -> Option<f64>);

#[derive(Clone, Copy)]
enum Unit {
    Bytes,
    Named(&'static str),
}

const METRICS: [Metric; 9] = [
    ("GPU utilization", Unit::Named("%"), |s| s.util_gpu.map(f64::from)),
    ("Memory utilization", Unit::Named("%"), |s| s.util_memory.map(f64::from)),
    ("Memory used", Unit::Bytes, |s| s.memory_used.map(|v| v as f64)),
    ("Power", Unit::Named("W"), |s| s.power_mw.map(|v| f64::from(v) / 1000.0)),
    ("Temperature", Unit::Named("°C"), |s| s.temperature_c.map(f64::from)),
    ("SM clock", Unit::Named("MHz"), |s| s.clocks.sm.map(f64::from)),
    ("Memory clock", Unit::Named("MHz"), |s| s.clocks.memory.map(f64::from)),
    ("PCIe TX", Unit::Named("B/s"), |s| s.pcie_tx_bps.map(|v| v as f64)),
    ("PCIe RX", Unit::Named("B/s"), |s| s.pcie_rx_bps.map(|v| v as f64)),
];

fn counter_descriptor(name: String, parent: u64, unit: Unit) -> TrackDescriptor {
    TrackDescriptor {
        name: Some(name),
        parent_uuid: Some(parent),
        counter: Some(match unit {
            Unit::Bytes => CounterDescriptor {
                unit: Some(UNIT_SIZE_BYTES),
                unit_name: None,
            },
            Unit::Named(n) => CounterDescriptor {
                unit: None,
                unit_name: Some(n.into()),
            },
        }),
        ..Default::default()
    }
}

/// `[x,y,z]`, as JSON lines write a launch shape.
struct Dim3<T>([T; 3]);

impl<T: std::fmt::Display> std::fmt::Display for Dim3<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{},{},{}]", self.0[0], self.0[1], self.0[2])
    }
}

/// An NVTX stack as one string, outermost first.
struct Joined<'a>(&'a [std::sync::Arc<str>]);

impl std::fmt::Display for Joined<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, s) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" / ")?;
            }
            f.write_str(s)?;
        }
        Ok(())
    }
}

impl PerfettoSink {
    pub fn create(path: &Path, max_bytes: u64) -> Result<Self> {
        let file = crate::export::output::create("--perfetto", path)?;
        Ok(Self::to_writer(
            BufWriter::with_capacity(1 << 16, file),
            max_bytes,
            &path.to_string_lossy(),
        ))
    }
}

impl<W: Write> PerfettoSink<W> {
    /// A sink writing to `out` (`name`: what messages call it).
    pub fn to_writer(out: W, max_bytes: u64, name: &str) -> Self {
        Self {
            w: Writer::new(out, max_bytes),
            path: crate::export::text::printable(name),
            procs: HashMap::new(),
            nvml_tracks: HashSet::new(),
            scratch: String::new(),
            stats: Stats::default(),
        }
    }

    pub fn get_ref(&self) -> &W {
        self.w.get_ref()
    }

    /// Bytes and packets written.
    pub fn written(&self) -> writer::Counts {
        self.w.counts
    }

    fn proc(&mut self, pid: u32) -> &mut Proc {
        if !self.procs.contains_key(&pid)
            && self.procs.len() >= MAX_PROCS
            && let Some(&old) = self.procs.keys().next()
            && let Some(p) = self.procs.remove(&old)
        {
            self.w.forget(p.tracks);
        }
        self.procs.entry(pid).or_default()
    }

    /// Writes a track of `pid` once; false when the cap stopped it.
    fn ensure(&mut self, pid: u32, uuid: u64, make: impl FnOnce() -> TrackDescriptor) -> io::Result<bool> {
        let p = self.proc(pid);
        if p.tracks.len() < MAX_TRACKS_PER_PROC {
            p.tracks.insert(uuid);
        }
        self.w.track(uuid, make)
    }

    fn ensure_process(&mut self, pid: u32, comm: &[u8; 16]) -> io::Result<bool> {
        self.ensure(pid, process_track(pid), || TrackDescriptor {
            process: Some(ProcessDescriptor {
                pid: Some(pid as i32),
                process_name: Some(comm_name(comm)),
            }),
            ..Default::default()
        })
    }

    /// The thread's track (and its process's), named by the comm its events carry.
    fn ensure_thread(&mut self, pid: u32, tid: u32, comm: &[u8; 16]) -> io::Result<Option<u64>> {
        let t = thread_track(pid, tid);
        if self.procs.get(&pid).is_some_and(|p| p.tracks.contains(&t)) && !self.w.capped {
            return Ok(Some(t));
        }
        if !self.ensure_process(pid, comm)? {
            return Ok(None);
        }
        let ok = self.ensure(pid, t, || TrackDescriptor {
            parent_uuid: Some(process_track(pid)),
            thread: Some(ThreadDescriptor {
                pid: Some(pid as i32),
                tid: Some(i64::from(tid)),
                thread_name: Some(comm_name(comm)),
            }),
            ..Default::default()
        })?;
        Ok(ok.then_some(t))
    }

    /// The lane track `lane` of a stream (lane 0: the stream's own track).
    fn ensure_stream(
        &mut self,
        pid: u32,
        comm: &[u8; 16],
        key: (u32, u32, u32),
        lane: usize,
    ) -> io::Result<Option<u64>> {
        let (device, context, stream) = key;
        if !self.ensure_process(pid, comm)? {
            return Ok(None);
        }
        let main = stream_track(pid, device, context, stream, 0);
        let ok = self.ensure(pid, main, || TrackDescriptor {
            name: Some(format!("GPU {device} stream {stream}")),
            parent_uuid: Some(process_track(pid)),
            ..Default::default()
        })?;
        if !ok || lane == 0 {
            return Ok(ok.then_some(main));
        }
        let t = stream_track(pid, device, context, stream, lane);
        let ok = self.ensure(pid, t, || TrackDescriptor {
            name: Some(format!("GPU {device} stream {stream} (overlap {lane})")),
            parent_uuid: Some(main),
            ..Default::default()
        })?;
        Ok(ok.then_some(t))
    }

    fn ensure_nvtx(&mut self, pid: u32, comm: &[u8; 16], lane: usize) -> io::Result<Option<u64>> {
        if !self.ensure_process(pid, comm)? {
            return Ok(None);
        }
        let main = nvtx_track(pid, 0);
        let ok = self.ensure(pid, main, || TrackDescriptor {
            name: Some("NVTX ranges".into()),
            parent_uuid: Some(process_track(pid)),
            ..Default::default()
        })?;
        if !ok || lane == 0 {
            return Ok(ok.then_some(main));
        }
        let t = nvtx_track(pid, lane);
        let ok = self.ensure(pid, t, || TrackDescriptor {
            name: Some(format!("NVTX ranges (overlap {lane})")),
            parent_uuid: Some(main),
            ..Default::default()
        })?;
        Ok(ok.then_some(t))
    }

    /// Counts an event by what became of it (None: nothing to write).
    fn count(&mut self, r: io::Result<Option<bool>>) -> Result<()> {
        match r? {
            Some(true) => self.stats.events += 1,
            Some(false) => self.stats.left_out += 1,
            None => {}
        }
        Ok(())
    }

    fn write_event(&mut self, ev: &Event) -> io::Result<Option<bool>> {
        let name = ev.api.map_or("?", |a| a.name);
        match &ev.body {
            Body::Launch(l) => {
                let Some(track) = self.ensure_thread(ev.pid, ev.tid, &ev.comm)? else {
                    return Ok(Some(false));
                };
                let flows = self.procs.get(&ev.pid).is_some_and(|p| p.cupti);
                self.w.event(ev.ts_ns, TYPE_INSTANT, track, Some(name))?;
                if let Some(k) = &l.kernel {
                    self.w.interned(Key::Kernel, &k.demangled);
                }
                if ev.api.map(|a| a.family) != Some(Family::GraphLaunch) {
                    self.w.string(Key::Grid, Dim3(l.grid));
                    self.w.string(Key::Block, Dim3(l.block));
                }
                self.w.uint(Key::Stream, l.stream);
                if flows {
                    self.w.flow(flow_id(ev.pid, ev.tid, ev.ts_ns));
                }
                Ok(Some(self.w.emit()?))
            }
            Body::Call(c) => {
                let Some(track) = self.ensure_thread(ev.pid, ev.tid, &ev.comm)? else {
                    return Ok(Some(false));
                };
                let family = ev.api.map(|a| a.family);
                let queues = matches!(family, Some(Family::Memcpy | Family::Memset));
                let flows = queues && self.procs.get(&ev.pid).is_some_and(|p| p.cupti);
                let ty = if c.abandoned { TYPE_INSTANT } else { TYPE_SLICE_BEGIN };
                self.w.event(ev.ts_ns, ty, track, Some(name))?;
                if let Some(b) = c.bytes {
                    self.w.uint(Key::Bytes, b);
                }
                if family == Some(Family::Memcpy) {
                    self.w.interned(Key::Direction, c.direction.name());
                    if let Some(h) = c.host_memory {
                        self.w.interned(Key::HostMemory, h.name());
                    }
                }
                if let Some(s) = c.stream {
                    self.w.uint(Key::Stream, s);
                }
                if c.abandoned {
                    self.w.boolean(Key::Abandoned, true);
                } else {
                    self.w.uint(Key::Result, u64::from(c.result));
                }
                if flows {
                    self.w.flow(flow_id(ev.pid, ev.tid, ev.ts_ns));
                }
                if !self.w.emit()? {
                    return Ok(Some(false));
                }
                if c.abandoned {
                    return Ok(Some(true));
                }
                Ok(Some(self.w.end(ev.ts_ns.saturating_add(c.duration_ns), track)?))
            }
            Body::Ioctl(i) => {
                let Some(track) = self.ensure_thread(ev.pid, ev.tid, &ev.comm)? else {
                    return Ok(Some(false));
                };
                // The ioctl's record carries its entry time (ioctl_enter's) and its duration.
                let mut scratch = std::mem::take(&mut self.scratch);
                scratch.clear();
                let name = match i.name {
                    Some(n) => n,
                    None => {
                        let _ = std::fmt::Write::write_fmt(&mut scratch, format_args!("ioctl {:#x}", i.cmd));
                        &scratch
                    }
                };
                self.w.event(ev.ts_ns, TYPE_SLICE_BEGIN, track, Some(name))?;
                self.scratch = scratch;
                self.w.uint(Key::Fd, u64::from(i.fd));
                self.w.int(Key::Ret, i.ret);
                if let Some(d) = &i.device {
                    self.w.interned(Key::Device, d);
                }
                if let Some(p) = i.parent {
                    self.w.interned(Key::Api, p.name);
                }
                if !self.w.emit()? {
                    return Ok(Some(false));
                }
                Ok(Some(self.w.end(ev.ts_ns.saturating_add(i.duration_ns), track)?))
            }
            Body::ProcessExit => {
                if let Some(p) = self.procs.remove(&ev.pid) {
                    self.w.forget(p.tracks);
                }
                Ok(None)
            }
            Body::Gpu(_) | Body::GpuName { .. } | Body::MarkerName { .. } => Ok(None),
        }
    }

    fn write_gpu(&mut self, a: &GpuActivity) -> io::Result<Option<bool>> {
        let r = &a.rec;
        let name: &str = match a.kind() {
            Some(GpuRecordKind::Kernel) => a
                .kernel
                .as_ref()
                .or(a.origin.as_ref().and_then(|o| o.kernel.as_ref()))
                .map_or("kernel", |k| &k.demangled),
            Some(GpuRecordKind::Memcpy) => crate::correlate::cupti_join::copy_label(r.copy_kind).unwrap_or("memcpy"),
            Some(GpuRecordKind::Memset) => "memset",
            _ => return Ok(None),
        };
        let key = (r.device, r.context, r.stream);
        let p = self.proc(a.pid);
        p.cupti = true;
        if !p.streams.contains_key(&key) && p.streams.len() >= MAX_STREAMS {
            self.stats.unplaced += 1;
            return Ok(None);
        }
        let Some(lane) = p.streams.entry(key).or_default().place(r.start_ns, r.end_ns) else {
            self.stats.unplaced += 1;
            return Ok(None);
        };
        let Some(track) = self.ensure_stream(a.pid, &a.comm, key, lane)? else {
            return Ok(Some(false));
        };
        self.w.event(r.start_ns, TYPE_SLICE_BEGIN, track, Some(name))?;
        self.w.uint(Key::CorrelationId, u64::from(r.correlation_id));
        match a.kind() {
            Some(GpuRecordKind::Kernel) => {
                self.w.string(Key::Grid, Dim3(r.grid));
                self.w.string(Key::Block, Dim3(r.block));
            }
            _ => self.w.uint(Key::Bytes, r.bytes),
        }
        if let Some(d) = a.queue_delay_ns() {
            self.w.int(Key::QueueDelayNs, d);
        }
        if r.graph_id != 0 {
            self.w.uint(Key::GraphId, u64::from(r.graph_id));
        }
        if let Some(n) = a.nvtx.as_deref().filter(|n| !n.is_empty()) {
            self.w.string(Key::Nvtx, Joined(n));
        }
        if let Some(o) = &a.origin {
            self.w.interned(Key::Api, o.cupti_api);
            if let Some(t) = o.launch_ts_ns {
                let f = flow_id(a.pid, o.tid, t);
                // A graph's kernels share one launch: the arrow runs on through each of them.
                if o.api.map(|s| s.family) == Some(Family::GraphLaunch) {
                    self.w.flow(f);
                } else {
                    self.w.terminate_flow(f);
                }
            }
        }
        if !self.w.emit()? {
            return Ok(Some(false));
        }
        Ok(Some(self.w.end(r.end_ns.max(r.start_ns), track)?))
    }

    fn write_nvtx(&mut self, r: &NvtxRange) -> io::Result<Option<bool>> {
        let track = match r.kind {
            NvtxKind::Thread | NvtxKind::Mark if r.tid != 0 => self.ensure_thread(r.pid, r.tid, &r.comm)?,
            NvtxKind::Mark | NvtxKind::Thread => self.ensure_nvtx(r.pid, &r.comm, 0)?,
            NvtxKind::Process => {
                let end = r.end_ns.unwrap_or(u64::MAX);
                let Some(lane) = self.proc(r.pid).nvtx.place(r.start_ns, end) else {
                    self.stats.unplaced += 1;
                    return Ok(None);
                };
                self.ensure_nvtx(r.pid, &r.comm, lane)?
            }
        };
        let Some(track) = track else {
            return Ok(Some(false));
        };
        let ty = if r.kind == NvtxKind::Mark {
            TYPE_INSTANT
        } else {
            TYPE_SLICE_BEGIN
        };
        self.w.event(r.start_ns, ty, track, Some(&r.label()))?;
        if let Some(d) = &r.domain {
            self.w.interned(Key::Domain, d);
        }
        if !self.w.emit()? {
            return Ok(Some(false));
        }
        match r.end_ns {
            Some(end) if ty == TYPE_SLICE_BEGIN => Ok(Some(self.w.end(end.max(r.start_ns), track)?)),
            _ => Ok(Some(true)),
        }
    }

    fn write_verdict(&mut self, ts: u64, pv: &ProcessVerdict) -> io::Result<Option<bool>> {
        let v = &pv.verdict;
        let p = self.proc(pv.pid);
        if p.class == Some(v.class) {
            return Ok(None);
        }
        p.class = Some(v.class);
        let mut comm = [0u8; 16];
        let n = pv.comm.len().min(16);
        comm[..n].copy_from_slice(&pv.comm.as_bytes()[..n]);
        if !self.ensure_process(pv.pid, &comm)? {
            return Ok(Some(false));
        }
        let e = &v.evidence;
        let name = format!("verdict: {}", v.class.name());
        self.w.event(ts, TYPE_INSTANT, process_track(pv.pid), Some(&name))?;
        self.w.interned(Key::Class, v.class.name());
        if let Some(s) = v.secondary {
            self.w.interned(Key::Secondary, s.name());
        }
        self.w.uint(Key::WindowNs, e.window_ns);
        if let Some(b) = e.gpu_busy() {
            self.w.double(Key::GpuBusy, b);
        }
        self.w.double(Key::CallsPerS, e.per_s(e.calls));
        self.w.double(Key::LaunchesPerS, e.per_s(e.launches));
        self.w.double(Key::SyncBlocked, e.frac(e.sync_ns));
        self.w.double(Key::CopyFraction, e.frac(e.copy_ns()));
        Ok(Some(self.w.emit()?))
    }

    fn write_anomaly(&mut self, a: &AnomalyLine<'_>) -> io::Result<Option<bool>> {
        let track = match a.flagged {
            Flagged::Event(ev) => self.ensure_thread(ev.pid, ev.tid, &ev.comm)?,
            Flagged::Gpu(g) => {
                let r = &g.rec;
                self.ensure_stream(g.pid, &g.comm, (r.device, r.context, r.stream), 0)?
            }
        };
        let Some(track) = track else {
            return Ok(Some(false));
        };
        let f = a.finding;
        let name = format!("anomaly: {}", f.what.kind());
        self.w.event(a.ts_ns, TYPE_INSTANT, track, Some(&name))?;
        match &f.what {
            What::Kernel { name, .. } => self.w.interned(Key::Kernel, &name.demangled),
            What::Call { api, .. } => self.w.interned(Key::Api, api),
            What::Bandwidth { direction, .. } => self.w.interned(Key::Direction, direction.name()),
        }
        self.w.double(Key::Observed, f.observed);
        self.w.double(Key::Typical, f.typical);
        self.w.interned(Key::Unit, f.what.unit());
        self.w.double(Key::Deviation, f.deviation);
        self.w.interned(Key::Mode, a.mode.name());
        Ok(Some(self.w.emit()?))
    }

    /// A counter's value on a track written on first use.
    fn counter(&mut self, ts: u64, track: u64, v: f64) -> io::Result<Option<bool>> {
        self.w.event(ts, TYPE_COUNTER, track, None)?;
        self.w.counter(v);
        Ok(Some(self.w.emit()?))
    }

    fn nvml_track(&mut self, uuid: u64, make: impl FnOnce() -> TrackDescriptor) -> io::Result<bool> {
        if self.nvml_tracks.len() < MAX_TRACKS_PER_PROC {
            self.nvml_tracks.insert(uuid);
        }
        self.w.track(uuid, make)
    }

    fn gpu_track(&mut self, index: u32, devices: &[DeviceInfo]) -> io::Result<Option<u64>> {
        let t = uuid("nvml-gpu", &[u64::from(index)]);
        let name = devices
            .iter()
            .find(|d| d.index == index)
            .map_or_else(|| format!("GPU {index}"), |d| format!("GPU {index} {}", d.name));
        let ok = self.nvml_track(t, || TrackDescriptor {
            name: Some(name),
            ..Default::default()
        })?;
        Ok(ok.then_some(t))
    }

    fn write_nvml(&mut self, line: &Line, comm: Option<&str>, devices: &[DeviceInfo]) -> io::Result<Option<bool>> {
        match line {
            Line::Info(info, _) => {
                let ok = self.gpu_track(info.index, std::slice::from_ref(info))?;
                Ok(ok.map(|_| true))
            }
            Line::Device(s) => {
                let Some(gpu) = self.gpu_track(s.device, devices)? else {
                    return Ok(Some(false));
                };
                let mut any = None;
                for (i, (name, unit, value)) in METRICS.iter().enumerate() {
                    let Some(v) = value(s) else { continue };
                    let t = uuid("nvml-counter", &[u64::from(s.device), i as u64]);
                    let unit = *unit;
                    if !self.nvml_track(t, || counter_descriptor((*name).into(), gpu, unit))? {
                        return Ok(Some(false));
                    }
                    any = self.counter(s.ts_ns, t, v)?;
                    if any == Some(false) {
                        break;
                    }
                }
                Ok(any)
            }
            Line::Process(p) => {
                let Some(v) = p.util_sm else { return Ok(None) };
                let mut c = [0u8; 16];
                let name = comm.unwrap_or("");
                let n = name.len().min(16);
                c[..n].copy_from_slice(&name.as_bytes()[..n]);
                if !self.ensure_process(p.pid, &c)? {
                    return Ok(Some(false));
                }
                let t = uuid("nvml-process-sm", &[u64::from(p.pid), u64::from(p.device)]);
                let device = p.device;
                let pid = p.pid;
                if !self.ensure(pid, t, || {
                    counter_descriptor(
                        format!("SM utilization (GPU {device})"),
                        process_track(pid),
                        Unit::Named("%"),
                    )
                })? {
                    return Ok(Some(false));
                }
                self.counter(p.ts_ns, t, f64::from(v))
            }
        }
    }

    fn write_memory(&mut self, ts: u64, m: &MemorySample, comm: &str) -> io::Result<Option<bool>> {
        let mut c = [0u8; 16];
        let n = comm.len().min(16);
        c[..n].copy_from_slice(&comm.as_bytes()[..n]);
        if !self.ensure_process(m.pid, &c)? {
            return Ok(Some(false));
        }
        let pid = m.pid;
        let t = uuid("device-memory", &[u64::from(pid)]);
        if !self.ensure(pid, t, || {
            counter_descriptor("CUDA device memory".into(), process_track(pid), Unit::Bytes)
        })? {
            return Ok(Some(false));
        }
        self.counter(ts, t, m.device as f64)
    }

    /// The line the end of the run prints.
    pub fn report(&self) -> String {
        let c = self.w.counts;
        let mut s = format!(
            "perfetto: wrote {} events ({:.1} MB, {} packets) to {}",
            self.stats.events,
            c.bytes as f64 / 1e6,
            c.packets,
            self.path
        );
        if self.stats.left_out > 0 {
            s += &format!("; {} left out by --perfetto-max-mb", self.stats.left_out);
        }
        if self.stats.unplaced > 0 {
            s += &format!(
                "; {} GPU records or NVTX ranges overlapped too deep to place",
                self.stats.unplaced
            );
        }
        s
    }
}

impl<W: Write + Send> Sink for PerfettoSink<W> {
    fn describe(&self) -> String {
        format!("the Perfetto trace {}", self.path)
    }

    fn event(&mut self, ev: &Event) -> Result<()> {
        let r = self.write_event(ev);
        self.count(r)
    }

    fn gpu(&mut self, a: &GpuActivity) -> Result<()> {
        let r = self.write_gpu(a);
        self.count(r)
    }

    fn cupti_state(&mut self, change: &CuptiChange) -> Result<()> {
        if change.status.state == Some(CuptiState::Active) {
            self.proc(change.pid).cupti = true;
        }
        Ok(())
    }

    fn memory(&mut self, ts_ns: u64, m: &MemorySample, comm: &str) -> Result<()> {
        let r = self.write_memory(ts_ns, m, comm);
        self.count(r)
    }

    fn verdict(&mut self, ts_ns: u64, v: &ProcessVerdict) -> Result<()> {
        let r = self.write_verdict(ts_ns, v);
        self.count(r)
    }

    fn nvtx(&mut self, r: &NvtxRange) -> Result<()> {
        let res = self.write_nvtx(r);
        self.count(res)
    }

    fn anomaly(&mut self, a: &AnomalyLine<'_>) -> Result<()> {
        let r = self.write_anomaly(a);
        self.count(r)
    }

    fn wants_nvml(&self) -> bool {
        true
    }

    fn nvml(&mut self, line: &Line, comm: Option<&str>, devices: &[DeviceInfo]) -> Result<()> {
        let r = self.write_nvml(line, comm, devices);
        self.count(r)
    }

    fn flush(&mut self) -> Result<()> {
        Ok(self.w.flush()?)
    }

    fn close(&mut self) {
        let _ = self.w.flush();
    }

    fn summary(&mut self, _s: &Summary<'_>) -> Result<()> {
        self.w.flush()?;
        crate::say(self.report());
        Ok(())
    }
}

#[cfg(test)]
mod tests;
