//! Immutable snapshots of the agent's state: what every view reads (the terminal, the OTLP
//! metric callbacks, the final summaries, and later the dashboard).
//!
//! The reader thread owns the correlator outright and publishes a [`Snapshot`] every
//! [`INTERVAL`] and once at exit, swapped in atomically: a view loads the latest with one
//! atomic pointer read and never waits on the reader, and the reader never waits on a view.
//! A process whose state did not change since the last snapshot is shared with it, not copied.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use arc_swap::ArcSwap;

use crate::{
    attach::Drops,
    correlate::{
        Budget, Correlator, Evicted, Leak, Process, Stats,
        cupti_join::{GpuStats, Status},
    },
    decode::KernelName,
    nvml,
};

/// How often the reader publishes.
pub const INTERVAL: Duration = Duration::from_millis(250);
/// Kernels listed per process (most launched).
pub const TOP_KERNELS: usize = 16;
/// A process with more distinct kernel handles than this has its top kernels recomputed at
/// most every [`TOP_KERNELS_REFRESH`] (the walk costs one step per handle).
const TOP_KERNELS_CHEAP: usize = 4096;
const TOP_KERNELS_REFRESH: Duration = Duration::from_secs(2);

/// One process as the views see it.
#[derive(Clone, Debug)]
pub struct ProcessView {
    pub pid: u32,
    pub comm: String,
    pub first_ts: u64,
    pub last_ts: u64,
    pub exited: bool,
    pub stats: Stats,
    /// (kernel, launches), most launched first, at most [`TOP_KERNELS`].
    pub top_kernels: Vec<(Arc<KernelName>, u64)>,
    /// What it has not freed (live allocations, or at its exit what it never freed).
    pub leaks: Vec<Leak>,
    /// What CUPTI said, once the injection library reported.
    pub gpu: Option<GpuView>,
}

impl ProcessView {
    /// The process's wall span observed so far, in ns (at least 1).
    pub fn span_ns(&self) -> u64 {
        self.last_ts.saturating_sub(self.first_ts).max(1)
    }

    fn of(p: &Process, top_kernels: Vec<(Arc<KernelName>, u64)>) -> Self {
        Self {
            pid: p.pid,
            comm: p.comm.clone(),
            first_ts: p.first_ts,
            last_ts: p.last_ts,
            exited: p.exited,
            stats: p.stats.clone(),
            top_kernels,
            leaks: p.leaks(),
            gpu: p.gpu.as_deref().map(|g| GpuView {
                status: g.status,
                stats: g.stats.clone(),
            }),
        }
    }
}

/// A process's CUPTI state and GPU activity counts.
#[derive(Clone, Debug)]
pub struct GpuView {
    pub status: Status,
    pub stats: GpuStats,
}

/// What the main task knows and reports to the reader: ring-buffer drops, attach refusals.
#[derive(Clone, Debug, Default)]
pub struct AgentStats {
    pub drops: Drops,
    pub attach_failures: u64,
}

/// The agent's state at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// 0 for the empty one before the first publication.
    pub seq: u64,
    /// CLOCK_MONOTONIC ns when taken.
    pub taken_ns: u64,
    /// The last one: taken after the reader's final drain.
    pub last: bool,
    pub events: u64,
    pub decode_errors: u64,
    /// Exited processes forgotten (past the summary's cap); their totals stay in `abandoned`.
    pub forgotten: u64,
    /// Calls that never returned, over every process seen.
    pub abandoned: u64,
    pub threshold_ns: u64,
    pub budget: Budget,
    pub evicted: Evicted,
    /// In pid order.
    pub procs: Vec<Arc<ProcessView>>,
    pub nvml: Arc<nvml::View>,
    pub agent: Arc<AgentStats>,
    /// The anomaly detector's settings and what it did.
    pub anomalies: (crate::analyze::anomaly::Config, crate::analyze::anomaly::Counts),
}

