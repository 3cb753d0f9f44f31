//! `--gpu-timing`: load the CUPTI injection library into a CUDA process that is already
//! running, switch its GPU timing on, and later off again (docs/DESIGN.md "GPU timing for a
//! running process").
//!
//! One thread of the target is borrowed, never the others:
//!
//! 1. checks first, touching nothing: libcuda is loaded; no tracer is attached; ptrace is
//!    allowed (Yama, CAP_SYS_PTRACE); glibc's dynamic loader is there and its glibc is at least
//!    as new as the library needs; there are unused bytes after a code segment for the code;
//! 2. a thread sleeping in a system call where it holds no lock ([`target::rank`]) is seized
//!    and interrupted (`PTRACE_SEIZE`, `PTRACE_INTERRUPT`: no other thread stops); the code
//!    ([`code`]) and its data are written, its registers pointed there, and it is let go at
//!    once — the stop lasts well under a millisecond (measured and reported as `pause`);
//! 3. the thread creates a memfd; the observer writes the library into it through
//!    `/proc/<pid>/fd/N` (checked to be that memfd first) — nothing is written into the
//!    target's file system, so a container's image is never touched;
//! 4. the thread `dlopen`s `/proc/self/fd/N`, restores every register and goes back into the
//!    system call it was in. The library's constructor only starts a thread of its own.
//!
//! Whatever happens to the observer (SIGKILL at any step), the thread either never left its
//! own code or runs the loader code to its end on its own and returns; the tests kill the
//! observer at each step ([`DIE_AT_ENV`]).

pub mod code;
mod ptrace;
pub mod target;

use std::{
    fs::File,
    io::Read,
    os::unix::fs::FileExt,
    path::Path,
    sync::OnceLock,
    time::{Duration, Instant},
};

use gpu_observer_common::cupti;

use self::{
    code::{data, go, state},
    ptrace::{Stop, Tracee},
    target::{Mapping, show_version},
};
use super::{discover, symbols};

/// Why GPU timing could not be given to a process. The process is observed with uprobes all
/// the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Yama, a missing CAP_SYS_PTRACE, or the kernel said no.
    PtraceDenied,
    /// Another tracer (a debugger, another tool) is attached.
    Traced,
    /// The process has not loaded libcuda.
    NoLibcuda,
    /// No glibc dynamic loader (a static executable, musl).
    NoLoader,
    /// Its glibc is older than the library needs.
    Glibc,
    /// Another profiler holds CUPTI.
    CuptiBusy,
    /// No thread waits where it can be borrowed safely.
    NoSafeThread,
    /// A step took longer than its bound.
    Timeout,
    /// Anything else (said in the message).
    Failed,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::PtraceDenied => "ptrace_denied",
            Reason::Traced => "traced",
            Reason::NoLibcuda => "no_libcuda",
            Reason::NoLoader => "no_loader",
            Reason::Glibc => "glibc",
            Reason::CuptiBusy => "cupti_busy",
            Reason::NoSafeThread => "no_safe_thread",
            Reason::Timeout => "timeout",
            Reason::Failed => "failed",
        }
    }
}

/// A refusal, with what to do about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reason: Reason,
    pub message: String,
}

fn refuse(reason: Reason, message: impl Into<String>) -> Refusal {
    Refusal {
        reason,
        message: message.into(),
    }
}

