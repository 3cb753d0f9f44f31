//! The terminal view: a per-process table refreshed every second, and the final summary.

use std::{collections::HashMap, fmt::Write as _, sync::Arc};

use gpu_observer_common::{
    api::Direction,
    cupti::{CuptiState, NvtxState},
};

use super::text::{Printable, printable, printable_cut};
use crate::{
    analyze::{
        anomaly::{Finding, Mode, What},
        findings::Noted,
        verdict::Verdict,
        window::ProcessVerdict,
    },
    attach::Drops,
    correlate::Stats,
    nvml::{ProcUse, State, View},
    snapshot::{GpuView, ProcessView, Snapshot},
};

const MIB: f64 = 1024.0 * 1024.0;
/// The latest anomalies shown under the live table (of every live process, newest first).
const ANOMALIES_SHOWN: usize = 3;
/// Characters of a kernel name shown in an anomaly line (names come from observed programs).
const ANOMALY_NAME_CHARS: usize = 80;

/// Keeps the previous counters so each refresh shows rates over the last interval.
#[derive(Default)]
pub struct LiveView {
    prev: HashMap<u32, Arc<ProcessView>>,
    /// (kernels, kernel GPU ns) at the previous refresh, per process with CUPTI.
    prev_gpu: HashMap<u32, (u64, u64)>,
    /// When the previous refresh's snapshot was taken (CLOCK_MONOTONIC ns; 0: none yet).
    prev_taken_ns: u64,
}

pub(crate) fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1024.0 * MIB {
        format!("{:.1} GiB", b / (1024.0 * MIB))
    } else if b >= MIB {
        format!("{:.1} MiB", b / MIB)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

impl LiveView {
    /// Renders the table: rates over the time between this snapshot and the previous one's
    /// (`interval_s` for the first).
    pub fn render(
        &mut self,
        snap: &Snapshot,
        drops: &Drops,
        verdicts: &HashMap<u32, ProcessVerdict>,
        mut interval_s: f64,
        elapsed_s: f64,
    ) -> String {
        if self.prev_taken_ns != 0 && snap.taken_ns > self.prev_taken_ns {
            interval_s = (snap.taken_ns - self.prev_taken_ns) as f64 / 1e9;
        }
        self.prev_taken_ns = snap.taken_ns;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "gpu-observer — {:.0} s, {} events, {} dropped{}",
            elapsed_s,
            snap.events,
            drops.total,
            if drops.total > 0 {
                "  (ring buffer full: raise --ring-buffer-size)"
            } else {
                ""
            }
        );
        for line in evicted_lines(snap) {
            let _ = writeln!(out, "{line}");
        }
        let gpus = &*snap.nvml;
        devices_now(&mut out, gpus);
        let _ = writeln!(
            out,
            "{:>8} {:<16} {:>10} {:>22} {:>22} {:>14} {:>10} {:>16} {:>6}",
            "PID",
            "COMM",
            "LAUNCH/s",
            "H→D (n, MB/s)",
            "D→H (n, MB/s)",
            "D→D/other n/s",
            "SYNC %",
            "IOCTL n/s, ms",
            "ANOM"
        );
        let mut next = HashMap::new();
        let mut next_gpu = HashMap::new();
        let zero = Stats::default();
        for p in &snap.procs {
            if p.exited {
                continue;
            }
            let now = &p.stats;
            let before = self.prev.get(&p.pid).map_or(&zero, |v| &v.stats);
            let rate = |n: u64| n as f64 / interval_s;
            let dir = |d: Direction| {
                let (a, b) = (now.copy(d), before.copy(d));
                (a.count - b.count, (a.bytes - b.bytes) as f64 / MIB / interval_s)
            };
            let (h2d_n, h2d_mb) = dir(Direction::CpuToGpu);
            let (d2h_n, d2h_mb) = dir(Direction::GpuToCpu);
            let other = (now.copy(Direction::GpuToGpu).count + now.copy(Direction::Unknown).count)
                - (before.copy(Direction::GpuToGpu).count + before.copy(Direction::Unknown).count);
            let sync_pct = (now.syncs.ns - before.syncs.ns) as f64 / (interval_s * 1e9) * 100.0;
            let _ = writeln!(
                out,
                "{:>8} {:<16} {:>10.0} {:>10.0} {:>11.1} {:>10.0} {:>11.1} {:>14.0} {:>9.1}% {:>8.0} {:>7.2} {:>6}",
                p.pid,
                Printable(&p.comm),
                rate(now.launches - before.launches),
                rate(h2d_n),
                h2d_mb,
                rate(d2h_n),
                d2h_mb,
                rate(other),
                sync_pct,
                rate(now.ioctls.count - before.ioctls.count),
                (now.ioctls.ns - before.ioctls.ns) as f64 / 1e6,
                anomaly_mark(p.anomaly_count())
            );
            next.insert(p.pid, p.clone());
            if let Some(v) = verdicts.get(&p.pid) {
                let _ = writeln!(out, "{:>8} {:<16} {}", "", "", printable(&v.verdict.describe()));
            }
            if let Some(u) = gpus.procs.get(&p.pid) {
                let _ = writeln!(out, "{:>8} {:<16} NVML: {}", "", "", process_use(u, true));
            }
            if let Some(g) = &p.gpu {
                let (k, ns) = (g.stats.kernels, g.stats.kernel_ns);
                let (pk, pns) = self.prev_gpu.get(&p.pid).copied().unwrap_or((0, 0));
                let _ = writeln!(
                    out,
                    "{:>8} {:<16} GPU: {} — {:.0} kernels/s, kernels busy {:.1}% of the interval, queue delay avg {:.1} µs",
                    "",
                    "",
                    CuptiState::name_of(g.status.state),
                    rate(k - pk),
                    (ns - pns) as f64 / (interval_s * 1e9) * 100.0,
                    crate::rules::mean_ns(g.stats.queue_delay_ns, g.stats.queue_delays) as f64 / 1e3
                );
                next_gpu.insert(p.pid, (k, ns));
            }
        }
        self.prev_gpu = next_gpu;
        if snap.procs.is_empty() {
            out.push_str("(no CUDA activity yet)\n");
        }
        latest_anomalies(&mut out, snap);
        self.prev = next;
        out
    }
}

