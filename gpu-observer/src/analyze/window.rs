//! Verdict windows: the main task samples each observed process's counters from the snapshot
//! (and its launching threads' CPU time from /proc) at every tick, and judges the last
//! [`WINDOW`] of each, and the whole run.

use std::collections::{HashMap, VecDeque};

use super::verdict::{BusySource, Evidence, Verdict, classify};
use crate::{procinfo::ProcInfo, snapshot::Snapshot};

/// The sliding window a verdict covers (a shorter one until that much has been seen).
pub const WINDOW_NS: u64 = 10_000_000_000;
/// Samples kept per process (ticks in a window, with room for a 100 ms `--interval-ms`).
const MAX_SAMPLES: usize = 128;
/// Launching threads whose CPU time is read per process (the most launching first).
const MAX_THREADS_READ: usize = 8;
/// Processes tracked at once (the snapshot's are bounded too).
const MAX_PROCESSES: usize = 4096;

/// A process's counters at one tick.
#[derive(Clone, Debug, Default)]
struct Sample {
    at_ns: u64,
    calls: u64,
    launches: u64,
    kernels: u64,
    kernel_ns: u64,
    busy_ns: Option<u64>,
    /// NVML's SM utilization samples of the process so far: (sum of percents, samples).
    nvml_sm: Option<(u64, u64)>,
    syncs: u64,
    sync_ns: u64,
    copy_ns: u64,
    process_cpu_ns: u64,
    /// (tid, CPU ns) of the most launching threads.
    threads: Vec<(u32, u64)>,
}

/// The evidence between two samples of one process.
fn between(a: &Sample, b: &Sample) -> Evidence {
    let launch_thread_cpu_ns = b
        .threads
        .iter()
        .filter_map(|(tid, now)| {
            let then = a.threads.iter().find(|(t, _)| t == tid).map_or(0, |(_, c)| *c);
            now.checked_sub(then)
        })
        .max()
        .unwrap_or(0);
    let window_ns = b.at_ns.saturating_sub(a.at_ns);
    // CUPTI's exact busy time when the process has it; else the mean of NVML's samples.
    let (gpu_busy_ns, busy_source) = match (b.busy_ns, b.nvml_sm) {
        (Some(n), _) => (Some(n.saturating_sub(a.busy_ns.unwrap_or(0))), BusySource::Cupti),
        (None, Some((sum, n))) => {
            let (sum0, n0) = a.nvml_sm.unwrap_or((0, 0));
            match n.checked_sub(n0).filter(|d| *d > 0) {
                Some(samples) => {
                    let pct = sum.saturating_sub(sum0) as f64 / samples as f64;
                    (Some((pct / 100.0 * window_ns as f64) as u64), BusySource::Nvml)
                }
                None => (None, BusySource::None),
            }
        }
        (None, None) => (None, BusySource::None),
    };
    Evidence {
        window_ns,
        busy_source,
        calls: b.calls.saturating_sub(a.calls),
        launches: b.launches.saturating_sub(a.launches),
        gpu_busy_ns,
        kernels: b.kernels.saturating_sub(a.kernels),
        kernel_ns: b.kernel_ns.saturating_sub(a.kernel_ns),
        launch_thread_cpu_ns,
        process_cpu_ns: b.process_cpu_ns.saturating_sub(a.process_cpu_ns),
        syncs: b.syncs.saturating_sub(a.syncs),
        sync_ns: b.sync_ns.saturating_sub(a.sync_ns),
        copy_ns: b.copy_ns.saturating_sub(a.copy_ns),
    }
}

/// A verdict of one process, and whose.
#[derive(Clone, Debug)]
pub struct ProcessVerdict {
    pub pid: u32,
    pub comm: String,
    pub verdict: Verdict,
}

#[derive(Default)]
struct Tracked {
    first: Option<Sample>,
    recent: VecDeque<Sample>,
}

/// Every observed process's samples.
#[derive(Default)]
pub struct Tracker {
    procs: HashMap<u32, Tracked>,
}

