//! JSON lines (`--format jsonl`): the schema in README.md ("JSON lines"), one object per event, written
//! straight into a buffered writer (no allocation per event).

mod gpu;
mod nvml;

pub use nvml::throttle_names;

use std::io::{self, Write};

use gpu_observer_common::api::{Direction, Family};

use crate::{
    analyze::{
        anomaly::{Finding, What},
        verdict::Verdict,
        window::ProcessVerdict,
    },
    correlate::{CuptiChange, Leak, MemorySample, cupti_join::GpuActivity},
    decode::{Body, Call, Event, HostMemory},
    export::{LeakReport, Sink, Summary},
    nvml::{DeviceInfo, Line, ProcUse},
    rules::bandwidth_mbps,
    snapshot::ProcessView,
};

pub struct JsonlWriter<W: Write> {
    out: W,
    threshold_ns: u64,
    /// Duration sampling (docs/DESIGN.md "Rules"): without it, copies, memsets and syncs shorter than the
    /// threshold are counted (in the summaries) but not written one by one.
    trace_all: bool,
    /// Lines left out by sampling, by type: memcpy, memset, sync, gpu_kernel, gpu_memcpy,
    /// gpu_memset.
    sampled_out: [u64; 6],
}

/// A pointer or handle written as a JSON string `"0x…"`.
struct Hex(u64);

impl std::fmt::Display for Hex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "\"{:#x}\"", self.0)
    }
}

/// An optional handle: `"0x…"` or `null`.
struct OptHex(Option<u64>);

impl std::fmt::Display for OptHex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(v) => write!(f, "\"{v:#x}\""),
            None => f.write_str("null"),
        }
    }
}

/// An optional number: the value or `null`.
struct OptNum<T>(Option<T>);

impl<T: std::fmt::Display> std::fmt::Display for OptNum<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(v) => write!(f, "{v}"),
            None => f.write_str("null"),
        }
    }
}

/// `"class":…,"secondary":…,"window_ns":…,"evidence":{…},"hint":…` of a verdict (the
/// members of an object, without its braces).
fn verdict_fields<W: Write>(o: &mut W, v: &Verdict) -> io::Result<()> {
    let e = &v.evidence;
    write!(o, "\"class\":\"{}\"", v.class.name())?;
    opt_str(o, "secondary", v.secondary.map(|c| c.name()))?;
    write!(
        o,
        ",\"window_ns\":{},\"capture_fraction\":{},\"estimate_error\":{},\"probe_share\":{},\"probe_corrected\":{},\"dropped\":{},\"partial\":{},\"evidence\":{{\"gpu_busy\":{}",
        e.window_ns,
        OptNum(e.capture_fraction.map(|f| Decimals(f, 4))),
        OptNum(e.estimate_error.map(|f| Decimals(f, 4))),
        OptNum(e.probe_share.map(|f| Decimals(f, 4))),
        e.probe_corrected,
        e.dropped,
        e.dropped > 0,
        OptNum(e.gpu_busy().map(|b| Decimals(b, 4)))
    )?;
    opt_str(o, "gpu_busy_source", e.busy_source.name())?;
    write!(
        o,
        ",\"gpu_idle\":{},\"calls\":{},\"calls_per_s\":{:.1},\"launches_per_s\":{:.1},\"mean_kernel_ns\":{},\"busy_ns_per_launch\":{},\"mean_launch_interval_ns\":{},\"launch_thread_cpu\":{:.4},\"process_cpu\":{:.4},\"host\":\"{}\",\"syncs_per_s\":{:.1},\"sync_blocked\":{:.4},\"copy_fraction\":{:.4},\"copies\":{{",
        OptNum(e.gpu_busy().map(|b| Decimals(1.0 - b, 4))),
        e.calls,
        e.per_s(e.calls),
        e.per_s(e.launches),
        OptNum(e.mean_kernel_ns().map(|n| n.round() as u64)),
        OptNum(e.busy_ns_per_launch().map(|n| n.round() as u64)),
        OptNum(e.mean_launch_interval_ns().map(|n| n.round() as u64)),
        e.frac(e.launch_thread_cpu_ns),
        e.frac(e.process_cpu_ns),
        e.host().name(),
        e.per_s(e.syncs),
        e.frac(e.sync_ns),
        e.frac(e.copy_ns()),
    )?;
    for (i, d) in Direction::REPORTED.into_iter().enumerate() {
        let a = e.copies[d.index()];
        write!(
            o,
            "{}\"{}\":{{\"count\":{},\"bytes\":{},\"gb_per_s\":{}}}",
            if i == 0 { "" } else { "," },
            d.name(),
            a.count,
            a.bytes,
            OptNum(e.copy_bytes_per_s(d).map(|r| Decimals(r / 1e9, 3)))
        )?;
    }
    write!(
        o,
        "}},\"pageable_share\":{},\"link_gb_per_s\":{},\"top_kernels\":[",
        OptNum(e.pageable_share().map(|p| Decimals(p, 4))),
        OptNum(e.link_bytes_per_s.map(|r| Decimals(r / 1e9, 3)))
    )?;
    for (i, k) in e.top_kernels.iter().enumerate() {
        write!(o, "{}{{\"name\":", if i == 0 { "" } else { "," })?;
        serde_json::to_writer(&mut *o, &*k.name).map_err(io::Error::other)?;
        write!(
            o,
            ",\"count\":{},\"gpu_ns\":{},\"exact\":{}}}",
            OptNum(k.count),
            k.gpu_ns,
            k.exact
        )?;
    }
    write!(o, "],\"anomalies\":{},\"worst_anomaly\":", e.anomalies)?;
    match &e.worst_anomaly {
        Some(n) => {
            o.write_all(b"{")?;
            finding_fields(o, &n.finding)?;
            write!(o, ",\"ts_ns\":{}}}", n.ts_ns)?;
        }
        None => o.write_all(b"null")?,
    }
    o.write_all(b"}")?;
    opt_str(o, "hint", Some(v.class.hint()))
}