/// What an injection did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Injected(Injected),
    /// The library is in the process already: injected by an earlier observer (`late`), or
    /// loaded through `CUDA_INJECTION64_PATH` (collecting whenever observed).
    AlreadyLoaded {
        late: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Injected {
    /// The borrowed thread.
    pub tid: i32,
    /// How long it was stopped (from the interrupt to its release).
    pub pause: Duration,
    /// How long it then ran the loader code instead of its own.
    pub diverted: Duration,
}

/// How long a thread may take to stop after the interrupt (a sleeping thread stops in
/// microseconds); the bound on the stop as a whole is the 20 ms.
const STOP_TIMEOUT: Duration = Duration::from_millis(20);
/// How long the memfd may take to appear.
const MEMFD_TIMEOUT: Duration = Duration::from_secs(1);
/// How long `dlopen` may take (the library's constructor only starts a thread).
const LOAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Threads tried at most.
const MAX_TRIES: usize = 8;
/// Stack a borrowed thread must have left below its stack pointer (the loader's needs, with a
/// wide margin), unless it is the main thread's growable stack.
const MIN_STACK: u64 = 256 * 1024;
/// x86-64's red zone: 128 bytes below the stack pointer that a leaf function may use.
const RED_ZONE: u64 = 128;
/// Largest injection library read.
const MAX_LIBRARY: u64 = 256 << 20;
/// Kernel return values of an interrupted system call that is to be restarted
/// (ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK) and EINTR (what some
/// calls return after a stop): the borrowed thread issues the call again.
const RESTART: [i64; 5] = [-512, -513, -514, -516, -4];

/// For the tests: the step name at which the observer kills itself (SIGKILL), to show that
/// no step leaves the target broken.
pub const DIE_AT_ENV: &str = "GPU_OBSERVER_INJECT_DIE_AT";

/// The steps, in order ([`DIE_AT_ENV`]).
pub const STEPS: [&str; 8] = [
    "seized",
    "stopped",
    "written",
    "regs_set",
    "released",
    "memfd",
    "half_written",
    "go",
];

fn step(name: &str) {
    static DIE_AT: OnceLock<Option<String>> = OnceLock::new();
    if DIE_AT.get_or_init(|| std::env::var(DIE_AT_ENV).ok()).as_deref() == Some(name) {
        // SAFETY: kill has no memory preconditions; the test asked for this death.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

/// The injection library, read once.
pub struct Library {
    bytes: Vec<u8>,
    /// The newest glibc it needs.
    needs_glibc: Option<(u32, u32, u32)>,
    pub path: String,
}

impl Library {
    pub fn load(path: &Path) -> Result<Self, String> {
        let shown = path.display().to_string();
        let opened = super::open::open_host(path).map_err(|r| r.detail)?;
        let facts = symbols::elf_facts(&opened, &shown, &[cupti::CONTROL_SYMBOL]).map_err(|r| r.detail)?;
        if !facts.symbols.contains_key(cupti::CONTROL_SYMBOL) {
            return Err(format!(
                "{shown} does not export {}: an older gpu-observer injection library",
                cupti::CONTROL_SYMBOL
            ));
        }
        if opened.size > MAX_LIBRARY {
            return Err(format!("{shown} is larger than {MAX_LIBRARY} bytes"));
        }
        let mut bytes = Vec::with_capacity(opened.size as usize);
        (&opened.file)
            .take(MAX_LIBRARY)
            .read_to_end(&mut bytes)
            .map_err(|e| format!("{shown}: {e}"))?;
        Ok(Self {
            bytes,
            needs_glibc: target::newest_glibc(facts.needs.iter().map(|(_, v)| v.as_str())),
            path: shown,
        })
    }
}

/// Whether a maps path is an injected library's memfd.
pub fn is_injected(path: &str) -> bool {
    path.strip_prefix("/memfd:")
        .and_then(|p| p.strip_suffix(" (deleted)"))
        .is_some_and(|name| name == cupti::MEMFD_NAME)
}

/// Loads `lib` into `pid`. Blocking (up to ~12 s in the worst case); run it on a thread of its
/// own, which ends afterwards: a thread left seized but not stopped (a stop that never came)
/// is detached by the kernel when its tracer thread ends.
pub fn inject(pid: u32, lib: &Library) -> Result<Outcome, Refusal> {
    // The kernel hides another user's maps from a caller that may not trace it.
    let maps = target::maps(pid).map_err(|e| match e.raw_os_error() {
        Some(libc::EACCES | libc::EPERM) => ptrace_error(pid, &e),
        _ => refuse(Reason::Failed, format!("cannot read /proc/{pid}/maps: {e}")),
    })?;
    if maps.iter().any(|m| is_injected(&m.path)) {
        return Ok(Outcome::AlreadyLoaded { late: true });
    }
    if maps.iter().any(|m| discover::is_hook_library(&m.path)) {
        return Ok(Outcome::AlreadyLoaded { late: false });
    }
    if !maps.iter().any(|m| discover::is_libcuda(&m.path)) {
        return Err(refuse(
            Reason::NoLibcuda,
            format!("pid {pid} has not loaded libcuda: it does not use the GPU (yet)"),
        ));
    }
    check_ptrace(pid)?;
    let loader = Loader::find(pid, &maps, lib)?;
    let cave = find_cave(pid, &maps, &loader)?;
    let candidates = target::candidates(pid, &target::threads(pid));
    if candidates.is_empty() {
        return Err(refuse(
            Reason::NoSafeThread,
            format!(
                "no thread of pid {pid} is waiting where it can safely load a library (each runs, or waits for a lock); try again in a moment"
            ),
        ));
    }
    let mem = File::options()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/mem"))
        .map_err(|e| ptrace_error(pid, &e))?;
    let target = Target {
        pid,
        maps: &maps,
        mem: &mem,
        cave,
        loader: &loader,
    };
    let mut skipped = Vec::new();
    for tid in candidates.into_iter().take(MAX_TRIES) {
        match target.borrow(tid) {
            Ok(stopped) => return target.load(stopped, lib).map(Outcome::Injected),
            Err(Try::Next(why)) => skipped.push(format!("tid {tid}: {why}")),
            Err(Try::Stop(r)) => return Err(r),
        }
    }
    Err(refuse(
        Reason::NoSafeThread,
        format!(
            "no thread of pid {pid} could be borrowed safely ({}); try again in a moment",
            skipped.join("; ")
        ),
    ))
}

/// The refusals that need no stop: another tracer, Yama, the capability.
fn check_ptrace(pid: u32) -> Result<(), Refusal> {
    if let Some(t) = target::tracer(pid) {
        let comm = crate::procinfo::ProcInfo::host().comm(t).unwrap_or_default();
        return Err(refuse(
            Reason::Traced,
            format!(
                "pid {pid} is already traced by pid {t} ({}): a debugger or another tool holds it, and a process has one tracer; stop that tool, or observe without --gpu-timing",
                crate::export::text::printable_cut(&comm, 32)
            ),
        ));
    }
    if target::yama_scope() == Some(3) {
        return Err(refuse(
            Reason::PtraceDenied,
            "kernel.yama.ptrace_scope is 3: no process may be traced, not even by root (it is lowered only by a reboot); --gpu-timing needs 0, 1 or 2",
        ));
    }
    if !target::has_cap_sys_ptrace() {
        return Err(refuse(
            Reason::PtraceDenied,
            "gpu-observer lacks CAP_SYS_PTRACE: run it as root (sudo), or add CAP_SYS_PTRACE to its container",
        ));
    }
    Ok(())
}

fn ptrace_error(pid: u32, e: &std::io::Error) -> Refusal {
    let yama = target::yama_scope().map_or(String::new(), |s| format!(", kernel.yama.ptrace_scope is {s}"));
    refuse(
        Reason::PtraceDenied,
        format!(
            "the kernel refused to trace pid {pid} ({e}{yama}): --gpu-timing needs CAP_SYS_PTRACE and a Yama scope of 2 or less"
        ),
    )
}

/// The target's `dlopen` (and `dlerror`, for messages).
struct Loader {
    dlopen: u64,
    dlerror: u64,
    mode: u32,
    /// libc's mapping and executable segments (read once, for [`find_cave`] too).
    libc: Mapping,
    libc_code: Vec<(u64, u64)>,
}

const RTLD_NOW: u32 = 2;
/// glibc's `__RTLD_DLOPEN`: what its internal `__libc_dlopen_mode` callers add.
const RTLD_DLOPEN: u32 = 0x8000_0000;

impl Loader {
    fn find(pid: u32, maps: &[Mapping], lib: &Library) -> Result<Self, Refusal> {
        let named = |prefixes: &[&str]| {
            maps.iter()
                .find(|m| m.offset == 0 && prefixes.iter().any(|p| m.file_name().starts_with(p)))
        };
        if named(&["ld-musl", "libc.musl"]).is_some() {
            return Err(refuse(
                Reason::NoLoader,
                format!("pid {pid} uses musl libc; the injection library is built for glibc"),
            ));
        }
        let (Some(libc), Some(_)) = (
            named(&["libc.so.6", "libc-2."]),
            named(&["ld-linux-x86-64.so", "ld-2."]),
        ) else {
            return Err(refuse(
                Reason::NoLoader,
                format!(
                    "pid {pid} has no glibc dynamic loader (a static executable?): no library can be loaded into it"
                ),
            ));
        };
        let wanted = ["dlopen", "dlerror", "__libc_dlopen_mode"];
        let facts = target::facts(pid, libc, &wanted).map_err(|e| refuse(Reason::Failed, e))?;
        let have = target::newest_glibc(facts.defines.iter().map(String::as_str));
        if let (Some(need), Some(have)) = (lib.needs_glibc, have)
            && need > have
        {
            return Err(refuse(
                Reason::Glibc,
                format!(
                    "pid {pid}'s glibc is {} but {} needs glibc {}: use the library `cargo xtask bundle` builds (it needs glibc 2.17)",
                    show_version(have),
                    lib.path,
                    show_version(need)
                ),
            ));
        }
        let at = |m: &Mapping, facts: &symbols::ElfFacts, name: &str| {
            facts
                .symbols
                .get(name)
                .and_then(|&off| target::address_of(maps, m, off))
        };
        // glibc 2.34 and later: dlopen is in libc. Before: in libdl, if the process loaded it,
        // else glibc's internal entry point.
        let libdl =
            named(&["libdl.so.2", "libdl-2."]).and_then(|m| target::facts(pid, m, &wanted[..2]).ok().map(|f| (m, f)));
        let from_libdl = |name: &str| libdl.as_ref().and_then(|(m, f)| at(m, f, name));
        let (dlopen, mode) = match at(libc, &facts, "dlopen").or_else(|| from_libdl("dlopen")) {
            Some(a) => (a, RTLD_NOW),
            None => match at(libc, &facts, "__libc_dlopen_mode") {
                Some(a) => (a, RTLD_NOW | RTLD_DLOPEN),
                None => {
                    return Err(refuse(Reason::NoLoader, format!("pid {pid}'s libc exports no dlopen")));
                }
            },
        };
        let dlerror = if mode == RTLD_NOW {
            at(libc, &facts, "dlerror")
                .or_else(|| from_libdl("dlerror"))
                .unwrap_or(0)
        } else {
            0
        };
        Ok(Self {
            dlopen,
            dlerror,
            mode,
            libc: libc.clone(),
            libc_code: facts.code,
        })
    }
}

/// Unused bytes after the end of an executable segment, in its last page: where the loader
/// code goes. libc's first (every glibc process has it; already read by [`Loader::find`]),
/// then the other libraries'.
fn find_cave(pid: u32, maps: &[Mapping], loader: &Loader) -> Result<u64, Refusal> {
    const MAX_FILES: usize = 16;
    let same_file = |a: &Mapping, b: &Mapping| a.ino == b.ino && a.dev == b.dev;
    if let Some(at) = cave_in(maps, &loader.libc, &loader.libc_code) {
        return Ok(at);
    }
    let mut files: Vec<&Mapping> = Vec::new();
    for m in maps
        .iter()
        .filter(|m| m.executable() && m.path.starts_with('/') && m.ino != 0 && !same_file(m, &loader.libc))
    {
        if !files.iter().any(|f| same_file(f, m)) {
            files.push(m);
        }
    }
    for m in files.into_iter().take(MAX_FILES) {
        if let Some(at) = target::facts(pid, m, &[])
            .ok()
            .and_then(|facts| cave_in(maps, m, &facts.code))
        {
            return Ok(at);
        }
    }
    Err(refuse(
        Reason::Failed,
        format!("no room for the loader code in pid {pid}'s libraries"),
    ))
}

/// Room for the loader code after one of `file`'s executable segments (`code`: their file
/// ranges), inside the same executable mapping and page.
fn cave_in(maps: &[Mapping], file: &Mapping, code: &[(u64, u64)]) -> Option<u64> {
    code.iter().find_map(|&(_, end)| {
        let at = target::address_of(maps, file, end.checked_sub(1)?)? + 1;
        let region = maps.iter().find(|r| r.start < at && at <= r.end && r.executable())?;
        let start = (at + 15) & !15;
        let limit = ((at + 4095) & !4095).min(region.end);
        (start + code::CODE_MAX <= limit).then_some(start)
    })
}

/// A borrowed thread, stopped, with what it was doing.
struct Stopped {
    tracee: Tracee,
    regs: libc::user_regs_struct,
    interrupted: Instant,
}

enum Try {
    /// This thread will not do; the next one may.
    Next(String),
    /// Give up (the reason holds for every thread).
    Stop(Refusal),
}

struct Target<'a> {
    pid: u32,
    maps: &'a [Mapping],
    mem: &'a File,
    cave: u64,
    loader: &'a Loader,
}

impl Target<'_> {
    /// Seizes and stops `tid`, and keeps it only if it sits at a system call it can be taken
    /// from (else lets it go unchanged).
    fn borrow(&self, tid: i32) -> Result<Stopped, Try> {
        let pid = self.pid;
        let mut t = match Tracee::seize(tid) {
            Ok(t) => t,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Err(Try::Next("exited".into())),
            Err(e) => return Err(Try::Stop(ptrace_error(pid, &e))),
        };
        step("seized");
        let interrupted = Instant::now();
        t.interrupt().map_err(|e| Try::Next(format!("interrupt: {e}")))?;
        let mut signals = 0;
        loop {
            match t.wait(STOP_TIMEOUT) {
                Ok(Some(Stop::Interrupted)) => break,
                // A signal came first: deliver it and wait for the interrupt's stop.
                Ok(Some(Stop::Signal(_))) if signals < 4 => {
                    signals += 1;
                    t.cont().map_err(|e| Try::Next(format!("continue: {e}")))?;
                }
                Ok(Some(Stop::Gone)) => return Err(Try::Next("exited".into())),
                Ok(Some(Stop::Signal(_))) | Ok(None) | Err(_) => {
                    // Not stopped in time: this thread stays seized until this (the tracing)
                    // thread ends, so no other thread may be tried.
                    return Err(Try::Stop(refuse(
                        Reason::Timeout,
                        format!("thread {tid} of pid {pid} did not stop within {STOP_TIMEOUT:?}; nothing was changed"),
                    )));
                }
            }
        }
        step("stopped");
        let regs = t.regs().map_err(|e| Try::Next(format!("registers: {e}")))?;
        let ret = regs.rax as i64;
        if (regs.orig_rax as i64) < 0 {
            return Err(Try::Next("it runs its own code now".into()));
        }
        if ret == -4 && self.signal_pending(tid) {
            // EINTR with a signal of its own waiting: the program wants to see it.
            return Err(Try::Next("a signal is pending".into()));
        }
        if !RESTART.contains(&ret) {
            return Err(Try::Next("its system call has just returned".into()));
        }
        let mut insn = [0u8; 2];
        if self.mem.read_exact_at(&mut insn, regs.rip.wrapping_sub(2)).is_err() || insn != [0x0f, 0x05] {
            return Err(Try::Next("not stopped after a `syscall` instruction".into()));
        }
        let stack = self.maps.iter().find(|m| m.start <= regs.rsp && regs.rsp < m.end);
        let room = stack.map_or(0, |m| regs.rsp - m.start);
        let growable = stack.is_some_and(|m| m.path == "[stack]");
        if !growable && room < MIN_STACK + RED_ZONE + data::LEN + 1024 {
            return Err(Try::Next(format!("{room} bytes of stack left")));
        }
        Ok(Stopped {
            tracee: t,
            regs,
            interrupted,
        })
    }

    fn signal_pending(&self, tid: i32) -> bool {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{}/task/{tid}/status", self.pid)) else {
            return true;
        };
        status
            .lines()
            .filter_map(|l| l.strip_prefix("SigPnd:").or_else(|| l.strip_prefix("ShdPnd:")))
            .any(|v| {
                u64::from_str_radix(v.trim(), 16).is_ok_and(|p| p != 0) || u64::from_str_radix(v.trim(), 16).is_err()
            })
    }

    /// Sends the stopped thread through the loader code, then loads the library with it.
    fn load(&self, s: Stopped, lib: &Library) -> Result<Injected, Refusal> {
        let (pid, tid) = (self.pid, s.tracee.tid);
        let failed = |what: &str, e: std::io::Error| refuse(Reason::Failed, format!("pid {pid}: {what}: {e}"));
        let r = &s.regs;
        // Go back into the interrupted call, as the kernel would have restarted it.
        let (rip, rax) = (r.rip - 2, r.orig_rax);
        let base = ((r.rsp - RED_ZONE - 256) & !63) - data::LEN;
        let plan = code::Plan {
            code: self.cave,
            data: base,
            dlopen: self.loader.dlopen,
            dlerror: self.loader.dlerror,
            mode: self.loader.mode,
            rsp: r.rsp,
            rip,
        };
        let block = code::data_block(&code::saved(r, rax), cupti::MEMFD_NAME);
        self.mem
            .write_all_at(&block, base)
            .map_err(|e| failed("writing the loader's data", e))?;
        self.mem
            .write_all_at(&code::assemble(&plan), self.cave)
            .map_err(|e| failed("writing the loader code", e))?;
        step("written");
        let mut regs = *r;
        regs.rip = self.cave;
        regs.rsp = base - 64;
        // No restart of the interrupted call on the way out of the stop: the code does it.
        regs.orig_rax = u64::MAX;
        regs.rax = 0;
        s.tracee.set_regs(&regs).map_err(|e| failed("setting registers", e))?;
        step("regs_set");
        s.tracee.detach().map_err(|e| failed("releasing the thread", e))?;
        let released = Instant::now();
        let pause = released - s.interrupted;
        step("released");
        let result = self.handshake(base, lib);
        if result.is_err() {
            let _ = self.mem.write_all_at(&go::ABORT.to_le_bytes(), base + data::GO);
        }
        let loaded = self.wait_state(base, &[state::RETURNED], LOAD_TIMEOUT);
        let diverted = released.elapsed();
        result?;
        match loaded {
            Some(_) => {}
            None => {
                return Err(refuse(
                    Reason::Timeout,
                    format!("thread {tid} of pid {pid} did not finish loading the library within {LOAD_TIMEOUT:?}"),
                ));
            }
        }
        let handle = self.read_u64(base + data::HANDLE).unwrap_or(0);
        if handle == 0 {
            let err = self.read_u64(base + data::ERR).unwrap_or(0);
            let msg = if err == 0 {
                "no message".to_string()
            } else {
                self.read_string(err, 512)
            };
            return Err(refuse(
                Reason::Failed,
                format!("pid {pid} could not load the library: {msg}"),
            ));
        }
        Ok(Injected { tid, pause, diverted })
    }

    /// Waits for the memfd, fills it, and says go.
    fn handshake(&self, base: u64, lib: &Library) -> Result<(), Refusal> {
        let pid = self.pid;
        match self.wait_state(base, &[state::MEMFD, state::RETURNED], MEMFD_TIMEOUT) {
            Some(state::MEMFD) => {}
            Some(_) => {
                let fd = self.read_u64(base + data::FD).unwrap_or(0) as u32 as i32;
                return Err(refuse(
                    Reason::Failed,
                    format!(
                        "memfd_create failed in pid {pid}: {}",
                        std::io::Error::from_raw_os_error(-fd)
                    ),
                ));
            }
            None => {
                return Err(refuse(
                    Reason::Timeout,
                    format!("pid {pid} did not create the memfd within {MEMFD_TIMEOUT:?}"),
                ));
            }
        }
        step("memfd");
        let fd = self.read_u64(base + data::FD).unwrap_or(0) as u32;
        let file = open_memfd(pid, fd)?;
        let half = lib.bytes.len() / 2;
        let write = |bytes: &[u8], at: u64| {
            file.write_all_at(bytes, at).map_err(|e| {
                refuse(
                    Reason::Failed,
                    format!("writing the library into pid {pid}'s memfd: {e}"),
                )
            })
        };
        write(&lib.bytes[..half], 0)?;
        step("half_written");
        write(&lib.bytes[half..], half as u64)?;
        let path = format!("/proc/self/fd/{fd}\0");
        let fail = |e| refuse(Reason::Failed, format!("pid {pid}: {e}"));
        self.mem
            .write_all_at(path.as_bytes(), base + data::PATH)
            .map_err(fail)?;
        self.mem
            .write_all_at(&go::LOAD.to_le_bytes(), base + data::GO)
            .map_err(fail)?;
        step("go");
        Ok(())
    }

    /// Polls the data block's `STATE` until it is one of `want`.
    fn wait_state(&self, base: u64, want: &[u32], timeout: Duration) -> Option<u32> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut b = [0u8; 4];
            if self.mem.read_exact_at(&mut b, base + data::STATE).is_err() {
                return None; // the process is gone
            }
            let s = u32::from_le_bytes(b);
            if want.contains(&s) {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn read_u64(&self, at: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.mem.read_exact_at(&mut b, at).ok()?;
        Some(u64::from_le_bytes(b))
    }

    /// A NUL-terminated string of the target, cut to `max` bytes and made printable.
    fn read_string(&self, at: u64, max: usize) -> String {
        let mut b = vec![0u8; max];
        let n = self.mem.read_at(&mut b, at).unwrap_or(0);
        b.truncate(n);
        if let Some(end) = b.iter().position(|&c| c == 0) {
            b.truncate(end);
        }
        crate::export::text::printable_cut(&String::from_utf8_lossy(&b), max)
    }
}

/// The memfd the borrowed thread created, open for writing — only once it is known to be a
/// memfd: the target could have put any file of its own at that number by now (a FIFO that
/// would block the open, a file it may only read), and root must not write into that. The
/// number is looked up as an `O_PATH` descriptor (which opens nothing), checked (a regular
/// tmpfs file without links, named `memfd:…`), and that very file is reopened for writing.
fn open_memfd(pid: u32, fd: u32) -> Result<File, Refusal> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let bad = |why: String| refuse(Reason::Failed, format!("pid {pid}'s memfd (fd {fd}): {why}"));
    let link = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).map_err(|e| bad(e.to_string()))?;
    // SAFETY: valid C string; O_PATH opens nothing (a FIFO does not block).
    let raw = unsafe { libc::open(link.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(bad(std::io::Error::last_os_error().to_string()));
    }
    // SAFETY: a new descriptor we own.
    let opath = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: all-zero is a valid stat/statfs; fstat/fstatfs fill them from our descriptor.
    let (mut st, mut fs): (libc::stat, libc::statfs) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    // SAFETY: valid descriptor and out-pointer.
    let stat = unsafe { libc::fstat(opath.as_raw_fd(), &mut st) };
    // SAFETY: as above.
    let statfs = unsafe { libc::fstatfs(opath.as_raw_fd(), &mut fs) };
    if stat != 0 || statfs != 0 {
        return Err(bad(std::io::Error::last_os_error().to_string()));
    }
    let name = std::fs::read_link(format!("/proc/self/fd/{}", opath.as_raw_fd())).unwrap_or_default();
    let is_memfd = st.st_mode & libc::S_IFMT == libc::S_IFREG
        && st.st_nlink == 0
        && fs.f_type == TMPFS_MAGIC
        && name.to_string_lossy().starts_with("/memfd:");
    if !is_memfd {
        return Err(bad(format!("not a memfd any more ({})", name.display())));
    }
    File::options()
        .write(true)
        .open(format!("/proc/self/fd/{}", opath.as_raw_fd()))
        .map_err(|e| bad(e.to_string()))
}

