//! The trace file as a stream of packets: framing, the size cap, interning, the sequence's
//! flags, track descriptors. Knows nothing of the agent's events (mod.rs turns those into
//! packets through [`Writer::event`] and friends).
//!
//! Every packet is framed as a `Trace`'s field 1 (`0x0A`, varint length, the packet), so the
//! file is a `Trace` after every packet, and each frame goes to the output in one `write_all`:
//! a file cut short (SIGKILL, a full disk) holds whole packets and at most one torn tail, which
//! readers skip. All packets are on one sequence (id 1); names are interned on it, and the
//! table is bounded: when full, the incremental state is cleared (flags 1|2) and restarted.

use std::{
    collections::{HashMap, HashSet},
    io::{self, Write},
};

use prost::Message;

use super::proto::{
    Clock, ClockSnapshot, DebugAnnotation, DebugAnnotationName, EventName, InternedData, InternedString,
    SEQ_INCREMENTAL_STATE_CLEARED, SEQ_NEEDS_INCREMENTAL_STATE, TracePacket, TracePacketDefaults, TrackDescriptor,
    TrackEvent,
};

/// The one writer sequence (must be non-zero for interned data).
const SEQUENCE: u32 = 1;
/// Names and strings interned before the table is cleared (≈ a few MB at most with long kernel
/// names).
pub const MAX_INTERNED: usize = 16_384;
/// Track descriptors remembered as written; past this the set starts over (writing a
/// descriptor again is harmless: they are not incremental state).
const MAX_TRACKS: usize = 65_536;
/// The most names and strings one event interns (its name, a few string annotations).
const PER_EVENT: usize = 8;

/// Debug-annotation names: a fixed table, interned (iid = index + 1) in every packet that
/// clears the incremental state, so events only carry their iids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key {
    Bytes,
    Direction,
    Stream,
    Result,
    Abandoned,
    Kernel,
    Grid,
    Block,
    CorrelationId,
    QueueDelayNs,
    Nvtx,
    Api,
    Fd,
    Ret,
    Device,
    Domain,
    Class,
    Secondary,
    WindowNs,
    GpuBusy,
    CallsPerS,
    LaunchesPerS,
    SyncBlocked,
    CopyFraction,
    Observed,
    Typical,
    Unit,
    Deviation,
    Mode,
    What,
    Context,
    GraphId,
    Value,
    HostMemory,
}

impl Key {
    pub const ALL: [Key; 34] = [
        Key::Bytes,
        Key::Direction,
        Key::Stream,
        Key::Result,
        Key::Abandoned,
        Key::Kernel,
        Key::Grid,
        Key::Block,
        Key::CorrelationId,
        Key::QueueDelayNs,
        Key::Nvtx,
        Key::Api,
        Key::Fd,
        Key::Ret,
        Key::Device,
        Key::Domain,
        Key::Class,
        Key::Secondary,
        Key::WindowNs,
        Key::GpuBusy,
        Key::CallsPerS,
        Key::LaunchesPerS,
        Key::SyncBlocked,
        Key::CopyFraction,
        Key::Observed,
        Key::Typical,
        Key::Unit,
        Key::Deviation,
        Key::Mode,
        Key::What,
        Key::Context,
        Key::GraphId,
        Key::Value,
        Key::HostMemory,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Key::Bytes => "bytes",
            Key::Direction => "direction",
            Key::Stream => "stream",
            Key::Result => "result",
            Key::Abandoned => "abandoned",
            Key::Kernel => "kernel",
            Key::Grid => "grid",
            Key::Block => "block",
            Key::CorrelationId => "correlation_id",
            Key::QueueDelayNs => "queue_delay_ns",
            Key::Nvtx => "nvtx",
            Key::Api => "api",
            Key::Fd => "fd",
            Key::Ret => "ret",
            Key::Device => "device",
            Key::Domain => "domain",
            Key::Class => "class",
            Key::Secondary => "secondary",
            Key::WindowNs => "window_ns",
            Key::GpuBusy => "gpu_busy",
            Key::CallsPerS => "calls_per_s",
            Key::LaunchesPerS => "launches_per_s",
            Key::SyncBlocked => "sync_blocked",
            Key::CopyFraction => "copy_fraction",
            Key::Observed => "observed",
            Key::Typical => "typical",
            Key::Unit => "unit",
            Key::Deviation => "deviation",
            Key::Mode => "mode",
            Key::What => "what",
            Key::Context => "context",
            Key::GraphId => "graph_id",
            Key::Value => "value",
            Key::HostMemory => "host_memory",
        }
    }

    fn iid(self) -> u64 {
        self as u64 + 1
    }
}