/// `"what":…,"key":…,"observed":…,"typical":…,"unit":…,"deviation":…` of a finding (the
/// members of an object, without its braces; a kernel's also `grid` and `block`), as the
/// `anomaly` line and the verdict's `worst_anomaly` write it.
fn finding_fields<W: Write>(o: &mut W, f: &Finding) -> io::Result<()> {
    write!(o, "\"what\":\"{}\",\"key\":", f.what.kind())?;
    match &f.what {
        What::Kernel { name, grid, block } => {
            serde_json::to_writer(&mut *o, &*name.demangled).map_err(io::Error::other)?;
            write!(o, ",\"grid\":{grid:?},\"block\":{block:?}")?;
        }
        What::Call { api, size } => write!(o, "{{\"api\":\"{api}\",\"size_class\":{size}}}")?,
        What::Bandwidth {
            direction,
            size,
            on_gpu,
        } => write!(
            o,
            "{{\"direction\":\"{}\",\"size_class\":{size},\"measured\":\"{}\"}}",
            direction.name(),
            if *on_gpu { "gpu" } else { "call" }
        )?,
    }
    write!(
        o,
        ",\"observed\":{},\"typical\":{},\"unit\":\"{}\",\"deviation\":{}",
        Decimals(f.observed, 1),
        Decimals(f.typical, 1),
        f.what.unit(),
        Decimals(f.deviation, 2),
    )
}

/// A number with this many decimals, formatted as it is written (no string in between: the
/// bandwidth is on every copy's line).
struct Decimals(f64, usize);

impl std::fmt::Display for Decimals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.*}", self.1, self.0)
    }
}

/// Writes `"key":` followed by a JSON string or `null`.
fn opt_str<W: Write>(out: &mut W, key: &str, v: Option<&str>) -> io::Result<()> {
    write!(out, ",\"{key}\":")?;
    match v {
        Some(s) => serde_json::to_writer(&mut *out, s).map_err(io::Error::other),
        None => out.write_all(b"null"),
    }
}

/// Writes `{"k":v,...}` for a list of (key, value) pairs.
fn counts<W: Write, K: std::fmt::Display, V: std::fmt::Display>(
    out: &mut W,
    items: impl IntoIterator<Item = (K, V)>,
) -> io::Result<()> {
    out.write_all(b"{")?;
    for (i, (k, v)) in items.into_iter().enumerate() {
        write!(out, "{}\"{k}\":{v}", if i == 0 { "" } else { "," })?;
    }
    out.write_all(b"}")
}

impl<W: Write> JsonlWriter<W> {
    pub fn new(out: W, threshold_ns: u64, trace_all: bool) -> Self {
        Self {
            out,
            threshold_ns,
            trace_all,
            sampled_out: [0; 6],
        }
    }

