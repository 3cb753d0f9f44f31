//! Correlate: per-process state built from the event stream, and what only it can tell —
//! kernel names behind launch handles, where a copy's bytes went (from the allocations seen),
//! the size of a free, the device behind an ioctl's fd.
//!
//! Bounded: names, live allocations, streams and ioctl commands are capped per process, and
//! exited processes keep only their counters (and are forgotten past a cap, counted). Kernel
//! names, live allocations and exited processes are also capped over all processes together by
//! a [`Budget`] derived from `--memory-limit-mb`, so no number of processes can add up past it;
//! what does not fit is not remembered and is counted in [`Evicted`].

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::Arc,
};

use gpu_observer_common::{
    api::{Direction, Family, MemKind},
    cupti::CuptiState,
};

use crate::{
    decode::{Body, Call, Event, HostMemory, KernelName},
    rules,
};

mod busy;
pub mod cupti_join;
pub mod late_names;
pub mod nvtx;

use cupti_join::{GpuActivity, GpuState, Pool, Recent, Status};

/// Live allocations remembered per process.
const MAX_LIVE_ALLOCS: usize = 1 << 20;
/// Kernel/function handles named per process.
const MAX_NAMES: usize = 1 << 20;
/// Distinct streams (and events, contexts) with their own sync counters per process.
const MAX_SYNC_HANDLES: usize = 256;
/// Threads whose launches are counted per process.
pub const MAX_LAUNCH_THREADS: usize = 64;
/// Distinct ioctl commands counted per process.
const MAX_IOCTL_CMDS: usize = 256;
/// Exited processes whose counters are kept for the final summary (at most; see [`Budget`]).
/// Few: an agent that runs for days on a node where jobs come and go would otherwise keep
/// growing for as long as it takes to fill a large table (~35 KB each, measured in the soak,
/// docs/BENCHMARKS.md), and a summary of thousands of exited processes is read by nobody; the
/// total's event and abandoned counts stay exact, and `forgotten_processes` says how many left.
const MAX_EXITED: usize = 256;
/// Bytes a remembered kernel name costs beyond its two strings (map slot, `Arc`, boxes).
const NAME_OVERHEAD: u64 = 96;
/// Bytes a remembered live allocation costs (B-tree slot with its key and value).
const ALLOC_COST: u64 = 64;
/// Bytes an exited process's counters may cost at worst (capped maps of ioctl commands, sync
/// handles and API counts, see the `MAX_*` above, and the names of its top GPU kernels kept by
/// [`cupti_join::GpuState::release`]).
const EXITED_COST: u64 = 80 * 1024;
/// Kernels an exited process keeps for its final summary (the most launched).
const EXITED_TOP_KERNELS: usize = 16;

/// How much of the agent's memory each growable table may use, over all processes together.
///
/// Derived from `--memory-limit-mb` once the agent runs (at the first event): what the agent
/// already holds then (its resident set: code, the loaded eBPF objects, buffers), twice the
/// ring buffer (its data pages are mapped twice) and [`SLACK_BYTES`] are taken off; of the rest,
/// 3/8 is for kernel names, 3/16 for live allocations, 3/16 for exited processes' counters and
/// a quarter for the CUPTI join (calls waiting for their API record, correlation ids, activity
/// waiting for its call, CUPTI's kernel names: [`cupti_join::Pool`]). Never less than [`MIN_TABLES_BYTES`] in all: a limit below what the agent needs to
/// run cannot be kept, and the summary's `memory_budget` shows what was used.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub limit_mb: u64,
    /// Bytes for the tables, over all processes (0 until derived).
    pub tables_bytes: u64,
    pub name_bytes: u64,
    pub allocs: u64,
    pub exited: usize,
    /// Bytes for the CUPTI join state of all processes.
    pub cupti_bytes: u64,
}

/// Allocator slack and what the final summary's formatting needs.
const SLACK_BYTES: u64 = 8 << 20;
/// The least the tables get whatever the limit.
const MIN_TABLES_BYTES: u64 = 4 << 20;

impl Budget {
    /// Budgets for `mb` when the agent already holds `resident` bytes and maps a ring of
    /// `ring_bytes`.
    pub fn derive(mb: u64, resident: u64, ring_bytes: u64) -> Self {
        let limit = mb.saturating_mul(1 << 20);
        let tables = limit
            .saturating_sub(resident)
            .saturating_sub(ring_bytes.saturating_mul(2))
            .saturating_sub(SLACK_BYTES)
            .max(MIN_TABLES_BYTES);
        Self {
            limit_mb: mb,
            tables_bytes: tables,
            name_bytes: tables / 8 * 3,
            allocs: tables / 16 * 3 / ALLOC_COST,
            exited: usize::try_from(tables / 16 * 3 / EXITED_COST)
                .unwrap_or(MAX_EXITED)
                .clamp(16, MAX_EXITED),
            cupti_bytes: tables / 4,
        }
    }
}

impl Default for Budget {
    fn default() -> Self {
        Self::derive(DEFAULT_MEMORY_LIMIT_MB, 0, 0)
    }
}

/// What the correlator needs to know about a process beyond its events (read from /proc by
/// `procinfo`; the correlator itself does no I/O).
pub trait Lookup: Send {
    /// The process's command name.
    fn comm(&self, pid: u32) -> Option<String>;
    /// The path an fd of the process points at (`/dev/nvidia-uvm`).
    fn fd_target(&self, pid: u32, fd: u32) -> Option<Arc<str>>;
    /// The agent's own resident set, in bytes (0 when unknown).
    fn own_resident_bytes(&self) -> u64;
}

impl Lookup for crate::procinfo::ProcInfo {
    fn comm(&self, pid: u32) -> Option<String> {
        crate::procinfo::ProcInfo::comm(self, pid)
    }

