//! Attach: load the eBPF object, hook the tracepoints, and put uprobes on every libcuda file the
//! observed processes map (each file once, every probed variant it exports).

pub mod attacher;
pub mod discover;
pub mod follow;
pub mod inject;
mod multi;
pub mod open;
pub mod stats;
pub mod symbols;

use std::{
    collections::HashMap,
    ffi::{CStr, OsStr},
    num::NonZeroU32,
    os::unix::ffi::OsStrExt,
    path::Path,
};

use anyhow::{Context, Result, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{
        TracePoint, UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope},
    },
};
use gpu_observer_common::{
    api::{self, Family},
    config,
    event::EventKind,
    names,
};

pub use attacher::Attacher;
pub use discover::FileKey;

/// The eBPF object of gpu-observer, built by build.rs.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/gpu-observer"));

/// What attaching one library file did.
#[derive(Debug)]
pub struct AttachReport {
    pub entry_points: usize,
    pub probes: usize,
    /// Entry points whose attach failed (name, error).
    pub failed: Vec<(&'static str, String)>,
}

/// One attachment of a program to a library file.
enum Link {
    /// A uprobe-multi link; dropping it detaches every offset it covers.
    Multi(std::os::fd::OwnedFd),
    /// A perf-event uprobe of the named program, detached through aya.
    Perf(&'static str, UProbeLinkId),
}

/// The links that hold one library file.
struct AttachedFile {
    links: Vec<Link>,
    /// Fleet mode: the links of the entry points that follow the capture windows
    /// ([`crate::rules::follows_capture_windows`]) while a window is open, what they cover,
    /// and the file itself, kept open to attach them again at the next window.
    windowed: Option<WindowedLinks>,
}

/// The probes of one file that come and go with the capture windows.
struct WindowedLinks {
    file: std::fs::File,
    /// The links' process (0: every process).
    pid: u32,
    groups: Vec<LinkGroup>,
    /// Open links, return probes first (see [`Probes::set_window`]).
    open: Vec<(bool, std::os::fd::OwnedFd)>,
}

/// What opening or closing a capture window did.
#[derive(Clone, Copy, Debug, Default)]
pub struct WindowChange {
    /// Links attached or closed.
    pub links: usize,
    /// Links the kernel refused (at an open).
    pub failed: usize,
    /// Time it took, from the first link to the last (closing waits for RCU grace periods).
    pub took_us: u64,
    /// When the windowed entries began (open: the gate opened after their last link was
    /// attached) or stopped recording (close: the gate closed before their first link was),
    /// CLOCK_MONOTONIC. Returns of calls entered before it still record.
    pub at_ns: u64,
    /// The gate was written (a failed open records nothing: not a captured window).
    pub gated: bool,
}

/// Which processes are observed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every process on the machine.
    All,
    /// One process (`--pid N --no-children`, `run --no-children`).
    One(u32),
    /// A process and all its descendants, present and future (`--pid N`, `run`): links for
    /// every process, filtered in BPF by the tree the `task_newtask` tracepoint keeps.
    Tree(u32),
}

impl Scope {
    /// The process a `--pid` or `run` observes.
    pub fn root(self) -> Option<u32> {
        match self {
            Scope::All => None,
            Scope::One(p) | Scope::Tree(p) => Some(p),
        }
    }
}

/// Loaded programs and the set of library files they are attached to.
pub struct Probes {
    ebpf: Ebpf,
    scope: UProbeScope,
    attached: HashMap<FileKey, AttachedFile>,
    /// uprobe-multi programs, or None when the kernel lacks them (perf-event uprobes instead).
    multi: Option<multi::MultiPrograms>,
    /// Fleet mode: the windowed probes are attached only while a capture window is open.
    windows: bool,
    window_open: bool,
}

const UPROBE_PROGRAMS: [&str; 7] = [
    names::PROG_LAUNCH_KERNEL,
    names::PROG_LAUNCH_KERNEL_EX,
    names::PROG_GRAPH_LAUNCH,
    names::PROG_API_ENTER,
    names::PROG_API_EXIT,
    names::PROG_CUPTI_BATCH,
    names::PROG_CUPTI_NAME,
];

/// The offsets one uprobe-multi link covers.
#[derive(Default)]
struct LinkGroup {
    prog: &'static str,
    /// Return probe (`BPF_F_UPROBE_MULTI_RETURN`).
    ret: bool,
    /// Follows the capture windows.
    windowed: bool,
    apis: Vec<&'static str>,
    offsets: Vec<u64>,
    cookies: Vec<u64>,
}

/// One (program, offset) attachment of an entry point.
struct ProbePoint {
    id: u32,
    name: &'static str,
    offset: u64,
    prog: &'static str,
    /// A return probe.
    ret: bool,
    windowed: bool,
}

/// Every attachment a library's entry points need: the family's entry program, plus the return
/// program for calls whose duration matters.
fn probe_points(syms: &symbols::LibrarySymbols) -> Vec<ProbePoint> {
    let mut out = Vec::new();
    for (&id, &offset) in &syms.offsets {
        // Ids come from the table (symbols.rs looks names up in it).
        let Some(spec) = api::by_id(id) else { continue };
        let windowed = crate::rules::follows_capture_windows(spec);
        let entry = match spec.family {
            Family::Launch => names::PROG_LAUNCH_KERNEL,
            Family::LaunchEx => names::PROG_LAUNCH_KERNEL_EX,
            Family::GraphLaunch => names::PROG_GRAPH_LAUNCH,
            _ => names::PROG_API_ENTER,
        };
        out.push(ProbePoint {
            id,
            name: spec.name,
            offset,
            prog: entry,
            ret: false,
            windowed,
        });
        if spec.family.has_return_probe() {
            out.push(ProbePoint {
                id,
                name: spec.name,
                offset,
                prog: names::PROG_API_EXIT,
                ret: true,
                windowed,
            });
        }
    }
    out
}

impl Probes {
    /// Loads and verifies the programs and hooks the tracepoints; no uprobe is attached yet.
    /// `windows`: fleet mode, the windowed probes wait for [`Self::set_window`].
    pub fn load(ring_bytes: u32, observed: Scope, perf_uprobes: bool, windows: bool) -> Result<Self> {
        let pid_filter = observed.root();
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(names::EVENTS, ring_bytes)
            .load(EBPF_OBJECT)
            .map_err(crate::preflight::explain_load_error)?;
        {
            let mut cfg: Array<_, u32> = Array::try_from(map_mut(&mut ebpf, names::CONFIG)?)?;
            cfg.set(config::FILTER_TGID, pid_filter.unwrap_or(0), 0)?;
            cfg.set(config::AGENT_TGID, std::process::id(), 0)?;
            cfg.set(
                config::FOLLOW_CHILDREN,
                u32::from(matches!(observed, Scope::Tree(_))),
                0,
            )?;
        }
        let loaded = if perf_uprobes {
            Err(anyhow!("--perf-uprobes"))
        } else {
            multi::MultiPrograms::load(&ebpf, EBPF_OBJECT, &UPROBE_PROGRAMS)
        };
        let multi = match loaded {
            Ok(m) => Some(m),
            Err(e) if windows => {
                bail!("--capture-window needs uprobe-multi links (Linux 6.6+): {e:#}")
            }
            Err(e) => {
                eprintln!(
                    "gpu-observer: note: uprobe-multi links unavailable ({e:#}); using perf-event uprobes (slower to detach)"
                );
                for name in UPROBE_PROGRAMS {
                    uprobe(&mut ebpf, name)?
                        .load()
                        .map_err(crate::preflight::explain_program_error(name))?;
                }
                None
            }
        };
        for (name, category, event) in [
            (names::PROG_IOCTL_ENTER, "syscalls", "sys_enter_ioctl"),
            (names::PROG_IOCTL_EXIT, "syscalls", "sys_exit_ioctl"),
            (names::PROG_PROCESS_EXIT, "sched", "sched_process_exit"),
        ] {
            let prog: &mut TracePoint = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("program {name} missing from the eBPF object"))?
                .try_into()?;
            prog.load().map_err(crate::preflight::explain_program_error(name))?;
            prog.attach(category, event).with_context(|| {
                format!("attach tracepoint {category}/{event}: is tracefs mounted (/sys/kernel/tracing)?")
            })?;
        }
        if matches!(observed, Scope::Tree(_)) {
            follow::check_newtask_format()?;
            let prog: &mut TracePoint = ebpf
                .program_mut(names::PROG_TASK_NEWTASK)
                .ok_or_else(|| anyhow!("program {} missing from the eBPF object", names::PROG_TASK_NEWTASK))?
                .try_into()?;
            prog.load()
                .map_err(crate::preflight::explain_program_error(names::PROG_TASK_NEWTASK))?;
            prog.attach("task", "task_newtask").context(
                "attach tracepoint task/task_newtask (needed to follow children; --no-children does without)",
            )?;
        }
        // A tree's future members are not known yet: their probes must already be there when
        // they start, so the links are for every process and BPF filters (docs/DESIGN.md).
        let scope = match observed {
            Scope::One(pid) => NonZeroU32::new(pid).map_or(UProbeScope::AllProcesses, UProbeScope::OneProcess),
            Scope::All | Scope::Tree(_) => UProbeScope::AllProcesses,
        };
        Ok(Self {
            ebpf,
            scope,
            attached: HashMap::new(),
            multi,
            windows,
            window_open: false,
        })
    }