    /// Duration sampling (`rules::kept`, docs/DESIGN.md "Rules"): counts
    /// and says true for a fast timed call that is not to be written.
    fn sample_out(&mut self, family: Option<Family>, c: &Call) -> bool {
        let slot = match family {
            Some(Family::Memcpy) => 0,
            Some(Family::Memset) => 1,
            Some(Family::Sync) => 2,
            _ => return false,
        };
        // An abandoned call has no duration to sample by, and is rare: always written.
        if c.abandoned || crate::rules::kept(c.duration_ns, self.threshold_ns, self.trace_all, c.anomalous) {
            return false;
        }
        self.sampled_out[slot] += 1;
        true
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    fn head(&mut self, ty: &str, ts_ns: u64, pid: u32, tid: u32, comm: &str) -> io::Result<()> {
        write!(
            self.out,
            "{{\"type\":\"{ty}\",\"ts_ns\":{ts_ns},\"pid\":{pid},\"tid\":{tid},\"comm\":"
        )?;
        serde_json::to_writer(&mut self.out, comm).map_err(io::Error::other)
    }

    fn event_head(&mut self, ty: &str, ev: &Event) -> io::Result<()> {
        self.head(ty, ev.ts_ns, ev.pid, ev.tid, &ev.comm())?;
        if let Some(api) = ev.api {
            write!(self.out, ",\"api\":\"{}\"", api.name)?;
        }
        Ok(())
    }

    pub fn event(&mut self, ev: &Event) -> io::Result<()> {
        match &ev.body {
            Body::Launch(l) => {
                self.event_head("launch", ev)?;
                opt_str(&mut self.out, "kernel", l.kernel.as_ref().map(|k| &*k.demangled))?;
                opt_str(&mut self.out, "kernel_mangled", l.kernel.as_ref().map(|k| &*k.mangled))?;
                write!(
                    self.out,
                    ",\"function\":{},\"grid\":[{},{},{}],\"block\":[{},{},{}],\"shared_mem_bytes\":{},\"stream\":{}",
                    Hex(l.function),
                    l.grid[0],
                    l.grid[1],
                    l.grid[2],
                    l.block[0],
                    l.block[1],
                    l.block[2],
                    l.shared_mem_bytes,
                    Hex(l.stream)
                )?;
                if l.read_errors != 0 {
                    write!(self.out, ",\"read_errors\":{}", l.read_errors)?;
                }
            }
            Body::Call(c) => {
                let family = ev.api.map(|a| a.family);
                if self.sample_out(family, c) {
                    return Ok(());
                }
                let ty = match family {
                    Some(Family::Memcpy) => "memcpy",
                    Some(Family::Memset) => "memset",
                    Some(Family::Alloc) => "alloc",
                    Some(Family::Free) => "free",
                    Some(Family::Sync) => "sync",
                    Some(Family::Module) => "module",
                    Some(Family::Symbol) => "symbol",
                    Some(Family::HostFunc) => "host_func",
                    _ => "init",
                };
                self.event_head(ty, ev)?;
                self.call_fields(family, c)?;
            }
            Body::Ioctl(i) => {
                self.event_head("ioctl", ev)?;
                write!(
                    self.out,
                    ",\"fd\":{},\"cmd\":{},\"arg\":{},\"duration_ns\":{},\"ret\":{}",
                    i.fd,
                    Hex(u64::from(i.cmd)),
                    Hex(i.arg),
                    i.duration_ns,
                    i.ret
                )?;
                opt_str(&mut self.out, "name", i.name)?;
                opt_str(&mut self.out, "device", i.device.as_deref())?;
                opt_str(&mut self.out, "parent_api", i.parent.map(|p| p.name))?;
            }
            Body::ProcessExit => self.event_head("process_exit", ev)?,
            // Written once joined, by `gpu`.
            Body::Gpu(_) | Body::GpuName { .. } | Body::MarkerName { .. } => return Ok(()),
        }
        self.out.write_all(b"}\n")
    }

    fn call_fields(&mut self, family: Option<Family>, c: &Call) -> io::Result<()> {
        let slow = crate::rules::is_slow(c.duration_ns, self.threshold_ns);
        // An abandoned call never returned: no duration, bandwidth or result.
        let dur = OptNum((!c.abandoned).then_some(c.duration_ns));
        let o = &mut self.out;
        match family {
            Some(Family::Memcpy) => {
                let bytes = c.bytes.unwrap_or(0);
                write!(
                    o,
                    ",\"direction\":\"{}\",\"direction_inferred\":{},\"bytes\":{bytes},\"duration_ns\":{dur},\"bandwidth_mbps\":{},\"is_slow\":{slow},\"async\":{},\"stream\":{},\"dst\":{},\"src\":{}",
                    c.direction.name(),
                    c.direction_inferred,
                    OptNum((!c.abandoned).then(|| Decimals(bandwidth_mbps(bytes, c.duration_ns), 3))),
                    c.stream.is_some(),
                    OptHex(c.stream),
                    OptHex(c.dst),
                    OptHex(c.src)
                )?;
                opt_str(o, "host_memory", c.host_memory.map(HostMemory::name))?;
            }
            Some(Family::Memset) => {
                write!(
                    o,
                    ",\"bytes\":{},\"duration_ns\":{dur},\"is_slow\":{slow},\"stream\":{},\"address\":{}",
                    OptNum(c.bytes),
                    OptHex(c.stream),
                    OptHex(c.address)
                )?;
            }
            Some(Family::Alloc | Family::Free) => {
                write!(
                    o,
                    ",\"bytes\":{},\"address\":{},\"memory\":\"{}\",\"duration_ns\":{dur},\"stream\":{}",
                    OptNum(c.bytes),
                    OptHex(c.address),
                    c.mem.name(),
                    OptHex(c.stream)
                )?;
            }
            Some(Family::Sync) => {
                write!(
                    o,
                    ",\"duration_ns\":{dur},\"is_slow\":{slow},\"handle\":{}",
                    OptHex(c.stream)
                )?;
            }
            Some(Family::HostFunc) => {
                write!(
                    o,
                    ",\"duration_ns\":{dur},\"stream\":{},\"function\":{}",
                    OptHex(c.stream),
                    OptHex(c.handle)
                )?;
            }
            Some(Family::Module | Family::Symbol) => {
                write!(
                    o,
                    ",\"duration_ns\":{dur},\"handle\":{},\"owner\":{}",
                    OptHex(c.handle),
                    OptHex(c.owner)
                )?;
                if family == Some(Family::Symbol) {
                    opt_str(o, "name", c.name.as_deref())?;
                    opt_str(o, "kernel", c.kernel.as_ref().map(|k| &*k.demangled))?;
                }
            }
            _ => write!(o, ",\"duration_ns\":{dur},\"handle\":{}", OptHex(c.stream))?,
        }
        write!(
            o,
            ",\"result\":{},\"ioctl_count\":{},\"ioctl_ns\":{}",
            OptNum((!c.abandoned).then_some(c.result)),
            c.ioctl_count,
            c.ioctl_ns
        )?;
        if c.abandoned {
            o.write_all(b",\"abandoned\":true")?;
        }
        if c.nested != 0 {
            write!(o, ",\"nested_calls\":{}", c.nested)?;
        }
        if c.read_errors != 0 {
            write!(o, ",\"read_errors\":{}", c.read_errors)?;
        }
        Ok(())
    }

    /// A point of a process's device-memory timeline.
    pub fn memory(&mut self, ts_ns: u64, m: &MemorySample, comm: &str) -> io::Result<()> {
        self.head("memory", ts_ns, m.pid, m.pid, comm)?;
        writeln!(
            self.out,
            ",\"device_bytes\":{},\"managed_bytes\":{},\"host_pinned_bytes\":{},\"live_allocations\":{}}}",
            m.device, m.managed, m.host, m.allocations
        )
    }

    /// An `anomaly` line: what was slow, how slow, against what.
    pub fn anomaly(&mut self, a: &crate::export::sink::AnomalyLine<'_>) -> io::Result<()> {
        let comm = crate::rules::comm(a.comm);
        self.head("anomaly", a.ts_ns, a.pid, a.tid, &comm)?;
        self.out.write_all(b",")?;
        finding_fields(&mut self.out, a.finding)?;
        writeln!(self.out, ",\"mode\":\"{}\"}}", a.mode.name())
    }

    /// A `verdict` line: the class of a process's last window and the numbers behind it.
    pub fn verdict(&mut self, ts_ns: u64, pv: &ProcessVerdict) -> io::Result<()> {
        self.head("verdict", ts_ns, pv.pid, pv.pid, &pv.comm)?;
        self.out.write_all(b",")?;
        verdict_fields(&mut self.out, &pv.verdict)?;
        self.out.write_all(b"}\n")
    }

    /// Allocations a process has not freed: at its exit, or on demand (SIGUSR1).
    pub fn leaks(&mut self, r: &LeakReport<'_>) -> io::Result<()> {
        for l in r.leaks {
            self.head("leak", r.ts_ns, r.pid, r.pid, r.comm)?;
            writeln!(
                self.out,
                ",\"api\":\"{}\",\"memory\":\"{}\",\"count\":{},\"bytes\":{},\"process_exited\":{}}}",
                l.api,
                l.mem.name(),
                l.count,
                l.bytes,
                r.exited
            )?;
        }
        Ok(())
    }

    /// One `summary` line per process, then the total line (always last; `events` and
    /// `dropped` always present).
    pub fn summary(&mut self, sum: &Summary<'_>) -> io::Result<()> {
        let (snap, drops, wall_ns, unattributed) = (sum.snapshot, sum.drops, sum.wall_ns, sum.unattributed_drops);
        let gpus = &*snap.nvml;
        for p in &snap.procs {
            self.process_summary(
                p,
                gpus.procs.get(&p.pid),
                drops.by_pid_kind.get(&p.pid).map_or(&[], Vec::as_slice),
                sum.verdicts.get(&p.pid),
            )?;
        }
        self.nvml_devices(gpus)?;
        write!(
            self.out,
            "{{\"type\":\"summary\",\"scope\":\"total\",\"pid\":null,\"events\":{},\"dropped\":{},\"dropped_by_kind\":",
            snap.events, drops.total
        )?;
        let kinds = drops.by_kind.iter().map(|(kind, n)| (kind.name(), *n));
        counts(&mut self.out, kinds)?;
        write!(
            self.out,
            ",\"abandoned\":{},\"memory_limit_mb\":{},\"memory_budget\":{{\"tables_bytes\":{},\"kernel_name_bytes\":{},\"allocations\":{},\"exited_processes\":{},\"cupti_bytes\":{}}},\"evicted\":{{\"kernel_names\":{},\"allocations\":{},\"processes\":{},\"cupti_records\":{}}},\"decode_errors\":{},\"processes\":{},\"forgotten_processes\":{},\"unattributed_drops\":{unattributed},\"threshold_us\":{},\"trace_all\":{},\"sampled_out\":{{\"memcpy\":{},\"memset\":{},\"sync\":{},\"gpu_kernel\":{},\"gpu_memcpy\":{},\"gpu_memset\":{}}},\"demangler\":\"{}\",\"wall_ns\":{wall_ns}",
            snap.abandoned,
            snap.budget.limit_mb,
            snap.budget.tables_bytes,
            snap.budget.name_bytes,
            snap.budget.allocs,
            snap.budget.exited,
            snap.budget.cupti_bytes,
            snap.evicted.kernel_names,
            snap.evicted.allocations,
            snap.evicted.processes,
            snap.evicted.cupti_records,
            snap.decode_errors,
            snap.procs.len(),
            snap.forgotten,
            self.threshold_ns / 1000,
            self.trace_all,
            self.sampled_out[0],
            self.sampled_out[1],
            self.sampled_out[2],
            self.sampled_out[3],
            self.sampled_out[4],
            self.sampled_out[5],
            crate::decode::demangle::style()
        )?;
        self.nvml_total(gpus)?;
        let (cfg, n) = snap.anomalies;
        write!(
            self.out,
            ",\"anomalies\":{{\"mode\":\"{}\",\"threshold\":{},\"warmup\":{},\"checked\":{},\"flagged\":{},\"keys\":{},\"keys_evicted\":{},\"keys_refused\":{}}}",
            cfg.mode.name(),
            cfg.threshold,
            cfg.warmup,
            n.checked,
            n.flagged,
            n.keys,
            n.keys_evicted,
            n.keys_refused
        )?;
        for (key, value) in sum.agent {
            write!(self.out, ",\"{key}\":")?;
            serde_json::to_writer(&mut self.out, value).map_err(io::Error::other)?;
        }
        self.out.write_all(b"}\n")?;
        self.out.flush()
    }

    fn process_summary(
        &mut self,
        p: &ProcessView,
        nvml: Option<&ProcUse>,
        dropped: &[(gpu_observer_common::event::EventKind, u64)],
        verdict: Option<&Verdict>,
    ) -> io::Result<()> {
        let s = &p.stats;
        let o = &mut self.out;
        let total: u64 = dropped.iter().map(|(_, n)| n).sum();
        write!(
            o,
            "{{\"type\":\"summary\",\"scope\":\"process\",\"pid\":{},\"comm\":",
            p.pid
        )?;
        serde_json::to_writer(&mut *o, &p.comm).map_err(io::Error::other)?;
        write!(o, ",\"events\":{},\"dropped\":{total},\"dropped_by_kind\":", s.events)?;
        counts(o, dropped.iter().map(|(k, n)| (k.name(), *n)))?;
        write!(
            o,
            ",\"exited\":{},\"wall_ns\":{},\"launches\":{},\"named_launches\":{},\"unresolved_launches\":{},\"launch_apis\":",
            p.exited,
            p.span_ns(),
            s.launches,
            s.named_launches,
            s.unresolved_launches
        )?;
        counts(o, s.launch_apis.iter())?;
        o.write_all(b",\"memcpy\":{")?;
        for (i, d) in Direction::REPORTED.iter().enumerate() {
            let a = s.copies[i];
            write!(
                o,
                "{}\"{}\":{{\"count\":{},\"bytes\":{},\"duration_ns\":{},\"bandwidth_mbps\":{:.3}}}",
                if i == 0 { "" } else { "," },
                d.name(),
                a.count,
                a.bytes,
                a.ns,
                bandwidth_mbps(a.bytes, a.ns)
            )?;
        }
        write!(
            o,
            ",\"inferred\":{},\"pinned\":{},\"pageable\":{}}},\"memset\":{{\"count\":{},\"bytes\":{}}},\"alloc\":{{\"count\":{},\"bytes\":{}}},\"free\":{{\"count\":{},\"bytes\":{},\"unknown\":{}}},\"outstanding_bytes\":{},\"outstanding\":{{\"device\":{},\"managed\":{},\"host_pinned\":{},\"allocations\":{}}},\"leaks\":[",
            s.inferred_copies,
            s.pinned_copies,
            s.pageable_copies,
            s.memsets.count,
            s.memsets.bytes,
            s.allocs.count,
            s.allocs.bytes,
            s.frees.count,
            s.frees.bytes,
            s.unknown_frees,
            s.outstanding_bytes(),
            s.live_device,
            s.live_managed,
            s.live_host,
            s.live_allocs
        )?;
        for (i, Leak { api, mem, count, bytes }) in p.leaks.iter().enumerate() {
            write!(
                o,
                "{}{{\"api\":\"{api}\",\"memory\":\"{}\",\"count\":{count},\"bytes\":{bytes}}}",
                if i == 0 { "" } else { "," },
                mem.name()
            )?;
        }
        let span = p.span_ns() as f64;
        write!(
            o,
            "],\"sync\":{{\"count\":{},\"duration_ns\":{},\"wall_fraction\":{:.4},\"by_target\":[",
            s.syncs.count,
            s.syncs.ns,
            s.syncs.ns as f64 / span
        )?;
        for (i, (t, a)) in s.sync_by_target.iter().enumerate() {
            let (kind, handle) = t.kind_and_handle();
            write!(
                o,
                "{}{{\"kind\":\"{kind}\",\"handle\":{},\"count\":{},\"duration_ns\":{},\"wall_fraction\":{:.4}}}",
                if i == 0 { "" } else { "," },
                OptHex(handle),
                a.count,
                a.ns,
                a.ns as f64 / span
            )?;
        }
        write!(
            o,
            "]}},\"host_funcs\":{{\"count\":{},\"duration_ns\":{}}},\"init\":{{\"count\":{},\"duration_ns\":{}}},\"modules\":{{\"count\":{},\"duration_ns\":{}}},\"ioctl\":{{\"count\":{},\"duration_ns\":{},\"in_calls\":{},\"by_api\":{{",
            s.host_funcs.count,
            s.host_funcs.ns,
            s.inits.count,
            s.inits.ns,
            s.modules.count,
            s.modules.ns,
            s.ioctls.count,
            s.ioctls.ns,
            s.ioctls_in_calls
        )?;
        for (i, (api, a)) in s.ioctl_by_api.iter().enumerate() {
            write!(
                o,
                "{}\"{api}\":{{\"count\":{},\"duration_ns\":{}}}",
                if i == 0 { "" } else { "," },
                a.count,
                a.ns
            )?;
        }
        o.write_all(b"},\"top_commands\":[")?;
        let mut cmds: Vec<_> = s.ioctl_by_cmd.iter().collect();
        cmds.sort_by(|a, b| b.1.1.ns.cmp(&a.1.1.ns).then(a.0.cmp(b.0)));
        for (i, (cmd, (name, a))) in cmds.iter().take(10).enumerate() {
            write!(
                o,
                "{}{{\"cmd\":{}",
                if i == 0 { "" } else { "," },
                Hex(u64::from(**cmd))
            )?;
            opt_str(o, "name", *name)?;
            write!(o, ",\"count\":{},\"duration_ns\":{}}}", a.count, a.ns)?;
        }
        write!(
            o,
            "]}},\"slow_calls\":{},\"failed_calls\":{},\"abandoned\":{},\"calls\":",
            s.slow_calls, s.failed_calls, s.abandoned_calls
        )?;
        counts(o, s.call_apis.iter())?;
        self.gpu_summary(p.gpu.as_ref())?;
        self.nvml_process(nvml)?;
        // The whole run's verdict (null: the process was not seen at two ticks).
        match verdict {
            Some(v) => {
                self.out.write_all(b",\"verdict\":{")?;
                verdict_fields(&mut self.out, v)?;
                self.out.write_all(b"}")?;
            }
            None => self.out.write_all(b",\"verdict\":null")?,
        }
        self.out.write_all(b"}\n")
    }
}

/// JSON lines as an event output: the writer and where it writes.
pub struct JsonlSink<W: Write + Send> {
    pub writer: JsonlWriter<W>,
    /// For messages: the path, or "stdout".
    pub dest: String,
}

impl<W: Write + Send> Sink for JsonlSink<W> {
    fn describe(&self) -> String {
        format!("JSON lines to {}", self.dest)
    }

