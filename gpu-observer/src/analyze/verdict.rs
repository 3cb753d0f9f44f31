//! The bottleneck verdict: which class a process's window falls in, decided by rules over named
//! constants kept in one table ([`RULES`]), each with the numbers that decided it.
//!
//! The rules are tried in the table's order; the first that holds is the primary class, the
//! next that holds the secondary. A window in which no rule holds is `mixed` (no single
//! bottleneck: its evidence is still reported).

use std::sync::Arc;

use gpu_observer_common::api::Direction;

use super::findings::Noted;
use crate::correlate::Amount;

/// A bottleneck class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    /// No CUDA work in the window.
    Idle,
    /// The GPU is busy most of the window: the kernels are the limit.
    GpuBound,
    /// The GPU idles between short kernels while the launching thread is saturated.
    LaunchBound,
    /// Frequent host synchronizations serialize the CPU and the GPU.
    SyncBound,
    /// Copies take most of the window.
    TransferBound,
    /// The GPU is starved while the process does something else (CPU work, or waiting).
    HostBound,
    /// No rule holds: no single bottleneck.
    Mixed,
}

impl Class {
    pub const fn name(self) -> &'static str {
        match self {
            Class::Idle => "idle",
            Class::GpuBound => "gpu_bound",
            Class::LaunchBound => "launch_bound",
            Class::SyncBound => "sync_bound",
            Class::TransferBound => "transfer_bound",
            Class::HostBound => "host_bound",
            Class::Mixed => "mixed",
        }
    }

    /// What to try.
    pub const fn hint(self) -> &'static str {
        match self {
            Class::Idle => "no CUDA work in the window",
            Class::GpuBound => "the kernels are the limit: optimize the top kernels by GPU time",
            Class::LaunchBound => {
                "one thread cannot issue work fast enough for short kernels: CUDA graphs, kernel fusion, torch.compile"
            }
            Class::SyncBound => "remove host synchronizations from the loop (.item(), .cpu(), cudaDeviceSynchronize)",
            Class::TransferBound => "pinned host memory, fewer or larger copies, overlap copies with compute",
            Class::HostBound => "the GPU waits for the CPU: speed up or overlap the host work (data loading, Python)",
            Class::Mixed => "no single bottleneck",
        }
    }
}

/// Where the GPU busy time comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BusySource {
    /// Not known (no CUPTI, no NVML sample of the process in the window).
    #[default]
    None,
    /// CUPTI: the union of the process's kernel, copy and memset intervals (exact).
    Cupti,
    /// NVML: the mean of the process's SM utilization samples (NVML's own sampling).
    Nvml,
    /// NVML: the mean utilization of the GPUs the process had to itself (the fraction of time a
    /// kernel ran, sampled every NVML round).
    NvmlDevice,
}

impl BusySource {
    pub const fn name(self) -> Option<&'static str> {
        match self {
            BusySource::None => None,
            BusySource::Cupti => Some("cupti"),
            BusySource::Nvml => Some("nvml"),
            BusySource::NvmlDevice => Some("nvml_device"),
        }
    }
}

/// What the host side of a starved GPU was doing: running on a CPU, or waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host {
    /// The process ran at least [`limits::HOST_CPU_BUSY`] of the window on CPUs.
    CpuBusy,
    /// It did not: it waited (I/O, sleep, locks, another process).
    Waiting,
}

impl Host {
    pub const fn name(self) -> &'static str {
        match self {
            Host::CpuBusy => "cpu_busy",
            Host::Waiting => "waiting",
        }
    }
}

/// A kernel's GPU time in the window.
#[derive(Clone, Debug, PartialEq)]
pub struct TopKernel {
    pub name: Arc<str>,
    /// Runs in the window (`None` when not known: see `exact`).
    pub count: Option<u64>,
    pub gpu_ns: u64,
    /// `false`: `gpu_ns` is a lower bound (the kernel was not among the few whose time the
    /// window's first sample kept).
    pub exact: bool,
}