    fn fd_target(&self, pid: u32, fd: u32) -> Option<Arc<str>> {
        crate::procinfo::ProcInfo::fd_target(self, pid, fd)
    }

    fn own_resident_bytes(&self) -> u64 {
        crate::procinfo::ProcInfo::own_resident_bytes(self)
    }
}

/// Knows nothing: events alone (replays and tests).
pub struct NoLookup;

impl Lookup for NoLookup {
    fn comm(&self, _: u32) -> Option<String> {
        None
    }

    fn fd_target(&self, _: u32, _: u32) -> Option<Arc<str>> {
        None
    }

    fn own_resident_bytes(&self) -> u64 {
        0
    }
}

/// The agent's default memory ceiling (`--memory-limit-mb`).
pub const DEFAULT_MEMORY_LIMIT_MB: u64 = 256;

/// What the [`Budget`] made the agent not remember, by kind (the summary's `evicted`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Kernel names not remembered (their launches say `kernel: null`, counted unresolved).
    pub kernel_names: u64,
    /// Allocations not tracked (their frees count as `unknown_frees`, their bytes not live).
    pub allocations: u64,
    /// Exited processes forgotten, oldest first (also `forgotten_processes`).
    pub processes: u64,
    /// CUPTI join state let go because its share of the budget was full: uprobe calls that
    /// stopped waiting for their API record, correlation ids forgotten (their later activity is
    /// unjoined), activity records sent out unjoined before their API record came, device
    /// records not kept (see [`cupti_join::Pool`]).
    pub cupti_records: u64,
}

/// What the tables hold now, against the [`Budget`].
#[derive(Clone, Copy, Debug, Default)]
struct Used {
    name_bytes: u64,
    allocs: u64,
    cupti_bytes: u64,
}

fn name_cost(n: &KernelName) -> u64 {
    NAME_OVERHEAD + n.mangled.len() as u64 + n.demangled.len() as u64
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Amount {
    pub count: u64,
    pub bytes: u64,
    pub ns: u64,
}

impl Amount {
    /// Saturating: sizes and durations come from the observed process (a call the driver
    /// refuses can still name 2^64 bytes), and a total must never wrap or panic.
    fn add(&mut self, bytes: u64, ns: u64) {
        self.count = self.count.saturating_add(1);
        self.bytes = self.bytes.saturating_add(bytes);
        self.ns = self.ns.saturating_add(ns);
    }
}

/// What a sync waited on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SyncTarget {
    Context,
    Stream(u64),
    Event(u64),
    /// Past [`MAX_SYNC_HANDLES`].
    Other,
}

impl SyncTarget {
    /// What was waited for, by kind, and its handle when it has one (the outputs name it so).
    pub const fn kind_and_handle(self) -> (&'static str, Option<u64>) {
        match self {
            SyncTarget::Context => ("context", None),
            SyncTarget::Stream(h) => ("stream", Some(h)),
            SyncTarget::Event(h) => ("event", Some(h)),
            SyncTarget::Other => ("other", None),
        }
    }
}

/// A live allocation.
#[derive(Clone, Copy, Debug)]
struct Alloc {
    bytes: u64,
    mem: MemKind,
    api: &'static str,
}

/// Counters of one process.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub events: u64,
    pub launches: u64,
    /// Launches per thread (at most [`MAX_LAUNCH_THREADS`]; later threads are not listed):
    /// which threads issue the work, for the verdict's launching-thread CPU time.
    pub launch_tids: BTreeMap<u32, u64>,
    pub launch_apis: BTreeMap<&'static str, u64>,
    /// Kernel launches whose handle was named (graph launches are neither named nor unresolved).
    pub named_launches: u64,
    /// Kernel launches of handles never named while observed (loaded before the observer).
    pub unresolved_launches: u64,
    /// Indexed like [`Direction::REPORTED`].
    pub copies: [Amount; 4],
    /// Generic/peer copies whose direction came from tracked allocations.
    pub inferred_copies: u64,
    pub pinned_copies: u64,
    pub pageable_copies: u64,
    pub memsets: Amount,
    pub allocs: Amount,
    pub frees: Amount,
    /// Live bytes by memory kind: device, managed, host (pinned).
    pub live_device: u64,
    pub live_managed: u64,
    pub live_host: u64,
    pub live_allocs: u64,
    pub syncs: Amount,
    pub sync_by_target: BTreeMap<SyncTarget, Amount>,
    pub inits: Amount,
    /// Host functions queued in streams (`cuLaunchHostFunc`): each stalls its stream while it runs.
    pub host_funcs: Amount,
    pub modules: Amount,
    pub ioctls: Amount,
    /// ioctls issued inside a probed call.
    pub ioctls_in_calls: u64,
    /// ioctls by the call they happened in.
    pub ioctl_by_api: BTreeMap<&'static str, Amount>,
    /// ioctls by (command, its name).
    pub ioctl_by_cmd: HashMap<u32, (Option<&'static str>, Amount)>,
    /// Calls that returned an error.
    pub failed_calls: u64,
    /// Calls that never returned (longjmp or an exception out of the driver), reported as such.
    pub abandoned_calls: u64,
    pub call_apis: BTreeMap<&'static str, u64>,
    /// Frees of pointers the agent never saw allocated (allocated before it attached).
    pub unknown_frees: u64,
    /// Copies, memsets and syncs longer than the threshold.
    pub slow_calls: u64,
}

impl Stats {
    pub fn copy(&self, d: Direction) -> Amount {
        self.copies[d.index()]
    }

    pub fn outstanding_bytes(&self) -> u64 {
        self.live_device + self.live_managed + self.live_host
    }