    /// The process uprobe-multi links are limited to (0: every process).
    fn link_pid(&self) -> u32 {
        match self.scope {
            UProbeScope::OneProcess(p) => p.get(),
            _ => 0,
        }
    }

    /// Library files attached so far.
    pub fn attached_count(&self) -> usize {
        self.attached.len()
    }

    pub fn is_attached(&self, key: &FileKey) -> bool {
        self.attached.contains_key(key)
    }

    /// Attaches every probed entry point of the open, validated library `opened`, through its
    /// descriptor (`/proc/self/fd/N`, see [`open::Opened::kernel_path`]). `Ok(None)` if that
    /// file already is; an error if no probe could be attached.
    pub fn attach_library(
        &mut self,
        opened: &open::Opened,
        syms: &symbols::LibrarySymbols,
    ) -> Result<Option<AttachReport>> {
        if self.attached.contains_key(&opened.key) {
            return Ok(None);
        }
        let path = opened.kernel_path();
        let mut report = AttachReport {
            entry_points: 0,
            probes: 0,
            failed: Vec::new(),
        };
        let (links, windowed) = if let Some(multi) = &self.multi {
            // Windowed groups come back only in fleet mode; they wait for the next window
            // unless one is open now.
            let (links, groups) = self.attach_multi(multi, &path, syms, &mut report);
            let mut windowed = None;
            if !groups.is_empty() {
                let mut w = WindowedLinks {
                    file: opened
                        .file
                        .try_clone()
                        .context("keep the library open for the capture windows")?,
                    pid: self.link_pid(),
                    groups,
                    open: Vec::new(),
                };
                if self.window_open {
                    let failed;
                    (w.open, failed) = w.attach(multi);
                    report.probes += w.open.len();
                    if failed > 0 && w.open.is_empty() && links.is_empty() {
                        bail!("the kernel refused every probe");
                    }
                }
                windowed = Some(w);
            }
            (links, windowed)
        } else {
            (self.attach_perf(&path, syms, &mut report)?, None)
        };
        if links.is_empty() && windowed.is_none() {
            let first = report
                .failed
                .first()
                .map(|(n, e)| format!("{n}: {e}"))
                .unwrap_or_default();
            bail!("the kernel refused every probe ({first})");
        }
        self.attached.insert(opened.key, AttachedFile { links, windowed });
        Ok(Some(report))
    }