/// A kernel name cut to `max` characters, escaped for the terminal (names come from the
/// observed programs).
fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        printable(s)
    } else {
        format!("{}…", printable(&s.chars().take(max).collect::<String>()))
    }
}

/// The anomalies column: `!N` once a process has any, so it stands out; `0` before.
fn anomaly_mark(n: u64) -> String {
    if n == 0 { "0".into() } else { format!("!{n}") }
}

/// The latest anomalies of the live processes, newest first, one line each.
fn latest_anomalies(out: &mut String, snap: &Snapshot) {
    let mode = snap.anomalies.0.mode;
    let mut latest: Vec<(u32, &Noted)> = snap
        .procs
        .iter()
        .filter(|p| !p.exited)
        .filter_map(|p| Some((p.pid, p.anomalies.as_deref()?)))
        .flat_map(|(pid, f)| f.latest().take(ANOMALIES_SHOWN).map(move |n| (pid, n)))
        .collect();
    latest.sort_by_key(|(pid, n)| (std::cmp::Reverse(n.ts_ns), *pid));
    for (pid, n) in latest.into_iter().take(ANOMALIES_SHOWN) {
        let _ = writeln!(
            out,
            "! pid {pid} {}, {:.1} s ago",
            describe_finding(&n.finding, mode),
            snap.taken_ns.saturating_sub(n.ts_ns) as f64 / 1e9
        );
    }
}

/// A finding for a person: what (a kernel's name escaped and cut), observed against typical
/// in their unit, and how many deviations (robust) or σ (sigma) apart.
pub(crate) fn describe_finding(f: &Finding, mode: Mode) -> String {
    let what = match &f.what {
        What::Kernel { name, .. } => format!("kernel \"{}\"", printable_cut(&name.demangled, ANOMALY_NAME_CHARS)),
        What::Call { api, size } => format!("{api}{}", size_range(*size)),
        What::Bandwidth {
            direction,
            size,
            on_gpu,
        } => format!(
            "{} bandwidth{}{}",
            arrow(*direction),
            size_range(*size),
            if *on_gpu { " on the GPU" } else { " in the call" }
        ),
    };
    let value = |v: f64| match f.what {
        What::Bandwidth { .. } => human_rate(v),
        _ => human_ns(v),
    };
    let deviation = match mode {
        Mode::Robust => format!("{} dev", three_digits(f.deviation)),
        Mode::Sigma => format!("{}σ", three_digits(f.deviation)),
    };
    format!(
        "{what} {}, typically {} ({deviation})",
        value(f.observed),
        value(f.typical)
    )
}