    fn event(&mut self, ev: &Event) -> anyhow::Result<()> {
        Ok(self.writer.event(ev)?)
    }

    fn gpu(&mut self, a: &GpuActivity) -> anyhow::Result<()> {
        Ok(self.writer.gpu(a)?)
    }

    fn cupti_state(&mut self, c: &CuptiChange) -> anyhow::Result<()> {
        Ok(self.writer.cupti(c)?)
    }

    fn nvtx(&mut self, r: &crate::correlate::nvtx::NvtxRange) -> anyhow::Result<()> {
        Ok(self.writer.nvtx(r)?)
    }

    fn gpu_timing(&mut self, n: &crate::export::sink::GpuTimingNote) -> anyhow::Result<()> {
        Ok(self.writer.gpu_timing(n)?)
    }

    fn capture(&mut self, e: &crate::observe::capture::Edge) -> anyhow::Result<()> {
        Ok(self.writer.capture(e)?)
    }

    fn memory(&mut self, ts_ns: u64, m: &MemorySample, comm: &str) -> anyhow::Result<()> {
        Ok(self.writer.memory(ts_ns, m, comm)?)
    }

    fn leaks(&mut self, r: &LeakReport<'_>) -> anyhow::Result<()> {
        Ok(self.writer.leaks(r)?)
    }