impl Tracker {
    /// Samples the snapshot's live processes (their threads' CPU time from `procinfo`) and
    /// returns each one's verdict over the last window (none for a process seen only once).
    /// Time is the snapshot's, so counters and clock agree.
    pub fn tick(&mut self, snap: &Snapshot, procinfo: &ProcInfo) -> Vec<ProcessVerdict> {
        self.sample(snap, procinfo, false)
    }

    /// The last tick, at the end of the run: exited processes are sampled too (their CPU time
    /// as last read: /proc no longer has it), so each whole-run verdict reaches their end.
    pub fn last_tick(&mut self, snap: &Snapshot, procinfo: &ProcInfo) {
        self.sample(snap, procinfo, true);
    }

    fn sample(&mut self, snap: &Snapshot, procinfo: &ProcInfo, exited_too: bool) -> Vec<ProcessVerdict> {
        let now_ns = snap.taken_ns;
        let mut out = Vec::new();
        // Exited processes keep their samples for the whole-run verdict while the snapshot
        // lists them.
        self.procs.retain(|pid, _| snap.process(*pid).is_some());
        for p in snap.procs.iter().filter(|p| exited_too || !p.exited) {
            if self
                .procs
                .get(&p.pid)
                .and_then(|t| t.recent.back())
                .is_some_and(|s| s.at_ns == now_ns)
            {
                // The same snapshot again (ticks faster than snapshots): nothing new.
                continue;
            }
            if !self.procs.contains_key(&p.pid) && self.procs.len() >= MAX_PROCESSES {
                continue;
            }
            let s = &p.stats;
            let mut tids: Vec<(u32, u64)> = s.launch_tids.iter().map(|(t, n)| (*t, *n)).collect();
            tids.sort_by_key(|t| std::cmp::Reverse(t.1));
            let last = self.procs.get(&p.pid).and_then(|t| t.recent.back());
            let sample = Sample {
                at_ns: now_ns,
                calls: s.launches + s.call_apis.values().sum::<u64>(),
                launches: s.launches,
                kernels: p.gpu.as_ref().map_or(0, |g| g.stats.kernels),
                kernel_ns: p.gpu.as_ref().map_or(0, |g| g.stats.kernel_ns),
                busy_ns: p.gpu.as_ref().map(|g| g.stats.busy_ns),
                nvml_sm: snap.nvml.procs.get(&p.pid).map(|u| (u.sm_util_sum, u.sm_util_samples)),
                syncs: s.syncs.count,
                sync_ns: s.syncs.ns,
                copy_ns: s.copies.iter().map(|a| a.ns).sum(),
                process_cpu_ns: procinfo
                    .process_cpu_ns(p.pid)
                    .or(last.map(|s| s.process_cpu_ns))
                    .unwrap_or(0),
                threads: tids
                    .iter()
                    .take(MAX_THREADS_READ)
                    .filter_map(|(t, _)| {
                        let before = last
                            .and_then(|s| s.threads.iter().find(|(x, _)| x == t))
                            .map(|(_, c)| *c);
                        procinfo.thread_cpu_ns(p.pid, *t).or(before).map(|c| (*t, c))
                    })
                    .collect(),
            };
            let t = self.procs.entry(p.pid).or_default();
            t.first.get_or_insert_with(|| sample.clone());
            while t.recent.len() >= MAX_SAMPLES
                || t.recent
                    .front()
                    .is_some_and(|f| now_ns.saturating_sub(f.at_ns) > WINDOW_NS)
            {
                t.recent.pop_front();
            }
            if let Some(oldest) = t.recent.front() {
                out.push(ProcessVerdict {
                    pid: p.pid,
                    comm: p.comm.clone(),
                    verdict: classify(&between(oldest, &sample)),
                });
            }
            t.recent.push_back(sample);
        }
        out
    }

    /// The verdict of a process over everything seen of it.
    pub fn whole_run(&self, pid: u32) -> Option<Verdict> {
        let t = self.procs.get(&pid)?;
        let (first, last) = (t.first.as_ref()?, t.recent.back()?);
        (last.at_ns > first.at_ns).then(|| classify(&between(first, last)))
    }
}
