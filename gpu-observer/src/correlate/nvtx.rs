//! NVTX ranges from CUPTI's marker records: paired, classified, and the stack of ranges open
//! on a thread at a given time (a kernel's launch).
//!
//! CUPTI records a push/pop range and a start/end range alike (a start and an end record
//! with one id, the thread that made each call): a range that ends on the thread that opened
//! it, innermost first, is a thread range; one that ends out of that order or on another
//! thread is a process range.

use std::sync::Arc;

/// The ranges open on a thread at a launch, outermost first (labels: [`label`]).
pub type NvtxStack = Arc<[Arc<str>]>;

/// What kind of NVTX marker a [`NvtxRange`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvtxKind {
    /// Opened and closed on one thread, nested (`nvtxRangePush`/`Pop`).
    Thread,
    /// Process-wide (`nvtxRangeStart`/`End`): ended out of nesting order or on another thread.
    Process,
    /// A point in time (`nvtxMark`).
    Mark,
}

impl NvtxKind {
    pub const fn name(self) -> &'static str {
        match self {
            NvtxKind::Thread => "thread",
            NvtxKind::Process => "process",
            NvtxKind::Mark => "mark",
        }
    }
}

/// A finished range (or a mark, or a range still open when its process exited or the run
/// ended), as the sinks get it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvtxRange {
    pub pid: u32,
    pub comm: [u8; 16],
    /// The thread that opened it (0 when CUPTI named none).
    pub tid: u32,
    /// CUPTI's marker id.
    pub id: u32,
    pub kind: NvtxKind,
    pub name: Arc<str>,
    /// The NVTX domain (None: the default domain).
    pub domain: Option<Arc<str>>,
    pub start_ns: u64,
    /// None for a mark, and for a range still open when its process exited or the run ended.
    pub end_ns: Option<u64>,
    /// Thread ranges: how many ranges were open beneath it on its thread (0: outermost).
    pub depth: u32,
}

impl NvtxRange {
    /// How it is shown in stacks and on timelines ([`label`]).
    pub fn label(&self) -> Arc<str> {
        label(self.domain.as_deref(), &self.name)
    }
}

/// A range's name as stacks show it: the name, after its domain when it has one
/// (`NCCL: AllReduce`).
pub fn label(domain: Option<&str>, name: &str) -> Arc<str> {
    match domain {
        Some(d) => format!("{d}: {name}").into(),
        None => name.into(),
    }
}