    fn verdict(&mut self, ts_ns: u64, v: &ProcessVerdict) -> anyhow::Result<()> {
        Ok(self.writer.verdict(ts_ns, v)?)
    }

    fn anomaly(&mut self, a: &crate::export::sink::AnomalyLine<'_>) -> anyhow::Result<()> {
        Ok(self.writer.anomaly(a)?)
    }

    fn wants_nvml(&self) -> bool {
        true
    }

    fn nvml(&mut self, line: &Line, comm: Option<&str>, devices: &[DeviceInfo]) -> anyhow::Result<()> {
        Ok(self.writer.nvml(line, comm, devices)?)
    }

    fn flush(&mut self) -> anyhow::Result<()> {
        Ok(self.writer.flush()?)
    }

    fn summary(&mut self, s: &Summary<'_>) -> anyhow::Result<()> {
        Ok(self.writer.summary(s)?)
    }
}

#[cfg(test)]
mod tests {
    use gpu_observer_common::api;

    use super::*;

    fn copy_line(duration_ns: u64, threshold_ns: u64, trace_all: bool) -> Option<serde_json::Value> {
        let spec = api::by_id(api::id_of("cuMemcpyHtoD_v2").unwrap()).unwrap();
        let ev = Event {
            ts_ns: 1,
            pid: 10,
            tid: 10,
            comm: *b"train\0\0\0\0\0\0\0\0\0\0\0",
            api: Some(spec),
            body: Body::Call(Call {
                bytes: Some(4096),
                ..Call::returned(spec, duration_ns)
            }),
        };
        let mut w = JsonlWriter::new(Vec::new(), threshold_ns, trace_all);
        w.event(&ev).unwrap();
        let out = String::from_utf8(w.out).unwrap();
        out.lines().next().map(|l| serde_json::from_str(l).unwrap())
    }