    fn live_mut(&mut self, mem: MemKind) -> &mut u64 {
        match mem {
            MemKind::Managed => &mut self.live_managed,
            MemKind::Host => &mut self.live_host,
            MemKind::Device | MemKind::None => &mut self.live_device,
        }
    }
}

/// Unfreed allocations of a process, grouped by the API that made them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leak {
    pub api: &'static str,
    pub mem: MemKind,
    pub count: u64,
    pub bytes: u64,
}

#[derive(Debug)]
pub struct Process {
    pub pid: u32,
    /// Which process with this pid (the n-th the correlator created): a pid reused, or a
    /// process forgotten and seen again, gets a new one.
    pub serial: u64,
    pub comm: String,
    pub first_ts: u64,
    /// End of the latest call seen (entry + duration).
    pub last_ts: u64,
    pub exited: bool,
    pub stats: Stats,
    /// Launches per kernel name, keyed by the name's allocation (no hashing of the string).
    kernels: HashMap<usize, (Arc<KernelName>, u64)>,
    live: BTreeMap<u64, Alloc>,
    /// What `live` adds up to by (entry point, memory kind), kept as allocations come and go
    /// so a leak report costs the number of entry points, not of allocations.
    live_by: BTreeMap<(&'static str, u8), Leak>,
    names: HashMap<u64, Arc<KernelName>>,
    fds: HashMap<u32, Option<Arc<str>>>,
    /// What an exited process never freed, summed at its exit (its `live` map is released).
    exit_leaks: Vec<Leak>,
    /// Memory counters changed since the last sample.
    memory_dirty: bool,
    /// Anything changed since the last snapshot took this process.
    changed: bool,
    /// CUPTI join state, once the process's injection library has reported.
    pub gpu: Option<Box<GpuState>>,
}

impl Process {
    fn new(pid: u32, serial: u64, ts: u64) -> Self {
        Self {
            pid,
            serial,
            comm: String::new(),
            first_ts: ts,
            last_ts: ts,
            exited: false,
            stats: Stats::default(),
            kernels: HashMap::new(),
            live: BTreeMap::new(),
            live_by: BTreeMap::new(),
            names: HashMap::new(),
            fds: HashMap::new(),
            exit_leaks: Vec::new(),
            memory_dirty: false,
            changed: true,
            gpu: None,
        }
    }

    /// The live allocation containing `ptr`.
    fn containing(&self, ptr: u64) -> Option<&Alloc> {
        let (start, a) = self.live.range(..=ptr).next_back()?;
        (ptr - start < a.bytes.max(1)).then_some(a)
    }

    /// The command name as the fixed-size field of GPU lines.
    fn comm_bytes(&self) -> [u8; 16] {
        let mut c = [0u8; 16];
        let n = self.comm.len().min(15);
        c[..n].copy_from_slice(&self.comm.as_bytes()[..n]);
        c
    }

    /// The process's wall span observed so far, in ns (at least 1).
    pub fn span_ns(&self) -> u64 {
        self.last_ts.saturating_sub(self.first_ts).max(1)
    }

    pub fn leaks(&self) -> Vec<Leak> {
        if self.exited {
            return self.exit_leaks.clone();
        }
        self.live_leaks()
    }

    /// What the live allocations add up to, by entry point and memory kind.
    fn live_leaks(&self) -> Vec<Leak> {
        self.live_by.values().cloned().collect()
    }

    /// The most launched kernels: (demangled name, launches), most first.
    pub fn top_kernels(&self, n: usize) -> Vec<(Arc<KernelName>, u64)> {
        let mut by_name: HashMap<&str, (&Arc<KernelName>, u64)> = HashMap::new();
        for (k, count) in self.kernels.values() {
            by_name.entry(&k.demangled).or_insert((k, 0)).1 += count;
        }
        let mut v: Vec<(&str, (&Arc<KernelName>, u64))> = by_name.into_iter().collect();
        v.sort_by(|a, b| b.1.1.cmp(&a.1.1).then(a.0.cmp(b.0)));
        v.into_iter().take(n).map(|(_, (k, c))| (k.clone(), c)).collect()
    }

    /// Distinct kernel handles launched (what [`Self::top_kernels`] walks).
    pub fn kernel_count(&self) -> usize {
        self.kernels.len()
    }

    /// Whether anything changed since the last call (a snapshot reuses what did not).
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// Counts an allocation into [`Self::live_by`] (`sign` +1) or out of it (-1).
    fn tally(&mut self, a: Alloc, add: bool) {
        let key = (a.api, a.mem as u8);
        let l = self.live_by.entry(key).or_insert(Leak {
            api: a.api,
            mem: a.mem,
            count: 0,
            bytes: 0,
        });
        if add {
            l.count += 1;
            l.bytes = l.bytes.saturating_add(a.bytes);
        } else {
            l.count = l.count.saturating_sub(1);
            l.bytes = l.bytes.saturating_sub(a.bytes);
            if l.count == 0 {
                self.live_by.remove(&key);
            }
        }
    }

    /// Remembers a handle's name if the per-process cap and the global budget allow.
    fn name(&mut self, handle: u64, name: Arc<KernelName>, budget: &Budget, used: &mut Used, evicted: &mut Evicted) {
        let cost = name_cost(&name);
        let old = self.names.get(&handle).map_or(0, |n| name_cost(n));
        let fits = (self.names.len() < MAX_NAMES || old != 0) && used.name_bytes - old + cost <= budget.name_bytes;
        if !fits {
            evicted.kernel_names += 1;
            return;
        }
        used.name_bytes = used.name_bytes - old + cost;
        self.names.insert(handle, name);
    }