    /// One uprobe-multi link per program for this file, of the probes that stay; the groups
    /// that follow the capture windows are returned unattached.
    fn attach_multi(
        &self,
        multi: &multi::MultiPrograms,
        path: &CStr,
        syms: &symbols::LibrarySymbols,
        report: &mut AttachReport,
    ) -> (Vec<Link>, Vec<LinkGroup>) {
        let pid = self.link_pid();
        let mut groups: Vec<LinkGroup> = Vec::new();
        for mut p in probe_points(syms) {
            // Without capture windows every probe stays: one link per program, as many as
            // ever (each link costs an RCU grace period to close).
            p.windowed &= self.windows;
            let i = match groups
                .iter()
                .position(|g| g.prog == p.prog && g.ret == p.ret && g.windowed == p.windowed)
            {
                Some(i) => i,
                None => {
                    groups.push(LinkGroup {
                        prog: p.prog,
                        ret: p.ret,
                        windowed: p.windowed,
                        ..Default::default()
                    });
                    groups.len() - 1
                }
            };
            let g = &mut groups[i];
            g.apis.push(p.name);
            g.offsets.push(p.offset);
            let gate = if p.windowed { api::Flags::WINDOWED } else { 0 };
            g.cookies.push(api::cookie(p.id) | u64::from(gate));
        }
        let (windowed, groups): (Vec<LinkGroup>, Vec<LinkGroup>) = groups.into_iter().partition(|g| g.windowed);
        let mut failed: std::collections::HashSet<&'static str> = std::collections::HashSet::new();
        let mut links = Vec::new();
        for LinkGroup {
            prog,
            ret,
            apis,
            offsets,
            cookies,
            ..
        } in groups
        {
            match multi.attach(prog, path, &offsets, &cookies, None, ret, pid) {
                Ok(link) => {
                    links.push(Link::Multi(link));
                    report.probes += offsets.len();
                }
                Err(e) => {
                    for name in apis {
                        if failed.insert(name) {
                            report.failed.push((name, format!("uprobe-multi link for {prog}: {e}")));
                        }
                    }
                }
            }
        }
        report.entry_points = syms.offsets.len() - failed.len();
        (links, windowed)
    }

