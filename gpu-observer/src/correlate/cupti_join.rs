//! Joins CUPTI's records (when work really ran on the GPU) to the uprobe events of the calls
//! that launched it.
//!
//! CUPTI ties a kernel/copy/memset record to the driver API record of its launching call by
//! correlation id. That API record carries the calling thread and CUPTI's own start/end of the
//! call; the uprobe event of the same call is the latest one of that API on that thread that
//! entered before the call ended. So: uprobe events of processes with CUPTI are kept per
//! thread for a while (`Recent`), an API record claims its uprobe event (`Origin`), and
//! activity records find their origin by correlation id — in whichever order they arrive
//! (activity before its API record waits in `pending`). Everything is bounded; whatever ages
//! out unjoined is still emitted and counted as unjoined.
//!
//! Bounded twice: per process by the `MAX_*` below, and over all processes together by the
//! CUPTI share of the agent's memory budget ([`Pool`], `--memory-limit-mb`), so that neither
//! many threads nor many processes can add up past it. What the share has no room for is let
//! go, oldest of the same thread or process first, and counted (`evicted.cupti_records`).

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::Arc,
};

use gpu_observer_common::{
    api::{self, ApiSpec, Family},
    cupti::{self, CuptiState, GpuRecord, GpuRecordKind, NvtxState, device_aux, status_aux},
};

use crate::decode::KernelName;

/// uprobe calls of a process kept waiting for their API record. CUPTI delivers records a
/// flush period (0.5 s) or more after the call: a training loop launching 20 000 kernels a
/// second has ~10 000 waiting; this leaves room for 25 times that (~10 MB).
const MAX_RECENT: usize = 262_144;
/// Threads with calls waiting.
const MAX_THREADS: usize = 4096;
/// Correlation ids remembered (a graph launch's kernels all use one).
const MAX_ORIGINS: usize = 262_144;
/// Activity records waiting for their API record.
const MAX_PENDING: usize = 131_072;
/// How long an activity record waits for its API record (GPU time; CUPTI delivers within its
/// flush period, 0.5 s by default).
pub const PENDING_AGE_NS: u64 = 5_000_000_000;
/// How long a uprobe call waits for its API record.
const RECENT_AGE_NS: u64 = 30_000_000_000;
/// How long a correlation id is remembered after its API call ended, for activity records that
/// come later (a graph's kernels, a kernel that ran long after a deep queue). Without an age a
/// long-running process filled the whole table (hundreds of thousands of ids) over tens of
/// minutes: the agent's memory grew all that time (the soak, docs/BENCHMARKS.md).
const ORIGIN_AGE_NS: u64 = 60_000_000_000;
/// Handle names learned from CUPTI between two looks of the correlator (it takes them after
/// each record).
const MAX_LEARNED: usize = 4096;
/// Kernel names tracked for the per-process top list.
const MAX_TOP: usize = 1024;
/// CUPTI kernel names remembered per process.
const MAX_GPU_NAMES: usize = 65_536;
/// Devices described per process (a node has at most a few dozen).
pub(super) const MAX_DEVICES: usize = 64;
/// Kernels an exited process keeps in its top list.
const EXITED_TOP: usize = 16;

/// Bytes charged to the [`Pool`] for what the tables hold. Sized from the types (see the
/// comments), rounded up for the map slots' load factor and the queues' doubling growth.
/// A waiting uprobe call: `Recent` (24 bytes) in a queue up to twice its length.
const RECENT_COST: u64 = 64;
/// A thread with calls waiting: its map slot and queue header, and the allocator's minimum.
const THREAD_COST: u64 = 128;
/// A correlation id's `Origin` (~80 bytes) in a map slot, and its id in the FIFO.
const ORIGIN_COST: u64 = 160;
/// An activity record waiting for its API record, in a vector up to twice its length, plus
/// its share of the map slot.
const PENDING_COST: u64 = 2 * std::mem::size_of::<GpuRecord>() as u64 + 32;
/// An entry of the FIFO of waiting activity (correlation id, start).
const ORDER_COST: u64 = 32;
/// A kernel of the top list: its map slot beyond the name's bytes.
const TOP_COST: u64 = 64;

/// The CUPTI join's share of the agent's memory budget over all processes
/// (`Budget::cupti_bytes`, see `correlate.rs`): every [`GpuState`] charges what its tables
/// hold here, gives it back when the entries go, and all of it when its process exits.
pub struct Pool<'a> {
    pub limit: u64,
    pub used: &'a mut u64,
    /// Let go because the share was full (`Evicted::cupti_records`).
    pub evicted: &'a mut u64,
    /// CUPTI's kernel names not remembered (`Evicted::kernel_names`).
    pub names_evicted: &'a mut u64,
}

impl Pool<'_> {
    fn fits(&self, cost: u64) -> bool {
        *self.used + cost <= self.limit
    }
}

/// A launch/copy/memset call seen by the uprobes, as the join needs it.
#[derive(Clone, Debug)]
pub struct Recent {
    pub ts_ns: u64,
    pub api: &'static ApiSpec,
    pub kernel: Option<Arc<KernelName>>,
    /// A kernel launch's function handle (0 otherwise).
    pub function: u64,
}

/// The call that put a correlation id's work on the GPU.
#[derive(Clone, Debug)]
pub struct Origin {
    pub tid: u32,
    /// The probed driver entry point the uprobes saw, when found.
    pub api: Option<&'static ApiSpec>,
    /// The API CUPTI recorded: that driver call, or the runtime call (`cudaLaunchKernel`) it
    /// was made from.
    pub cupti_api: &'static str,
    /// The uprobe's entry timestamp of the call, when it was found.
    pub launch_ts_ns: Option<u64>,
    /// CUPTI's own timing of the call.
    pub api_start_ns: u64,
    pub api_end_ns: u64,
    pub kernel: Option<Arc<KernelName>>,
    /// The launched function handle, when the call was a kernel launch the uprobes saw.
    pub function: u64,
}

