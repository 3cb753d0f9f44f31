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
    analyze::{anomaly::Finding, findings::Findings},
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
    /// What the anomaly detector flagged of it (none: nothing yet).
    pub anomalies: Option<Arc<Findings>>,
}

impl ProcessView {
    /// The process's wall span observed so far, in ns (at least 1).
    pub fn span_ns(&self) -> u64 {
        self.last_ts.saturating_sub(self.first_ts).max(1)
    }

    /// How many anomalies were flagged in it so far.
    pub fn anomaly_count(&self) -> u64 {
        self.anomalies.as_ref().map_or(0, |a| a.count)
    }

    fn of(p: &Process, top_kernels: Vec<(Arc<KernelName>, u64)>, anomalies: Option<Arc<Findings>>) -> Self {
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
                nvtx: g.nvtx.stats,
            }),
            anomalies,
        }
    }
}

/// A process's CUPTI state and GPU activity counts.
#[derive(Clone, Debug)]
pub struct GpuView {
    pub status: Status,
    pub stats: GpuStats,
    /// Its NVTX ranges and marks.
    pub nvtx: crate::correlate::nvtx::NvtxStats,
}

/// What the main task knows and reports to the reader: ring-buffer drops, attach refusals.
#[derive(Clone, Debug, Default)]
pub struct AgentStats {
    pub drops: Drops,
    pub attach_failures: u64,
    /// Fleet mode: the share of the time since the first capture window that the windows
    /// covered (the windowed counters saw that share of the calls).
    pub capture_fraction: Option<f64>,
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
    /// What the anomaly detector flagged, per process: kept here, with the processes the
    /// correlator keeps, because the detector forgets a process at its exit.
    findings: HashMap<u32, Arc<Findings>>,
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
                findings: HashMap::new(),
                seq: 0,
            },
            Snapshots(current),
        )
    }

    /// A finding of the anomaly detector about `pid` (`ts_ns`: when the flagged call began),
    /// for the next snapshots. Per finding, not per event (findings are rare); a snapshot that
    /// holds the process's findings keeps its copy.
    pub fn note_anomaly(&mut self, pid: u32, ts_ns: u64, finding: &Finding) {
        Arc::make_mut(self.findings.entry(pid).or_default()).note(ts_ns, finding);
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
            let findings = self.findings.get(&p.pid);
            // A finding comes with the call or GPU record that changed the process, but a view
            // is never reused with an older count.
            let same_findings = |v: &ProcessView| v.anomaly_count() == findings.map_or(0, |f| f.count);
            let view = match prev {
                Some(v) if !changed && !last && same_findings(v) => v.clone(),
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
                    Arc::new(ProcessView::of(p, top, findings.cloned()))
                }
            };
            procs.push(view);
        }
        procs.sort_unstable_by_key(|p| p.pid);
        self.views = procs.iter().map(|p| (p.pid, p.clone())).collect();
        self.top_at.retain(|pid, _| corr.procs.contains_key(pid));
        // Findings go with the process (the correlator bounds the exited ones it keeps).
        self.findings.retain(|pid, _| corr.procs.contains_key(pid));
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

/// Snapshots of known processes, for the views' tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::{sync::Arc, time::Duration};

    use gpu_observer_common::api;

    use super::{Publisher, Snapshot};
    use crate::{
        analyze::anomaly::{Finding, What},
        correlate::Correlator,
        decode::{Body, Call, Event, KernelName},
        nvml::{Hub, State},
    };

    /// A correlator that has seen one 100 µs `cuStreamSynchronize` of each of `pids`
    /// (comm `train`), and a publisher with NVML off.
    pub fn with_processes(pids: &[u32]) -> (Correlator, Publisher) {
        let mut corr = Correlator::new(100_000);
        for &pid in pids {
            corr.observe(&mut sync(pid, 1_000));
        }
        let hub = Hub::new(State::Off, Duration::from_millis(100), None);
        (corr, Publisher::new(hub.view()).0)
    }

    /// A returned `cuStreamSynchronize` of `pid` at `ts_ns`.
    pub fn sync(pid: u32, ts_ns: u64) -> Event {
        let spec = api::by_id(api::id_of("cuStreamSynchronize").unwrap()).unwrap();
        Event {
            ts_ns,
            pid,
            tid: pid,
            comm: *b"train\0\0\0\0\0\0\0\0\0\0\0",
            api: Some(spec),
            body: Body::Call(Call::returned(spec, 100_000)),
        }
    }

    /// A kernel finding: `observed` ns against `typical`, `deviation` deviations.
    pub fn kernel_finding(name: &str, observed: f64, typical: f64, deviation: f64) -> Finding {
        Finding {
            what: What::Kernel {
                name: Arc::new(KernelName::new(name)),
                grid: [20, 1, 1],
                block: [1, 1, 1],
            },
            observed,
            typical,
            deviation,
        }
    }

    /// Publishes at `now_ns`.
    pub fn publish(p: &mut Publisher, corr: &mut Correlator, now_ns: u64) -> Arc<Snapshot> {
        let nvml = Hub::new(State::Off, Duration::from_millis(100), None).view();
        p.publish(corr, nvml, Default::default(), Default::default(), now_ns, false)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;

    #[test]
    fn findings_reach_the_view_of_their_process_and_go_with_it() {
        let (mut corr, mut p) = with_processes(&[10, 20]);
        p.note_anomaly(10, 500, &kernel_finding("gemm", 20_000.0, 2_000.0, 115.0));
        // A process the correlator does not know (none of its events were seen): not kept.
        p.note_anomaly(30, 600, &kernel_finding("gemm", 20_000.0, 2_000.0, 115.0));
        let s1 = publish(&mut p, &mut corr, 1_000_000);
        let v = s1.process(10).unwrap();
        assert_eq!(v.anomaly_count(), 1);
        let n = v.anomalies.as_ref().unwrap().latest().next().unwrap();
        assert_eq!((n.seq, n.ts_ns, n.finding.observed), (1, 500, 20_000.0));
        assert_eq!(s1.process(20).unwrap().anomaly_count(), 0);
        assert!(s1.process(20).unwrap().anomalies.is_none());
        assert!(!p.findings.contains_key(&30));
        // A finding with no other change of the process still gives it a new view; the earlier
        // snapshot keeps what it had.
        p.note_anomaly(10, 700, &kernel_finding("gemm", 30_000.0, 2_000.0, 130.0));
        let s2 = publish(&mut p, &mut corr, 2_000_000);
        assert_eq!(s2.process(10).unwrap().anomaly_count(), 2);
        assert_eq!(s1.process(10).unwrap().anomaly_count(), 1);
        let worst = s2
            .process(10)
            .unwrap()
            .anomalies
            .as_ref()
            .unwrap()
            .worst_after(0)
            .unwrap();
        assert_eq!((worst.seq, worst.finding.deviation), (2, 130.0));
        // Unchanged processes share their view with the last snapshot.
        assert!(std::sync::Arc::ptr_eq(&s1.procs[1], &s2.procs[1]));
        // An exited process keeps its findings for the summary (the detector forgets it).
        let mut exit = sync(10, 3_000);
        exit.body = crate::decode::Body::ProcessExit;
        corr.observe(&mut exit);
        let s3 = publish(&mut p, &mut corr, 3_000_000);
        let v = s3.process(10).unwrap();
        assert!(v.exited);
        assert_eq!(v.anomaly_count(), 2);
    }
}