    /// Opens or closes a capture window (fleet mode): attaches or closes the windowed probes
    /// of every attached file. At an open the return probes come first, so that no call
    /// entered in the window misses its return; at a close the entry probes go first, so that
    /// calls in flight return into the still-attached return probes for one more RCU grace
    /// period (~45 ms); a call still in flight after that is reported when its thread next
    /// enters a probed call, as abandoned (docs/DESIGN.md "Fleet mode").
    pub fn set_window(&mut self, open: bool) -> WindowChange {
        let start = std::time::Instant::now();
        let mut change = WindowChange::default();
        if !self.windows || open == self.window_open {
            return change;
        }
        self.window_open = open;
        let Some(multi) = &self.multi else { return change };
        // The gate (`config::WINDOW_OPEN`) opens after every link is attached and closes before
        // any is closed; its open is stamped before the write and its close after, and the
        // programs look at it on both sides of their timestamp (emit.rs `enter_probe`): the
        // windowed entries record exactly between the two timestamps,
        // while attaching and closing (milliseconds, and an RCU grace period per link) only
        // cost traps. A failed gate write leaves the window closed: nothing recorded.
        if open {
            for f in self.attached.values_mut() {
                if let Some(w) = &mut f.windowed {
                    let failed;
                    (w.open, failed) = w.attach(multi);
                    change.failed += failed;
                    change.links += w.open.len();
                }
            }
            change.at_ns = crate::clock::monotonic_ns();
            change.gated = self.set_config(config::WINDOW_OPEN, 1).is_ok();
        } else {
            change.gated = self.set_config(config::WINDOW_OPEN, 0).is_ok();
            change.at_ns = crate::clock::monotonic_ns();
            let (mut entries, mut returns) = (Vec::new(), Vec::new());
            for f in self.attached.values_mut() {
                if let Some(w) = &mut f.windowed {
                    for (ret, fd) in w.open.drain(..) {
                        if ret { returns.push(fd) } else { entries.push(fd) }
                    }
                }
            }
            change.links = entries.len() + returns.len();
            close_all(entries);
            close_all(returns);
        }
        change.took_us = start.elapsed().as_micros() as u64;
        change
    }