/// A device's attributes, for theoretical occupancy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Device {
    pub sm_count: u32,
    pub max_threads_per_sm: u32,
    pub max_blocks_per_sm: u32,
    pub registers_per_sm: u32,
    pub shared_mem_per_sm: u32,
    pub reserved_shared_mem_per_block: u32,
    pub warp_size: u32,
    pub compute_capability: u32,
}

impl Device {
    fn from_record(r: &GpuRecord) -> Self {
        let a = |i: usize| r.aux[i].min(u64::from(u32::MAX)) as u32;
        Self {
            sm_count: a(device_aux::SM_COUNT),
            max_threads_per_sm: a(device_aux::MAX_THREADS_PER_SM),
            max_blocks_per_sm: a(device_aux::MAX_BLOCKS_PER_SM),
            registers_per_sm: a(device_aux::REGISTERS_PER_SM),
            shared_mem_per_sm: a(device_aux::SHARED_MEM_PER_SM),
            reserved_shared_mem_per_block: a(device_aux::RESERVED_SHARED_MEM_PER_BLOCK),
            warp_size: a(device_aux::WARP_SIZE),
            compute_capability: a(device_aux::COMPUTE_CAPABILITY),
        }
    }

    /// Theoretical occupancy (active warps / maximum warps per SM) of a kernel's launch, as the
    /// CUDA occupancy calculator computes it: blocks per SM limited by threads, the block
    /// limit, registers (allocated per warp in units of 256) and shared memory (allocated in
    /// units of 128 bytes, plus what the system reserves per block).
    ///
    /// Every input comes from records a process can forge: the arithmetic saturates, and a
    /// launch no SM could hold has occupancy 0 rather than a panic.
    pub fn occupancy(&self, threads_per_block: u64, registers_per_thread: u32, shared_mem: u64) -> Option<f64> {
        let warp = u64::from(self.warp_size);
        let max_warps = u64::from(self.max_threads_per_sm).checked_div(warp).unwrap_or(0);
        if max_warps == 0 || threads_per_block == 0 || self.max_blocks_per_sm == 0 {
            return None;
        }
        let warps_per_block = threads_per_block.div_ceil(warp);
        let mut blocks = (max_warps / warps_per_block).min(u64::from(self.max_blocks_per_sm));
        if registers_per_thread > 0 {
            let regs_per_warp = u64::from(registers_per_thread)
                .saturating_mul(warp)
                .div_ceil(256)
                .saturating_mul(256);
            let per_block = regs_per_warp.saturating_mul(warps_per_block);
            blocks = blocks.min(u64::from(self.registers_per_sm) / per_block);
        }
        let smem = shared_mem.saturating_add(u64::from(self.reserved_shared_mem_per_block));
        if smem > 0 && self.shared_mem_per_sm > 0 {
            blocks = blocks.min(u64::from(self.shared_mem_per_sm) / smem.div_ceil(128).saturating_mul(128));
        }
        Some(blocks.saturating_mul(warps_per_block) as f64 / max_warps as f64)
    }
}

/// The injection library's latest status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Status {
    pub state: Option<CuptiState>,
    pub cupti_result: u64,
    pub cupti_dropped: u64,
    pub rate_limited: u64,
    pub forwarded: u64,
    pub buffers: u64,
    pub buffer_bytes: u64,
    pub rate_limit: u64,
    /// Whether its NVTX calls reach CUPTI.
    pub nvtx: Option<NvtxState>,
    /// The library was injected into the running process (`--gpu-timing`).
    pub injected: bool,
}

/// Per-process counts of GPU activity.
#[derive(Clone, Debug, Default)]
pub struct GpuStats {
    pub kernels: u64,
    pub memcpys: u64,
    pub memsets: u64,
    pub joined: u64,
    pub unjoined: u64,
    pub kernel_ns: u64,
    pub memcpy_ns: u64,
    pub memset_ns: u64,
    pub queue_delay_ns: u64,
    pub queue_delays: u64,
    pub max_queue_delay_ns: u64,
    pub api_records: u64,
    /// API records whose uprobe call was not found (it ran before the observer attached).
    pub api_unmatched: u64,
    /// uprobe calls dropped from the join's bounded wait (too many waiting, or over 30 s).
    pub recent_evicted: u64,
    /// Kernels by demangled name: (count, GPU ns).
    pub by_kernel: BTreeMap<Arc<str>, (u64, u64)>,
    /// First and last GPU timestamps seen, for the busy fraction.
    pub first_gpu_ns: u64,
    pub last_gpu_ns: u64,
    /// Time at least one of the process's kernels, copies or memsets ran on a device, summed
    /// over devices: the union of their intervals (overlapping work counted once; busy.rs).
    pub busy_ns: u64,
}

impl GpuStats {
    /// Kernels by GPU time, most first (ties by name).
    pub fn top_kernels(&self, n: usize) -> Vec<(&Arc<str>, u64, u64)> {
        let mut v: Vec<(&Arc<str>, u64, u64)> = self.by_kernel.iter().map(|(k, (c, ns))| (k, *c, *ns)).collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(b.0)));
        v.truncate(n);
        v
    }
}

/// A GPU record joined to its launching call: one `gpu_kernel`/`gpu_memcpy`/`gpu_memset` line.
#[derive(Clone, Debug)]
pub struct GpuActivity {
    pub pid: u32,
    pub comm: [u8; 16],
    pub rec: GpuRecord,
    pub origin: Option<Origin>,
    pub kernel: Option<Arc<KernelName>>,
    pub occupancy: Option<f64>,
    pub sm_count: Option<u32>,
    /// The anomaly detector flagged it (analyze/anomaly.rs): always written, never sampled out.
    pub anomalous: bool,
    /// The NVTX ranges open on the launching thread at launch, outermost first (a joined
    /// kernel, copy or memset of a process whose NVTX calls reach CUPTI).
    pub nvtx: Option<super::nvtx::NvtxStack>,
}

impl GpuActivity {
    pub fn kind(&self) -> Option<GpuRecordKind> {
        GpuRecordKind::from_u32(self.rec.kind)
    }