/// A copy direction as the table heads it.
pub(crate) fn arrow(d: Direction) -> &'static str {
    match d {
        Direction::CpuToGpu => "H→D",
        Direction::GpuToCpu => "D→H",
        Direction::GpuToGpu => "D→D",
        Direction::Unknown | Direction::None => "other",
    }
}

/// A size class (analyze/anomaly.rs `size_class`: 1 + ⌊log2 bytes⌋) as its byte range;
/// nothing for an unsized call.
fn size_range(class: u8) -> String {
    let pow2 = |n: u32| match n {
        0..10 => format!("{} B", 1u64 << n),
        10..20 => format!("{} KiB", 1u64 << (n - 10)),
        20..30 => format!("{} MiB", 1u64 << (n - 20)),
        30..40 => format!("{} GiB", 1u64 << (n - 30)),
        // Classes go up to 64 (2^64 bytes, past u64).
        _ => format!("{} TiB", (1u128 << n.min(64)) >> 40),
    };
    match u32::from(class) {
        0 => String::new(),
        c => format!(" of {}–{}", pow2(c - 1), pow2(c)),
    }
}

/// Three significant digits (two decimals under 10, one under 100, none above).
fn three_digits(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// A duration in ns, in the unit that keeps it readable.
pub(crate) fn human_ns(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{} µs", three_digits(ns / 1e3))
    } else if ns < 1e9 {
        format!("{} ms", three_digits(ns / 1e6))
    } else {
        format!("{} s", three_digits(ns / 1e9))
    }
}

/// A rate in bytes/s, decimal units (as link rates are quoted).
pub(crate) fn human_rate(bps: f64) -> String {
    if bps >= 1e9 {
        format!("{} GB/s", three_digits(bps / 1e9))
    } else if bps >= 1e6 {
        format!("{} MB/s", three_digits(bps / 1e6))
    } else if bps >= 1e3 {
        format!("{} kB/s", three_digits(bps / 1e3))
    } else {
        format!("{bps:.0} B/s")
    }
}

/// One line per GPU: its latest NVML sample.
fn devices_now(out: &mut String, gpus: &View) {
    if gpus.state == State::Unavailable {
        let _ = writeln!(out, "NVML unavailable: {}", Printable(&gpus.message));
    }
    for (d, s) in gpus.latest() {
        let Some(s) = s else { continue };
        let mut parts = Vec::new();
        if let Some(u) = s.util_gpu {
            parts.push(format!("util {u}%"));
        }
        if let (Some(used), Some(total)) = (s.memory_used, s.memory_total) {
            parts.push(format!("memory {} / {}", human_bytes(used), human_bytes(total)));
        }
        if let Some(mw) = s.power_mw {
            let limit = s.power_limit_mw.map(|l| format!(" / {:.0} W", f64::from(l) / 1000.0));
            parts.push(format!("{:.0} W{}", f64::from(mw) / 1000.0, limit.unwrap_or_default()));
        }
        if let Some(t) = s.temperature_c {
            parts.push(format!("{t} °C"));
        }
        if let Some(c) = s.clocks.sm {
            parts.push(format!("SM {c} MHz"));
        }
        if let (Some(tx), Some(rx)) = (s.pcie_tx_bps, s.pcie_rx_bps) {
            parts.push(format!(
                "PCIe tx {:.0} / rx {:.0} MB/s",
                tx as f64 / MIB,
                rx as f64 / MIB
            ));
        }
        let slow: Vec<_> = s
            .throttle_reasons
            .map(|r| super::jsonl::throttle_names(r & !0x1))
            .unwrap_or_default();
        if !slow.is_empty() {
            parts.push(format!("slowed: {}", slow.join(",")));
        }
        if let Some(x) = s.last_xid {
            parts.push(format!("Xid {x} ({} errors)", s.xid_errors.unwrap_or(0)));
        }
        let _ = writeln!(out, "GPU {} {}: {}", d.index, Printable(&d.name), parts.join(", "));
    }
}