    /// Perf-event uprobes through aya, one per entry point and program.
    fn attach_perf(
        &mut self,
        path: &CStr,
        syms: &symbols::LibrarySymbols,
        report: &mut AttachReport,
    ) -> Result<Vec<Link>> {
        let path = Path::new(OsStr::from_bytes(path.to_bytes()));
        let mut failed = std::collections::HashSet::new();
        let mut links = Vec::new();
        for p in probe_points(syms) {
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(p.offset),
                cookie: Some(api::cookie(p.id)),
            };
            match uprobe(&mut self.ebpf, p.prog)?.attach(point, path, self.scope) {
                Ok(id) => {
                    links.push(Link::Perf(p.prog, id));
                    report.probes += 1;
                }
                Err(e) => {
                    failed.insert(p.name);
                    report.failed.push((p.name, format!("{e:#}")));
                }
            }
        }
        report.entry_points = syms.offsets.len() - failed.len();
        Ok(links)
    }

    /// Probes the hooks of a CUPTI injection library file (once per file). Its semaphore is
    /// the links' reference counter: raised in every process mapping the file, now or later,
    /// while we are attached, which is what turns the library's CUPTI collection on.
    pub fn attach_hooks(&mut self, opened: &open::Opened, hooks: &symbols::HookSymbols) -> Result<bool> {
        if self.attached.contains_key(&opened.key) {
            return Ok(false);
        }
        let multi = self.multi.as_ref().ok_or_else(|| {
            anyhow!("CUPTI hooks need uprobe-multi links (Linux 6.6+); this process is observed with uprobes only")
        })?;
        let path = opened.kernel_path();
        let pid = self.link_pid();
        let mut links = Vec::new();
        for (prog, offset) in [
            (names::PROG_CUPTI_BATCH, hooks.batch),
            (names::PROG_CUPTI_NAME, hooks.name),
        ] {
            let link = multi
                .attach(prog, &path, &[offset], &[0], Some(&[hooks.semaphore]), false, pid)
                .with_context(|| format!("attach {prog}"))?;
            links.push(Link::Multi(link));
        }
        self.attached.insert(opened.key, AttachedFile { links, windowed: None });
        Ok(true)
    }

    /// Detaches every probe of these files; returns the files that were attached.
    ///
    /// Closing a uprobe-multi link waits for an RCU grace period in the kernel (~45 ms here,
    /// five links a libcuda); the links are closed from threads of their own at once, so the
    /// waits overlap instead of adding up.
    pub fn release(&mut self, keys: &[FileKey]) -> usize {
        let mut fds = Vec::new();
        let mut released = 0;
        for key in keys {
            let Some(file) = self.attached.remove(key) else {
                continue;
            };
            released += 1;
            if let Some(w) = file.windowed {
                fds.extend(w.open.into_iter().map(|(_, fd)| fd));
            }
            for link in file.links {
                match link {
                    Link::Multi(fd) => fds.push(fd),
                    Link::Perf(prog, id) => {
                        if let Err(e) = uprobe(&mut self.ebpf, prog).and_then(|p| Ok(p.detach(id)?)) {
                            crate::say(format_args!("warning: detaching {prog}: {e:#}"));
                        }
                    }
                }
            }
        }
        close_all(fds);
        released
    }

    /// Stops every program (they return at their first instruction) without detaching.
    pub fn disable(&mut self) -> Result<()> {
        self.set_config(config::DISABLED, 1)
    }

    fn set_config(&mut self, slot: u32, value: u32) -> Result<()> {
        let mut cfg: Array<_, u32> = Array::try_from(map_mut(&mut self.ebpf, names::CONFIG)?)?;
        cfg.set(slot, value, 0)?;
        Ok(())
    }

    /// Records a process's ioctls from now on (it maps libcuda, but may not have called it yet).
    pub fn observe_pid(&mut self, pid: u32) -> Result<()> {
        let mut observed: BpfHashMap<_, u32, u32> = BpfHashMap::try_from(map_mut(&mut self.ebpf, names::OBSERVED)?)?;
        observed.insert(pid, 1, 0)?;
        Ok(())
    }

    /// Adds processes to the followed tree (descendants found in /proc): (pid, parent).
    pub fn follow(&mut self, members: &[(u32, u32)]) -> Result<()> {
        let mut map: BpfHashMap<_, u32, u32> = BpfHashMap::try_from(map_mut(&mut self.ebpf, names::FOLLOWED)?)?;
        for &(pid, parent) in members {
            if map.get(&pid, 0).is_err() {
                map.insert(pid, parent, 0)?;
            }
        }
        Ok(())
    }

    /// The followed tree's members now (not the root).
    pub fn followed(&self) -> Vec<u32> {
        let Some(m) = self.ebpf.map(names::FOLLOWED) else {
            return Vec::new();
        };
        let Ok(map) = BpfHashMap::<_, u32, u32>::try_from(m) else {
            return Vec::new();
        };
        map.keys().filter_map(Result::ok).collect()
    }

    /// Children of followed processes that did not fit in the tree's map (not observed).
    pub fn follow_missed(&self) -> u64 {
        let Some(m) = self.ebpf.map(names::FOLLOW_MISSED) else {
            return 0;
        };
        let Ok(a) = PerCpuArray::<_, u64>::try_from(m) else {
            return 0;
        };
        a.get(&0, 0).map(|v| v.iter().sum()).unwrap_or(0)
    }

    /// The ring buffer, moved out to the reader thread.
    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map(names::EVENTS)
            .ok_or_else(|| anyhow!("map {} missing", names::EVENTS))?;
        Ok(RingBuf::try_from(map)?)
    }

    /// Records dropped because the ring was full, by kind and by process.
    pub fn drops(&self) -> Result<Drops> {
        let per_kind: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map(names::DROPS)
                .ok_or_else(|| anyhow!("map DROPS missing"))?,
        )?;
        let mut drops = Drops::default();
        for kind in EventKind::ALL {
            let n: u64 = per_kind.get(&(kind as u32), 0)?.iter().sum();
            drops.by_kind.push((kind, n));
            drops.total += n;
        }
        let per_pid: PerCpuHashMap<_, u64, u64> = PerCpuHashMap::try_from(
            self.ebpf
                .map(names::DROPS_BY_PID)
                .ok_or_else(|| anyhow!("map DROPS_BY_PID missing"))?,
        )?;
        for item in per_pid.iter() {
            let (key, values) = item?;
            let n: u64 = values.iter().sum();
            // The programs write only valid kinds (gpu_observer_common::event::drop_key).
            let (pid, kind) = ((key >> 8) as u32, EventKind::from_u32((key & 0xff) as u32));
            if let Some(kind) = kind {
                let kinds = drops.by_pid_kind.entry(pid).or_default();
                match kinds.iter_mut().find(|(k, _)| *k == kind) {
                    Some((_, total)) => *total += n,
                    None => kinds.push((kind, n)),
                }
            }
        }
        Ok(drops)
    }
}