    pub fn duration_ns(&self) -> u64 {
        self.rec.end_ns.saturating_sub(self.rec.start_ns)
    }

    /// GPU start − the launching call's entry, when joined.
    pub fn queue_delay_ns(&self) -> Option<i64> {
        let launch = self.origin.as_ref()?.launch_ts_ns?;
        Some(self.rec.start_ns as i64 - launch as i64)
    }
}

/// The join state of one process that runs the injection library.
#[derive(Debug, Default)]
pub struct GpuState {
    pub status: Status,
    /// A library injected late announced that it is enabling collection (its next status
    /// says how that went).
    pub starting: bool,
    pub stats: GpuStats,
    /// What `stats.busy_ns` has counted (not in the snapshots: only its total is read).
    busy: super::busy::BusyUnion,
    devices: HashMap<u32, Device>,
    names: HashMap<u64, Arc<KernelName>>,
    recent: HashMap<u32, VecDeque<Recent>>,
    /// Entries in `recent`, all threads.
    recent_len: usize,
    origins: HashMap<u32, Origin>,
    origin_order: VecDeque<u32>,
    pending: HashMap<u32, Vec<GpuRecord>>,
    pending_order: VecDeque<(u32, u64)>,
    pending_count: usize,
    /// Bytes charged to the [`Pool`] for this process's tables.
    held: u64,
    /// Its NVTX ranges (nvtx.rs), for the stacks of its GPU records.
    pub nvtx: super::nvtx::Nvtx,
    /// Handles named by CUPTI that the uprobes could not name (loaded before the observer
    /// came): (function, name), taken by the correlator after each record.
    pub learned: Vec<(u64, Arc<KernelName>)>,
}

impl GpuState {
    fn charge(&mut self, pool: &mut Pool, cost: u64) {
        *pool.used += cost;
        self.held += cost;
    }

    fn refund(&mut self, pool: &mut Pool, cost: u64) {
        *pool.used -= cost;
        self.held -= cost;
    }

    /// Bytes this process's join state is charged.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Drops the oldest waiting call of `tid` (its queue must be non-empty), and the thread's
    /// entry when that was the last one.
    fn pop_recent(&mut self, tid: u32, pool: &mut Pool) {
        let Some(q) = self.recent.get_mut(&tid) else { return };
        let popped = q.pop_front().is_some();
        let empty = q.is_empty();
        if popped {
            self.recent_len -= 1;
            self.stats.recent_evicted += 1;
            self.refund(pool, RECENT_COST);
        }
        if empty {
            self.recent.remove(&tid);
            self.refund(pool, THREAD_COST);
        }
    }

    /// A launch/copy/memset call of this process, seen by the uprobes.
    pub fn call(&mut self, tid: u32, r: Recent, pool: &mut Pool) {
        // This thread's calls that waited too long, or that the per-process cap pushes out.
        while let Some(f) = self.recent.get(&tid).and_then(VecDeque::front) {
            if f.ts_ns + RECENT_AGE_NS >= r.ts_ns && self.recent_len < MAX_RECENT {
                break;
            }
            self.pop_recent(tid, pool);
        }
        let known = self.recent.contains_key(&tid);
        if !known && self.recent.len() >= MAX_THREADS {
            self.stats.recent_evicted += 1;
            return;
        }
        if self.recent_len >= MAX_RECENT {
            // Full with other threads' calls: this one cannot wait.
            self.stats.recent_evicted += 1;
            return;
        }
        let cost = RECENT_COST + if known { 0 } else { THREAD_COST };
        if !pool.fits(cost) {
            // The share is full: the thread's own oldest call makes room, else this one goes.
            *pool.evicted += 1;
            if known {
                self.pop_recent(tid, pool);
                if !self.recent.contains_key(&tid) {
                    // That was its only one: the thread's entry went with it.
                    if !pool.fits(RECENT_COST + THREAD_COST) {
                        self.stats.recent_evicted += 1;
                        return;
                    }
                    self.charge(pool, RECENT_COST + THREAD_COST);
                } else {
                    self.charge(pool, RECENT_COST);
                }
            } else {
                self.stats.recent_evicted += 1;
                return;
            }
        } else {
            self.charge(pool, cost);
        }
        self.recent.entry(tid).or_default().push_back(r);
        self.recent_len += 1;
    }

    /// Drops waiting calls older than [`RECENT_AGE_NS`] before `now_ns`, in every thread (a
    /// thread that stopped calling would otherwise hold its calls until the process exits).
    pub fn age(&mut self, now_ns: u64, pool: &mut Pool) {
        // Ids are in the order their API records came, which is the order of their calls' ends
        // closely enough: stop at the first one young enough.
        if let Some(before) = now_ns.checked_sub(ORIGIN_AGE_NS) {
            while let Some(id) = self.origin_order.front() {
                if self.origins.get(id).is_some_and(|o| o.api_end_ns >= before) {
                    break;
                }
                self.forget_oldest_origin(pool);
            }
        }
        let Some(before) = now_ns.checked_sub(RECENT_AGE_NS) else {
            return;
        };
        let aged: Vec<u32> = self
            .recent
            .iter()
            .filter(|(_, q)| q.front().is_some_and(|f| f.ts_ns < before))
            .map(|(t, _)| *t)
            .collect();
        for tid in aged {
            while let Some(f) = self.recent.get(&tid).and_then(VecDeque::front) {
                if f.ts_ns >= before {
                    break;
                }
                self.pop_recent(tid, pool);
            }
        }
    }

    pub fn name(&mut self, key: u64, name: Arc<KernelName>, pool: &mut Pool) {
        let cost = super::name_cost(&name);
        let old = self.names.get(&key).map_or(0, |n| super::name_cost(n));
        let fits = (self.names.len() < MAX_GPU_NAMES || old != 0) && *pool.used - old + cost <= pool.limit;
        if !fits {
            *pool.names_evicted += 1;
            return;
        }
        self.refund(pool, old);
        self.charge(pool, cost);
        self.names.insert(key, name);
    }

