//! Verdict windows: the main task samples each observed process's counters from the snapshot
//! (and its launching threads' CPU time from /proc) at every tick, and judges the last
//! [`WINDOW_NS`] of each, and the whole run; then counts the tick's GPU time by class
//! ([`super::gpu_time`]).

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
};

use super::{
    estimate::{self, CaptureLog, Captured},
    findings::{Noted, worse},
    gpu_time::{GpuTime, Holder, Published},
    verdict::{self, BusySource, Class, Evidence, TopKernel, Verdict, classify},
};
use crate::{correlate::Amount, procinfo::ProcInfo, snapshot::Snapshot};

/// The sliding window a verdict covers (a shorter one until that much has been seen).
pub const WINDOW_NS: u64 = 10_000_000_000;
/// Samples kept per process (ticks in a window, with room for a 100 ms `--interval-ms`).
const MAX_SAMPLES: usize = 128;
/// Launching threads whose CPU time is read per process (the most launching first).
const MAX_THREADS_READ: usize = 8;
/// Processes tracked at once (the snapshot's are bounded too).
const MAX_PROCESSES: usize = 4096;
/// Kernels kept per sample (the most GPU time so far), and shown per window.
const KERNELS_KEPT: usize = 8;
const KERNELS_SHOWN: usize = 3;

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
    /// The utilization samples of the GPUs NVML listed the process alone on, summed over the
    /// ticks it was (sum of percents, samples): the process's busy time when no other process
    /// shares its GPUs.
    nvml_device: (f64, u64),
    /// (kernel, count, GPU ns) so far of the [`KERNELS_KEPT`] with the most GPU time, most
    /// first.
    kernels_top: Vec<(Arc<str>, u64, u64)>,
    syncs: u64,
    sync_ns: u64,
    copies: [Amount; 4],
    pinned_copies: u64,
    pageable_copies: u64,
    link_bytes_per_s: Option<f64>,
    process_cpu_ns: u64,
    /// (tid, CPU ns) of the most launching threads.
    threads: Vec<(u32, u64)>,
    /// Anomalies flagged so far.
    anomalies: u64,
    /// Records of the process dropped (ring buffer full) so far.
    dropped: u64,
}

/// The kernels with the most GPU time between two samples. Exact for a kernel among `a`'s
/// kept ones, or when `a` kept all the process had; otherwise `a` is known to have had at
/// most its last kept kernel's time for it, so that is subtracted and the window's time is a
/// lower bound (`exact: false`, count unknown).
fn top_kernels(a: &Sample, b: &Sample) -> Vec<TopKernel> {
    let floor = (a.kernels_top.len() >= KERNELS_KEPT).then(|| a.kernels_top.last().map_or(0, |k| k.2));
    let mut v: Vec<TopKernel> = b
        .kernels_top
        .iter()
        .filter_map(|(name, count, ns)| {
            let before = a.kernels_top.iter().find(|k| k.0 == *name);
            let k = match (before, floor) {
                (Some((_, c0, ns0)), _) => TopKernel {
                    name: name.clone(),
                    count: Some(count.saturating_sub(*c0)),
                    gpu_ns: ns.saturating_sub(*ns0),
                    exact: true,
                },
                (None, None) => TopKernel {
                    name: name.clone(),
                    count: Some(*count),
                    gpu_ns: *ns,
                    exact: true,
                },
                (None, Some(f)) => TopKernel {
                    name: name.clone(),
                    count: None,
                    gpu_ns: ns.saturating_sub(f),
                    exact: false,
                },
            };
            (k.gpu_ns > 0).then_some(k)
        })
        .collect();
    v.sort_by_key(|k| std::cmp::Reverse(k.gpu_ns));
    v.truncate(KERNELS_SHOWN);
    v
}