/// Writes `word` into a process's injection library: switches one injected late
/// on or off, or pauses any between fleet mode's capture windows ([`cupti::control`]). The word is found through
/// the process's maps (the bounded ELF reader, through `map_files`) and written through
/// `/proc/<pid>/mem`.
pub fn set_control(pid: u32, word: u32) -> Result<(), String> {
    let maps = target::maps(pid).map_err(|e| format!("pid {pid}: {e}"))?;
    let Some(m) = maps
        .iter()
        .find(|m| is_injected(&m.path) || discover::is_hook_library(&m.path))
    else {
        return Err(format!("pid {pid} has no injection library"));
    };
    let facts = target::facts(pid, m, &[cupti::CONTROL_SYMBOL])?;
    let at = facts
        .symbols
        .get(cupti::CONTROL_SYMBOL)
        .and_then(|&off| target::address_of(&maps, m, off))
        .ok_or_else(|| format!("pid {pid}: the injection library has no {}", cupti::CONTROL_SYMBOL))?;
    File::options()
        .write(true)
        .open(format!("/proc/{pid}/mem"))
        .and_then(|f| f.write_all_at(&word.to_le_bytes(), at))
        .map_err(|e| format!("pid {pid}: writing the control word: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_injected_memfd_is_recognised() {
        assert!(is_injected("/memfd:gpu-observer-cupti (deleted)"));
        assert!(!is_injected("/memfd:gpu-observer-cupti"));
        assert!(!is_injected("/memfd:other (deleted)"));
        assert!(!is_injected("/tmp/gpu-observer-cupti (deleted)"));
    }

    #[test]
    fn reasons_have_stable_names() {
        let all = [
            Reason::PtraceDenied,
            Reason::Traced,
            Reason::NoLibcuda,
            Reason::NoLoader,
            Reason::Glibc,
            Reason::CuptiBusy,
            Reason::NoSafeThread,
            Reason::Timeout,
            Reason::Failed,
        ];
        let names: Vec<&str> = all.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            names,
            [
                "ptrace_denied",
                "traced",
                "no_libcuda",
                "no_loader",
                "glibc",
                "cupti_busy",
                "no_safe_thread",
                "timeout",
                "failed"
            ]
        );
    }
}