/// What was written and what was not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub packets: u64,
    pub bytes: u64,
    /// Times the interning table was full and started over.
    pub intern_resets: u64,
}

/// A deterministic track uuid: FNV-1a over the kind and the ids (never 0, which is the
/// implicit global track).
pub fn uuid(kind: &str, ids: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    kind.bytes().for_each(&mut eat);
    eat(0xff);
    for id in ids {
        id.to_le_bytes().into_iter().for_each(&mut eat);
    }
    h.max(1)
}

pub struct Writer<W: Write> {
    out: W,
    max_bytes: u64,
    max_interned: usize,
    /// The packet of the event being built (reused: its vectors keep their capacity).
    pkt: TracePacket,
    /// Names and strings the event being built interns for the first time.
    new_interned: InternedData,
    names: HashMap<Box<str>, u64>,
    strings: HashMap<Box<str>, u64>,
    /// Annotations and strings of earlier events, kept for their capacity.
    spare: Vec<DebugAnnotation>,
    spare_strings: Vec<String>,
    frame: Vec<u8>,
    tracks: HashSet<u64>,
    /// Whether the first packet (which clears the sequence's state) is out.
    started: bool,
    /// The cap was reached: nothing more is written.
    pub capped: bool,
    pub counts: Counts,
}

impl<W: Write> Writer<W> {
    pub fn new(out: W, max_bytes: u64) -> Self {
        Self::with_intern_limit(out, max_bytes, MAX_INTERNED)
    }

    pub fn with_intern_limit(out: W, max_bytes: u64, max_interned: usize) -> Self {
        Self {
            out,
            max_bytes,
            max_interned: max_interned.max(PER_EVENT),
            pkt: TracePacket {
                trusted_packet_sequence_id: Some(SEQUENCE),
                sequence_flags: Some(SEQ_NEEDS_INCREMENTAL_STATE),
                track_event: Some(TrackEvent::default()),
                ..Default::default()
            },
            new_interned: InternedData::default(),
            names: HashMap::new(),
            strings: HashMap::new(),
            spare: Vec::new(),
            spare_strings: Vec::new(),
            frame: Vec::new(),
            tracks: HashSet::new(),
            started: false,
            capped: false,
            counts: Counts::default(),
        }
    }