    /// At the process's exit (after [`GpuState::expire`] of everything): releases the join
    /// tables, keeps the counters and the top kernels by GPU time, gives the bytes back.
    pub fn release(&mut self, pool: &mut Pool) {
        self.recent = HashMap::new();
        self.recent_len = 0;
        self.origins = HashMap::new();
        self.origin_order = VecDeque::new();
        self.pending = HashMap::new();
        self.pending_order = VecDeque::new();
        self.pending_count = 0;
        self.names = HashMap::new();
        self.devices = HashMap::new();
        if self.stats.by_kernel.len() > EXITED_TOP {
            let keep: Vec<Arc<str>> = self
                .stats
                .top_kernels(EXITED_TOP)
                .into_iter()
                .map(|(k, _, _)| k.clone())
                .collect();
            self.stats.by_kernel.retain(|k, _| keep.contains(k));
        }
        *pool.used -= self.held;
        self.held = 0;
    }

    /// Folds in one record; joined activity goes to `out`. Returns the new state when a
    /// status record changed it.
    pub fn record(
        &mut self,
        pid: u32,
        comm: [u8; 16],
        rec: &GpuRecord,
        out: &mut Vec<GpuActivity>,
        nvtx_out: &mut Vec<super::nvtx::NvtxRange>,
        pool: &mut Pool,
    ) -> Option<Status> {
        match GpuRecordKind::from_u32(rec.kind)? {
            GpuRecordKind::Status => {
                let a = |i: usize| rec.aux[i];
                let new = Status {
                    state: CuptiState::from_u64(a(status_aux::STATE)),
                    cupti_result: a(status_aux::CUPTI_RESULT),
                    cupti_dropped: a(status_aux::CUPTI_DROPPED),
                    rate_limited: a(status_aux::RATE_LIMITED),
                    forwarded: a(status_aux::FORWARDED),
                    buffers: a(status_aux::BUFFERS),
                    buffer_bytes: a(status_aux::BUFFER_BYTES),
                    rate_limit: a(status_aux::RATE_LIMIT),
                    nvtx: NvtxState::from_u32(rec.cbid),
                    injected: rec.device == status_aux::INJECTED,
                };
                // A start announced: launches from now on wait for their names, the state
                // (and its line) waits for the status after the enable.
                self.starting = new.state == Some(CuptiState::Starting) && new.injected;
                if new.state == Some(CuptiState::Starting) {
                    return None;
                }
                let changed = new.state != self.status.state;
                self.status = new;
                changed.then_some(new)
            }
            GpuRecordKind::Device => {
                if self.devices.len() < MAX_DEVICES || self.devices.contains_key(&rec.device) {
                    self.devices.insert(rec.device, Device::from_record(rec));
                } else {
                    *pool.evicted += 1;
                }
                None
            }
            GpuRecordKind::Api | GpuRecordKind::RuntimeApi => {
                self.api(rec, pid, comm, out, pool);
                None
            }
            GpuRecordKind::Marker => {
                self.nvtx.record(pid, comm, rec, nvtx_out, pool);
                None
            }
            GpuRecordKind::Kernel | GpuRecordKind::Memcpy | GpuRecordKind::Memset => {
                // Busy time as CUPTI delivers the records (nearly in time order), not as they
                // are joined: a record waits for its API record, which can come a buffer later.
                let added = self.busy.add(rec.device, rec.start_ns, rec.end_ns);
                self.stats.busy_ns = self.stats.busy_ns.saturating_add(added);
                if let Some(o) = self.origins.get(&rec.correlation_id).cloned() {
                    self.emit(pid, comm, *rec, Some(o), out, pool);
                } else {
                    self.park(pid, comm, *rec, out, pool);
                }
                None
            }
        }
    }

    /// An API record claims the uprobe event of its call: for a driver call, the latest one of
    /// that entry point on the thread that entered before the call ended; for a runtime call,
    /// the first driver call of the matching family made inside it.
    fn api(&mut self, rec: &GpuRecord, pid: u32, comm: [u8; 16], out: &mut Vec<GpuActivity>, pool: &mut Pool) {
        let q = self.recent.get_mut(&rec.tid);
        let (cupti_api, found) = if rec.kind == GpuRecordKind::RuntimeApi as u32 {
            let Some((name, family)) = cupti::runtime_api_of_cbid(rec.cbid) else {
                return;
            };
            let found = q.and_then(|q| {
                // A thread's calls are queued in time order: search only those inside the call.
                let from = q.partition_point(|r| r.ts_ns < rec.start_ns);
                let i = (from..q.len())
                    .take_while(|&i| q[i].ts_ns <= rec.end_ns)
                    .find(|&i| same_family(q[i].api.family, family))?;
                q.remove(i)
            });
            (runtime_name(name), found)
        } else {
            let Some((name, spec)) = cupti::api_of_cbid(rec.cbid).and_then(|n| Some((n, api::by_id(api::id_of(n)?)?)))
            else {
                return;
            };
            let found = q.and_then(|q| {
                // A thread's calls are queued in time order: the latest that entered before the
                // call ended is found from there, not by a walk over every later call (with
                // CUPTI's records a second behind a 50 000 launch/s thread, that walk made the
                // join quadratic and the reader fall behind).
                let to = q.partition_point(|r| r.ts_ns <= rec.end_ns);
                // By name, not address: `APIS` is a const, so two references to one entry
                // can point at different copies (seen in a release build: every join lost).
                let i = (0..to).rev().find(|&i| q[i].api.name == spec.name)?;
                q.remove(i)
            });
            (name, found)
        };
        if found.is_some() {
            self.recent_len -= 1;
            self.refund(pool, RECENT_COST);
            if self.recent.get(&rec.tid).is_some_and(VecDeque::is_empty) {
                self.recent.remove(&rec.tid);
                self.refund(pool, THREAD_COST);
            }
        }
        self.stats.api_records += 1;
        if found.is_none() {
            self.stats.api_unmatched += 1;
            // A driver and a runtime record of one call: keep the one that found its uprobe.
            if self
                .origins
                .get(&rec.correlation_id)
                .is_some_and(|o| o.launch_ts_ns.is_some())
            {
                return;
            }
        }
        let origin = Origin {
            tid: rec.tid,
            api: found.as_ref().map(|r| r.api),
            cupti_api,
            launch_ts_ns: found.as_ref().map(|r| r.ts_ns),
            api_start_ns: rec.start_ns,
            api_end_ns: rec.end_ns,
            function: found.as_ref().map_or(0, |r| r.function),
            kernel: found.and_then(|r| r.kernel),
        };
        let waiting = self.pending.remove(&rec.correlation_id);
        if let Some(w) = &waiting {
            self.pending_count -= w.len();
            self.refund(pool, PENDING_COST * w.len() as u64);
        }
        let known = self.origins.contains_key(&rec.correlation_id);
        if !known && self.origins.len() >= MAX_ORIGINS {
            self.forget_oldest_origin(pool);
        }
        // The share is full: this process's oldest ids make room; with none, this id is not
        // remembered (what waited for it is still joined below; later activity is unjoined).
        while !known && !pool.fits(ORIGIN_COST) && !self.origin_order.is_empty() {
            *pool.evicted += 1;
            self.forget_oldest_origin(pool);
        }
        if known {
            self.origins.insert(rec.correlation_id, origin.clone());
        } else if pool.fits(ORIGIN_COST) {
            self.charge(pool, ORIGIN_COST);
            self.origins.insert(rec.correlation_id, origin.clone());
            self.origin_order.push_back(rec.correlation_id);
        } else {
            *pool.evicted += 1;
        }
        for r in waiting.into_iter().flatten() {
            self.emit(pid, comm, r, Some(origin.clone()), out, pool);
        }
    }