    /// At exit: sums what was never freed and releases the per-handle tables.
    fn release(&mut self, used: &mut Used) {
        self.exit_leaks = self.live_leaks();
        used.name_bytes -= self.names.values().map(|n| name_cost(n)).sum::<u64>();
        used.allocs -= self.live.len() as u64;
        self.names = HashMap::new();
        self.live = BTreeMap::new();
        self.live_by = BTreeMap::new();
        self.fds = HashMap::new();
        // Kernel launch counts hold their names: keep the most launched for the summary.
        if self.kernels.len() > EXITED_TOP_KERNELS {
            let mut v: Vec<(usize, (Arc<KernelName>, u64))> = self.kernels.drain().collect();
            v.sort_by_key(|k| std::cmp::Reverse(k.1.1));
            v.truncate(EXITED_TOP_KERNELS);
            self.kernels = v.into_iter().collect();
        }
    }

    /// Which side of a copy a pointer is on, from the allocations seen.
    fn side(&self, ptr: u64) -> Side {
        match self.containing(ptr).map(|a| a.mem) {
            Some(MemKind::Device | MemKind::Managed | MemKind::None) => Side::Gpu,
            Some(MemKind::Host) => Side::PinnedHost,
            None => Side::Untracked,
        }
    }

    /// The device file behind an fd, looked up once per fd.
    fn device(&mut self, fd: u32, lookup: &dyn Lookup) -> Option<Arc<str>> {
        let pid = self.pid;
        self.fds.entry(fd).or_insert_with(|| lookup.fd_target(pid, fd)).clone()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Gpu,
    PinnedHost,
    /// Not allocated through the driver while observed: ordinary host memory, or memory
    /// allocated before the observer attached.
    Untracked,
}

/// Direction of a copy whose API does not say, from where its pointers live.
fn infer_direction(dst: Side, src: Side) -> Option<Direction> {
    use Side::*;
    match (dst, src) {
        (Gpu, Gpu) => Some(Direction::GpuToGpu),
        (Gpu, PinnedHost | Untracked) => Some(Direction::CpuToGpu),
        (PinnedHost | Untracked, Gpu) => Some(Direction::GpuToCpu),
        _ => None,
    }
}

/// A point of a process's memory timeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemorySample {
    pub pid: u32,
    pub device: u64,
    pub managed: u64,
    pub host: u64,
    pub allocations: u64,
}

/// A process's CUPTI state changed (a `cupti` line, a message on stderr).
#[derive(Clone, Debug)]
pub struct CuptiChange {
    pub pid: u32,
    pub ts_ns: u64,
    pub comm: String,
    pub status: Status,
}

pub struct Correlator {
    pub procs: HashMap<u32, Process>,
    pub events: u64,
    pub decode_errors: u64,
    /// Exited processes forgotten because of [`MAX_EXITED`].
    pub forgotten: u64,
    /// Abandoned calls of the forgotten processes (the total stays exact).
    forgotten_abandoned: u64,
    pub budget: Budget,
    /// (limit MB, ring bytes) until the budget is derived at the first event.
    pending_limit: Option<(u64, u64)>,
    used: Used,
    /// What the budget made the agent not remember.
    pub evicted: Evicted,
    /// Copies, memsets and syncs that take at least this are slow ([`rules::is_slow`]).
    pub threshold_ns: u64,
    exited_order: VecDeque<u32>,
    /// GPU activity joined since the last drain (written by the pipeline).
    pub gpu_out: Vec<GpuActivity>,
    /// CUPTI state changes since the last drain.
    pub cupti_changes: Vec<CuptiChange>,
    /// NVTX ranges and marks finished since the last drain.
    pub nvtx_out: Vec<nvtx::NvtxRange>,
    /// Launches waiting for CUPTI to name their handle.
    pub held: late_names::Held,
    /// Processes created so far ([`Process::serial`]).
    serials: u64,
    lookup: Box<dyn Lookup>,
}

impl Correlator {
    /// A correlator that learns nothing beyond the events ([`NoLookup`]); see [`Self::with_lookup`].
    pub fn new(threshold_ns: u64) -> Self {
        Self {
            procs: HashMap::new(),
            events: 0,
            decode_errors: 0,
            forgotten: 0,
            forgotten_abandoned: 0,
            budget: Budget::default(),
            pending_limit: None,
            used: Used::default(),
            evicted: Evicted::default(),
            threshold_ns,
            exited_order: VecDeque::new(),
            gpu_out: Vec::new(),
            cupti_changes: Vec::new(),
            nvtx_out: Vec::new(),
            held: Default::default(),
            serials: 0,
            lookup: Box::new(NoLookup),
        }
    }

    /// Where process names and fd targets come from (`procinfo` on a live system).
    pub fn with_lookup(mut self, lookup: Box<dyn Lookup>) -> Self {
        self.lookup = lookup;
        self
    }

    /// Sets the global table budgets from `--memory-limit-mb` and the ring buffer's size; they
    /// are derived at the first event, when what the running agent holds is known.
    pub fn with_memory_limit_mb(mut self, mb: u64, ring_bytes: u32) -> Self {
        self.budget = Budget::derive(mb, 0, 0);
        self.pending_limit = Some((mb, u64::from(ring_bytes)));
        self
    }

    /// Launches that waited for their name and may go now (late_names.rs), appended to
    /// `batch`; the ones [`Self::observe`] marked to wait are taken out of it. `now_ns`
    /// `u64::MAX`: all of them (the end of the run).
    pub fn settle_held(&mut self, batch: &mut Vec<Event>, now_ns: u64) {
        self.held.settle(batch, now_ns, &mut self.procs);
    }