/// A process's GPUs, memory and SM utilization as NVML sees them.
fn process_use(u: &ProcUse, live: bool) -> String {
    let devs: Vec<String> = u.devices.iter().map(u32::to_string).collect();
    let util = if live {
        u.sm_util_last.map(|v| format!(", SM {v}%")).unwrap_or_default()
    } else {
        u.sm_util_mean()
            .map(|m| format!(", SM utilization mean {m:.1}%, max {}%", u.sm_util_max))
            .unwrap_or_default()
    };
    if live {
        format!("GPU {} — {}{util}", devs.join(","), human_bytes(u.memory_bytes))
    } else {
        format!(
            "GPU {} — memory max {} (last {}){util}",
            devs.join(","),
            human_bytes(u.memory_max_bytes),
            human_bytes(u.memory_bytes)
        )
    }
}

/// The devices over the whole run.
fn devices_summary(out: &mut String, gpus: &View) {
    match gpus.state {
        State::Unavailable => {
            let _ = writeln!(out, "\nNVML unavailable: {}", gpus.message);
        }
        State::Off => {}
        State::Starting | State::Active => {
            for (d, t) in gpus.devices.iter().zip(&gpus.totals) {
                let pct = |a: &crate::nvml::Agg| {
                    a.mean()
                        .map(|m| format!("{m:.1}% mean, {:.0}% max", a.max))
                        .unwrap_or_else(|| "-".into())
                };
                let _ = writeln!(
                    out,
                    "\nGPU {} {} ({}): {} samples\n  utilization   {}\n  memory        {} max of {}\n  power         {}\n  temperature   {}\n  slowed        {} samples (power/thermal/clock caps)",
                    d.index,
                    Printable(&d.name),
                    d.uuid.as_deref().unwrap_or("-"),
                    t.samples,
                    pct(&t.util_gpu),
                    t.memory_used
                        .max()
                        .map_or_else(|| "-".into(), |b| human_bytes(b as u64)),
                    d.memory_total_bytes.map_or_else(|| "-".into(), human_bytes),
                    t.power_w
                        .mean()
                        .map(|m| format!("{m:.0} W mean, {:.0} W max", t.power_w.max))
                        .unwrap_or_else(|| "-".into()),
                    t.temperature_c
                        .max()
                        .map(|m| format!("{m:.0} °C max"))
                        .unwrap_or_else(|| "-".into()),
                    t.throttled_samples
                );
            }
            let c = &gpus.cost;
            let slowest = c
                .stats
                .iter()
                .zip(crate::nvml::QUERY_NAMES)
                .max_by_key(|(s, _)| s.max_ns);
            if let Some((s, name)) = slowest.filter(|(s, _)| s.count > 0) {
                let _ = writeln!(
                    out,
                    "\nNVML sampler: {} rounds every {} ms, {:.3}% of a core; slowest query {name} {:.0} µs",
                    c.samples,
                    gpus.interval.as_millis(),
                    c.cpu_ratio() * 100.0,
                    s.max_ns as f64 / 1e3
                );
            }
        }
    }
}

/// What the memory limit made the agent forget (a warning: data is missing), and how many
/// exited processes the summary no longer lists (a note: by design), one line each.
pub fn evicted_lines(snap: &Snapshot) -> Vec<String> {
    let e = &snap.evicted;
    let mut parts = Vec::new();
    if e.kernel_names + e.allocations + e.cupti_records > 0 {
        parts.push(format!(
            "warning: within --memory-limit-mb, {} kernel names, {} allocations and {} CUPTI join records were not remembered \
             (their launches are unnamed, their frees unsized, their GPU activity unjoined); raise --memory-limit-mb to keep more",
            e.kernel_names, e.allocations, e.cupti_records
        ));
    }
    if e.processes > 0 {
        // Not a shortage: the summary keeps the latest exited processes only (correlate.rs).
        parts.push(format!(
            "note: the summary lists the latest {} exited processes; {} earlier ones are in the totals only",
            snap.budget.exited, e.processes
        ));
    }
    parts
}