    fn forget_oldest_origin(&mut self, pool: &mut Pool) {
        if let Some(old) = self.origin_order.pop_front()
            && self.origins.remove(&old).is_some()
        {
            self.refund(pool, ORIGIN_COST);
        }
    }

    fn park(&mut self, pid: u32, comm: [u8; 16], rec: GpuRecord, out: &mut Vec<GpuActivity>, pool: &mut Pool) {
        if self.pending_count >= MAX_PENDING {
            // Bound hit: the oldest half goes out unjoined.
            self.expire_while(pid, comm, out, pool, |_, waiting| waiting > MAX_PENDING / 2);
        }
        if self.pending_order.len() > 2 * self.pending_count + 1024 {
            // Entries of ids joined since are stale: drop them.
            let before = self.pending_order.len();
            let pending = &self.pending;
            self.pending_order.retain(|(c, _)| pending.contains_key(c));
            let gone = (before - self.pending_order.len()) as u64;
            self.refund(pool, ORDER_COST * gone);
        }
        let cost = PENDING_COST + ORDER_COST;
        if !pool.fits(cost) && self.pending_count > 0 {
            // The share is full: this process's oldest waiting half goes out unjoined.
            let before = self.stats.unjoined;
            let half = self.pending_count / 2;
            self.expire_while(pid, comm, out, pool, |_, waiting| waiting > half);
            *pool.evicted += self.stats.unjoined - before;
        }
        if !pool.fits(cost) {
            // Still no room: this record cannot wait for its API record.
            *pool.evicted += 1;
            self.emit(pid, comm, rec, None, out, pool);
            return;
        }
        self.charge(pool, cost);
        self.pending.entry(rec.correlation_id).or_default().push(rec);
        self.pending_order.push_back((rec.correlation_id, rec.start_ns));
        self.pending_count += 1;
    }

    /// Emits, unjoined, the activity records that started before `before_ns` and still wait
    /// for their API record (`u64::MAX`: all of them, at exit).
    pub fn expire(&mut self, pid: u32, comm: [u8; 16], before_ns: u64, out: &mut Vec<GpuActivity>, pool: &mut Pool) {
        self.expire_while(pid, comm, out, pool, |ts, _| before_ns == u64::MAX || ts < before_ns);
    }

    fn expire_while(
        &mut self,
        pid: u32,
        comm: [u8; 16],
        out: &mut Vec<GpuActivity>,
        pool: &mut Pool,
        go_on: impl Fn(u64, usize) -> bool,
    ) {
        while let Some(&(corr, ts)) = self.pending_order.front() {
            if !go_on(ts, self.pending_count) {
                break;
            }
            self.pending_order.pop_front();
            self.refund(pool, ORDER_COST);
            if let Some(waiting) = self.pending.remove(&corr) {
                self.pending_count -= waiting.len();
                self.refund(pool, PENDING_COST * waiting.len() as u64);
                for r in waiting {
                    self.emit(pid, comm, r, None, out, pool);
                }
            }
        }
    }

    /// Whether activity is waiting for its API record.
    pub fn has_pending(&self) -> bool {
        self.pending_count > 0
    }