    /// The `anomaly` line of a robust-mode finding about a launch of pid 10, thread 11, at 5 ns.
    fn anomaly_line(finding: &crate::analyze::anomaly::Finding) -> String {
        let spec = api::by_id(api::id_of("cuLaunchKernel").unwrap()).unwrap();
        let ev = Event {
            ts_ns: 5,
            pid: 10,
            tid: 11,
            comm: *b"train\0\0\0\0\0\0\0\0\0\0\0",
            api: Some(spec),
            body: Body::Call(Call::returned(spec, 1_000)),
        };
        let mut w = JsonlWriter::new(Vec::new(), 100_000, false);
        w.anomaly(&crate::export::AnomalyLine {
            ts_ns: 5,
            pid: 10,
            tid: 11,
            comm: &ev.comm,
            finding,
            mode: crate::analyze::anomaly::Mode::Robust,
            flagged: crate::export::Flagged::Event(&ev),
            last: true,
        })
        .unwrap();
        String::from_utf8(w.out).unwrap()
    }

    #[test]
    fn an_anomaly_line_carries_a_hostile_kernel_name_escaped_and_whole() {
        use crate::analyze::anomaly::{Finding, What};
        // Quotes, a backslash, a newline, a terminal escape and 4 KiB: the line stays one line
        // of JSON with no raw control byte, and the name comes back exactly.
        let name = format!("k\"\\\n\x1b[31mred\x07{}", "x".repeat(4096));
        let finding = Finding {
            what: What::Kernel {
                name: std::sync::Arc::new(crate::decode::KernelName::new(&name)),
                grid: [2, 1, 1],
                block: [128, 1, 1],
            },
            observed: 20_000.0,
            typical: 2_000.0,
            deviation: 115.13,
        };
        let out = anomaly_line(&finding);
        assert_eq!(out.matches('\n').count(), 1, "one line");
        assert!(!out.bytes().any(|b| b < 0x20 && b != b'\n'), "no raw control byte");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["type"], "anomaly");
        assert_eq!(v["key"].as_str(), Some(name.as_str()));
        assert_eq!(v["grid"], serde_json::json!([2, 1, 1]));
        assert_eq!(v["block"], serde_json::json!([128, 1, 1]));
        assert_eq!(
            (v["observed"].as_f64(), v["typical"].as_f64()),
            (Some(20_000.0), Some(2_000.0))
        );
        assert_eq!(v["deviation"].as_f64(), Some(115.13));
    }