/// Unfreed allocations of every process (SIGUSR1).
pub fn leak_report(snap: &Snapshot) -> String {
    let mut out = String::from("gpu-observer: allocations not freed\n");
    for p in &snap.procs {
        for l in &p.leaks {
            let _ = writeln!(
                out,
                "  pid {:>7} {:<16} {:<28} {:>8} × {} ({}){}",
                p.pid,
                Printable(&p.comm),
                l.api,
                l.count,
                human_bytes(l.bytes),
                l.mem.name(),
                if p.exited { ", process exited" } else { "" }
            );
        }
    }
    out
}

/// The summary printed at exit.
pub fn final_summary(snap: &Snapshot, drops: &Drops, wall_ns: u64, verdicts: &HashMap<u32, Verdict>) -> String {
    let gpus = &*snap.nvml;
    let mut out = String::new();
    let wall_s = wall_ns as f64 / 1e9;
    let _ = writeln!(
        out,
        "gpu-observer summary: {:.1} s, {} events, {} dropped, {} processes",
        wall_s,
        snap.events,
        drops.total,
        snap.procs.len()
    );
    if drops.total > 0 {
        let _ = writeln!(
            out,
            "  WARNING: {} records were lost because the ring buffer was full (raise --ring-buffer-size)",
            drops.total
        );
    }
    for line in evicted_lines(snap) {
        let _ = writeln!(out, "  {line}");
    }
    for p in &snap.procs {
        let s = &p.stats;
        let dropped = drops.of_pid(p.pid);
        let _ = writeln!(
            out,
            "\npid {} ({}){}: {} events, {} dropped",
            p.pid,
            Printable(&p.comm),
            if p.exited { ", exited" } else { "" },
            s.events,
            dropped
        );
        let apis: Vec<String> = s.launch_apis.iter().map(|(a, n)| format!("{a} {n}")).collect();
        let _ = writeln!(out, "  launches      {:>10}   {}", s.launches, apis.join(", "));
        if s.abandoned_calls > 0 {
            let _ = writeln!(
                out,
                "  abandoned     {:>10}   calls that never returned (longjmp or an exception out of the driver)",
                s.abandoned_calls
            );
        }
        for (name, d) in [
            ("copies H→D", Direction::CpuToGpu),
            ("copies D→H", Direction::GpuToCpu),
            ("copies D→D", Direction::GpuToGpu),
            ("copies other", Direction::Unknown),
        ] {
            let a = s.copy(d);
            if a.count > 0 {
                let _ = writeln!(
                    out,
                    "  {name:<13} {:>10}   {} in {:.3} ms ({:.1} MB/s while copying)",
                    a.count,
                    human_bytes(a.bytes),
                    a.ns as f64 / 1e6,
                    crate::rules::bandwidth_mbps(a.bytes, a.ns)
                );
            }
        }
        if s.memsets.count > 0 {
            let _ = writeln!(
                out,
                "  memsets       {:>10}   {}",
                s.memsets.count,
                human_bytes(s.memsets.bytes)
            );
        }
        let _ = writeln!(
            out,
            "  allocs        {:>10}   {} ({} frees, {} outstanding)",
            s.allocs.count,
            human_bytes(s.allocs.bytes),
            s.frees.count,
            human_bytes(s.outstanding_bytes())
        );
        if s.named_launches + s.unresolved_launches > 0 {
            let top: Vec<String> = p
                .top_kernels
                .iter()
                .take(5)
                .map(|(k, n)| format!("{n}× {}", shorten(&k.demangled, 60)))
                .collect();
            let _ = writeln!(
                out,
                "  kernels       {:>10}   named ({} unresolved: loaded before the observer); top: {}",
                s.named_launches,
                s.unresolved_launches,
                top.join("; ")
            );
        }
        if s.inferred_copies + s.pinned_copies + s.pageable_copies > 0 {
            let _ = writeln!(
                out,
                "  copy memory   {:>10}   pinned host, {} pageable host, {} directions inferred from allocations",
                s.pinned_copies, s.pageable_copies, s.inferred_copies
            );
        }
        let wall = p.span_ns();
        let _ = writeln!(
            out,
            "  syncs         {:>10}   {:.3} ms blocked, summed over threads ({:.1}% of its active wall time)",
            s.syncs.count,
            s.syncs.ns as f64 / 1e6,
            s.syncs.ns as f64 / wall as f64 * 100.0
        );
        let _ = writeln!(
            out,
            "  ioctls        {:>10}   {:.3} ms ({} inside CUDA calls)",
            s.ioctls.count,
            s.ioctls.ns as f64 / 1e6,
            s.ioctls_in_calls
        );
        let mut cmds: Vec<_> = s.ioctl_by_cmd.iter().collect();
        cmds.sort_by(|a, b| b.1.1.ns.cmp(&a.1.1.ns).then(a.0.cmp(b.0)));
        for (cmd, (name, a)) in cmds.iter().take(3) {
            let _ = writeln!(
                out,
                "    {:<34} {:>8} × {:.3} ms",
                name.map_or_else(|| format!("{cmd:#x}"), str::to_string),
                a.count,
                a.ns as f64 / 1e6
            );
        }
        if s.host_funcs.count > 0 {
            let _ = writeln!(
                out,
                "  host funcs    {:>10}   queued in streams (each stalls its stream while it runs)",
                s.host_funcs.count
            );
        }
        if s.slow_calls > 0 {
            let _ = writeln!(
                out,
                "  slow calls    {:>10}   copies/memsets/syncs over the threshold",
                s.slow_calls
            );
        }
        for l in &p.leaks {
            let _ = writeln!(
                out,
                "  {} {:>10}   {} of {} memory from {} never freed",
                if p.exited { "leaked     " } else { "outstanding" },
                l.count,
                human_bytes(l.bytes),
                l.mem.name(),
                l.api
            );
        }
        if s.failed_calls > 0 {
            let _ = writeln!(out, "  failed calls  {:>10}", s.failed_calls);
        }
        anomaly_summary(&mut out, p, snap.anomalies.0.mode);
        if let Some(v) = verdicts.get(&p.pid) {
            let _ = writeln!(out, "  verdict       {}", printable(&v.describe()));
        }
        if let Some(u) = gpus.procs.get(&p.pid) {
            let _ = writeln!(out, "  NVML          {}", process_use(u, false));
        }
        if let Some(g) = &p.gpu {
            gpu_summary(&mut out, g);
        }
    }
    devices_summary(&mut out, gpus);
    // Processes on a GPU that made no CUDA call the observer saw (they started before it, or
    // use the GPU another way).
    let mut others: Vec<_> = gpus
        .procs
        .iter()
        .filter(|(pid, _)| snap.process(**pid).is_none() && gpus.wants(**pid))
        .collect();
    others.sort_by_key(|(pid, _)| **pid);
    if !others.is_empty() {
        out.push_str("\nother processes on the GPUs (NVML)\n");
        for (pid, u) in others {
            let _ = writeln!(
                out,
                "  pid {pid:>7} {:<16} {}",
                Printable(&u.comm),
                process_use(u, false)
            );
        }
    }
    out
}