    /// One activity record out, with the origin of its correlation id when known.
    fn emit(
        &mut self,
        pid: u32,
        comm: [u8; 16],
        rec: GpuRecord,
        origin: Option<Origin>,
        out: &mut Vec<GpuActivity>,
        pool: &mut Pool,
    ) {
        let s = &mut self.stats;
        let dur = rec.end_ns.saturating_sub(rec.start_ns);
        if s.first_gpu_ns == 0 || rec.start_ns < s.first_gpu_ns {
            s.first_gpu_ns = rec.start_ns;
        }
        s.last_gpu_ns = s.last_gpu_ns.max(rec.end_ns);
        if origin.as_ref().is_some_and(|o| o.launch_ts_ns.is_some()) {
            s.joined += 1;
        } else {
            s.unjoined += 1;
        }
        let mut kernel = None;
        let mut occupancy = None;
        let mut sm_count = None;
        match GpuRecordKind::from_u32(rec.kind) {
            Some(GpuRecordKind::Kernel) => {
                s.kernels += 1;
                s.kernel_ns = s.kernel_ns.saturating_add(dur);
                kernel = self
                    .names
                    .get(&rec.name_key)
                    .cloned()
                    .or_else(|| origin.as_ref().and_then(|o| o.kernel.clone()));
                // CUPTI names a handle the uprobes never saw named (loaded before the
                // observer came): the correlator learns it (bounded until it takes them).
                if let (Some(k), Some(o)) = (&kernel, &origin)
                    && o.kernel.is_none()
                    && o.function != 0
                    && self.learned.len() < MAX_LEARNED
                {
                    self.learned.push((o.function, k.clone()));
                }
                if let Some(k) = &kernel {
                    if let Some(e) = s.by_kernel.get_mut(&*k.demangled) {
                        e.0 += 1;
                        e.1 = e.1.saturating_add(dur);
                    } else {
                        // A new name in the top list costs its bytes: only while the share has
                        // room (the kernel is counted in the totals either way).
                        let cost = TOP_COST + k.demangled.len() as u64;
                        if s.by_kernel.len() < MAX_TOP && pool.fits(cost) {
                            s.by_kernel.insert(Arc::from(&*k.demangled), (1, dur));
                            *pool.used += cost;
                            self.held += cost;
                        }
                    }
                }
                if let Some(d) = self.devices.get(&rec.device) {
                    sm_count = Some(d.sm_count);
                    let threads = rec
                        .block
                        .iter()
                        .fold(1u64, |t, &b| t.saturating_mul(u64::from(b.max(0) as u32)));
                    let smem = u64::from(rec.static_shared_mem) + u64::from(rec.dynamic_shared_mem);
                    occupancy = d.occupancy(threads, rec.registers_per_thread, smem);
                }
            }
            Some(GpuRecordKind::Memcpy) => {
                s.memcpys += 1;
                s.memcpy_ns = s.memcpy_ns.saturating_add(dur);
            }
            _ => {
                s.memsets += 1;
                s.memset_ns = s.memset_ns.saturating_add(dur);
            }
        }
        if let Some(launch) = origin.as_ref().and_then(|o| o.launch_ts_ns)
            && rec.start_ns >= launch
        {
            let delay = rec.start_ns - launch;
            s.queue_delay_ns = s.queue_delay_ns.saturating_add(delay);
            s.queue_delays += 1;
            s.max_queue_delay_ns = s.max_queue_delay_ns.max(delay);
        }
        let nvtx = origin
            .as_ref()
            .and_then(|o| Some((o.tid, o.launch_ts_ns?)))
            .and_then(|(tid, ts)| self.nvtx.stack(tid, ts));
        out.push(GpuActivity {
            pid,
            comm,
            rec,
            origin,
            kernel,
            occupancy,
            sm_count,
            anomalous: false,
            nvtx,
        });
    }
}

/// Whether a probed driver call can be the one a runtime call of `family` makes.
fn same_family(probed: Family, runtime: Family) -> bool {
    match runtime {
        Family::Launch | Family::LaunchEx => matches!(probed, Family::Launch | Family::LaunchEx),
        other => probed == other,
    }
}

/// `cudaLaunchKernel_v7000` → `cudaLaunchKernel`.
fn runtime_name(name: &'static str) -> &'static str {
    match name.rsplit_once("_v") {
        Some((base, v)) if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => base,
        _ => name,
    }
}

/// CUPTI_ACTIVITY_MEMCPY_KIND_* as written in JSON.
pub fn copy_kind_name(k: u32) -> &'static str {
    copy_kind(k).map_or("unknown", |c| c.0)
}

/// A copy as the timeline and the flamegraph name it (`memcpy HtoD`); None for a kind CUPTI
/// did not name.
pub fn copy_label(k: u32) -> Option<&'static str> {
    copy_kind(k).map(|c| c.1)
}

/// CUPTI_ACTIVITY_MEMCPY_KIND_* 1..=10: (JSON name, label).
const COPY_KINDS: [(&str, &str); 10] = [
    ("htod", "memcpy HtoD"),
    ("dtoh", "memcpy DtoH"),
    ("htoa", "memcpy HtoA"),
    ("atoh", "memcpy AtoH"),
    ("atoa", "memcpy AtoA"),
    ("atod", "memcpy AtoD"),
    ("dtoa", "memcpy DtoA"),
    ("dtod", "memcpy DtoD"),
    ("htoh", "memcpy HtoH"),
    ("ptop", "memcpy PtoP"),
];

fn copy_kind(k: u32) -> Option<&'static (&'static str, &'static str)> {
    COPY_KINDS.get((k as usize).checked_sub(1)?)
}