impl Snapshot {
    fn empty(nvml: Arc<nvml::View>) -> Self {
        Self {
            seq: 0,
            taken_ns: 0,
            last: false,
            events: 0,
            decode_errors: 0,
            forgotten: 0,
            abandoned: 0,
            threshold_ns: 0,
            budget: Budget::default(),
            evicted: Evicted::default(),
            procs: Vec::new(),
            nvml,
            agent: Arc::new(AgentStats::default()),
            anomalies: Default::default(),
        }
    }

    pub fn process(&self, pid: u32) -> Option<&ProcessView> {
        self.procs
            .binary_search_by_key(&pid, |p| p.pid)
            .ok()
            .map(|i| &*self.procs[i])
    }
}

/// Where snapshots are read: cheap to clone, one per view.
#[derive(Clone)]
pub struct Snapshots(Arc<ArcSwap<Snapshot>>);

impl Snapshots {
    /// The latest snapshot (one atomic load; it stays valid as long as it is held).
    pub fn load(&self) -> Arc<Snapshot> {
        self.0.load_full()
    }
}

/// The reader's side: builds and publishes snapshots.
pub struct Publisher {
    current: Arc<ArcSwap<Snapshot>>,
    views: HashMap<u32, Arc<ProcessView>>,
    /// When each busy process's top kernels were last computed.
    top_at: HashMap<u32, Instant>,
    seq: u64,
}

impl Publisher {
    pub fn new(nvml: Arc<nvml::View>) -> (Self, Snapshots) {
        let current = Arc::new(ArcSwap::from_pointee(Snapshot::empty(nvml)));
        (
            Self {
                current: current.clone(),
                views: HashMap::new(),
                top_at: HashMap::new(),
                seq: 0,
            },
            Snapshots(current),
        )
    }

    /// Builds a snapshot of `corr` (reusing the views of processes that did not change) and
    /// swaps it in.
    pub fn publish(
        &mut self,
        corr: &mut Correlator,
        nvml: Arc<nvml::View>,
        agent: Arc<AgentStats>,
        anomalies: (crate::analyze::anomaly::Config, crate::analyze::anomaly::Counts),
        now_ns: u64,
        last: bool,
    ) -> Arc<Snapshot> {
        self.seq += 1;
        let mut procs: Vec<Arc<ProcessView>> = Vec::with_capacity(corr.procs.len());
        let now = Instant::now();
        for p in corr.procs.values_mut() {
            let changed = p.take_changed();
            let prev = self.views.get(&p.pid);
            let view = match prev {
                Some(v) if !changed && !last => v.clone(),
                _ => {
                    let stale = prev.is_some_and(|_| {
                        p.kernel_count() > TOP_KERNELS_CHEAP
                            && self
                                .top_at
                                .get(&p.pid)
                                .is_some_and(|t| now.duration_since(*t) < TOP_KERNELS_REFRESH)
                    });
                    let top = match prev {
                        Some(v) if stale && !last => v.top_kernels.clone(),
                        _ => {
                            if p.kernel_count() > TOP_KERNELS_CHEAP {
                                self.top_at.insert(p.pid, now);
                            }
                            p.top_kernels(TOP_KERNELS)
                        }
                    };
                    Arc::new(ProcessView::of(p, top))
                }
            };
            procs.push(view);
        }
        procs.sort_unstable_by_key(|p| p.pid);
        self.views = procs.iter().map(|p| (p.pid, p.clone())).collect();
        self.top_at.retain(|pid, _| corr.procs.contains_key(pid));
        let snap = Arc::new(Snapshot {
            seq: self.seq,
            taken_ns: now_ns,
            last,
            events: corr.events,
            decode_errors: corr.decode_errors,
            forgotten: corr.forgotten,
            abandoned: corr.abandoned_calls(),
            threshold_ns: corr.threshold_ns,
            budget: corr.budget,
            evicted: corr.evicted,
            procs,
            nvml,
            agent,
            anomalies,
        });
        self.current.store(snap.clone());
        snap
    }
}