/// The evidence between two samples of one process.
/// A thread's CPU time is counted from `a`'s reading of it; a thread `a` did not read counts
/// from its first reading (`first_read`: when, and how much) if that came after `a` — the CPU
/// time it had before then is not known and not counted — and not at all otherwise (it was
/// read before `a`, so its time before the window would be counted).
/// `captured`: fleet mode's capture of the process between the two (analyze/estimate.rs);
/// the counts the windowed probes feed are scaled by it — by the captured time less the
/// probes' own time when the process is host-paced (`verdict::host_paced`).
fn between(a: &Sample, b: &Sample, first_read: &HashMap<u32, (u64, u64)>, captured: Option<Captured>) -> Evidence {
    let thread_cpu: Vec<u64> = b
        .threads
        .iter()
        .filter_map(|(tid, now)| {
            let then = match a.threads.iter().find(|(t, _)| t == tid) {
                Some((_, c)) => *c,
                None => match first_read.get(tid) {
                    Some((at, c)) if *at > a.at_ns => *c,
                    _ => return None,
                },
            };
            now.checked_sub(then)
        })
        .collect();
    let launch_thread_cpu_ns = thread_cpu.iter().copied().max().unwrap_or(0);
    let window_ns = b.at_ns.saturating_sub(a.at_ns);
    // CUPTI's exact busy time when the process has it; else, when the process had its GPUs to
    // itself, their utilization (NVML samples it every round); else the mean of NVML's
    // per-process samples (read every 10 s: they lag).
    let alone = match (a.nvml_device, b.nvml_device) {
        ((sum0, n0), (sum, n)) if n > n0 => Some((sum - sum0) / (n - n0) as f64),
        _ => None,
    };
    // A fraction, not ns: NVML's percent × the window would truncate (70 % read as 69.99…).
    let (gpu_busy, busy_source) = match (b.busy_ns, alone, b.nvml_sm) {
        (Some(n), ..) => {
            let ns = n.saturating_sub(a.busy_ns.unwrap_or(0));
            (Some(ns as f64 / window_ns.max(1) as f64), BusySource::Cupti)
        }
        (None, Some(pct), _) => (Some(pct / 100.0), BusySource::NvmlDevice),
        (None, None, Some((sum, n))) => {
            let (sum0, n0) = a.nvml_sm.unwrap_or((0, 0));
            match n.checked_sub(n0).filter(|d| *d > 0) {
                Some(samples) => {
                    let pct = sum.saturating_sub(sum0) as f64 / samples as f64;
                    (Some(pct / 100.0), BusySource::Nvml)
                }
                None => (None, BusySource::None),
            }
        }
        (None, None, None) => (None, BusySource::None),
    };
    let partial = captured.filter(|c| c.ns < window_ns);
    let probe_share = partial.and_then(|c| Some(c.probe_ns? as f64 / c.ns.max(1) as f64));
    // The launching threads together: a step handed from thread to thread (PyTorch's forward
    // on the main thread, its backward on the autograd thread) keeps no single one busy.
    let launching_cpu_ns: u64 = thread_cpu.iter().sum();
    let paced = verdict::host_paced(gpu_busy, launching_cpu_ns as f64 / window_ns.max(1) as f64);
    // The time the captured work would have taken without the probes.
    let free_ns = partial.map(|c| match c.probe_ns {
        Some(p) if paced => c.ns.saturating_sub(p).max(1),
        _ => c.ns,
    });
    let est = |n: u64| free_ns.map_or(n, |c| estimate::scale(n, c, window_ns));
    let calls_seen = b.calls.saturating_sub(a.calls);
    Evidence {
        window_ns,
        capture_fraction: partial.map(|c| c.ns as f64 / window_ns.max(1) as f64),
        estimate_error: partial.map(|c| estimate::error_bound(calls_seen, &c)),
        probe_share,
        probe_corrected: paced && partial.is_some_and(|c| c.probe_ns.is_some()),
        dropped: b.dropped.saturating_sub(a.dropped),
        busy_source,
        calls: est(calls_seen),
        launches: est(b.launches.saturating_sub(a.launches)),
        gpu_busy: gpu_busy.map(|b| b.clamp(0.0, 1.0)),
        kernels: b.kernels.saturating_sub(a.kernels),
        kernel_ns: b.kernel_ns.saturating_sub(a.kernel_ns),
        top_kernels: top_kernels(a, b),
        launch_thread_cpu_ns,
        process_cpu_ns: b.process_cpu_ns.saturating_sub(a.process_cpu_ns),
        syncs: est(b.syncs.saturating_sub(a.syncs)),
        sync_ns: est(b.sync_ns.saturating_sub(a.sync_ns)),
        copies: std::array::from_fn(|i| Amount {
            count: est(b.copies[i].count.saturating_sub(a.copies[i].count)),
            bytes: est(b.copies[i].bytes.saturating_sub(a.copies[i].bytes)),
            ns: est(b.copies[i].ns.saturating_sub(a.copies[i].ns)),
        }),
        pinned_copies: est(b.pinned_copies.saturating_sub(a.pinned_copies)),
        pageable_copies: est(b.pageable_copies.saturating_sub(a.pageable_copies)),
        link_bytes_per_s: b.link_bytes_per_s,
        anomalies: b.anomalies.saturating_sub(a.anomalies),
        // The caller's: the samples keep counts, the snapshot the findings.
        worst_anomaly: None,
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
    /// Each launching thread's first CPU reading: (when, CPU ns); at most
    /// [`crate::correlate::MAX_LAUNCH_THREADS`] (the threads the snapshot lists).
    first_read: HashMap<u32, (u64, u64)>,
    /// The GPUs it was alone on at the last tick, and their utilization totals then.
    alone: Option<(Vec<u32>, f64, u64)>,
    /// The most severe anomaly since the first sample (for the whole-run verdict), gathered
    /// tick by tick: the snapshot answers exactly for a short stretch (analyze/findings.rs).
    worst_anomaly: Option<Noted>,
}

/// Every observed process's samples, and the GPU time by class.
pub struct Tracker {
    procs: HashMap<u32, Tracked>,
    gpu_time: GpuTime,
    /// Fleet mode: the capture windows (observe/capture.rs writes them); the evidence of a
    /// window without any capture is not judged.
    pub capture: Option<CaptureLog>,
}

impl Tracker {
    /// `gpu_time`: where the GPU time by class is published (for `gpu.cuda.time`).
    pub fn new(gpu_time: Published) -> Self {
        Self {
            procs: HashMap::new(),
            gpu_time: GpuTime::new(gpu_time),
            capture: None,
        }
    }

    /// Samples the snapshot's live processes (their threads' CPU time from `procinfo`) and
    /// returns each one's verdict over the last window (none for a process seen only once).
    /// Time is the snapshot's, so counters and clock agree.
    pub fn tick(&mut self, snap: &Snapshot, procinfo: &ProcInfo) -> Vec<ProcessVerdict> {
        if snap.seq == 0 {
            // The empty snapshot before the first publication: no time of its own.
            return Vec::new();
        }
        let verdicts = self.sample(snap, procinfo, false);
        let holders = holders(snap, &verdicts);
        self.gpu_time.tick(snap.taken_ns, &holders, procinfo);
        verdicts
    }

    /// The last tick, at the end of the run: exited processes are sampled too (their CPU time
    /// as last read: /proc no longer has it), so each whole-run verdict reaches their end.
    pub fn last_tick(&mut self, snap: &Snapshot, procinfo: &ProcInfo) {
        self.sample(snap, procinfo, true);
    }

    fn sample(&mut self, snap: &Snapshot, procinfo: &ProcInfo, exited_too: bool) -> Vec<ProcessVerdict> {
        let now_ns = snap.taken_ns;
        let mut out = Vec::new();
        // Processes NVML lists on each GPU now, counted once for every process's `alone_on`.
        let mut listed: HashMap<u32, usize> = HashMap::new();
        for u in snap.nvml.procs.values() {
            for d in &u.devices_now {
                *listed.entry(*d).or_default() += 1;
            }
        }
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
            let mut sample = Sample {
                at_ns: now_ns,
                calls: s.launches + s.call_apis.values().sum::<u64>(),
                launches: s.launches,
                kernels: p.gpu.as_ref().map_or(0, |g| g.stats.kernels),
                kernel_ns: p.gpu.as_ref().map_or(0, |g| g.stats.kernel_ns),
                busy_ns: p.gpu.as_ref().map(|g| g.stats.busy_ns),
                nvml_sm: snap.nvml.procs.get(&p.pid).map(|u| (u.sm_util_sum, u.sm_util_samples)),
                nvml_device: last.map_or((0.0, 0), |s| s.nvml_device),
                kernels_top: p.gpu.as_ref().map_or_else(Vec::new, |g| {
                    g.stats
                        .top_kernels(KERNELS_KEPT)
                        .into_iter()
                        .map(|(k, c, ns)| (k.clone(), c, ns))
                        .collect()
                }),
                syncs: s.syncs.count,
                sync_ns: s.syncs.ns,
                copies: s.copies,
                pinned_copies: s.pinned_copies,
                pageable_copies: s.pageable_copies,
                link_bytes_per_s: link_of(snap, p.pid),
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
                anomalies: p.anomaly_count(),
                dropped: snap.agent.drops.of_pid(p.pid),
            };
            let findings = p.anomalies.as_deref();
            // The most severe finding since the last sample (none before the first: the whole
            // run starts at it).
            let since_last = last.and_then(|s| findings?.worst_after(s.anomalies)).cloned();
            let t = self.procs.entry(p.pid).or_default();
            if since_last.is_some() {
                t.worst_anomaly = worse(t.worst_anomaly.as_ref(), since_last.as_ref()).cloned();
            }
            // Device utilization while alone: what the GPUs sampled since the last tick, when
            // the process was alone on the same GPUs then and now.
            let now_alone = alone_on(snap, &listed, p.pid);
            if let (Some((d0, sum0, n0)), Some((d, sum, n))) = (&t.alone, &now_alone)
                && d0 == d
                && n >= n0
            {
                sample.nvml_device.0 += sum - sum0;
                sample.nvml_device.1 += n - n0;
            }
            t.alone = now_alone;
            for (tid, cpu) in &sample.threads {
                if t.first_read.len() < crate::correlate::MAX_LAUNCH_THREADS || t.first_read.contains_key(tid) {
                    t.first_read.entry(*tid).or_insert((now_ns, *cpu));
                }
            }
            t.first.get_or_insert_with(|| sample.clone());
            while t.recent.len() >= MAX_SAMPLES
                || t.recent
                    .front()
                    .is_some_and(|f| now_ns.saturating_sub(f.at_ns) > WINDOW_NS)
            {
                t.recent.pop_front();
            }
            let captured = self
                .capture
                .as_ref()
                .map(|l| l.captured(p.pid, t.recent.front().map_or(now_ns, |o| o.at_ns), now_ns));
            if let Some(oldest) = t.recent.front()
                && captured.is_none_or(|c| c.ns > 0)
            {
                let mut e = between(oldest, &sample, &t.first_read, captured);
                e.worst_anomaly = findings.and_then(|f| f.worst_after(oldest.anomalies)).cloned();
                out.push(ProcessVerdict {
                    pid: p.pid,
                    comm: p.comm.clone(),
                    verdict: classify(e),
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
        let captured = self.capture.as_ref().map(|l| l.captured(pid, first.at_ns, last.at_ns));
        (last.at_ns > first.at_ns && captured.is_none_or(|c| c.ns > 0)).then(|| {
            let mut e = between(first, last, &t.first_read, captured);
            e.worst_anomaly = t.worst_anomaly.clone();
            classify(e)
        })
    }
}

/// The GPUs NVML lists the process on now, when no other process is listed on them
/// (`listed`: how many processes NVML lists on each GPU), and their utilization samples so far.
fn alone_on(snap: &Snapshot, listed: &HashMap<u32, usize>, pid: u32) -> Option<(Vec<u32>, f64, u64)> {
    let nvml = &snap.nvml;
    let mine = &nvml.procs.get(&pid)?.devices_now;
    if mine.is_empty() || mine.iter().any(|d| listed.get(d).copied().unwrap_or(0) > 1) {
        return None;
    }
    let (mut sum, mut n) = (0.0, 0);
    for d in mine {
        let t = nvml.totals.get(*d as usize)?;
        sum += t.util_gpu.sum;
        n += t.util_gpu.n;
    }
    Some((mine.clone(), sum, n))
}

/// The theoretical PCIe rate of the first GPU NVML saw the process on.
fn link_of(snap: &Snapshot, pid: u32) -> Option<f64> {
    let dev = *snap.nvml.procs.get(&pid)?.devices.first()?;
    snap.nvml
        .devices
        .iter()
        .find(|d| d.index == dev)?
        .pcie_max_link
        .bytes_per_s()
}

/// Who holds a GPU context at this tick, counted under which class (see [`super::gpu_time`]).
fn holders(snap: &Snapshot, verdicts: &[ProcessVerdict]) -> Vec<Holder> {
    let nvml = &snap.nvml;
    // Each GPU's UUID once a tick, shared by every key that names it.
    let unknown: Arc<str> = Arc::from("");
    let uuids: HashMap<u32, Arc<str>> = nvml
        .devices
        .iter()
        .map(|d| (d.index, d.uuid.as_deref().map_or_else(|| unknown.clone(), Arc::from)))
        .collect();
    let uuid = |index: u32| uuids.get(&index).cloned().unwrap_or_else(|| unknown.clone());
    if nvml.procs_round_ns > 0 {
        let class_of: HashMap<u32, Class> = verdicts.iter().map(|v| (v.pid, v.verdict.class)).collect();
        // NVML lists processes: those it lists now, observed or not.
        nvml.procs
            .iter()
            .filter(|(pid, u)| !u.devices_now.is_empty() && (nvml.wants(**pid) || snap.process(**pid).is_some()))
            .filter_map(|(pid, u)| {
                let class = match snap.process(*pid) {
                    // Observed: its window's class (none yet at its first tick).
                    Some(_) => *class_of.get(pid)?,
                    None => Class::Idle,
                };
                Some(Holder {
                    pid: *pid,
                    class,
                    gpus: u.devices_now.iter().map(|d| uuid(*d)).collect(),
                })
            })
            .collect()
    } else {
        // No listing: every live observed process that made a call, on a GPU not known.
        verdicts
            .iter()
            .filter(|v| snap.process(v.pid).is_some_and(|p| !p.exited && p.stats.events > 0))
            .map(|v| Holder {
                pid: v.pid,
                class: v.verdict.class,
                gpus: vec![unknown.clone()],
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{analyze::verdict::Verdict, correlate::Correlator, snapshot::Publisher};

    fn kernels(list: &[(&str, u64, u64)]) -> Sample {
        Sample {
            kernels_top: list.iter().map(|(n, c, ns)| (Arc::from(*n), *c, *ns)).collect(),
            ..Sample::default()
        }
    }

    #[test]
    fn window_top_kernels_are_exact_for_kept_kernels_and_a_lower_bound_for_newcomers() {
        // The first sample kept everything the process had: exact.
        let a = kernels(&[("gemm", 10, 1000), ("add", 100, 500)]);
        let b = kernels(&[("gemm", 30, 5000), ("add", 300, 900), ("new", 1, 50)]);
        let top = top_kernels(&a, &b);
        let got: Vec<(&str, Option<u64>, u64, bool)> =
            top.iter().map(|k| (&*k.name, k.count, k.gpu_ns, k.exact)).collect();
        assert_eq!(
            got,
            [
                ("gemm", Some(20), 4000, true),
                ("add", Some(200), 400, true),
                ("new", Some(1), 50, true)
            ]
        );
        // A full first sample: a kernel not in it had at most its last kept kernel's time.
        let full: Vec<(String, u64, u64)> = (0..KERNELS_KEPT as u64)
            .map(|i| (format!("k{i}"), 1, 100 - i))
            .collect();
        let a = Sample {
            kernels_top: full.iter().map(|(n, c, ns)| (Arc::from(n.as_str()), *c, *ns)).collect(),
            ..Sample::default()
        };
        let b = kernels(&[("late", 50, 10_000), ("k0", 2, 150)]);
        let top = top_kernels(&a, &b);
        let floor = 100 - (KERNELS_KEPT as u64 - 1);
        assert_eq!(
            (&*top[0].name, top[0].count, top[0].gpu_ns, top[0].exact),
            ("late", None, 10_000 - floor, false)
        );
        assert_eq!(
            (&*top[1].name, top[1].count, top[1].gpu_ns, top[1].exact),
            ("k0", Some(1), 50, true)
        );
    }

    #[test]
    fn a_window_counts_its_anomalies_and_names_the_most_severe_and_so_does_the_whole_run() {
        use crate::snapshot::testing::*;
        const S: u64 = 1_000_000_000;
        let (mut corr, mut p) = with_processes(&[10]);
        let mut t = Tracker::new(Default::default());
        // No /proc: CPU times unknown (this test is about the anomalies).
        let procinfo = ProcInfo::new("/nonexistent", "/nonexistent");
        // A finding before the first sample (the first, seq 1): the whole run starts at that
        // sample, without it.
        p.note_anomaly(10, 10, &kernel_finding("early", 9e6, 1e3, 200.0));
        let mut at = |p: &mut Publisher, corr: &mut Correlator, s: u64| {
            corr.observe(&mut sync(10, s * S));
            let snap = publish(p, corr, s * S);
            let v = t.tick(&snap, &procinfo);
            (v.first().map(|v| v.verdict.clone()), t.whole_run(10))
        };
        assert!(at(&mut p, &mut corr, 1).0.is_none(), "one sample: no window");
        for (ts, dev) in [(1_100, 9.0), (1_200, 30.0), (1_300, 12.0)] {
            p.note_anomaly(10, ts, &kernel_finding("gemm", 20_000.0, 2_000.0, dev));
        }
        let (window, whole) = at(&mut p, &mut corr, 2);
        let summary = |v: &Verdict| {
            let w = v.evidence.worst_anomaly.as_ref();
            (v.evidence.anomalies, w.map(|n| (n.seq, n.ts_ns, n.finding.deviation)))
        };
        assert_eq!(summary(&window.unwrap()), (3, Some((3, 1_200, 30.0))));
        assert_eq!(summary(&whole.unwrap()), (3, Some((3, 1_200, 30.0))));
        p.note_anomaly(10, 2_500, &kernel_finding("gemm", 25_000.0, 2_000.0, 20.0));
        let (window, whole) = at(&mut p, &mut corr, 3);
        assert_eq!(summary(&window.unwrap()), (4, Some((3, 1_200, 30.0))));
        assert_eq!(summary(&whole.unwrap()), (4, Some((3, 1_200, 30.0))));
        // 10 s on, the window starts at the sample of second 3: only what came since.
        p.note_anomaly(10, 9_000, &kernel_finding("gemm", 21_000.0, 2_000.0, 10.0));
        p.note_anomaly(10, 9_100, &kernel_finding("gemm", 22_000.0, 2_000.0, 11.0));
        let (window, whole) = at(&mut p, &mut corr, 13);
        let window = window.unwrap();
        assert_eq!(window.evidence.window_ns, 10 * S);
        assert_eq!(summary(&window), (2, Some((7, 9_100, 11.0))));
        assert_eq!(summary(&whole.unwrap()), (6, Some((3, 1_200, 30.0))));
        // Anomalies are evidence only: the class is what it would be without them.
        let mut without = window.evidence.clone();
        without.anomalies = 0;
        without.worst_anomaly = None;
        assert_eq!(classify(without).class, window.class);
        // A window without findings says none.
        let (window, _) = at(&mut p, &mut corr, 23);
        assert_eq!(summary(&window.unwrap()), (0, None));
    }

    #[test]
    fn a_thread_counts_only_cpu_time_read_inside_the_window() {
        let at = |at_ns, threads: &[(u32, u64)]| Sample {
            at_ns,
            threads: threads.to_vec(),
            ..Sample::default()
        };
        let a = at(1_000, &[(10, 500)]);
        let b = at(2_000, &[(10, 1_300), (11, 5_000), (12, 9_000)]);
        // 11 was first read inside the window (at 1 500, with 4 600 ns): 400 ns count; 12 was
        // read before the window but not by `a`: its 9 000 ns are not the window's.
        let first: HashMap<u32, (u64, u64)> = [(10, (0, 0)), (11, (1_500, 4_600)), (12, (500, 100))].into();
        assert_eq!(between(&a, &b, &first, None).launch_thread_cpu_ns, 800);
        let only_new = at(2_000, &[(11, 5_000), (12, 9_000)]);
        assert_eq!(between(&a, &only_new, &first, None).launch_thread_cpu_ns, 400);
    }

    #[test]
    fn a_host_paced_process_is_scaled_by_its_captured_time_less_the_probes() {
        const S: u64 = 1_000_000_000;
        // 10 s; 1 000 launches seen in 1 s captured, of which the probes took 0.2 s of the
        // busiest launching thread.
        let sample = |at_ns, threads: &[(u32, u64)], launches, busy_pct: f64| Sample {
            at_ns,
            threads: threads.to_vec(),
            launches,
            nvml_device: (busy_pct, u64::from(at_ns > 0)),
            ..Sample::default()
        };
        let captured = Captured {
            ns: S,
            probe_ns: Some(S / 5),
            windows: 1,
            spread: None,
        };
        let first: HashMap<u32, (u64, u64)> = [(10, (0, 0)), (11, (0, 0))].into();
        let a = sample(0, &[(10, 0), (11, 0)], 0, 0.0);
        let judge = |threads: &[(u32, u64)], busy| {
            let e = between(&a, &sample(10 * S, threads, 1_000, busy), &first, Some(captured));
            (e.launches, e.probe_corrected, e.probe_share)
        };
        // The step passes between two threads, 5 s and 4 s: together 90 % of the window, the
        // GPU 30 % busy: host-paced, the launches scaled by 10 s / 0.8 s.
        assert_eq!(judge(&[(10, 5 * S), (11, 4 * S)], 30.0), (12_500, true, Some(0.2)));
        // 70 % together: the host waits too; scaled by the captured time alone.
        assert_eq!(judge(&[(10, 4 * S), (11, 3 * S)], 30.0), (10_000, false, Some(0.2)));
        // The GPU 80 % busy paces it.
        assert_eq!(judge(&[(10, 5 * S), (11, 4 * S)], 80.0), (10_000, false, Some(0.2)));
    }
}