/// What a process did in one window. Fractions are of the window's wall time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Evidence {
    pub window_ns: u64,
    /// CUDA calls of any kind (launches included).
    pub calls: u64,
    pub launches: u64,
    /// The fraction of the window the process's work ran on its GPUs (0 to 1), when known,
    /// and from where.
    pub gpu_busy: Option<f64>,
    pub busy_source: BusySource,
    /// Kernels that ran, and their summed GPU time (for the mean kernel time).
    pub kernels: u64,
    pub kernel_ns: u64,
    /// The kernels with the most GPU time in the window, most first (CUPTI only).
    pub top_kernels: Vec<TopKernel>,
    /// CPU time of the busiest thread that launched work, and of the whole process.
    pub launch_thread_cpu_ns: u64,
    pub process_cpu_ns: u64,
    pub syncs: u64,
    /// Time blocked in syncs, summed over threads.
    pub sync_ns: u64,
    /// Copy calls by direction (indexed like [`Direction::REPORTED`]): count, bytes, and the
    /// time in the calls summed over threads.
    pub copies: [Amount; 4],
    /// Copies whose host end was pinned, or pageable (when it was known).
    pub pinned_copies: u64,
    pub pageable_copies: u64,
    /// The theoretical data rate, bytes/s each way, of the PCIe link of the process's GPU
    /// (NVML's maximum generation × width), when known.
    pub link_bytes_per_s: Option<f64>,
    /// Anomalies the detector flagged in the window (analyze/anomaly.rs), and the most severe
    /// of them (the largest deviation). Evidence only: no rule reads them, the class is the
    /// same with or without.
    pub anomalies: u64,
    pub worst_anomaly: Option<Noted>,
    /// Fleet mode: the share of the window the capture windows covered; the counts of
    /// launches, calls, syncs and copies above are then estimates scaled from them
    /// (analyze/estimate.rs). `None`: captured all the time, exact.
    pub capture_fraction: Option<f64>,
    /// With `capture_fraction`: the relative error of those rates at 95 %.
    pub estimate_error: Option<f64>,
    /// With `capture_fraction`: the share of the busiest launching thread's captured time
    /// the probes themselves took (measured; `None` when not).
    pub probe_share: Option<f64>,
    /// The estimates were scaled by the captured time less the probes' share: the process
    /// is host-paced ([`host_paced`]), so the probes slowed it while captured.
    pub probe_corrected: bool,
    /// Records of the process the ring buffer had no room for in the window: the evidence is
    /// partial (the counts are low by at least that much).
    pub dropped: u64,
}

impl Evidence {
    /// `ns` as a fraction of the window.
    pub fn frac(&self, ns: u64) -> f64 {
        ns as f64 / self.window_ns.max(1) as f64
    }

    /// GPU busy fraction (`None` when unknown: the rules that need it do not hold).
    pub fn gpu_busy(&self) -> Option<f64> {
        self.gpu_busy
    }

    pub fn per_s(&self, n: u64) -> f64 {
        n as f64 * 1e9 / self.window_ns.max(1) as f64
    }

    /// Mean GPU time of a kernel, and mean time between launches, in ns.
    pub fn mean_kernel_ns(&self) -> Option<f64> {
        (self.kernels > 0).then(|| self.kernel_ns as f64 / self.kernels as f64)
    }

    /// GPU busy time per launch: the mean kernel time's stand-in without CUPTI (it also counts
    /// copies and overlapping kernels once).
    pub fn busy_ns_per_launch(&self) -> Option<f64> {
        let busy = self.gpu_busy? * self.window_ns as f64;
        (self.launches > 0).then(|| busy / self.launches as f64)
    }

    /// The kernel time the launch rule compares with the launch interval: CUPTI's mean kernel
    /// time, else the busy time per launch.
    pub fn kernel_time_ns(&self) -> Option<f64> {
        self.mean_kernel_ns().or_else(|| self.busy_ns_per_launch())
    }

    pub fn mean_launch_interval_ns(&self) -> Option<f64> {
        (self.launches > 0).then(|| self.window_ns as f64 / self.launches as f64)
    }

    /// Time in copy calls, every direction.
    pub fn copy_ns(&self) -> u64 {
        self.copies.iter().fold(0u64, |t, a| t.saturating_add(a.ns))
    }

    /// The rate a direction's copies achieved while in the call, bytes/s (decimal units, as
    /// link rates are quoted).
    pub fn copy_bytes_per_s(&self, d: Direction) -> Option<f64> {
        let a = self.copies[d.index()];
        (a.ns > 0).then(|| a.bytes as f64 * 1e9 / a.ns as f64)
    }