/// A process's anomalies over the run: how many, the most severe and the latest.
fn anomaly_summary(out: &mut String, p: &ProcessView, mode: Mode) {
    let _ = writeln!(out, "  anomalies     {:>10}", p.anomaly_count());
    let Some(f) = p.anomalies.as_deref() else { return };
    let worst = f.worst_after(0);
    if let Some(w) = worst {
        let _ = writeln!(out, "    most severe {}", describe_finding(&w.finding, mode));
    }
    if let Some(l) = f.latest().next().filter(|l| Some(l.seq) != worst.map(|w| w.seq)) {
        let _ = writeln!(out, "    latest      {}", describe_finding(&l.finding, mode));
    }
}

/// What CUPTI said about a process: GPU time, joins, queue delay, the kernels that took the GPU.
fn gpu_summary(out: &mut String, g: &GpuView) {
    let (s, st) = (&g.stats, &g.status);
    let _ = writeln!(
        out,
        "  CUPTI         {:>10}   {}",
        CuptiState::name_of(st.state),
        CuptiState::message_of(st.state)
    );
    let n = &g.nvtx;
    let ranges = n.thread_ranges + n.process_ranges + n.marks + n.open_at_end;
    if ranges > 0 {
        let _ = writeln!(
            out,
            "  NVTX          {:>10}   ranges and marks ({} thread, {} process, {} marks, {} open at the end); {} GPU records carry their stack",
            ranges, n.thread_ranges, n.process_ranges, n.marks, n.open_at_end, n.stacks
        );
    } else {
        let _ = writeln!(
            out,
            "  NVTX          {:>10}   {}",
            NvtxState::name_of(st.nvtx),
            NvtxState::message_of(st.nvtx)
        );
    }
    if s.kernels + s.memcpys + s.memsets == 0 {
        return;
    }
    let span = s.last_gpu_ns.saturating_sub(s.first_gpu_ns).max(1) as f64;
    let _ = writeln!(
        out,
        "  GPU kernels   {:>10}   {:.3} ms of GPU time ({:.1}% of the span they ran in); queue delay avg {:.1} µs, max {:.1} µs",
        s.kernels,
        s.kernel_ns as f64 / 1e6,
        s.kernel_ns as f64 / span * 100.0,
        crate::rules::mean_ns(s.queue_delay_ns, s.queue_delays) as f64 / 1e3,
        s.max_queue_delay_ns as f64 / 1e3
    );
    let _ = writeln!(
        out,
        "  GPU copies    {:>10}   {:.3} ms; memsets {} ({:.3} ms)",
        s.memcpys,
        s.memcpy_ns as f64 / 1e6,
        s.memsets,
        s.memset_ns as f64 / 1e6
    );
    let _ = writeln!(
        out,
        "  joined        {:>10}   to their launch ({} not joined; CUPTI dropped {}, rate-limited {})",
        s.joined, s.unjoined, st.cupti_dropped, st.rate_limited
    );
    for (name, count, ns) in s.top_kernels(5) {
        let _ = writeln!(
            out,
            "    {:>9.3} ms {:>8}× {}",
            ns as f64 / 1e6,
            count,
            shorten(name, 70)
        );
    }
}