    /// Folds one event in and fills in what only the agent knows.
    pub fn observe(&mut self, ev: &mut Event) {
        self.events += 1;
        if let Some((mb, ring)) = self.pending_limit.take() {
            self.budget = Budget::derive(mb, self.lookup.own_resident_bytes(), ring);
        }
        let threshold = self.threshold_ns;
        let (budget, used, evicted, lookup) = (&self.budget, &mut self.used, &mut self.evicted, &*self.lookup);
        // The CUPTI join's share of the budget, borrowed where it is needed.
        macro_rules! pool {
            () => {
                &mut Pool {
                    limit: budget.cupti_bytes,
                    used: &mut used.cupti_bytes,
                    evicted: &mut evicted.cupti_records,
                    names_evicted: &mut evicted.kernel_names,
                }
            };
        }
        let p = self.procs.entry(ev.pid).or_insert_with(|| {
            self.serials += 1;
            Process::new(ev.pid, self.serials, ev.ts_ns)
        });
        // GPU records come from the injection library's own threads: their names are not the
        // process's (look it up the first time, if nothing else named the process).
        let hook = matches!(ev.body, Body::Gpu(_) | Body::GpuName { .. } | Body::MarkerName { .. });
        p.changed = true;
        if hook {
            if p.comm.is_empty() {
                p.comm = lookup.comm(ev.pid).unwrap_or_default();
            }
        } else if p.comm.is_empty() || ev.tid == ev.pid {
            let comm = ev.comm();
            if p.comm != *comm {
                p.comm = comm.into_owned();
            }
        }
        p.first_ts = p.first_ts.min(ev.ts_ns);
        p.last_ts = p.last_ts.max(ev.ts_ns);
        p.stats.events += 1;
        let api = ev.api;
        match &mut ev.body {
            Body::Launch(l) => {
                let s = &mut p.stats;
                s.launches += 1;
                if s.launch_tids.len() < MAX_LAUNCH_THREADS || s.launch_tids.contains_key(&ev.tid) {
                    *s.launch_tids.entry(ev.tid).or_default() += 1;
                }
                let spec = api.map(|a| (a.name, a.family));
                *s.launch_apis.entry(spec.map_or("?", |a| a.0)).or_default() += 1;
                if spec.is_some_and(|a| a.1 != Family::GraphLaunch) {
                    l.kernel = p.names.get(&l.function).cloned();
                    // An unknown handle while CUPTI runs in a process it was injected into
                    // (its handles were loaded before the observer came): its kernel record
                    // will name it (late_names.rs). Under `run` the uprobes saw every handle
                    // that has a name, and launches are written as they come.
                    if l.kernel.is_none()
                        && p.gpu.as_deref().is_some_and(|g| {
                            g.starting || (g.status.injected && g.status.state == Some(CuptiState::Active))
                        })
                        && self.held.has_room()
                    {
                        l.held = Some(p.serial);
                        self.held.mark();
                    } else {
                        count_launch(p, l.kernel.as_ref());
                    }
                }
                if let (Some(g), Some(spec)) = (p.gpu.as_deref_mut(), api) {
                    g.call(
                        ev.tid,
                        Recent {
                            ts_ns: ev.ts_ns,
                            api: spec,
                            kernel: l.kernel.clone(),
                            function: l.function,
                        },
                        pool!(),
                    );
                }
            }
            Body::Call(c) => {
                // decode gives every call its api (a record without one is a decode error).
                let Some(spec) = api else { return };
                p.last_ts = p.last_ts.max(ev.ts_ns + c.duration_ns);
                *p.stats.call_apis.entry(spec.name).or_default() += 1;
                if c.abandoned {
                    p.stats.abandoned_calls += 1;
                } else if c.result != 0 {
                    p.stats.failed_calls += 1;
                }
                if rules::sampled_by_duration(spec.family) && rules::is_slow(c.duration_ns, threshold) {
                    p.stats.slow_calls += 1;
                }
                Self::call(p, spec.family, spec.name, c, budget, used, evicted);
                if matches!(spec.family, Family::Memcpy | Family::Memset)
                    && let Some(g) = p.gpu.as_deref_mut()
                {
                    g.call(
                        ev.tid,
                        Recent {
                            ts_ns: ev.ts_ns,
                            api: spec,
                            kernel: None,
                            function: 0,
                        },
                        pool!(),
                    );
                }
            }
            Body::Gpu(rec) => {
                let comm = p.comm_bytes();
                let g = p.gpu.get_or_insert_with(Default::default);
                let status = g.record(ev.pid, comm, rec, &mut self.gpu_out, &mut self.nvtx_out, pool!());
                if !g.learned.is_empty() {
                    for (function, name) in std::mem::take(&mut g.learned) {
                        if !p.names.contains_key(&function) {
                            p.name(function, name.clone(), budget, used, evicted);
                            self.held.learn(ev.pid, function, name);
                        }
                    }
                }
                if let Some(status) = status {
                    self.cupti_changes.push(CuptiChange {
                        pid: ev.pid,
                        ts_ns: ev.ts_ns,
                        comm: p.comm.clone(),
                        status,
                    });
                }
            }
            Body::GpuName { key, name } => {
                p.gpu
                    .get_or_insert_with(Default::default)
                    .name(*key, name.clone(), pool!());
            }
            Body::MarkerName { id, name, domain } => {
                p.gpu
                    .get_or_insert_with(Default::default)
                    .nvtx
                    .name(*id, name.clone(), domain.clone());
            }
            Body::Ioctl(i) => {
                i.device = p.device(i.fd, lookup);
                let uvm = i.device.as_deref().is_some_and(|d| d.ends_with("nvidia-uvm"));
                i.name = crate::ioctl_names::name(i.cmd, uvm);
                let s = &mut p.stats;
                s.ioctls.add(0, i.duration_ns);
                if let Some(parent) = i.parent {
                    s.ioctls_in_calls += 1;
                    s.ioctl_by_api.entry(parent.name).or_default().add(0, i.duration_ns);
                }
                if s.ioctl_by_cmd.len() < MAX_IOCTL_CMDS || s.ioctl_by_cmd.contains_key(&i.cmd) {
                    s.ioctl_by_cmd
                        .entry(i.cmd)
                        .or_insert((i.name, Amount::default()))
                        .1
                        .add(0, i.duration_ns);
                }
            }
            Body::ProcessExit => {
                let comm = p.comm_bytes();
                if let Some(g) = p.gpu.as_deref_mut() {
                    g.expire(ev.pid, comm, u64::MAX, &mut self.gpu_out, pool!());
                    g.nvtx.finish(ev.pid, comm, &mut self.nvtx_out, pool!());
                    // Its join state is of no more use: only the counters stay.
                    g.release(pool!());
                }
                if !p.exited {
                    p.release(used);
                    p.exited = true;
                    self.exited_order.push_back(ev.pid);
                }
                while self.exited_order.len() > budget.exited
                    && let Some(old) = self.exited_order.pop_front()
                    && self.procs.get(&old).is_some_and(|p| p.exited)
                    && let Some(gone) = self.procs.remove(&old)
                {
                    self.forgotten_abandoned += gone.stats.abandoned_calls;
                    // GPU records that came after the exit may have been charged since.
                    used.cupti_bytes -= gone.gpu.as_deref().map_or(0, GpuState::held);
                    self.forgotten += 1;
                    evicted.processes += 1;
                }
            }
        }
    }