    /// Pageable copies among those whose host end was known.
    pub fn pageable_share(&self) -> Option<f64> {
        let known = self.pinned_copies + self.pageable_copies;
        (known > 0).then(|| self.pageable_copies as f64 / known as f64)
    }

    /// Whether the host ran or waited (see [`Host`]).
    pub fn host(&self) -> Host {
        if self.frac(self.process_cpu_ns) >= limits::HOST_CPU_BUSY {
            Host::CpuBusy
        } else {
            Host::Waiting
        }
    }
}

/// The thresholds, one table (docs/DESIGN.md mirrors it). Fractions of the window.
pub mod limits {
    /// `gpu_bound`: the GPU busy at least this.
    pub const GPU_BOUND_BUSY: f64 = 0.70;
    /// `launch_bound`: the GPU busy less than this ...
    pub const LAUNCH_BOUND_BUSY_BELOW: f64 = 0.50;
    /// ... while the busiest launching thread runs at least this much of the window ...
    pub const LAUNCH_BOUND_THREAD_CPU: f64 = 0.80;
    /// `sync_bound`: at least this many syncs a second ...
    pub const SYNC_BOUND_PER_S: f64 = 100.0;
    /// ... blocking at least this fraction (summed over threads) ...
    pub const SYNC_BOUND_BLOCKED: f64 = 0.30;
    /// ... while the GPU is busy less than this.
    pub const SYNC_BOUND_BUSY_BELOW: f64 = 0.50;
    /// `transfer_bound`: copy calls take at least this fraction.
    pub const TRANSFER_BOUND_COPY: f64 = 0.50;
    /// `host_bound`: the GPU busy less than this.
    pub const HOST_BOUND_BUSY_BELOW: f64 = 0.30;
    /// The host counts as CPU-busy (not waiting) when the process ran at least this fraction
    /// of the window on CPUs, summed over its threads: half a core.
    pub const HOST_CPU_BUSY: f64 = 0.50;
}

/// Whether the host paces the work, so that time the probes add to the launching thread
/// is added to the work's (fleet mode's estimates take it out, analyze/estimate.rs): the
/// GPU, measured, is not the bottleneck (below `GPU_BOUND_BUSY`) and the launching threads
/// together are saturated (`LAUNCH_BOUND_THREAD_CPU` of the window, `threads_share`: their
/// CPU time summed, since a step may pass from one launching thread to another and keep
/// neither busy alone). When the GPU paces it, the probes' time comes out of the waiting.
pub fn host_paced(gpu_busy: Option<f64>, threads_share: f64) -> bool {
    gpu_busy.is_some_and(|b| b < limits::GPU_BOUND_BUSY) && threads_share >= limits::LAUNCH_BOUND_THREAD_CPU
}

/// A rule: its class and whether it holds for the evidence.
pub struct Rule {
    pub class: Class,
    pub holds: fn(&Evidence) -> bool,
}

/// The classes in the order they are tried.
pub const RULES: [Rule; 5] = [
    Rule {
        class: Class::TransferBound,
        holds: |e| e.frac(e.copy_ns()) >= limits::TRANSFER_BOUND_COPY,
    },
    Rule {
        class: Class::GpuBound,
        holds: |e| e.gpu_busy().is_some_and(|b| b >= limits::GPU_BOUND_BUSY),
    },
    Rule {
        class: Class::SyncBound,
        holds: |e| {
            e.per_s(e.syncs) >= limits::SYNC_BOUND_PER_S
                && e.frac(e.sync_ns) >= limits::SYNC_BOUND_BLOCKED
                && e.gpu_busy().is_some_and(|b| b < limits::SYNC_BOUND_BUSY_BELOW)
        },
    },
    Rule {
        class: Class::LaunchBound,
        holds: |e| {
            e.gpu_busy().is_some_and(|b| b < limits::LAUNCH_BOUND_BUSY_BELOW)
                && e.frac(e.launch_thread_cpu_ns) >= limits::LAUNCH_BOUND_THREAD_CPU
                && matches!((e.kernel_time_ns(), e.mean_launch_interval_ns()), (Some(k), Some(i)) if k < i)
        },
    },
    Rule {
        class: Class::HostBound,
        holds: |e| e.gpu_busy().is_some_and(|b| b < limits::HOST_BOUND_BUSY_BELOW),
    },
];

/// A window's verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub class: Class,
    pub secondary: Option<Class>,
    pub evidence: Evidence,
}