    #[test]
    fn a_copy_of_exactly_the_threshold_is_written_and_slow() {
        let at = copy_line(100_000, 100_000, false).expect("kept");
        assert_eq!(at["is_slow"], true);
        assert_eq!(
            copy_line(99_999, 100_000, false),
            None,
            "sampled out below the threshold"
        );
        let below = copy_line(99_999, 100_000, true).expect("--trace-all keeps it");
        assert_eq!(below["is_slow"], false);
    }

    fn kernel_finding() -> crate::analyze::anomaly::Finding {
        crate::analyze::anomaly::Finding {
            what: What::Kernel {
                name: std::sync::Arc::new(crate::decode::KernelName::new("gemm\u{1b}[2J")),
                grid: [20, 1, 1],
                block: [32, 1, 1],
            },
            observed: 20_000.0,
            typical: 2_000.0,
            deviation: 115.129_254_6,
        }
    }

    #[test]
    fn an_anomaly_line_says_what_against_what() {
        // The line is the finding's: what was flagged only matters to OTLP.
        assert_eq!(
            anomaly_line(&kernel_finding()),
            concat!(
                r#"{"type":"anomaly","ts_ns":5,"pid":10,"tid":11,"comm":"train","what":"kernel","#,
                r#""key":"gemm\u001b[2J","grid":[20, 1, 1],"block":[32, 1, 1],"observed":20000.0,"#,
                r#""typical":2000.0,"unit":"ns","deviation":115.13,"mode":"robust"}"#,
                "\n"
            )
        );
    }