impl Drop for Probes {
    /// Every library's links at once (see [`Probes::release`]), before aya drops the rest.
    fn drop(&mut self) {
        let keys: Vec<FileKey> = self.attached.keys().copied().collect();
        self.release(&keys);
    }
}

impl WindowedLinks {
    /// Attaches every group through the kept file, return probes first: the links, and the
    /// number of groups the kernel refused.
    fn attach(&self, multi: &multi::MultiPrograms) -> (Vec<(bool, std::os::fd::OwnedFd)>, usize) {
        let path = open::fd_path(std::os::fd::AsRawFd::as_raw_fd(&self.file));
        let (mut open, mut failed) = (Vec::new(), 0);
        for ret in [true, false] {
            for g in self.groups.iter().filter(|g| g.ret == ret) {
                match multi.attach(g.prog, &path, &g.offsets, &g.cookies, None, g.ret, self.pid) {
                    Ok(fd) => open.push((ret, fd)),
                    Err(e) => {
                        failed += 1;
                        crate::say(format_args!("warning: capture window: attaching {}: {e}", g.prog));
                    }
                }
            }
        }
        (open, failed)
    }
}

/// Closes descriptors from parallel threads (at most 64 at a time); one that cannot get a
/// thread is closed here.
fn close_all(fds: Vec<std::os::fd::OwnedFd>) {
    let mut fds = fds.into_iter().peekable();
    while fds.peek().is_some() {
        let threads: Vec<_> = fds
            .by_ref()
            .take(64)
            .filter_map(|fd| std::thread::Builder::new().spawn(move || drop(fd)).ok())
            .collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

/// Ring-buffer overflow counts.
#[derive(Clone, Debug, Default)]
pub struct Drops {
    pub total: u64,
    pub by_kind: Vec<(EventKind, u64)>,
    /// Per process, by kind.
    pub by_pid_kind: HashMap<u32, Vec<(EventKind, u64)>>,
}

impl Drops {
    /// A process's drops, all kinds.
    pub fn of_pid(&self, pid: u32) -> u64 {
        self.by_pid_kind
            .get(&pid)
            .map_or(0, |kinds| kinds.iter().map(|(_, n)| n).sum())
    }
}

fn map_mut<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut aya::maps::Map> {
    ebpf.map_mut(name)
        .ok_or_else(|| anyhow!("map {name} missing from the eBPF object"))
}

fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    Ok(ebpf
        .program_mut(name)
        .ok_or_else(|| anyhow!("program {name} missing from the eBPF object"))?
        .try_into()?)
}