    pub fn get_ref(&self) -> &W {
        &self.out
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// Writes one packet whole, unless it would pass the cap (then nothing, ever again).
    fn write(&mut self, pkt: &TracePacket) -> io::Result<bool> {
        if self.capped {
            return Ok(false);
        }
        self.frame.clear();
        // Field 1 of `Trace`, length-delimited.
        self.frame.push(0x0A);
        pkt.encode_length_delimited(&mut self.frame).map_err(io::Error::other)?;
        let n = self.frame.len() as u64;
        if self.counts.bytes + n > self.max_bytes {
            self.capped = true;
            return Ok(false);
        }
        self.out.write_all(&self.frame)?;
        self.counts.bytes += n;
        self.counts.packets += 1;
        Ok(true)
    }

    /// A packet that clears the sequence's incremental state and sets it up again: the
    /// timestamp clock, the annotation names, and (first packet only) the clock snapshot.
    fn clear_state(&mut self) -> io::Result<bool> {
        let mut pkt = TracePacket {
            trusted_packet_sequence_id: Some(SEQUENCE),
            sequence_flags: Some(SEQ_INCREMENTAL_STATE_CLEARED | SEQ_NEEDS_INCREMENTAL_STATE),
            trace_packet_defaults: Some(TracePacketDefaults {
                timestamp_clock_id: Some(super::proto::CLOCK_MONOTONIC),
            }),
            interned_data: Some(InternedData {
                debug_annotation_names: Key::ALL
                    .iter()
                    .map(|k| DebugAnnotationName {
                        iid: Some(k.iid()),
                        name: Some(k.name().into()),
                    })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        };
        if !self.started {
            pkt.clock_snapshot = Some(clock_snapshot());
            pkt.timestamp = pkt.clock_snapshot.as_ref().and_then(|c| c.clocks[0].timestamp);
        } else {
            self.counts.intern_resets += 1;
        }
        self.names.clear();
        self.strings.clear();
        self.started = true;
        self.write(&pkt)
    }

    /// Writes a track's descriptor once (again after the set of written ones started over, or
    /// after [`forget`](Self::forget)). False when the cap stopped it.
    pub fn track(&mut self, uuid: u64, make: impl FnOnce() -> TrackDescriptor) -> io::Result<bool> {
        if self.tracks.contains(&uuid) {
            return Ok(!self.capped);
        }
        if !self.started && !self.clear_state()? {
            return Ok(false);
        }
        if self.tracks.len() >= MAX_TRACKS {
            self.tracks.clear();
        }
        let mut d = make();
        d.uuid = Some(uuid);
        let pkt = TracePacket {
            trusted_packet_sequence_id: Some(SEQUENCE),
            track_descriptor: Some(d),
            ..Default::default()
        };
        let ok = self.write(&pkt)?;
        if ok {
            self.tracks.insert(uuid);
        }
        Ok(ok)
    }

    /// Tracks of a process that exited: their descriptors are written again if its pid comes back.
    pub fn forget(&mut self, uuids: impl IntoIterator<Item = u64>) {
        for u in uuids {
            self.tracks.remove(&u);
        }
    }

    /// Starts an event packet: its time, type, track and (interned) name. Annotations, flows
    /// and a counter value are added to it, then [`emit`](Self::emit) writes it.
    pub fn event(&mut self, ts: u64, ty: i32, track: u64, name: Option<&str>) -> io::Result<()> {
        if !self.started || self.names.len() + self.strings.len() + PER_EVENT > self.max_interned {
            self.clear_state()?;
        }
        self.new_interned.clear();
        self.pkt.timestamp = Some(ts);
        let te = self.pkt.track_event.get_or_insert_with(Default::default);
        while let Some(mut a) = te.debug_annotations.pop() {
            if let Some(mut s) = a.string_value.take() {
                s.clear();
                self.spare_strings.push(s);
            }
            self.spare.push(a);
        }
        te.r#type = Some(ty);
        te.track_uuid = Some(track);
        te.double_counter_value = None;
        te.flow_ids.clear();
        te.terminating_flow_ids.clear();
        te.name_iid = None;
        if let Some(name) = name {
            let iid = intern(&mut self.names, name, &mut self.new_interned, false);
            if let Some(te) = self.pkt.track_event.as_mut() {
                te.name_iid = Some(iid);
            }
        }
        Ok(())
    }

    fn te(&mut self) -> &mut TrackEvent {
        self.pkt.track_event.get_or_insert_with(Default::default)
    }

    fn annotation(&mut self, key: Key) -> DebugAnnotation {
        let mut a = self.spare.pop().unwrap_or_default();
        a.name_iid = Some(key.iid());
        a.bool_value = None;
        a.uint_value = None;
        a.int_value = None;
        a.double_value = None;
        a.string_value = None;
        a.string_value_iid = None;
        a
    }

    pub fn uint(&mut self, key: Key, v: u64) {
        let mut a = self.annotation(key);
        a.uint_value = Some(v);
        self.te().debug_annotations.push(a);
    }

    pub fn int(&mut self, key: Key, v: i64) {
        let mut a = self.annotation(key);
        a.int_value = Some(v);
        self.te().debug_annotations.push(a);
    }

    pub fn double(&mut self, key: Key, v: f64) {
        let mut a = self.annotation(key);
        a.double_value = Some(v);
        self.te().debug_annotations.push(a);
    }

    pub fn boolean(&mut self, key: Key, v: bool) {
        let mut a = self.annotation(key);
        a.bool_value = Some(v);
        self.te().debug_annotations.push(a);
    }

    /// A string annotation written out in the packet (for values that rarely repeat).
    pub fn string(&mut self, key: Key, v: impl std::fmt::Display) {
        let mut a = self.annotation(key);
        let mut s = self.spare_strings.pop().unwrap_or_default();
        let _ = std::fmt::Write::write_fmt(&mut s, format_args!("{v}"));
        a.string_value = Some(s);
        self.te().debug_annotations.push(a);
    }

    /// A string annotation interned (kernel names, directions: values that repeat).
    pub fn interned(&mut self, key: Key, v: &str) {
        let mut a = self.annotation(key);
        a.string_value_iid = Some(intern(&mut self.strings, v, &mut self.new_interned, true));
        self.te().debug_annotations.push(a);
    }

    pub fn flow(&mut self, id: u64) {
        self.te().flow_ids.push(id);
    }

    pub fn terminate_flow(&mut self, id: u64) {
        self.te().terminating_flow_ids.push(id);
    }

    pub fn counter(&mut self, v: f64) {
        self.te().double_counter_value = Some(v);
    }

    /// Writes the event started by [`event`](Self::event). False when the cap stopped it.
    pub fn emit(&mut self) -> io::Result<bool> {
        let interned = (!self.new_interned.is_empty()).then(|| std::mem::take(&mut self.new_interned));
        self.pkt.interned_data = interned;
        let pkt = std::mem::take(&mut self.pkt);
        let r = self.write(&pkt);
        self.pkt = pkt;
        if let Some(d) = self.pkt.interned_data.take() {
            self.new_interned = d;
        }
        r
    }

    /// A SLICE_END on `track` (no name, no annotations).
    pub fn end(&mut self, ts: u64, track: u64) -> io::Result<bool> {
        self.event(ts, super::proto::TYPE_SLICE_END, track, None)?;
        self.emit()
    }
}

/// The iid of `s` in `table`, interning it (into `new`) when it is not there yet.
fn intern(table: &mut HashMap<Box<str>, u64>, s: &str, new: &mut InternedData, string_value: bool) -> u64 {
    if let Some(&iid) = table.get(s) {
        return iid;
    }
    let iid = table.len() as u64 + 1;
    table.insert(s.into(), iid);
    if string_value {
        new.debug_annotation_string_values.push(InternedString {
            iid: Some(iid),
            str: Some(s.as_bytes().to_vec()),
        });
    } else {
        new.event_names.push(EventName {
            iid: Some(iid),
            name: Some(s.into()),
        });
    }
    iid
}

/// The clocks' readings at the start, back to back: trace time is CLOCK_MONOTONIC (the
/// agent's and CUPTI's clock); BOOTTIME (the readers' default) and REALTIME (wall time in the
/// UI) are given against it.
fn clock_snapshot() -> ClockSnapshot {
    let mono = crate::clock::clock_ns(libc::CLOCK_MONOTONIC);
    let boot = crate::clock::clock_ns(libc::CLOCK_BOOTTIME);
    let real = crate::clock::clock_ns(libc::CLOCK_REALTIME);
    let clock = |id, ts| Clock {
        clock_id: Some(id),
        timestamp: Some(ts),
    };
    ClockSnapshot {
        clocks: vec![
            clock(super::proto::CLOCK_MONOTONIC, mono),
            clock(super::proto::CLOCK_BOOTTIME, boot),
            clock(super::proto::CLOCK_REALTIME, real),
        ],
        primary_trace_clock: Some(super::proto::CLOCK_MONOTONIC as i32),
    }
}