impl Verdict {
    /// One line for a person: the class, the numbers that decided it, what to try.
    pub fn describe(&self) -> String {
        let e = &self.evidence;
        let mut parts = Vec::new();
        match (e.gpu_busy(), e.busy_source.name()) {
            (Some(b), Some(from)) => parts.push(format!("GPU busy {:.1}% ({from})", b * 100.0)),
            _ => parts.push("GPU busy unknown (neither CUPTI nor an NVML sample)".to_string()),
        }
        if e.launches > 0 {
            parts.push(format!("{:.0} launches/s", e.per_s(e.launches)));
        }
        if let (Some(k), Some(i)) = (e.kernel_time_ns(), e.mean_launch_interval_ns()) {
            let what = if e.kernels > 0 {
                "kernels"
            } else {
                "GPU busy per launch"
            };
            parts.push(format!(
                "{what} {:.1} µs vs {:.1} µs between launches",
                k / 1e3,
                i / 1e3
            ));
        }
        if e.launch_thread_cpu_ns > 0 {
            parts.push(format!(
                "launching thread {:.0}% CPU",
                e.frac(e.launch_thread_cpu_ns) * 100.0
            ));
        }
        if e.syncs > 0 {
            parts.push(format!(
                "{:.0} syncs/s, {:.0}% blocked",
                e.per_s(e.syncs),
                e.frac(e.sync_ns) * 100.0
            ));
        }
        // Copies below 1 % of the window are noise beside the rest, unless they decided it.
        let copies_matter = e.frac(e.copy_ns()) >= 0.01
            || self.class == Class::TransferBound
            || self.secondary == Some(Class::TransferBound);
        if e.copy_ns() > 0 && copies_matter {
            let mut c = format!("copies {:.0}%", e.frac(e.copy_ns()) * 100.0);
            for (d, arrow) in [(Direction::CpuToGpu, "H→D"), (Direction::GpuToCpu, "D→H")] {
                if let Some(r) = e.copy_bytes_per_s(d) {
                    c.push_str(&format!(" {arrow} {:.1} GB/s", r / 1e9));
                }
            }
            if let Some(link) = e.link_bytes_per_s {
                c.push_str(&format!(" of a {:.1} GB/s link", link / 1e9));
            }
            if let Some(p) = e.pageable_share() {
                c.push_str(&format!(", {:.0}% pageable", p * 100.0));
            }
            parts.push(c);
        }
        if let Some(k) = e.top_kernels.first()
            && e.kernel_ns > 0
        {
            parts.push(format!(
                "top kernel {} ({:.0}% of kernel time)",
                short(&k.name, 48),
                k.gpu_ns as f64 * 100.0 / e.kernel_ns as f64
            ));
        }
        if matches!(self.class, Class::HostBound) || matches!(self.secondary, Some(Class::HostBound)) {
            parts.push(format!(
                "{:.0} calls/s, host {} (process {:.0}% CPU)",
                e.per_s(e.calls),
                e.host().name(),
                e.frac(e.process_cpu_ns) * 100.0
            ));
        }
        if let (Some(f), Some(err)) = (e.capture_fraction, e.estimate_error) {
            parts.push(format!(
                "estimated from {:.0}% of the time (±{:.0}%)",
                f * 100.0,
                err * 100.0
            ));
            if let (Some(p), true) = (e.probe_share, e.probe_corrected) {
                parts.push(format!(
                    "corrected for the probes' {:.0}% of the launching thread",
                    p * 100.0
                ));
            }
        }
        if e.dropped > 0 {
            parts.push(format!("evidence partial: {} records dropped", e.dropped));
        }
        let second = self
            .secondary
            .map(|s| format!(" (then {})", s.name()))
            .unwrap_or_default();
        format!(
            "{}{second} over {:.1} s: {} — {}",
            self.class.name(),
            e.window_ns as f64 / 1e9,
            parts.join(", "),
            self.class.hint()
        )
    }
}

/// At most `max` characters of a name, with an ellipsis when cut.
fn short(name: &str, max: usize) -> String {
    match name.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &name[..at]),
        None => name.to_string(),
    }
}

