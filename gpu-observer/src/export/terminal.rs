//! The terminal view: a per-process table refreshed every second, and the final summary.

use std::{collections::HashMap, fmt::Write as _, sync::Arc};

use gpu_observer_common::{api::Direction, cupti::CuptiState};

use super::text::{Printable, printable};
use crate::{
    analyze::{verdict::Verdict, window::ProcessVerdict},
    attach::Drops,
    correlate::Stats,
    nvml::{ProcUse, State, View},
    snapshot::{GpuView, ProcessView, Snapshot},
};

const MIB: f64 = 1024.0 * 1024.0;

/// Keeps the previous counters so each refresh shows rates over the last interval.
#[derive(Default)]
pub struct LiveView {
    prev: HashMap<u32, Arc<ProcessView>>,
    /// (kernels, kernel GPU ns) at the previous refresh, per process with CUPTI.
    prev_gpu: HashMap<u32, (u64, u64)>,
    /// When the previous refresh's snapshot was taken (CLOCK_MONOTONIC ns; 0: none yet).
    prev_taken_ns: u64,
}

fn human_bytes(b: u64) -> String {
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
            "{:>8} {:<16} {:>10} {:>22} {:>22} {:>14} {:>10} {:>16}",
            "PID", "COMM", "LAUNCH/s", "H→D (n, MB/s)", "D→H (n, MB/s)", "D→D/other n/s", "SYNC %", "IOCTL n/s, ms"
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
                "{:>8} {:<16} {:>10.0} {:>10.0} {:>11.1} {:>10.0} {:>11.1} {:>14.0} {:>9.1}% {:>8.0} {:>7.2}",
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
                (now.ioctls.ns - before.ioctls.ns) as f64 / 1e6
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
        let dropped = drops.by_pid.get(&p.pid).copied().unwrap_or(0);
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

/// What CUPTI said about a process: GPU time, joins, queue delay, the kernels that took the GPU.
fn gpu_summary(out: &mut String, g: &GpuView) {
    let (s, st) = (&g.stats, &g.status);
    let _ = writeln!(
        out,
        "  CUPTI         {:>10}   {}",
        CuptiState::name_of(st.state),
        CuptiState::message_of(st.state)
    );
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
