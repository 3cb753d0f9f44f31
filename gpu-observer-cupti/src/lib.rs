//! gpu-observer's CUPTI injection library: load it with
//! `CUDA_INJECTION64_PATH=/path/libgpu_observer_cupti.so` (or `gpu-observer run -- CMD`) and
//! the CUDA driver calls [`InitializeInjection`] when the process initializes CUDA.
//!
//! It asks CUPTI for kernel, copy and memset activity (when each really ran on the GPU) and for
//! the driver API records that tie them to their launches (correlation ids), on CUPTI's clock
//! set to CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`. Records are handed to gpu-observer
//! through hook functions its eBPF programs probe (see `gpu_observer_common::cupti`):
//!
//! - nothing is collected unless an observer is attached: the kernel raises
//!   [`gpu_observer_cupti_semaphore`] while the observer's uprobe is on the hook, and a control
//!   thread enables CUPTI's activity kinds then, and disables them when it drops back to zero;
//! - nothing here may crash or stall the host process: every entry point from C runs inside
//!   `catch_unwind`, every failure leaves the process running without GPU timestamps, and the
//!   observer is told why (a status record).
//!
//! Loaded late: `gpu-observer --pid N --gpu-timing` injects this library into a process that is
//! already running (docs/DESIGN.md "GPU timing for a running process"): it is `dlopen`ed from
//! `/proc/self/fd/N` (a memfd) by a thread the observer borrowed, which may hold driver locks.
//! So the constructor only starts the control thread; that thread loads CUPTI and enables
//! activity on the contexts that exist, and only while the observer also sets
//! [`gpu_observer_cupti_control`] to `ON` (attaching without `--gpu-timing` never turns CUPTI
//! on). Withdrawing sets it back to `OFF`: activity is flushed and disabled and the library
//! stays, idle, until an observer turns it on again.
//!
//! Settings (environment; `gpu-observer run` sets them from its flags):
//! `GPU_OBSERVER_CUDA_BUFFER_SIZE` (activity buffer bytes, default 8 MiB; docs/DESIGN.md "Defaults"),
//! `GPU_OBSERVER_CUPTI_RATE_LIMIT` (records per second forwarded, default 1 000 000, 0 = none),
//! `GPU_OBSERVER_CUPTI_FLUSH_MS` (default 500), `GPU_OBSERVER_CUPTI_PATH` (libcupti to load).

pub mod convert;
mod cupti;