/// Classifies one window.
pub fn classify(e: Evidence) -> Verdict {
    if e.calls == 0 {
        return Verdict {
            class: Class::Idle,
            secondary: None,
            evidence: e,
        };
    }
    let mut held = RULES.iter().filter(|r| (r.holds)(&e)).map(|r| r.class);
    let (class, secondary) = (held.next().unwrap_or(Class::Mixed), held.next());
    Verdict {
        class,
        secondary,
        evidence: e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    /// A window of 1 s with some calls and the GPU busy `busy` of it.
    fn busy(busy: f64) -> Evidence {
        Evidence {
            window_ns: S,
            calls: 10,
            gpu_busy: Some(busy),
            busy_source: BusySource::Cupti,
            ..Evidence::default()
        }
    }

    fn class(e: Evidence) -> Class {
        classify(e).class
    }

    /// Copies from the host taking `ns` of the window, split over both directions.
    fn copying(ns: u64) -> [Amount; 4] {
        let mut c = [Amount::default(); 4];
        c[Direction::CpuToGpu.index()] = Amount {
            count: 1,
            bytes: 1 << 30,
            ns: ns / 2,
        };
        c[Direction::GpuToCpu.index()] = Amount {
            count: 1,
            bytes: 1 << 29,
            ns: ns - ns / 2,
        };
        c
    }

    #[test]
    fn a_starved_gpu_says_whether_the_host_ran_or_waited_from_half_a_core() {
        let at = |cpu: u64| {
            classify(Evidence {
                process_cpu_ns: cpu,
                ..busy(0.1)
            })
        };
        let (ran, waited) = (at(S / 2), at(S / 2 - 1));
        assert_eq!((ran.class, ran.evidence.host()), (Class::HostBound, Host::CpuBusy));
        assert_eq!(
            (waited.class, waited.evidence.host()),
            (Class::HostBound, Host::Waiting)
        );
        assert!(
            ran.describe().contains("host cpu_busy (process 50% CPU)"),
            "{}",
            ran.describe()
        );
        assert!(waited.describe().contains("host waiting"), "{}", waited.describe());
    }

    #[test]
    fn transfer_evidence_has_the_rate_each_way_against_the_link_and_the_pageable_share() {
        let v = classify(Evidence {
            copies: copying(S),
            pinned_copies: 1,
            pageable_copies: 3,
            link_bytes_per_s: Some(63.0e9),
            ..busy(0.1)
        });
        let e = &v.evidence;
        assert_eq!(v.class, Class::TransferBound);
        // 2^30 bytes in 0.5 s, 2^29 in 0.5 s.
        assert_eq!(e.copy_bytes_per_s(Direction::CpuToGpu), Some(2.0 * (1u64 << 30) as f64));
        assert_eq!(e.copy_bytes_per_s(Direction::GpuToCpu), Some(2.0 * (1u64 << 29) as f64));
        assert_eq!(e.copy_bytes_per_s(Direction::GpuToGpu), None);
        assert_eq!(e.pageable_share(), Some(0.75));
        assert_eq!(
            v.describe().split(" — ").next().unwrap(),
            "transfer_bound (then host_bound) over 1.0 s: GPU busy 10.0% (cupti), copies 100% H→D 2.1 GB/s D→H 1.1 GB/s of a 63.0 GB/s link, 75% pageable, 10 calls/s, host waiting (process 0% CPU)"
        );
    }

    #[test]
    fn gpu_bound_names_its_top_kernel_and_its_share_of_kernel_time() {
        let v = classify(Evidence {
            kernels: 10,
            kernel_ns: S * 8 / 10,
            top_kernels: vec![TopKernel {
                name: Arc::from("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64"),
                count: Some(10),
                gpu_ns: S * 6 / 10,
                exact: true,
            }],
            ..busy(0.8)
        });
        assert_eq!(v.class, Class::GpuBound);
        assert!(
            v.describe()
                .contains("top kernel sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesiz… (75% of kernel time)"),
            "{}",
            v.describe()
        );
    }

    #[test]
    fn no_calls_is_idle_whatever_else() {
        assert_eq!(class(Evidence { calls: 0, ..busy(0.9) }), Class::Idle);
        assert_eq!(class(Evidence { calls: 1, ..busy(0.9) }), Class::GpuBound);
    }

    #[test]
    fn gpu_bound_starts_at_exactly_70_percent_busy() {
        assert_eq!(class(busy(0.70)), Class::GpuBound);
        assert_eq!(class(busy(0.699)), Class::Mixed);
    }

    #[test]
    fn host_bound_is_below_30_percent_busy() {
        assert_eq!(class(busy(0.299)), Class::HostBound);
        assert_eq!(class(busy(0.30)), Class::Mixed);
        // Without a GPU busy signal no GPU rule can hold.
        assert_eq!(
            class(Evidence {
                gpu_busy: None,
                ..busy(0.0)
            }),
            Class::Mixed
        );
    }

    #[test]
    fn transfer_bound_starts_at_half_the_window_in_copies_and_comes_first() {
        let e = Evidence {
            copies: copying(S / 2),
            ..busy(0.9)
        };
        let v = classify(e);
        assert_eq!((v.class, v.secondary), (Class::TransferBound, Some(Class::GpuBound)));
        assert_eq!(
            class(Evidence {
                copies: copying(S / 2 - 1),
                ..busy(0.5)
            }),
            Class::Mixed
        );
    }

    /// 16 000 launches/s of 4 µs kernels from one thread at 100 % CPU, GPU 6.4 % busy: the
    /// H100 PyTorch case of the issue.
    fn launch_loop() -> Evidence {
        Evidence {
            launches: 16_000,
            kernels: 16_000,
            kernel_ns: 16_000 * 4_000,
            launch_thread_cpu_ns: S,
            ..busy(0.064)
        }
    }

    #[test]
    fn launch_bound_needs_a_saturated_thread_and_kernels_shorter_than_the_launch_gap() {
        let v = classify(launch_loop());
        assert_eq!((v.class, v.secondary), (Class::LaunchBound, Some(Class::HostBound)));
        // The thread at exactly 80 %: still launch-bound; just under: not.
        let at = Evidence {
            launch_thread_cpu_ns: S * 8 / 10,
            ..launch_loop()
        };
        assert_eq!(class(at), Class::LaunchBound);
        let under = Evidence {
            launch_thread_cpu_ns: S * 8 / 10 - 1,
            ..launch_loop()
        };
        assert_eq!(class(under), Class::HostBound);
        // Kernels as long as the gap between launches: not launch-bound.
        let long = Evidence {
            kernel_ns: 16_000 * 62_500,
            ..launch_loop()
        };
        assert_eq!(class(long), Class::HostBound);
        // Busy at exactly 50 %: not launch-bound (and not host-bound either).
        let half = Evidence {
            gpu_busy: Some(0.5),
            ..launch_loop()
        };
        assert_eq!(class(half), Class::Mixed);
    }

    #[test]
    fn without_cupti_kernels_the_launch_rule_compares_busy_time_per_launch() {
        let nvml = Evidence {
            kernels: 0,
            kernel_ns: 0,
            busy_source: BusySource::Nvml,
            ..launch_loop()
        };
        assert_eq!(nvml.busy_ns_per_launch(), Some(4_000.0));
        let v = classify(nvml);
        assert_eq!(v.class, Class::LaunchBound);
        assert!(
            v.describe()
                .contains("GPU busy per launch 4.0 µs vs 62.5 µs between launches"),
            "{}",
            v.describe()
        );
        // No busy signal at all: the rule cannot hold.
        let blind = Evidence {
            kernels: 0,
            gpu_busy: None,
            ..launch_loop()
        };
        assert_eq!(class(blind), Class::Mixed);
    }

    #[test]
    fn sync_bound_needs_frequent_blocking_syncs_on_an_underused_gpu() {
        let e = Evidence {
            syncs: 100,
            sync_ns: S * 3 / 10,
            ..busy(0.4)
        };
        assert_eq!(class(e.clone()), Class::SyncBound);
        assert_eq!(class(Evidence { syncs: 99, ..e.clone() }), Class::Mixed);
        assert_eq!(
            class(Evidence {
                sync_ns: S * 3 / 10 - 1,
                ..e.clone()
            }),
            Class::Mixed
        );
        assert_eq!(
            class(Evidence {
                gpu_busy: Some(0.5),
                ..e
            }),
            Class::Mixed
        );
    }

    #[test]
    fn every_class_has_a_distinct_name_and_a_hint() {
        let all = [
            Class::Idle,
            Class::GpuBound,
            Class::LaunchBound,
            Class::SyncBound,
            Class::TransferBound,
            Class::HostBound,
            Class::Mixed,
        ];
        let mut names: Vec<&str> = all.iter().map(|c| c.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
        assert!(all.iter().all(|c| !c.hint().is_empty()));
    }
}
