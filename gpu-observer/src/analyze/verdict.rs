//! The bottleneck verdict: which class a process's window falls in, decided by rules over named
//! constants kept in one table ([`RULES`]), each with the numbers that decided it.
//!
//! The rules are tried in the table's order; the first that holds is the primary class, the
//! next that holds the secondary. A window in which no rule holds is `mixed` (no single
//! bottleneck: its evidence is still reported).

/// A bottleneck class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

impl BusySource {
    pub const fn name(self) -> Option<&'static str> {
        match self {
            BusySource::None => None,
            BusySource::Cupti => Some("cupti"),
            BusySource::Nvml => Some("nvml"),
        }
    }
}

/// What a process did in one window. Fractions are of the window's wall time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Evidence {
    pub window_ns: u64,
    /// CUDA calls of any kind (launches included).
    pub calls: u64,
    pub launches: u64,
    /// Time the process's work ran on its GPUs, when known, and from where.
    pub gpu_busy_ns: Option<u64>,
    pub busy_source: BusySource,
    /// Kernels that ran, and their summed GPU time (for the mean kernel time).
    pub kernels: u64,
    pub kernel_ns: u64,
    /// CPU time of the busiest thread that launched work, and of the whole process.
    pub launch_thread_cpu_ns: u64,
    pub process_cpu_ns: u64,
    pub syncs: u64,
    /// Time blocked in syncs, summed over threads.
    pub sync_ns: u64,
    /// Time in copy calls, summed over threads.
    pub copy_ns: u64,
}

impl Evidence {
    /// `ns` as a fraction of the window.
    pub fn frac(&self, ns: u64) -> f64 {
        ns as f64 / self.window_ns.max(1) as f64
    }

    /// GPU busy fraction (0 when unknown: the rules that need it do not hold).
    pub fn gpu_busy(&self) -> Option<f64> {
        self.gpu_busy_ns.map(|b| self.frac(b).min(1.0))
    }

    pub fn per_s(&self, n: u64) -> f64 {
        n as f64 * 1e9 / self.window_ns.max(1) as f64
    }

    /// Mean GPU time of a kernel, and mean time between launches, in ns.
    pub fn mean_kernel_ns(&self) -> Option<f64> {
        (self.kernels > 0).then(|| self.kernel_ns as f64 / self.kernels as f64)
    }

    pub fn mean_launch_interval_ns(&self) -> Option<f64> {
        (self.launches > 0).then(|| self.window_ns as f64 / self.launches as f64)
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
        holds: |e| e.frac(e.copy_ns) >= limits::TRANSFER_BOUND_COPY,
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
                && matches!((e.mean_kernel_ns(), e.mean_launch_interval_ns()), (Some(k), Some(i)) if k < i)
        },
    },
    Rule {
        class: Class::HostBound,
        holds: |e| e.gpu_busy().is_some_and(|b| b < limits::HOST_BOUND_BUSY_BELOW),
    },
];

/// A window's verdict.
#[derive(Clone, Copy, Debug, PartialEq)]
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
        if let (Some(k), Some(i)) = (e.mean_kernel_ns(), e.mean_launch_interval_ns()) {
            parts.push(format!(
                "kernels {:.1} µs vs {:.1} µs between launches",
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
        if e.copy_ns > 0 {
            parts.push(format!("copies {:.0}%", e.frac(e.copy_ns) * 100.0));
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

/// Classifies one window.
pub fn classify(e: &Evidence) -> Verdict {
    if e.calls == 0 {
        return Verdict {
            class: Class::Idle,
            secondary: None,
            evidence: *e,
        };
    }
    let mut held = RULES.iter().filter(|r| (r.holds)(e)).map(|r| r.class);
    Verdict {
        class: held.next().unwrap_or(Class::Mixed),
        secondary: held.next(),
        evidence: *e,
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
            gpu_busy_ns: Some((busy * S as f64) as u64),
            ..Evidence::default()
        }
    }

    fn class(e: Evidence) -> Class {
        classify(&e).class
    }

    #[test]
    fn no_calls_is_idle_whatever_else() {
        assert_eq!(class(Evidence { calls: 0, ..busy(0.9) }), Class::Idle);
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
                gpu_busy_ns: None,
                ..busy(0.0)
            }),
            Class::Mixed
        );
    }

    #[test]
    fn transfer_bound_starts_at_half_the_window_in_copies_and_comes_first() {
        let e = Evidence {
            copy_ns: S / 2,
            ..busy(0.9)
        };
        let v = classify(&e);
        assert_eq!((v.class, v.secondary), (Class::TransferBound, Some(Class::GpuBound)));
        assert_eq!(
            class(Evidence {
                copy_ns: S / 2 - 1,
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
        let v = classify(&launch_loop());
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
            gpu_busy_ns: Some(S / 2),
            ..launch_loop()
        };
        assert_eq!(class(half), Class::Mixed);
    }

    #[test]
    fn sync_bound_needs_frequent_blocking_syncs_on_an_underused_gpu() {
        let e = Evidence {
            syncs: 100,
            sync_ns: S * 3 / 10,
            ..busy(0.4)
        };
        assert_eq!(class(e), Class::SyncBound);
        assert_eq!(class(Evidence { syncs: 99, ..e }), Class::Mixed);
        assert_eq!(
            class(Evidence {
                sync_ns: S * 3 / 10 - 1,
                ..e
            }),
            Class::Mixed
        );
        assert_eq!(
            class(Evidence {
                gpu_busy_ns: Some(S / 2),
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