use std::{
    collections::HashSet,
    ffi::{CStr, c_char, c_int, c_void},
    panic::{AssertUnwindSafe, catch_unwind},
    sync::{
        Mutex, OnceLock,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use gpu_observer_common::cupti::{
    CuptiState, GpuRecord, GpuRecordKind, MAX_BATCH, NvtxState, control, device_aux, marker, status_aux,
};

use crate::{
    convert::{Converted, kind},
    cupti::Cupti,
};

/// A uprobe reference counter (the kernel adds one per attached uprobe), alone in its page.
///
/// The page matters: when the library is mapped after the observer attached, the kernel bumps
/// the counter at mmap time in the first writable mapping of its file page — and while the
/// loader is still relocating, the RELRO segment is writable and may map that same file page.
/// The count would land in the RELRO copy and the library would never see it.
#[repr(C, align(4096))]
pub struct Semaphore {
    pub count: u16,
}

/// Raised by the kernel while a gpu-observer uprobe on the hooks is attached (like a USDT
/// is-enabled semaphore). In `.probes`, a data section, so it has a file offset.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".probes")]
#[allow(non_upper_case_globals)]
pub static mut gpu_observer_cupti_semaphore: Semaphore = Semaphore { count: 0 };

/// Written by an observer (`gpu_observer_common::cupti::control`): `ON`/`OFF` switch a library
/// injected into a running process ([`LATE`]); `PAUSE` holds any library between fleet mode's
/// capture windows.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".probes")]
#[allow(non_upper_case_globals)]
pub static mut gpu_observer_cupti_control: u32 = control::OFF;

/// Loaded into a running process by `gpu-observer --gpu-timing` (from a memfd), not by the
/// CUDA driver.
static LATE: AtomicBool = AtomicBool::new(false);

/// Runs when the library is loaded, whoever loads it. Only a late load does anything: it starts
/// the control thread and returns (no CUDA or CUPTI call here: the loading thread may hold the
/// driver's locks, and the loader's lock is held until this returns). Under
/// `CUDA_INJECTION64_PATH` the driver calls [`InitializeInjection`] instead.
extern "C" fn on_load() {
    let _ = catch_unwind(|| {
        if loaded_from_memfd() {
            LATE.store(true, Relaxed);
            spawn_control();
        }
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

/// Whether this library was opened as `/proc/self/fd/N`: what the observer's injection does,
/// and no other loader of it (`CUDA_INJECTION64_PATH`, `NVTX_INJECTION64_PATH`) names a memfd.
fn loaded_from_memfd() -> bool {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr reads the loader's tables for an address inside this library and fills a
    // valid out-struct; the name it points to lives as long as the library.
    if unsafe { libc::dladdr(on_load as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return false;
    }
    // SAFETY: non-null, NUL-terminated (see above).
    unsafe { CStr::from_ptr(info.dli_fname) }
        .to_bytes()
        .starts_with(b"/proc/self/fd/")
}

/// The observer's control word now.
fn control_word() -> u32 {
    // SAFETY: a plain read of a u32 the observer may write at any time (through
    // /proc/<pid>/mem); volatile so each check sees the current value.
    unsafe { std::ptr::read_volatile(&raw const gpu_observer_cupti_control) }
}

/// Whether to collect: an observer is attached, has not paused collection (fleet mode between
/// windows) and, for a late load, has switched it on.
fn wanted() -> bool {
    observed()
        && match control_word() {
            control::ON => true,
            control::PAUSE => false,
            _ => !LATE.load(Relaxed),
        }
}

/// With no observer attached, a pause left by one (killed between two capture windows) is
/// lifted: the next observer starts from the initial word.
fn lift_stale_pause() {
    if !observed() && control_word() == control::PAUSE {
        // SAFETY: a plain write of a u32 the observer may also write (it writes whole words;
        // either value is a valid one).
        unsafe { std::ptr::write_volatile(&raw mut gpu_observer_cupti_control, control::OFF) }
    }
}

/// Whether an observer is attached now.
fn observed() -> bool {
    // SAFETY: a plain read of a u16 the kernel may change at any time; volatile so each check
    // sees the current value.
    unsafe { std::ptr::read_volatile(&raw const gpu_observer_cupti_semaphore.count) != 0 }
}

/// The hook the observer's eBPF program probes: it copies `count` records from `records`.
/// It does nothing itself; its first instruction is a 5-byte nop, which the kernel emulates
/// (~0.66 µs a hit instead of ~11 µs for a single-stepped instruction; docs/DESIGN.md "Measured costs").
#[cfg(target_arch = "x86_64")]
#[unsafe(no_mangle)]
#[unsafe(naked)]
pub extern "C" fn gpu_observer_cupti_batch(_records: *const GpuRecord, _count: u32) {
    core::arch::naked_asm!(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00", "ret");
}

/// The hook for kernel names: `key` is CUPTI's name pointer, `name` the NUL-terminated name.
#[cfg(target_arch = "x86_64")]
#[unsafe(no_mangle)]
#[unsafe(naked)]
pub extern "C" fn gpu_observer_cupti_name(_key: u64, _name: *const c_char) {
    core::arch::naked_asm!(".byte 0x0f, 0x1f, 0x44, 0x00, 0x00", "ret");
}

#[cfg(not(target_arch = "x86_64"))]
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn gpu_observer_cupti_batch(records: *const GpuRecord, count: u32) {
    std::hint::black_box((records, count));
}

#[cfg(not(target_arch = "x86_64"))]
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn gpu_observer_cupti_name(key: u64, name: *const c_char) {
    std::hint::black_box((key, name));
}

/// Settings read once from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// How API calls are recorded for the join (`GPU_OBSERVER_CUPTI_API`): `per_api` (only
    /// the work APIs; whole API kinds where CUPTI cannot) or `kinds` (whole DRIVER/RUNTIME
    /// kinds). Unset: `per_api`, except in a library injected late, where CUPTI 13 on the H100
    /// recorded no API call at all with the per-API switches in some runs (docs/VALIDATION.md
    /// "GPU timing for a running process"), and whole kinds always joined.
    pub api: Option<ApiMode>,
    pub buffer_bytes: usize,
    pub rate_limit: u64,
    pub flush: Duration,
    pub cupti_path: Option<String>,
}

impl Config {
    pub const DEFAULT_BUFFER_BYTES: usize = 8 * 1024 * 1024;
    pub const DEFAULT_RATE_LIMIT: u64 = 1_000_000;

    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Self {
        let num = |k: &str| get(k).and_then(|v| v.trim().parse::<u64>().ok());
        Self {
            api: match get("GPU_OBSERVER_CUPTI_API").as_deref().map(str::trim) {
                Some("kinds") => Some(ApiMode::Kinds),
                Some("per_api") => Some(ApiMode::PerApi),
                _ => None,
            },
            buffer_bytes: num("GPU_OBSERVER_CUDA_BUFFER_SIZE").map_or(Self::DEFAULT_BUFFER_BYTES, |v| {
                v.clamp(64 * 1024, 256 * 1024 * 1024) as usize
            }),
            rate_limit: num("GPU_OBSERVER_CUPTI_RATE_LIMIT").unwrap_or(Self::DEFAULT_RATE_LIMIT),
            flush: Duration::from_millis(num("GPU_OBSERVER_CUPTI_FLUSH_MS").unwrap_or(500).clamp(10, 60_000)),
            cupti_path: get("GPU_OBSERVER_CUPTI_PATH").filter(|p| !p.is_empty()),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApiMode {
    PerApi,
    Kinds,
}

/// Process-wide state: set up once by [`InitializeInjection`].
struct Injection {
    cfg: Config,
    cupti: Option<Cupti>,
    state: AtomicU64,
    result: AtomicU64,
    enabled: AtomicBool,
    /// Enabled through the per-API switches (else whole DRIVER/RUNTIME kinds).
    per_api: AtomicBool,
    /// Collection was started once already (a later start uses whole API kinds).
    started: AtomicBool,
    forwarded: AtomicU64,
    rate_limited: AtomicU64,
    cupti_dropped: AtomicU64,
    buffers: AtomicU64,
    limiter: Mutex<Bucket>,
    /// Serializes enabling and disabling (the driver's thread and the control thread).
    switch: Mutex<()>,
    /// Held while a flush hands buffers to the hook: the exit handler waits for the control
    /// thread's flush in progress, whose records the process's end would otherwise cut off
    /// (seen in the tests on a loaded machine: the last ~90 ms of records missing).
    flushing: Mutex<()>,
    /// Name pointers already sent to the current observer.
    names_sent: Mutex<HashSet<u64>>,
    /// The device table reached the current observer (kernel records need it for occupancy).
    devices_sent: AtomicBool,
    /// Whether NVTX hands its calls to CUPTI (an [`NvtxState`]).
    nvtx: AtomicU32,
    /// CUPTI records NVTX markers now (enabled with the work kinds, when it can).
    markers: AtomicBool,
}

static INJECTION: OnceLock<Injection> = OnceLock::new();

/// Most names remembered as sent (beyond it, a name may be sent twice: harmless).
const MAX_NAMES: usize = 65_536;
const POLL: Duration = Duration::from_millis(100);
const STATUS_EVERY: Duration = Duration::from_secs(1);

/// Token bucket for the per-process rate limit (one second of burst).
pub struct Bucket {
    rate: u64,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    pub fn new(rate: u64, now: Instant) -> Self {
        Self {
            rate,
            tokens: rate as f64,
            last: now,
        }
    }

    /// Takes one token; false when the budget is spent (and always true without a limit).
    pub fn take(&mut self, now: Instant) -> bool {
        if self.rate == 0 {
            return true;
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate as f64).min(self.rate as f64);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// CLOCK_MONOTONIC ns: what CUPTI stamps records with once registered.
extern "C" fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid timespec out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Called by the CUDA driver inside `cuInit` (CUDA_INJECTION64_PATH). Returns 1: whatever
/// happens here, the process goes on (without GPU timestamps if CUPTI cannot be used).
#[unsafe(no_mangle)]
pub extern "C" fn InitializeInjection() -> c_int {
    let _ = catch_unwind(|| {
        let inj = INJECTION.get_or_init(init);
        // Observed from the start (`gpu-observer run`): collect from the first kernel on, and
        // tell the observer now, before the first launch, so it keeps every call for the join.
        if observed() {
            // The device table first, here: the control thread may start too late for a
            // short-lived process (seen in the tests: it exited before the thread's first look).
            send_devices(inj);
            start(inj);
            send_status(inj);
        }
    });
    1
}

/// Called by NVTX on a process's first NVTX call when `NVTX_INJECTION64_PATH` names this
/// library (`gpu-observer run` sets it): CUPTI becomes the NVTX tool, through the same libcupti
/// this library loaded, so that its markers land where the activity kinds are enabled (a second
/// copy of CUPTI, say the one a PyTorch wheel ships, would record them for nobody). NVTX may
/// come before `cuInit`: CUPTI is loaded here then. Returns CUPTI's answer (0: NVTX calls do
/// nothing, the process runs on).
#[unsafe(no_mangle)]
pub extern "C" fn InitializeInjectionNvtx2(get_export_table: Option<cupti::NvtxGetExportTable>) -> c_int {
    catch_unwind(|| {
        let inj = INJECTION.get_or_init(init);
        let Some(f) = inj.cupti.as_ref().and_then(|c| c.nvtx_init) else {
            inj.nvtx.store(NvtxState::Failed as u32, Relaxed);
            return 0;
        };
        // SAFETY: CUPTI's NVTX entry point, handed NVTX's own getter unchanged.
        let r = unsafe { f(get_export_table) };
        let state = if r != 0 { NvtxState::Active } else { NvtxState::Failed };
        inj.nvtx.store(state as u32, Relaxed);
        r
    })
    .unwrap_or(0)
}

fn init() -> Injection {
    let cfg = Config::from_env(|k| std::env::var(k).ok());
    let inj = |cupti, state: CuptiState, result: i32| Injection {
        limiter: Mutex::new(Bucket::new(cfg.rate_limit, Instant::now())),
        switch: Mutex::new(()),
        flushing: Mutex::new(()),
        cfg: cfg.clone(),
        cupti,
        state: AtomicU64::new(state as u64),
        result: AtomicU64::new(result as u64),
        enabled: AtomicBool::new(false),
        per_api: AtomicBool::new(false),
        started: AtomicBool::new(false),
        forwarded: AtomicU64::new(0),
        rate_limited: AtomicU64::new(0),
        cupti_dropped: AtomicU64::new(0),
        buffers: AtomicU64::new(0),
        names_sent: Mutex::new(HashSet::new()),
        devices_sent: AtomicBool::new(false),
        nvtx: AtomicU32::new(NvtxState::NotLoaded as u32),
        markers: AtomicBool::new(false),
    };
    let c = match Cupti::load(cfg.cupti_path.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            warn(&e);
            spawn_control();
            return inj(None, CuptiState::NoCupti, 0);
        }
    };
    // Injected late into a running process, CUPTI may already serve another tool (an
    // in-process profiler, nsys): registering our buffers would take its records away. A
    // subscriber probe says so without touching its state; the process is then left alone.
    if LATE.load(Relaxed) && c.another_subscriber() {
        warn("another profiler holds CUPTI (CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)");
        return inj(Some(c), CuptiState::Busy, cupti::MULTIPLE_SUBSCRIBERS);
    }
    // The clock first: CUPTI requires it before any activity kind is enabled.
    // SAFETY: CUPTI entry points called with the arguments their headers specify.
    let setup = unsafe {
        [
            (c.register_timestamp)(monotonic_ns),
            (c.set_thread_id_type)(cupti::THREAD_ID_TYPE_SYSTEM),
            (c.register_callbacks)(buffer_requested, buffer_completed),
        ]
    };
    let failed = setup.iter().copied().find(|&r| r != cupti::SUCCESS);
    let state = match failed {
        None => CuptiState::Idle,
        Some(cupti::MULTIPLE_SUBSCRIBERS) => CuptiState::Busy,
        Some(_) => CuptiState::Failed,
    };
    if let Some(r) = failed {
        warn(&format!("CUPTI set-up failed: {}", c.describe(r)));
    }
    // SAFETY: registered once, at init; the handler only flushes through CUPTI.
    unsafe { libc::atexit(at_exit) };
    spawn_control();
    inj(Some(c), state, failed.unwrap_or(0))
}

/// Says why GPU timestamps are missing, on the process's stderr, only while an observer is
/// attached (as under `gpu-observer run`): a process that merely carries the library (a
/// DaemonSet-injected environment) is never written to. The observer reports it too.
fn warn(msg: &str) {
    if observed() {
        eprintln!("gpu-observer-cupti: {msg}; this process is observed with uprobes only");
    }
}

/// Starts the control thread, once per process (the driver's `InitializeInjection` and a late
/// load each ask for it).
fn spawn_control() {
    static STARTED: AtomicBool = AtomicBool::new(false);
    if STARTED.swap(true, Relaxed) {
        return;
    }
    let _ = std::thread::Builder::new().name("gpu-observer-cupti".into()).spawn(|| {
        let _ = catch_unwind(control);
    });
}

/// Follows the semaphore: enable when an observer comes, flush while it stays, disable when
/// it goes. Also re-sends the device table and status to each new observer.
fn control() {
    let inj = if LATE.load(Relaxed) {
        // A late load: CUDA is up, and this thread holds nothing; set CUPTI up here.
        INJECTION.get_or_init(init)
    } else {
        // The driver calls InitializeInjection before INJECTION is set: wait for it.
        loop {
            if let Some(i) = INJECTION.get() {
                break i;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let mut was_observed = false;
    let mut last_flush = Instant::now();
    let mut last_status = Instant::now();
    loop {
        let now_observed = wanted();
        if now_observed && !was_observed {
            inj.names_sent.lock().map(|mut n| n.clear()).ok();
            // The device table first: a kernel record that reached the agent before it would
            // have no occupancy (seen under load: a flush beat send_devices).
            inj.devices_sent.store(false, Relaxed);
            send_devices(inj);
            start(inj);
            send_status(inj);
            last_status = Instant::now();
        } else if !now_observed && was_observed {
            stop(inj);
            // A withdraw (the observer is still attached) learns that the last records are out.
            if observed() {
                send_status(inj);
            }
        } else if now_observed {
            if inj.enabled.load(Relaxed) && last_flush.elapsed() >= inj.cfg.flush {
                flush(inj, 0);
                last_flush = Instant::now();
            }
            if last_status.elapsed() >= STATUS_EVERY {
                send_status(inj);
                last_status = Instant::now();
            }
        }
        was_observed = now_observed;
        lift_stale_pause();
        std::thread::sleep(POLL);
    }
}

fn set_state(inj: &Injection, state: CuptiState, result: i32) {
    inj.state.store(state as u64, Relaxed);
    inj.result.store(result as u64, Relaxed);
}

/// The activity kinds of GPU work (always enabled together).
const WORK_KINDS: [u32; 3] = [kind::CONCURRENT_KERNEL, kind::MEMCPY, kind::MEMSET];
/// Whole API kinds, when CUPTI cannot record single APIs.
const API_KINDS: [u32; 2] = [kind::DRIVER, kind::RUNTIME];

/// Asks CUPTI to record only the API calls that launch GPU work (the per-API switches of
/// newer CUPTI): every other driver/runtime call then costs nothing. False if not supported.
fn set_work_apis(c: &Cupti, on: bool) -> Result<(), i32> {
    let (Some(driver), Some(runtime)) = (c.enable_driver_api, c.enable_runtime_api) else {
        return Err(cupti::NOT_SUPPORTED);
    };
    let ids = cupti_ids();
    for &(domain, cbid) in &ids {
        let f = if domain == 0 { driver } else { runtime };
        // SAFETY: CUPTI entry point with a callback id from its headers.
        let r = unsafe { f(cbid, u8::from(on)) };
        if r != cupti::SUCCESS {
            return Err(r);
        }
    }
    Ok(())
}

/// (0 driver / 1 runtime, callback id) of every work API.
fn cupti_ids() -> Vec<(u8, u32)> {
    use gpu_observer_common::cupti::{DRIVER_CBIDS, RUNTIME_CBIDS};
    DRIVER_CBIDS
        .iter()
        .map(|(c, _)| (0, *c))
        .chain(RUNTIME_CBIDS.iter().map(|(c, _, _)| (1, *c)))
        .collect()
}

/// Enables GPU work records and the API records that correlate them; on
/// CUPTI_ERROR_MULTIPLE_SUBSCRIBERS (nsys, ncu, an in-process profiler) undoes what it enabled
/// and reports the process as busy.
fn start(inj: &Injection) {
    let Some(c) = &inj.cupti else { return };
    let _switch = inj.switch.lock().unwrap_or_else(|e| e.into_inner());
    if inj.enabled.load(Relaxed) || inj.state.load(Relaxed) == CuptiState::Failed as u64 {
        return;
    }
    // A late load says it is starting before it enables anything: the agent holds a launch
    // of a handle it cannot name for its kernel record's name only while CUPTI runs
    // (correlate/late_names.rs), and a launch CUPTI records between the enable and the status
    // sent after it would otherwise go out unnamed (seen in the tests on a loaded machine).
    // Should the enable fail, the status after it says so; launches held meanwhile wait at
    // most their hold.
    if LATE.load(Relaxed) && observed() {
        send_status_as(inj, CuptiState::Starting as u64);
    }
    // Per-API switches only at the process's first start: set after its contexts exist (a
    // late load, or a restart after fleet mode's pause) CUPTI 13 on the H100 recorded no API
    // call with them (docs/VALIDATION.md; a paused-and-resumed loop joined none of 117 834
    // kernel records), and whole kinds always joined.
    let restarted = inj.started.swap(true, Relaxed);
    let mode = inj.cfg.api.unwrap_or(if LATE.load(Relaxed) || restarted {
        ApiMode::Kinds
    } else {
        ApiMode::PerApi
    });
    let per_api = mode == ApiMode::PerApi
        && match set_work_apis(c, true) {
            Ok(()) => true,
            Err(cupti::MULTIPLE_SUBSCRIBERS) => return refuse(inj, c, cupti::MULTIPLE_SUBSCRIBERS, 0, false),
            Err(_) => {
                // Older CUPTI, or refused: whole API kinds instead (more records, same join).
                let _ = set_work_apis(c, false);
                false
            }
        };
    let kinds: Vec<u32> = WORK_KINDS
        .iter()
        .chain(if per_api { &[][..] } else { &API_KINDS[..] })
        .copied()
        .collect();
    for (i, k) in kinds.iter().enumerate() {
        // SAFETY: CUPTI entry point with a valid activity kind.
        let r = unsafe { (c.enable)(*k) };
        if r != cupti::SUCCESS {
            for k in &kinds[..i] {
                // SAFETY: as above.
                unsafe { (c.disable)(*k) };
            }
            return refuse(inj, c, r, *k, per_api);
        }
    }
    inj.per_api.store(per_api, Relaxed);
    inj.enabled.store(true, Relaxed);
    // NVTX ranges are a bonus: a CUPTI that cannot record them still times the GPU work.
    // SAFETY: CUPTI entry point with a valid activity kind.
    inj.markers
        .store(unsafe { (c.enable)(kind::MARKER) } == cupti::SUCCESS, Relaxed);
    set_state(inj, CuptiState::Active, 0);
}

/// CUPTI said no: undo the per-API switches and say why.
fn refuse(inj: &Injection, c: &Cupti, r: i32, kind: u32, per_api: bool) {
    if per_api {
        let _ = set_work_apis(c, false);
    }
    let state = if r == cupti::MULTIPLE_SUBSCRIBERS {
        CuptiState::Busy
    } else {
        CuptiState::Failed
    };
    warn(&format!(
        "cannot enable CUPTI activity (kind {kind}): {}",
        c.describe(r)
    ));
    set_state(inj, state, r);
}

fn stop(inj: &Injection) {
    let Some(c) = &inj.cupti else { return };
    let _switch = inj.switch.lock().unwrap_or_else(|e| e.into_inner());
    if !inj.enabled.swap(false, Relaxed) {
        return;
    }
    for k in WORK_KINDS {
        // SAFETY: CUPTI entry point with a valid activity kind.
        unsafe { (c.disable)(k) };
    }
    if inj.markers.swap(false, Relaxed) {
        // SAFETY: as above.
        unsafe { (c.disable)(kind::MARKER) };
    }
    if inj.per_api.load(Relaxed) {
        let _ = set_work_apis(c, false);
    } else {
        for k in API_KINDS {
            // SAFETY: as above.
            unsafe { (c.disable)(k) };
        }
    }
    flush(inj, cupti::FLUSH_FORCED);
    set_state(inj, CuptiState::Idle, 0);
}

fn flush(inj: &Injection, flag: u32) {
    // Kernel records come out of the flush: the device table must precede them. Sent here if
    // the driver could not tell it before (not yet initialized when first asked).
    if !inj.devices_sent.load(Relaxed) {
        send_devices(inj);
    }
    if let Some(c) = &inj.cupti {
        // Bounded: a flush stuck inside CUPTI must not hold the process's exit.
        let _held = lock_within(&inj.flushing, FLUSH_WAIT);
        // SAFETY: CUPTI entry point; completed buffers come back through buffer_completed.
        unsafe { (c.flush_all)(flag) };
    }
}

/// The longest a flush waits for another one in progress before going ahead without it.
const FLUSH_WAIT: Duration = Duration::from_secs(1);

/// Locks `m` if it can within `wait` (None after that: the caller goes on unserialized).
fn lock_within(m: &Mutex<()>, wait: Duration) -> Option<std::sync::MutexGuard<'_, ()>> {
    let deadline = Instant::now() + wait;
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(std::sync::TryLockError::WouldBlock) => return None,
        }
    }
}

extern "C" fn at_exit() {
    let _ = catch_unwind(|| {
        if let Some(inj) = INJECTION.get()
            && inj.enabled.load(Relaxed)
        {
            flush(inj, cupti::FLUSH_FORCED);
            send_status(inj);
        }
    });
}

/// CUPTI asks for an activity buffer: one of the configured size, 8-byte aligned.
extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let bytes = INJECTION
            .get()
            .map_or(Config::DEFAULT_BUFFER_BYTES, |i| i.cfg.buffer_bytes);
        // A size too large for a layout gets no buffer (CUPTI then drops, and counts, records).
        let p = match std::alloc::Layout::from_size_align(bytes, 8) {
            // SAFETY: non-zero size; freed in buffer_completed with the same layout.
            Ok(layout) => unsafe { std::alloc::alloc(layout) },
            Err(_) => std::ptr::null_mut(),
        };
        // SAFETY: CUPTI passes valid out-pointers.
        unsafe {
            *buffer = p;
            *size = if p.is_null() { 0 } else { bytes };
            *max_records = 0;
        }
    }));
}

/// CUPTI hands back a full (or flushed) buffer: forward its records while observed.
extern "C" fn buffer_completed(ctx: *mut c_void, stream: u32, buffer: *mut u8, size: usize, valid: usize) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if let Some(inj) = INJECTION.get() {
            inj.buffers.fetch_add(1, Relaxed);
            if observed() {
                forward(inj, buffer, valid);
            }
            if let Some(c) = &inj.cupti {
                let mut dropped = 0usize;
                // SAFETY: CUPTI entry point with the context/stream of this buffer.
                if unsafe { (c.dropped)(ctx, stream, &mut dropped) } == cupti::SUCCESS {
                    inj.cupti_dropped.fetch_add(dropped as u64, Relaxed);
                }
            }
        }
    }));
    if !buffer.is_null() && size > 0 {
        // The layout buffer_requested allocated with (valid then, so valid now).
        if let Ok(layout) = std::alloc::Layout::from_size_align(size, 8) {
            // SAFETY: allocated in buffer_requested with this size and alignment.
            unsafe { std::alloc::dealloc(buffer, layout) };
        }
    }
}

/// Batches the buffer's records into [`GpuRecord`]s for the hook.
fn forward(inj: &Injection, buffer: *mut u8, valid: usize) {
    let Some(c) = &inj.cupti else { return };
    let mut batch = [GpuRecord::default(); MAX_BATCH as usize];
    let mut n = 0usize;
    let mut record: *mut u8 = std::ptr::null_mut();
    let mut limiter = inj.limiter.lock().unwrap_or_else(|e| e.into_inner());
    let now = Instant::now();
    // SAFETY: CUPTI walks its own buffer; `record` stays inside [buffer, buffer + valid).
    while unsafe { (c.next_record)(buffer, valid, &mut record) } == cupti::SUCCESS {
        let offset = (record as usize).wrapping_sub(buffer as usize);
        if record.is_null() || offset >= valid {
            break;
        }
        // SAFETY: inside the valid part of the buffer, at most the bytes left in it.
        let bytes = unsafe { std::slice::from_raw_parts(record, valid - offset) };
        let (rec, name, marker_name) = match convert::convert(bytes) {
            Converted::Record(r) => (r, None, None),
            Converted::Kernel(r, name) => (r, Some(name), None),
            Converted::Marker(r, name, domain) => (r, None, Some((name, domain))),
            Converted::Skip => continue,
        };
        if !limiter.take(now) {
            inj.rate_limited.fetch_add(1, Relaxed);
            continue;
        }
        if let Some(key) = name {
            send_name(inj, key);
        }
        if let Some((name, domain)) = marker_name {
            send_marker_name(rec.name_key, name, domain);
        }
        batch[n] = rec;
        n += 1;
        if n == batch.len() {
            send(&batch[..n]);
            inj.forwarded.fetch_add(n as u64, Relaxed);
            n = 0;
        }
    }
    if n > 0 {
        send(&batch[..n]);
        inj.forwarded.fetch_add(n as u64, Relaxed);
    }
}

fn send(records: &[GpuRecord]) {
    for chunk in records.chunks(MAX_BATCH as usize) {
        gpu_observer_cupti_batch(chunk.as_ptr(), chunk.len() as u32);
    }
}

/// The first time the current observer sees a kernel, its name.
fn send_name(inj: &Injection, key: u64) {
    if key == 0 {
        return;
    }
    let mut sent = inj.names_sent.lock().unwrap_or_else(|e| e.into_inner());
    if sent.contains(&key) {
        return;
    }
    if sent.len() < MAX_NAMES {
        sent.insert(key);
    }
    // SAFETY: CUPTI's name pointer: a NUL-terminated string it keeps for the process's life.
    let name = unsafe { CStr::from_ptr(key as *const c_char) };
    gpu_observer_cupti_name(key, name.as_ptr());
}

/// A marker's name (each range's own: NVTX names are not interned), before its record, as
/// `domain` 0x1f `name` (the name alone in the default domain), cut to the hook's bound.
fn send_marker_name(key: u64, name: u64, domain: u64) {
    if key == 0 || name == 0 {
        return;
    }
    let mut buf = [0u8; gpu_observer_common::event::NAME_LEN];
    let room = buf.len() - 1;
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        let n = bytes.len().min(room - len);
        buf[len..len + n].copy_from_slice(&bytes[..n]);
        len += n;
    };
    if domain != 0 {
        // SAFETY: CUPTI's domain pointer: a NUL-terminated string, valid while its buffer is.
        put(unsafe { CStr::from_ptr(domain as *const c_char) }.to_bytes());
        put(&[marker::DOMAIN_SEPARATOR]);
    }
    // SAFETY: CUPTI's name pointer: as above.
    put(unsafe { CStr::from_ptr(name as *const c_char) }.to_bytes());
    gpu_observer_cupti_name(key, buf.as_ptr().cast());
}

fn send_status(inj: &Injection) {
    send_status_as(inj, inj.state.load(Relaxed));
}

/// The status with `state` reported in place of the library's own.
fn send_status_as(inj: &Injection, state: u64) {
    let mut aux = [0u64; 8];
    aux[status_aux::STATE] = state;
    aux[status_aux::CUPTI_RESULT] = inj.result.load(Relaxed);
    aux[status_aux::CUPTI_DROPPED] = inj.cupti_dropped.load(Relaxed);
    aux[status_aux::RATE_LIMITED] = inj.rate_limited.load(Relaxed);
    aux[status_aux::FORWARDED] = inj.forwarded.load(Relaxed);
    aux[status_aux::BUFFERS] = inj.buffers.load(Relaxed);
    aux[status_aux::BUFFER_BYTES] = inj.cfg.buffer_bytes as u64;
    aux[status_aux::RATE_LIMIT] = inj.cfg.rate_limit;
    send(&[GpuRecord {
        kind: GpuRecordKind::Status as u32,
        start_ns: monotonic_ns(),
        device: if LATE.load(Relaxed) { status_aux::INJECTED } else { 0 },
        cbid: inj.nvtx.load(Relaxed),
        aux,
        ..Default::default()
    }]);
}

/// Each device's attributes for occupancy, from the libcuda the process already loaded;
/// remembered as sent once the driver answered.
fn send_devices(inj: &Injection) {
    type GetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
    type GetAttr = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
    // SAFETY: RTLD_NOLOAD only finds the libcuda this process has already loaded.
    let Ok(lib) =
        (unsafe { libloading::os::unix::Library::open(Some("libcuda.so.1"), libc::RTLD_NOW | libc::RTLD_NOLOAD) })
    else {
        return;
    };
    // SAFETY: driver API signatures from cuda.h.
    let (Ok(count), Ok(attr)) = (unsafe { lib.get::<GetCount>(b"cuDeviceGetCount\0") }, unsafe {
        lib.get::<GetAttr>(b"cuDeviceGetAttribute\0")
    }) else {
        return;
    };
    let mut n: c_int = 0;
    // SAFETY: valid out-pointer; the driver is initialized (we run after cuInit).
    if unsafe { count(&mut n) } != 0 {
        return;
    }
    // CU_DEVICE_ATTRIBUTE_* in the order of `device_aux`.
    const ATTRS: [(usize, c_int); 9] = [
        (device_aux::SM_COUNT, 16),
        (device_aux::MAX_THREADS_PER_SM, 39),
        (device_aux::MAX_BLOCKS_PER_SM, 106),
        (device_aux::REGISTERS_PER_SM, 82),
        (device_aux::SHARED_MEM_PER_SM, 81),
        (device_aux::RESERVED_SHARED_MEM_PER_BLOCK, 111),
        (device_aux::WARP_SIZE, 10),
        (device_aux::COMPUTE_CAPABILITY, 75),
        (device_aux::COMPUTE_CAPABILITY, 76),
    ];
    let mut records = Vec::new();
    for dev in 0..n.clamp(0, 64) {
        let mut aux = [0u64; 8];
        for (slot, a) in ATTRS {
            let mut v: c_int = 0;
            // SAFETY: valid out-pointer, a device ordinal below the count.
            if unsafe { attr(&mut v, a, dev) } == 0 {
                let v = v.max(0) as u64;
                aux[slot] = match a {
                    75 => v * 10,
                    76 => aux[slot] + v,
                    _ => v,
                };
            }
        }
        records.push(GpuRecord {
            kind: GpuRecordKind::Device as u32,
            device: dev as u32,
            aux,
            ..Default::default()
        });
    }
    send(&records);
    inj.devices_sent.store(true, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_and_bounds() {
        let c = Config::from_env(|_| None);
        assert_eq!(
            (c.buffer_bytes, c.rate_limit, c.flush, c.cupti_path),
            (8 << 20, 1_000_000, Duration::from_millis(500), None)
        );
        let c = Config::from_env(|k| {
            Some(match k {
                "GPU_OBSERVER_CUDA_BUFFER_SIZE" => "1".into(),
                "GPU_OBSERVER_CUPTI_RATE_LIMIT" => "0".into(),
                "GPU_OBSERVER_CUPTI_FLUSH_MS" => "junk".into(),
                _ => "/x/libcupti.so".into(),
            })
        });
        assert_eq!(c.buffer_bytes, 64 * 1024, "clamped up to 64 KiB");
        assert_eq!((c.rate_limit, c.flush), (0, Duration::from_millis(500)));
        assert_eq!(c.cupti_path.as_deref(), Some("/x/libcupti.so"));
    }

    #[test]
    fn bucket_allows_the_rate_and_refills() {
        let t0 = Instant::now();
        let mut b = Bucket::new(3, t0);
        assert_eq!((0..5).filter(|_| b.take(t0)).count(), 3);
        let t1 = t0 + Duration::from_millis(700);
        assert_eq!(
            (0..5).filter(|_| b.take(t1)).count(),
            2,
            "0.7 s at 3/s refills 2.1 tokens"
        );
        let mut unlimited = Bucket::new(0, t0);
        assert!((0..1000).all(|_| unlimited.take(t0)));
    }

    #[test]
    fn without_an_observer_nothing_is_sent() {
        assert!(!observed());
    }
}