/// CUPTI_ACTIVITY_MEMORY_KIND_* as written in JSON.
pub fn memory_kind_name(k: u16) -> &'static str {
    match k {
        1 => "pageable",
        2 => "pinned",
        3 => "device",
        4 => "array",
        5 => "managed",
        6 => "device_static",
        7 => "managed_static",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unbounded pool's counters, for the tests of the join itself.
    #[derive(Default)]
    struct Counts {
        used: u64,
        evicted: u64,
        names: u64,
        limit: Option<u64>,
    }

    impl Counts {
        fn pool(&mut self) -> Pool<'_> {
            Pool {
                limit: self.limit.unwrap_or(u64::MAX),
                used: &mut self.used,
                evicted: &mut self.evicted,
                names_evicted: &mut self.names,
            }
        }
    }

    const H100: Device = Device {
        sm_count: 132,
        max_threads_per_sm: 2048,
        max_blocks_per_sm: 32,
        registers_per_sm: 65536,
        shared_mem_per_sm: 233_472,
        reserved_shared_mem_per_block: 1024,
        warp_size: 32,
        compute_capability: 90,
    };

    #[test]
    fn occupancy_follows_the_calculator() {
        // 256 threads, 32 registers: 8 blocks by threads and by registers → 64/64 warps.
        assert_eq!(H100.occupancy(256, 32, 0), Some(1.0));
        // 64 registers: 2048 per warp, 16384 per block → 4 blocks → 32 warps.
        assert_eq!(H100.occupancy(256, 64, 0), Some(0.5));
        // 48 KiB of shared memory (+1 KiB reserved) per block: 4 blocks of 8 warps.
        assert_eq!(H100.occupancy(256, 32, 48 * 1024), Some(0.5));
        // One thread per block: the 32-block limit leaves 32 of 64 warps.
        assert_eq!(H100.occupancy(1, 0, 0), Some(0.5));
        assert_eq!(Device::default().occupancy(256, 32, 0), None);
    }

    fn api_rec(corr: u32, tid: u32, cbid: u32, start: u64, end: u64) -> GpuRecord {
        GpuRecord {
            kind: GpuRecordKind::Api as u32,
            correlation_id: corr,
            tid,
            cbid,
            start_ns: start,
            end_ns: end,
            ..Default::default()
        }
    }

    fn kernel_rec(corr: u32, start: u64, end: u64) -> GpuRecord {
        GpuRecord {
            kind: GpuRecordKind::Kernel as u32,
            correlation_id: corr,
            start_ns: start,
            end_ns: end,
            block: [128, 1, 1],
            registers_per_thread: 32,
            ..Default::default()
        }
    }

    fn launch(ts: u64) -> Recent {
        Recent {
            function: 0,
            ts_ns: ts,
            api: api::by_id(api::id_of("cuLaunchKernel").unwrap()).unwrap(),
            kernel: Some(Arc::new(KernelName::new("k"))),
        }
    }

    #[test]
    fn activity_joins_its_launch_in_either_order() {
        let mut g = GpuState::default();
        let mut c = Counts::default();
        let mut out = Vec::new();
        g.call(7, launch(1_000), &mut c.pool());
        g.call(7, launch(5_000), &mut c.pool());
        // Kernel of the second launch before its API record: it waits.
        g.record(
            1,
            [0; 16],
            &kernel_rec(2, 9_000, 12_000),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        assert!(out.is_empty() && g.has_pending());
        g.record(
            1,
            [0; 16],
            &api_rec(1, 7, 307, 1_200, 2_000),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        g.record(
            1,
            [0; 16],
            &api_rec(2, 7, 307, 5_300, 6_000),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].origin.as_ref().unwrap().launch_ts_ns, Some(5_000));
        assert_eq!(out[0].queue_delay_ns(), Some(4_000));
        assert_eq!(out[0].kernel.as_ref().unwrap().demangled.as_ref(), "k");
        g.record(
            1,
            [0; 16],
            &kernel_rec(1, 3_000, 4_000),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        assert_eq!(out[1].origin.as_ref().unwrap().launch_ts_ns, Some(1_000));
        assert_eq!((g.stats.joined, g.stats.unjoined, g.stats.kernel_ns), (2, 0, 4_000));
        assert!(!g.has_pending());
    }

    #[test]
    fn correlation_ids_are_forgotten_a_minute_after_their_call() {
        let mut g = GpuState::default();
        let mut c = Counts::default();
        let mut out = Vec::new();
        let s = 1_000_000_000;
        g.call(7, launch(s), &mut c.pool());
        g.record(
            1,
            [0; 16],
            &api_rec(1, 7, 307, s + 100, s + 200),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        g.call(7, launch(40 * s), &mut c.pool());
        g.record(
            1,
            [0; 16],
            &api_rec(2, 7, 307, 40 * s + 100, 40 * s + 200),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        // 59 s after the first call ended: both ids still known; a late kernel of id 1 joins.
        g.age(s + 200 + ORIGIN_AGE_NS - 1, &mut c.pool());
        g.record(
            1,
            [0; 16],
            &kernel_rec(1, 2 * s, 2 * s + 5),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        assert_eq!(out.pop().unwrap().origin.unwrap().launch_ts_ns, Some(s));
        let held = c.used;
        // Past a minute: id 1 is forgotten (its bytes given back), id 2 is not.
        g.age(s + 201 + ORIGIN_AGE_NS, &mut c.pool());
        assert_eq!(held - c.used, ORIGIN_COST);
        assert!(!g.origins.contains_key(&1) && g.origins.contains_key(&2));
        g.record(
            1,
            [0; 16],
            &kernel_rec(2, 41 * s, 41 * s + 5),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        assert_eq!(out.pop().unwrap().origin.unwrap().launch_ts_ns, Some(40 * s));
        assert_eq!(c.evicted, 0, "ageing is not eviction");
    }

    #[test]
    fn runtime_records_claim_the_driver_call_made_inside_them() {
        let mut g = GpuState::default();
        let mut c = Counts::default();
        let mut out = Vec::new();
        let ex = Recent {
            function: 0,
            ts_ns: 2_000,
            api: api::by_id(api::id_of("cuLaunchKernelEx").unwrap()).unwrap(),
            kernel: None,
        };
        g.call(7, launch(500), &mut c.pool()); // before the runtime call: not it
        g.call(7, ex, &mut c.pool());
        let mut rt = api_rec(5, 7, 211, 1_500, 3_000); // cudaLaunchKernel
        rt.kind = GpuRecordKind::RuntimeApi as u32;
        g.record(1, [0; 16], &rt, &mut out, &mut Vec::new(), &mut c.pool());
        g.record(
            1,
            [0; 16],
            &kernel_rec(5, 4_000, 5_000),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        let o = out[0].origin.as_ref().unwrap();
        assert_eq!((o.launch_ts_ns, o.cupti_api), (Some(2_000), "cudaLaunchKernel"));
        assert_eq!(o.api.map(|a| a.name), Some("cuLaunchKernelEx"));
        // A runtime memcpy made no probed driver call: joined to CUPTI's record only.
        let mut cp = api_rec(6, 7, 41, 6_000, 7_000);
        cp.kind = GpuRecordKind::RuntimeApi as u32;
        g.record(1, [0; 16], &cp, &mut out, &mut Vec::new(), &mut c.pool());
        assert_eq!(g.stats.api_unmatched, 1);
        assert_eq!(runtime_name("cudaMemcpy_ptds_v7000"), "cudaMemcpy_ptds");
    }

    #[test]
    fn waiting_calls_are_bounded_per_process_and_counted() {
        let mut g = GpuState::default();
        let mut c = Counts::default();
        for i in 0..(MAX_RECENT as u64 + 10) {
            g.call((i % 3) as u32, launch(1_000 + i), &mut c.pool());
        }
        assert_eq!(g.recent_len, MAX_RECENT);
        assert_eq!(g.recent.values().map(VecDeque::len).sum::<usize>(), MAX_RECENT);
        assert_eq!(g.stats.recent_evicted, 10);
        // Thirty seconds later the old ones age out as new calls come.
        g.call(0, launch(40_000_000_000), &mut c.pool());
        assert!(g.recent[&0].len() == 1 && g.recent_len < MAX_RECENT);
    }

    #[test]
    fn the_shared_budget_bounds_all_threads_and_counts_what_it_lets_go() {
        // Room for 100 waiting calls with their threads: 4000 threads calling once each.
        let mut g = GpuState::default();
        let mut c = Counts {
            limit: Some(100 * (RECENT_COST + THREAD_COST)),
            ..Default::default()
        };
        for t in 0..4000u32 {
            g.call(t, launch(1_000 + u64::from(t)), &mut c.pool());
        }
        assert_eq!((g.recent.len(), g.recent_len), (100, 100));
        assert_eq!(c.used, 100 * (RECENT_COST + THREAD_COST));
        assert_eq!((c.evicted, g.stats.recent_evicted), (3900, 3900));
        // A thread already waiting makes room with its own oldest call.
        g.call(5, launch(9_000), &mut c.pool());
        assert_eq!((g.recent[&5].len(), g.recent[&5][0].ts_ns), (1, 9_000));
        assert_eq!(c.evicted, 3901);
        // Claimed calls give their bytes back, and the thread's entry goes with its last.
        let mut out = Vec::new();
        g.record(
            1,
            [0; 16],
            &api_rec(1, 5, 307, 8_000, 9_500),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        assert_eq!(c.used, 99 * (RECENT_COST + THREAD_COST) + ORIGIN_COST);
        // Activity with no API record waits while there is room, then goes out unjoined.
        let room = 100 * (RECENT_COST + THREAD_COST) - c.used;
        let fit = room / (PENDING_COST + ORDER_COST);
        for i in 0..fit + 3 {
            g.record(
                1,
                [0; 16],
                &kernel_rec(100 + i as u32, 10, 20),
                &mut out,
                &mut Vec::new(),
                &mut c.pool(),
            );
        }
        assert!(c.used <= 100 * (RECENT_COST + THREAD_COST));
        assert_eq!(
            c.evicted - 3901,
            g.stats.unjoined,
            "every record sent out early is counted"
        );
        assert!(g.stats.unjoined > 0);
        // Exit: everything is given back.
        g.expire(1, [0; 16], u64::MAX, &mut out, &mut c.pool());
        g.release(&mut c.pool());
        assert_eq!((c.used, g.held()), (0, 0));
    }

    #[test]
    fn unmatched_activity_ages_out_counted() {
        let mut g = GpuState::default();
        let mut c = Counts::default();
        let mut out = Vec::new();
        g.record(
            1,
            [0; 16],
            &kernel_rec(9, 100, 200),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        g.expire(1, [0; 16], 50, &mut out, &mut c.pool());
        assert!(out.is_empty(), "not old enough");
        g.expire(1, [0; 16], 101, &mut out, &mut c.pool());
        assert_eq!(out.len(), 1);
        assert!(out[0].origin.is_none());
        assert_eq!((g.stats.joined, g.stats.unjoined), (0, 1));
        // An API record whose call the uprobes never saw: joined to nothing, counted.
        g.record(
            1,
            [0; 16],
            &api_rec(3, 7, 307, 1, 2),
            &mut out,
            &mut Vec::new(),
            &mut c.pool(),
        );
        assert_eq!(g.stats.api_unmatched, 1);
    }

    #[test]
    fn status_changes_are_reported_once() {
        let mut g = GpuState::default();
        let mut c = Counts::default();
        let mut out = Vec::new();
        let mut st = GpuRecord {
            kind: GpuRecordKind::Status as u32,
            ..Default::default()
        };
        st.aux[status_aux::STATE] = CuptiState::Busy as u64;
        st.aux[status_aux::CUPTI_RESULT] = 39;
        let s = g
            .record(1, [0; 16], &st, &mut out, &mut Vec::new(), &mut c.pool())
            .expect("changed");
        assert_eq!((s.state, s.cupti_result), (Some(CuptiState::Busy), 39));
        assert_eq!(
            g.record(1, [0; 16], &st, &mut out, &mut Vec::new(), &mut c.pool()),
            None
        );
    }

    #[test]
    fn a_late_librarys_announced_start_is_no_state_but_holds_until_the_next_status() {
        let mut g = GpuState::default();
        let mut c = Counts::default();
        let mut out = Vec::new();
        let mut st = GpuRecord {
            kind: GpuRecordKind::Status as u32,
            device: status_aux::INJECTED,
            ..Default::default()
        };
        let mut say = |g: &mut GpuState, state: CuptiState| {
            st.aux[status_aux::STATE] = state as u64;
            g.record(1, [0; 16], &st, &mut out, &mut Vec::new(), &mut c.pool())
        };
        assert_eq!(say(&mut g, CuptiState::Starting), None, "no line of its own");
        assert!(g.starting);
        assert_eq!(g.status.state, None);
        let s = say(&mut g, CuptiState::Active).expect("changed");
        assert_eq!(s.state, Some(CuptiState::Active));
        assert!(!g.starting);
        // A restart that then fails: announced, then busy.
        say(&mut g, CuptiState::Idle);
        assert_eq!(say(&mut g, CuptiState::Starting), None);
        assert_eq!(g.status.state, Some(CuptiState::Idle));
        assert_eq!(
            say(&mut g, CuptiState::Busy).map(|s| s.state),
            Some(Some(CuptiState::Busy))
        );
        assert!(!g.starting);
    }
}