    #[test]
    fn a_verdict_line_carries_the_windows_anomaly_count_and_its_most_severe() {
        use crate::analyze::{findings::Noted, verdict::classify, window::ProcessVerdict};
        let line = |anomalies, worst_anomaly| {
            let mut w = JsonlWriter::new(Vec::new(), 100_000, false);
            let verdict = classify(crate::analyze::verdict::Evidence {
                window_ns: 1_000_000_000,
                calls: 10,
                anomalies,
                worst_anomaly,
                ..Default::default()
            });
            w.verdict(
                7,
                &ProcessVerdict {
                    pid: 10,
                    comm: "train".into(),
                    verdict,
                },
            )
            .unwrap();
            let v: serde_json::Value = serde_json::from_slice(&w.out).unwrap();
            v
        };
        let none = line(0, None);
        assert_eq!(none["evidence"]["anomalies"], 0, "{none}");
        assert_eq!(none["evidence"]["worst_anomaly"], serde_json::Value::Null, "{none}");
        let some = line(
            3,
            Some(Noted {
                seq: 2,
                ts_ns: 1_234,
                finding: kernel_finding(),
            }),
        );
        assert_eq!(some["class"], "mixed", "{some}");
        assert_eq!(some["evidence"]["anomalies"], 3, "{some}");
        assert_eq!(
            some["evidence"]["worst_anomaly"],
            serde_json::json!({
                "what": "kernel",
                "key": "gemm\u{1b}[2J",
                "grid": [20, 1, 1],
                "block": [32, 1, 1],
                "observed": 20000.0,
                "typical": 2000.0,
                "unit": "ns",
                "deviation": 115.13,
                "ts_ns": 1234
            }),
            "{some}"
        );
        // The hint comes after the evidence, as before.
        assert_eq!(some["hint"], "no single bottleneck");
    }
}