/// The notices a person watching stderr needs as they happen: a process's CUPTI state changed
/// (GPU timestamps start flowing, or another profiler holds CUPTI and the process is observed
/// with uprobes only).
pub struct StderrNotices;

impl super::Sink for StderrNotices {
    fn describe(&self) -> String {
        "notices to stderr".into()
    }

    fn event(&mut self, _: &crate::decode::Event) -> anyhow::Result<()> {
        Ok(())
    }

    fn gpu(&mut self, _: &crate::correlate::cupti_join::GpuActivity) -> anyhow::Result<()> {
        Ok(())
    }

    fn cupti_state(&mut self, c: &crate::correlate::CuptiChange) -> anyhow::Result<()> {
        crate::say(format_args!(
            "pid {} ({}): {}",
            c.pid,
            Printable(&c.comm),
            CuptiState::message_of(c.status.state)
        ));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        analyze::anomaly::{Finding, What},
        snapshot::testing::*,
    };

    const S: u64 = 1_000_000_000;

    /// A name an observed program could give a kernel: a terminal title change, a screen clear,
    /// a forged row, a bidi override, then 1 000 more characters.
    fn hostile() -> String {
        format!("\x1b]0;pwn\x07\x1b[2J\n    666 root FORGED\u{202e}{}", "A".repeat(1000))
    }

    /// Process 10 with three findings (the last a hostile kernel name), process 20 with none.
    fn snapshot() -> Arc<Snapshot> {
        let (mut corr, mut p) = with_processes(&[10, 20]);
        p.note_anomaly(10, S / 2, &kernel_finding("gemm_x", 412_000.0, 41_000.0, 115.4));
        let copy = Finding {
            what: What::Call {
                api: "cuMemcpyHtoD_v2",
                size: 23,
            },
            observed: 5_000_000.0,
            typical: 3_000.0,
            deviation: 9.87,
        };
        p.note_anomaly(10, S, &copy);
        p.note_anomaly(10, 2 * S, &kernel_finding(&hostile(), 20_000.0, 2_000.0, 115.1));
        publish(&mut p, &mut corr, 3 * S)
    }

    /// Nothing an observed process wrote reaches the terminal raw.
    fn assert_safe(text: &str) {
        let bad: Vec<char> = text
            .chars()
            .filter(|&c| (c.is_control() && c != '\n') || c == '\u{202e}')
            .collect();
        assert!(bad.is_empty(), "raw {bad:?} in:\n{text}");
        assert!(!text.contains("\n    666 root"), "a forged row:\n{text}");
    }

