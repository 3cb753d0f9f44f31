//! What every event output implements. The pipeline holds a list of sinks and names none of
//! them: JSON lines, OTLP spans and the stderr notices are each one `Sink`, and a new output
//! (the Perfetto writer) is one more.
//!
//! Calls come from the reader thread, in the order things happened: a batch's CUPTI state
//! changes, then its events, then its GPU records and the leaks of processes that exited in
//! it; memory, NVML samples and flushes on the reader's timers; the summary once at the end.
//! An error stops the agent (the output is gone: a closed pipe, a full disk), so a sink that
//! can lose data without harm (OTLP's bounded queue) counts its losses and returns `Ok`.

use anyhow::Result;

use crate::{
    analyze::window::ProcessVerdict,
    attach::Drops,
    correlate::{CuptiChange, Leak, MemorySample, cupti_join::GpuActivity, nvtx::NvtxRange},
    decode::Event,
    nvml::{DeviceInfo, Line},
    snapshot::Snapshot,
};

/// Allocations a process has not freed: at its exit, or on demand (SIGUSR1).
pub struct LeakReport<'a> {
    pub ts_ns: u64,
    pub pid: u32,
    pub comm: &'a str,
    pub exited: bool,
    pub leaks: &'a [Leak],
}

/// A call or GPU record the anomaly detector flagged (analyze/anomaly.rs).
pub struct AnomalyLine<'a> {
    /// When the call began (a GPU record: when it started on the GPU).
    pub ts_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub comm: &'a [u8; 16],
    pub finding: &'a crate::analyze::anomaly::Finding,
    pub mode: crate::analyze::anomaly::Mode,
    /// What was flagged, as the sink was handed it: a sink that built something of its own for
    /// that call or record (OTLP: its span) finds it by this.
    pub flagged: Flagged<'a>,
    /// The last finding of that call or record in this batch (a copy can be flagged twice: its
    /// time in the call and its bandwidth), so such a sink knows when it has them all.
    pub last: bool,
}

/// The event or GPU record an [`AnomalyLine`] is about.
#[derive(Clone, Copy)]
pub enum Flagged<'a> {
    Event(&'a Event),
    Gpu(&'a GpuActivity),
}

/// The end of a run, for the sinks that write a summary.
pub struct Summary<'a> {
    pub snapshot: &'a Snapshot,
    pub drops: &'a Drops,
    pub wall_ns: u64,
    /// Drops of processes the agent never saw an event of.
    pub unattributed_drops: u64,
    /// What other parts of the agent report in the total, by key (`otlp`, `libraries`).
    pub agent: &'a [(&'a str, serde_json::Value)],
    /// Each process's verdict over the whole run.
    pub verdicts: &'a std::collections::HashMap<u32, crate::analyze::verdict::Verdict>,
}

/// Something `--gpu-timing` did to a process (`attach::inject`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuTimingNote {
    pub ts_ns: u64,
    pub pid: u32,
    /// The borrowed thread (injected), else the process.
    pub tid: u32,
    pub comm: String,
    pub event: GpuTimingEvent,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuTimingEvent {
    /// The library was loaded: how long the borrowed thread was stopped, and then ran the
    /// loader instead of its own code.
    Injected { pause_us: u64, diverted_us: u64 },
    /// It was there: injected by an earlier observer (`late`), or loaded through
    /// `CUDA_INJECTION64_PATH`.
    AlreadyLoaded { late: bool },
    /// Not done ([`crate::attach::inject::Reason`]); uprobes observe it all the same.
    Refused { reason: &'static str, message: String },
    /// GPU timing switched off (flushed): the records the library forwarded in all.
    Withdrawn { records: u64 },
}

impl GpuTimingEvent {
    pub fn name(&self) -> &'static str {
        match self {
            GpuTimingEvent::Injected { .. } => "injected",
            GpuTimingEvent::AlreadyLoaded { .. } => "already_loaded",
            GpuTimingEvent::Refused { .. } => "refused",
            GpuTimingEvent::Withdrawn { .. } => "withdrawn",
        }
    }
}

pub trait Sink: Send {
    /// What it writes where, for messages ("JSON lines to stdout").
    fn describe(&self) -> String;

    /// An event, with what the correlator filled in (kernel name, copy direction, freed size).
    fn event(&mut self, ev: &Event) -> Result<()>;

    /// A GPU record from CUPTI, joined to its launch when it could be.
    fn gpu(&mut self, a: &GpuActivity) -> Result<()>;

    /// A process's CUPTI state changed.
    fn cupti_state(&mut self, _change: &CuptiChange) -> Result<()> {
        Ok(())
    }

    /// What `--gpu-timing` did to a process.
    fn gpu_timing(&mut self, _n: &GpuTimingNote) -> Result<()> {
        Ok(())
    }

    /// A capture window opened or closed (fleet mode).
    fn capture(&mut self, _e: &crate::observe::capture::Edge) -> Result<()> {
        Ok(())
    }

    /// A point of a process's memory timeline (once a second for processes whose memory changed).
    fn memory(&mut self, _ts_ns: u64, _m: &MemorySample, _comm: &str) -> Result<()> {
        Ok(())
    }

    fn leaks(&mut self, _report: &LeakReport<'_>) -> Result<()> {
        Ok(())
    }

    /// A process's bottleneck verdict over its last window.
    fn verdict(&mut self, _ts_ns: u64, _v: &ProcessVerdict) -> Result<()> {
        Ok(())
    }

    /// An NVTX range that ended, a mark, or a range still open when its process exited or the
    /// run ended (after the batch's GPU records).
    fn nvtx(&mut self, _r: &NvtxRange) -> Result<()> {
        Ok(())
    }

    /// A call or GPU record found anomalous (after the event or record itself).
    fn anomaly(&mut self, _a: &AnomalyLine<'_>) -> Result<()> {
        Ok(())
    }

    /// Whether this sink writes NVML samples (only then are they queued for the reader).
    fn wants_nvml(&self) -> bool {
        false
    }

    fn nvml(&mut self, _line: &Line, _comm: Option<&str>, _devices: &[DeviceInfo]) -> Result<()> {
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    /// No more events will come (the reader has drained the ring): a sink that hands events
    /// to a thread of its own lets it finish now.
    fn close(&mut self) {}

    /// The run's summary, after the last event.
    fn summary(&mut self, _s: &Summary<'_>) -> Result<()> {
        Ok(())
    }
}