    fn call(
        p: &mut Process,
        family: Family,
        api: &'static str,
        c: &mut Call,
        budget: &Budget,
        used: &mut Used,
        evicted: &mut Evicted,
    ) {
        // An abandoned call's effect is unknown: no allocation tracked, none freed, no name.
        let ok = c.result == 0 && !c.abandoned;
        match family {
            Family::Memcpy => {
                let (dst, src) = (c.dst.map(|d| p.side(d)), c.src.map(|s| p.side(s)));
                if c.direction == Direction::Unknown
                    && let (Some(d), Some(s)) = (dst, src)
                    && let Some(dir) = infer_direction(d, s)
                {
                    c.direction = dir;
                    c.direction_inferred = true;
                    p.stats.inferred_copies += 1;
                }
                // The host end of the copy, once the direction is known.
                let host = match c.direction {
                    Direction::CpuToGpu => src,
                    Direction::GpuToCpu => dst,
                    _ => None,
                };
                c.host_memory = host.map(|h| match h {
                    Side::PinnedHost => HostMemory::Pinned,
                    _ => HostMemory::Pageable,
                });
                match c.host_memory {
                    Some(HostMemory::Pinned) => p.stats.pinned_copies += 1,
                    Some(HostMemory::Pageable) => p.stats.pageable_copies += 1,
                    None => {}
                }
                p.stats.copies[c.direction.index()].add(c.bytes.unwrap_or(0), c.duration_ns);
            }
            Family::Memset => p.stats.memsets.add(c.bytes.unwrap_or(0), c.duration_ns),
            Family::Alloc => {
                let bytes = c.bytes.unwrap_or(0);
                p.stats.allocs.add(bytes, c.duration_ns);
                if let (true, Some(addr)) = (ok, c.address) {
                    let known = p.live.contains_key(&addr);
                    if !known && (p.live.len() >= MAX_LIVE_ALLOCS || used.allocs >= budget.allocs) {
                        evicted.allocations += 1;
                        return;
                    }
                    if !known {
                        used.allocs += 1;
                    }
                    let a = Alloc { bytes, mem: c.mem, api };
                    if let Some(old) = p.live.insert(addr, a) {
                        // Re-registration of the same address: replace, not double count.
                        let live = p.stats.live_mut(old.mem);
                        *live = live.saturating_sub(old.bytes);
                        p.stats.live_allocs -= 1;
                        p.tally(old, false);
                    }
                    p.tally(a, true);
                    let live = p.stats.live_mut(c.mem);
                    *live = live.saturating_add(bytes);
                    p.stats.live_allocs += 1;
                    p.memory_dirty = true;
                }
            }
            Family::Free => {
                let freed = match (ok, c.address) {
                    (true, Some(a)) => p.live.remove(&a).inspect(|_| used.allocs -= 1),
                    (false, Some(a)) => p.live.get(&a).copied(),
                    _ => None,
                };
                match freed {
                    Some(a) => {
                        c.bytes = Some(a.bytes);
                        if ok {
                            p.tally(a, false);
                            let live = p.stats.live_mut(a.mem);
                            *live = live.saturating_sub(a.bytes);
                            p.stats.live_allocs -= 1;
                            p.memory_dirty = true;
                        }
                    }
                    None if c.address.is_some_and(|a| a != 0) => p.stats.unknown_frees += 1,
                    None => {}
                }
                p.stats.frees.add(c.bytes.unwrap_or(0), c.duration_ns);
            }
            Family::Sync => {
                p.stats.syncs.add(0, c.duration_ns);
                let target = match (api, c.stream) {
                    ("cuEventSynchronize", Some(h)) => SyncTarget::Event(h),
                    (a, Some(h)) if a.starts_with("cuStream") => SyncTarget::Stream(h),
                    _ => SyncTarget::Context,
                };
                let by = &mut p.stats.sync_by_target;
                let target = if by.len() < MAX_SYNC_HANDLES || by.contains_key(&target) {
                    target
                } else {
                    SyncTarget::Other
                };
                by.entry(target).or_default().add(0, c.duration_ns);
            }
            Family::Init => p.stats.inits.add(0, c.duration_ns),
            Family::HostFunc => p.stats.host_funcs.add(0, c.duration_ns),
            Family::Module => p.stats.modules.add(0, c.duration_ns),
            Family::Symbol => {
                if let (true, Some(handle)) = (ok, c.handle) {
                    let name = match (&c.name, c.owner) {
                        (Some(n), _) => Some(Arc::new(KernelName::new(n))),
                        // cuKernelGetFunction: the function is named like its kernel.
                        (None, Some(owner)) => p.names.get(&owner).cloned(),
                        (None, None) => None,
                    };
                    if let Some(name) = name {
                        c.kernel = Some(name.clone());
                        p.name(handle, name, budget, used, evicted);
                    }
                }
            }
            Family::Launch | Family::LaunchEx | Family::GraphLaunch => {}
        }
    }