    #[test]
    fn the_live_table_marks_processes_with_anomalies_and_lists_the_latest_safely() {
        let snap = snapshot();
        let text = LiveView::default().render(&snap, &Drops::default(), &HashMap::new(), 1.0, 3.0);
        assert_safe(&text);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].ends_with("  ANOM"), "{text}");
        let row = |pid: &str| {
            *lines
                .iter()
                .find(|l| l.trim_start().starts_with(pid))
                .unwrap_or_else(|| panic!("no row {pid}:\n{text}"))
        };
        assert!(row("10 ").ends_with(" !3"), "{text}");
        assert!(row("20 ").ends_with("      0"), "{text}");
        // Newest first; the hostile name escaped and cut to 80 characters as shown.
        let shown = "\\x1b]0;pwn\\x07\\x1b[2J\\x0a    666 root FORGED\\u{202e}";
        let name = format!("{shown}{}…", "A".repeat(80 - shown.chars().count()));
        let anomalies: Vec<&str> = lines.iter().copied().filter(|l| l.starts_with("! ")).collect();
        assert_eq!(
            anomalies,
            [
                format!("! pid 10 kernel \"{name}\" 20.0 µs, typically 2.00 µs (115 dev), 1.0 s ago"),
                "! pid 10 cuMemcpyHtoD_v2 of 4 MiB–8 MiB 5.00 ms, typically 3.00 µs (9.87 dev), 2.0 s ago".into(),
                "! pid 10 kernel \"gemm_x\" 412 µs, typically 41.0 µs (115 dev), 2.5 s ago".into(),
            ]
        );
    }

    #[test]
    fn the_final_summary_gives_each_process_its_count_the_most_severe_and_the_latest() {
        let snap = snapshot();
        let text = final_summary(&snap, &Drops::default(), 3 * S, &HashMap::new());
        assert_safe(&text);
        let at = |pid: &str| {
            let from = text
                .find(&format!("\npid {pid} (train)"))
                .unwrap_or_else(|| panic!("{text}"));
            let block = &text[from + 1..];
            block[..block.find("\n\n").unwrap_or(block.len())].to_string()
        };
        let ten = at("10");
        let lines: Vec<&str> = ten
            .lines()
            .filter(|l| l.contains("anomalies") || l.starts_with("    most") || l.starts_with("    latest"))
            .collect();
        assert_eq!(lines[0], "  anomalies              3", "{ten}");
        assert_eq!(
            lines[1], "    most severe kernel \"gemm_x\" 412 µs, typically 41.0 µs (115 dev)",
            "{ten}"
        );
        assert!(
            lines[2].starts_with("    latest      kernel \"\\x1b]0;pwn\\x07"),
            "{ten}"
        );
        assert!(
            lines[2].ends_with("AAA…\" 20.0 µs, typically 2.00 µs (115 dev)"),
            "{ten}"
        );
        assert!(at("20").contains("\n  anomalies              0\n"), "{}", at("20"));
    }

    #[test]
    fn findings_read_in_their_units() {
        let bw = Finding {
            what: What::Bandwidth {
                direction: Direction::GpuToCpu,
                size: 30,
                on_gpu: true,
            },
            observed: 2.1e9,
            typical: 25.04e9,
            deviation: 12.0,
        };
        assert_eq!(
            describe_finding(&bw, Mode::Robust),
            "D→H bandwidth of 512 MiB–1 GiB on the GPU 2.10 GB/s, typically 25.0 GB/s (12.0 dev)"
        );
        let sync = Finding {
            what: What::Call {
                api: "cuStreamSynchronize",
                size: 0,
            },
            observed: 1.5e9,
            typical: 800.0,
            deviation: 4.44,
        };
        assert_eq!(
            describe_finding(&sync, Mode::Sigma),
            "cuStreamSynchronize 1.50 s, typically 800 ns (4.44σ)"
        );
        assert_eq!(size_range(1), " of 1 B–2 B");
        assert_eq!(size_range(64), " of 8388608 TiB–16777216 TiB");
        assert_eq!(human_rate(999.0), "999 B/s");
        assert_eq!(human_rate(1.5e4), "15.0 kB/s");
    }
}