    /// Emits, unjoined, GPU activity that waited too long for its API record (all of it when
    /// `now_ns` is `u64::MAX`: the observer is stopping).
    pub fn expire_gpu(&mut self, now_ns: u64) {
        let before = if now_ns == u64::MAX {
            u64::MAX
        } else {
            now_ns.saturating_sub(cupti_join::PENDING_AGE_NS)
        };
        let (budget, used, evicted) = (&self.budget, &mut self.used, &mut self.evicted);
        for p in self.procs.values_mut() {
            let comm = p.comm_bytes();
            let Some(g) = p.gpu.as_deref_mut() else { continue };
            let mut pool = Pool {
                limit: budget.cupti_bytes,
                used: &mut used.cupti_bytes,
                evicted: &mut evicted.cupti_records,
                names_evicted: &mut evicted.kernel_names,
            };
            if g.has_pending() {
                g.expire(p.pid, comm, before, &mut self.gpu_out, &mut pool);
                p.changed = true;
            }
            if now_ns != u64::MAX {
                g.age(now_ns, &mut pool);
            } else {
                // The end of the run: ranges still open go out unended.
                g.nvtx.finish(p.pid, comm, &mut self.nvtx_out, &mut pool);
            }
        }
    }

    /// Memory timeline points of processes whose memory changed since the last call.
    pub fn memory_samples(&mut self) -> Vec<MemorySample> {
        let mut out = Vec::new();
        for p in self.procs.values_mut().filter(|p| p.memory_dirty) {
            p.memory_dirty = false;
            out.push(MemorySample {
                pid: p.pid,
                device: p.stats.live_device,
                managed: p.stats.live_managed,
                host: p.stats.live_host,
                allocations: p.stats.live_allocs,
            });
        }
        out.sort_by_key(|m| m.pid);
        out
    }

    /// Calls that never returned, over every process seen (forgotten ones included).
    pub fn abandoned_calls(&self) -> u64 {
        self.forgotten_abandoned + self.procs.values().map(|p| p.stats.abandoned_calls).sum::<u64>()
    }

    /// Processes in pid order.
    pub fn sorted(&self) -> Vec<&Process> {
        let mut v: Vec<&Process> = self.procs.values().collect();
        v.sort_by_key(|p| p.pid);
        v
    }
}

/// A kernel launch counted in its process's statistics: named (and its kernel's launch
/// count), or unresolved.
fn count_launch(p: &mut Process, kernel: Option<&Arc<KernelName>>) {
    match kernel {
        Some(k) => {
            p.stats.named_launches += 1;
            let key = Arc::as_ptr(k) as usize;
            if p.kernels.len() < MAX_NAMES || p.kernels.contains_key(&key) {
                p.kernels.entry(key).or_insert_with(|| (k.clone(), 0)).1 += 1;
            }
        }
        None => p.stats.unresolved_launches += 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{Event, Launch};
    use gpu_observer_common::api;

    fn ev(body: Body, name: &str) -> Event {
        Event {
            ts_ns: 1,
            pid: 10,
            tid: 10,
            comm: *b"train\0\0\0\0\0\0\0\0\0\0\0",
            api: api::by_id(api::id_of(name).unwrap()),
            body,
        }
    }

    fn call(name: &str, f: impl FnOnce(&mut Call)) -> Event {
        let spec = api::by_id(api::id_of(name).unwrap()).unwrap();
        let mut c = Call::returned(spec, 100);
        f(&mut c);
        ev(Body::Call(c), name)
    }

    fn alloc(name: &str, addr: u64, bytes: u64) -> Event {
        call(name, |c| {
            c.address = Some(addr);
            c.bytes = Some(bytes);
        })
    }

    fn copy(name: &str, dst: u64, src: u64) -> Call {
        let mut c = Correlator::new(100_000);
        for mut e in [
            alloc("cuMemAlloc_v2", 0x1000, 4096),
            alloc("cuMemAllocHost_v2", 0x9000, 4096),
        ] {
            c.observe(&mut e);
        }
        let mut e = call(name, |c| {
            c.dst = Some(dst);
            c.src = Some(src);
            c.bytes = Some(16);
        });
        c.observe(&mut e);
        let Body::Call(c) = e.body else { unreachable!() };
        c
    }

    #[test]
    fn generic_copies_get_their_direction_and_host_memory_from_allocations() {
        let c = copy("cuMemcpy", 0x1800, 0x9100);
        assert_eq!(
            (c.direction, c.host_memory, c.direction_inferred),
            (Direction::CpuToGpu, Some(HostMemory::Pinned), true)
        );
        let c = copy("cuMemcpyAsync", 0x5_0000, 0x1000);
        assert_eq!(
            (c.direction, c.host_memory),
            (Direction::GpuToCpu, Some(HostMemory::Pageable))
        );
        let c = copy("cuMemcpyPeer", 0x1000, 0x1fff);
        assert_eq!(c.direction, Direction::GpuToGpu);
        // One past the end of the device block is not in it.
        let c = copy("cuMemcpy", 0x2000, 0x5_0000);
        assert_eq!((c.direction, c.direction_inferred), (Direction::Unknown, false));
        // Explicit APIs keep their direction and learn the host side.
        let c = copy("cuMemcpyHtoD_v2", 0x1000, 0x9000);
        assert_eq!(
            (c.direction, c.host_memory, c.direction_inferred),
            (Direction::CpuToGpu, Some(HostMemory::Pinned), false)
        );
    }

    #[test]
    fn frees_get_their_size_leaks_and_memory_samples_follow() {
        let mut c = Correlator::new(100_000);
        for mut e in [
            alloc("cuMemAlloc_v2", 0x1000, 4096),
            alloc("cuMemAlloc_v2", 0x9000, 100),
            alloc("cuMemAllocManaged", 0x20000, 64),
            alloc("cuMemAllocHost_v2", 0x30000, 8),
        ] {
            c.observe(&mut e);
        }
        let mut free = call("cuMemFree_v2", |c| c.address = Some(0x1000));
        c.observe(&mut free);
        let Body::Call(f) = &free.body else { unreachable!() };
        assert_eq!(f.bytes, Some(4096));
        let p = &c.procs[&10];
        assert_eq!(
            (
                p.stats.live_device,
                p.stats.live_managed,
                p.stats.live_host,
                p.stats.live_allocs
            ),
            (100, 64, 8, 3)
        );
        assert_eq!(
            p.leaks(),
            vec![
                Leak {
                    api: "cuMemAllocHost_v2",
                    mem: MemKind::Host,
                    count: 1,
                    bytes: 8
                },
                Leak {
                    api: "cuMemAllocManaged",
                    mem: MemKind::Managed,
                    count: 1,
                    bytes: 64
                },
                Leak {
                    api: "cuMemAlloc_v2",
                    mem: MemKind::Device,
                    count: 1,
                    bytes: 100
                },
            ]
        );
        assert_eq!(
            c.memory_samples(),
            vec![MemorySample {
                pid: 10,
                device: 100,
                managed: 64,
                host: 8,
                allocations: 3
            }]
        );
        assert!(c.memory_samples().is_empty(), "no change, no sample");
        c.observe(&mut call("cuMemFree_v2", |c| c.address = Some(0x5555)));
        assert_eq!(c.procs[&10].stats.unknown_frees, 1);
    }

    #[test]
    fn launches_are_named_through_modules_libraries_and_kernels() {
        let mut c = Correlator::new(100_000);
        let launch = |f: u64| ev(Body::Launch(Launch::of(f)), "cuLaunchKernel");
        let named = |api: &str, handle: u64, owner: Option<u64>, name: Option<&str>| {
            call(api, |c| {
                c.handle = Some(handle);
                c.owner = owner;
                c.name = name.map(Into::into);
            })
        };
        for mut e in [
            named("cuModuleGetFunction", 0xf1, Some(0x40d), Some("_Z9scale_vecPffj")),
            named("cuLibraryGetKernel", 0xbeef, Some(0x11b), Some("write_value")),
            named("cuKernelGetFunction", 0xf2, Some(0xbeef), None),
        ] {
            c.observe(&mut e);
        }
        let name_of = |c: &mut Correlator, f: u64| {
            let mut e = launch(f);
            c.observe(&mut e);
            let Body::Launch(l) = e.body else { unreachable!() };
            l.kernel.map(|k| k.demangled.to_string())
        };
        assert_eq!(
            name_of(&mut c, 0xf1).as_deref(),
            Some("scale_vec(float*, float, unsigned int)")
        );
        assert_eq!(name_of(&mut c, 0xf2).as_deref(), Some("write_value"));
        assert_eq!(
            name_of(&mut c, 0xbeef).as_deref(),
            Some("write_value"),
            "a CUkernel launched directly"
        );
        assert_eq!(name_of(&mut c, 0xdead), None);
        let s = &c.procs[&10].stats;
        assert_eq!((s.named_launches, s.unresolved_launches), (3, 1));
    }

    #[test]
    fn syncs_are_accounted_per_stream_event_and_context() {
        let mut c = Correlator::new(100);
        for (api, h, d) in [
            ("cuStreamSynchronize", Some(0x5), 300),
            ("cuStreamSynchronize_ptsz", Some(0x5), 50),
            ("cuEventSynchronize", Some(0xe), 7),
            ("cuCtxSynchronize", None, 1000),
        ] {
            c.observe(&mut call(api, |c| {
                c.stream = h;
                c.duration_ns = d;
            }));
        }
        let s = &c.procs[&10].stats;
        assert_eq!(
            s.sync_by_target[&SyncTarget::Stream(5)],
            Amount {
                count: 2,
                bytes: 0,
                ns: 350
            }
        );
        assert_eq!(s.sync_by_target[&SyncTarget::Event(0xe)].ns, 7);
        assert_eq!(s.sync_by_target[&SyncTarget::Context].ns, 1000);
        assert_eq!((s.syncs.count, s.syncs.ns, s.slow_calls), (4, 1357, 2));
    }

    #[test]
    fn a_call_of_exactly_the_threshold_is_slow() {
        let mut c = Correlator::new(100);
        for (api, d) in [
            ("cuCtxSynchronize", 99),
            ("cuCtxSynchronize", 100),
            ("cuMemcpyHtoD_v2", 100),
            ("cuMemcpyHtoD_v2", 101),
            // Not sampled by duration: never counted slow.
            ("cuMemAlloc_v2", 1000),
        ] {
            c.observe(&mut call(api, |c| c.duration_ns = d));
        }
        assert_eq!(c.procs[&10].stats.slow_calls, 3);
    }
}
