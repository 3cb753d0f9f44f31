//! `cargo xtask soak --minutes N`: the long-run stability check of issue 10 ("Also": RSS, fds
//! and BPF links flat, captured + dropped = calls every minute).
//!
//! One all-process observer (`--format jsonl --trace-all`; its JSON lines are read from a pipe
//! and counted per pid, never stored) watches a fixed mix of the fake workloads of
//! tests/fixtures/README.md for N minutes:
//! - churn: a short-lived `cuda_workload` every [`CHURN_PERIOD`] (`load`, `init`, one `run`,
//!   `exit`). Most load the shared copy of the fake libcuda, attached up front with `--libcuda`
//!   as the driver's own files are; every `--private-every`-th (5) loads a private copy (a new
//!   inode), which the agent has to find by its rescan, attach, and may release once the
//!   process is gone;
//! - steady load: one long-lived workload doing a `run` every [`STEADY_PERIOD`];
//! - CUPTI: one long-lived workload started with `CUDA_INJECTION64_PATH` set to the observer's
//!   injection library and the fake libcupti, whose GPU records the agent joins to the launches.
//!
//! Every workload keeps its own ledger: the `run` record file has one line per call it made
//! (the reply says the same number, and both are checked), plus the two calls of `init`.
//! At the end of every minute the workloads pause between two units of work, so everything made
//! so far is finished; the soak waits until the agent has written a line for every one of those
//! calls (or until nothing more comes), gives the rescan time to release what exited processes
//! mapped, samples the agent (`/proc/<pid>/status` VmRSS, `/proc/<pid>/fd`), and lets the
//! workloads go on. The pause costs a few seconds a minute.

use std::{
    borrow::Cow,
    collections::HashMap,
    fs,
    io::{BufRead, BufReader, Write},
    path::PathBuf,
    process::{Child, ChildStdout, Command, Stdio},
    sync::{Arc, Condvar, Mutex},
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::workload::Workload;

/// What `cargo xtask soak` was asked for.
pub struct Options {
    pub minutes: u64,
    pub minute_secs: u64,
    pub debug: bool,
    pub private_every: u64,
    pub observer: Option<PathBuf>,
    pub out: Option<PathBuf>,
}

// Modest rates (the build machine has 2 cores and the agent must keep up with no ring drops at
// the default 8 MiB): about 1 800 calls/s and 220 GPU records/s in all, see docs/BENCHMARKS.md.
/// A churn process is started this often (one at a time).
const CHURN_PERIOD: Duration = Duration::from_millis(500);
/// `run T N` of a churn process: 150 calls (75 a round, tests/fixtures/README.md).
const CHURN_RUN: (u64, u64) = (1, 2);
/// The steady workload does a `run` this often: 300 calls.
const STEADY_PERIOD: Duration = Duration::from_millis(250);
const STEADY_RUN: (u64, u64) = (2, 2);
/// The CUPTI workload does a `run` this often: 150 calls, 112 GPU records.
const CUPTI_PERIOD: Duration = Duration::from_millis(500);
const CUPTI_RUN: (u64, u64) = (1, 2);
/// GPU records the fake CUPTI makes per round and thread (tests/fixtures/README.md): a kernel
/// per launch but three per graph launch (6 + 2 × 3), a record per copy (20) and memset (24).
const GPU_RECORDS_PER_ROUND: u64 = 12 + 20 + 24;
/// `init` makes two probed calls: `cuInit` and `cuDevicePrimaryCtxRetain`.
const INIT_CALLS: u64 = 2;
/// The agent's rescan (`--interval-ms`): its default.
const INTERVAL_MS: u64 = 1000;
/// The JSON line types of probed API calls (the other lines are ioctls, process exits, GPU
/// records, summaries, memory samples).
const CALL_TYPES: [&str; 9] = [
    "launch", "memcpy", "memset", "alloc", "free", "sync", "init", "module", "symbol",
];
/// The issue's bound: RSS at the last minute within 5 % of the reference minute.
const RSS_TOLERANCE: f64 = 0.05;
/// Runs shorter than this compare RSS with minute 1 instead of minute 5.
const SHORT_RUN_MINUTES: u64 = 10;
/// How long the agent may take to write what a paused mix made before that minute's
/// accounting is judged as it stands: after this long with no new line.
const QUIET_FOR: Duration = Duration::from_secs(3);
/// At most this long for a minute's accounting to close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(30);
const ATTACH_TIMEOUT: Duration = Duration::from_secs(15);
/// After SIGINT the agent must have exited (with its summary) within this.
const EXIT_TIMEOUT: Duration = Duration::from_secs(30);

/// What was counted for one pid: calls from the workload's ledger, lines from the agent.
#[derive(Default, Clone, Copy)]
struct Counts {
    ours: bool,
    calls: u64,
    captured: u64,
    gpu_expected: u64,
    gpu_captured: u64,
}

#[derive(Default)]
struct Book {
    pids: HashMap<u32, Counts>,
    /// Workload processes that exited after doing their work.
    processes: u64,
    /// Lines of the agent's output, and those that were not JSON.
    lines: u64,
    bad_lines: u64,
    total_summary: Option<String>,
    errors: Vec<String>,
}

#[derive(Default, Clone, Copy)]
struct Totals {
    calls: u64,
    captured: u64,
    gpu_expected: u64,
    gpu_captured: u64,
    /// Pids of ours whose calls and lines differ.
    pids_off: u64,
    /// Call lines of processes the soak did not start.
    foreign: u64,
}

impl Book {
    fn totals(&self) -> Totals {
        let mut t = Totals::default();
        for c in self.pids.values() {
            if !c.ours {
                t.foreign += c.captured;
                continue;
            }
            t.calls += c.calls;
            t.captured += c.captured;
            t.gpu_expected += c.gpu_expected;
            t.gpu_captured += c.gpu_captured;
            if c.calls != c.captured || c.gpu_expected != c.gpu_captured {
                t.pids_off += 1;
            }
        }
        t
    }
}

/// The agent's stderr, and the running drop total its warning line carries.
#[derive(Default)]
struct Log {
    lines: Vec<String>,
    drops: u64,
}

/// Pauses the workload threads between two units of work.
#[derive(Default)]
struct Gate {
    st: Mutex<GateState>,
    cv: Condvar,
}

#[derive(Default)]
struct GateState {
    paused: bool,
    stop: bool,
    parked: usize,
    active: usize,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Between two units of work: waits while paused; false once the soak stops.
    fn checkpoint(&self) -> bool {
        let mut st = self.lock();
        if st.paused && !st.stop {
            st.parked += 1;
            self.cv.notify_all();
            while st.paused && !st.stop {
                st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            st.parked -= 1;
        }
        !st.stop
    }

    fn enter(&self) {
        self.lock().active += 1;
    }

    fn leave(&self) {
        self.lock().active -= 1;
        self.cv.notify_all();
    }

    /// Returns once every workload thread is parked.
    fn pause(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        st.paused = true;
        while st.parked < st.active {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "{} of {} workload threads did not pause within {timeout:?}",
                    st.active - st.parked,
                    st.active
                );
            }
            st = self.cv.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        Ok(())
    }

    fn resume(&self) {
        self.lock().paused = false;
        self.cv.notify_all();
    }

    fn stop(&self) {
        self.lock().stop = true;
        self.cv.notify_all();
    }
}

struct Ctx {
    fixtures: PathBuf,
    out: PathBuf,
    shared_lib: PathBuf,
    cupti_lib: PathBuf,
    /// Every this many churn processes, one loads a private copy of the fake libcuda (0: none).
    private_every: u64,
    book: Mutex<Book>,
    log: Mutex<Log>,
    gate: Gate,
}

impl Ctx {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A pid of ours: registered before it makes any call, so every line for it counts.
    fn register(&self, pid: u32) {
        self.book().pids.entry(pid).or_default().ours = true;
    }

    fn credit(&self, pid: u32, calls: u64, gpu: u64) {
        let mut b = self.book();
        let c = b.pids.entry(pid).or_default();
        c.calls += calls;
        c.gpu_expected += gpu;
    }

    fn log_len(&self) -> usize {
        self.log().lines.len()
    }

    /// Waits for a line of the agent's stderr, from line `from` on, that `pred` accepts.
    fn wait_log(&self, from: usize, timeout: Duration, pred: impl Fn(&str) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut seen = from;
        loop {
            {
                let log = self.log();
                if log.lines[seen.min(log.lines.len())..].iter().any(|l| pred(l)) {
                    return true;
                }
                seen = log.lines.len();
            }
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The scripted workload (tests/fixtures/cuda_workload), driven line by line.
fn sleep_rest(period: Duration, since: Instant) {
    thread::sleep(period.saturating_sub(since.elapsed()));
}

/// One churn process: `load`, (wait for the attach of a private copy), `init`, `run`, `exit`.
fn churn_one(ctx: &Ctx, seq: u64) -> Result<()> {
    let private = ctx.private_every != 0 && seq.is_multiple_of(ctx.private_every);
    let (lib, dir) = if private {
        let dir = ctx.out.join("private").join(seq.to_string());
        fs::create_dir_all(&dir)?;
        let lib = dir.join("libcuda.so.1");
        fs::copy(ctx.fixtures.join("libcuda.so.1"), &lib)?;
        (lib, Some(dir))
    } else {
        (ctx.shared_lib.clone(), None)
    };
    let from = ctx.log_len();
    let mut w = Workload::start(&ctx.fixtures.join("cuda_workload"), &[])?;
    ctx.register(w.pid);
    w.cmd(&format!("load {}", lib.display()))?;
    if private {
        // A new inode is found by the rescan: calls made before the attach are not seen.
        let needle = lib.display().to_string();
        if !ctx.wait_log(from, ATTACH_TIMEOUT, |l| l.contains("attached") && l.contains(&needle)) {
            bail!(
                "pid {}: the agent did not say `attached ...{needle}` within {ATTACH_TIMEOUT:?}",
                w.pid
            );
        }
    }
    w.cmd("init")?;
    ctx.credit(w.pid, INIT_CALLS, 0);
    let calls = w.run(CHURN_RUN, &ctx.out.join("ledger-churn.jsonl"))?;
    ctx.credit(w.pid, calls, 0);
    w.exit()?;
    ctx.book().processes += 1;
    if let Some(dir) = dir {
        fs::remove_dir_all(dir)?;
    }
    Ok(())
}

fn churn(ctx: &Ctx) -> Result<()> {
    let mut seq = 0;
    let mut failed_in_a_row = 0;
    while ctx.gate.checkpoint() {
        let t0 = Instant::now();
        seq += 1;
        match churn_one(ctx, seq) {
            Ok(()) => failed_in_a_row = 0,
            Err(e) => {
                // Counted (a FAIL at the end), and the churn goes on unless it keeps failing.
                ctx.book().errors.push(format!("churn: {e:#}"));
                failed_in_a_row += 1;
                if failed_in_a_row == 10 {
                    bail!("10 churn processes failed in a row; the churn stops");
                }
            }
        }
        sleep_rest(CHURN_PERIOD, t0);
    }
    Ok(())
}

/// A long-lived workload doing a `run` every `period`; with `cupti`, under the injection
/// library, each run also owed its GPU records.
fn steady(ctx: &Ctx, name: &str, cupti: bool, period: Duration, run: (u64, u64)) -> Result<()> {
    let env = if cupti {
        vec![
            ("CUDA_INJECTION64_PATH", ctx.cupti_lib.display().to_string()),
            (
                "GPU_OBSERVER_CUPTI_PATH",
                ctx.fixtures.join("libcupti.so.13").display().to_string(),
            ),
        ]
    } else {
        Vec::new()
    };
    let from = ctx.log_len();
    let mut w = Workload::start(&ctx.fixtures.join("cuda_workload"), &env)?;
    ctx.register(w.pid);
    w.cmd(&format!("load {}", ctx.shared_lib.display()))?;
    w.cmd("init")?;
    ctx.credit(w.pid, INIT_CALLS, 0);
    if cupti {
        // `init` loaded the injection library; the agent probes its hooks at its next rescan.
        let needle = format!("pid {} (", w.pid);
        if !ctx.wait_log(from, ATTACH_TIMEOUT * 2, |l| {
            l.contains(&needle) && l.contains("CUPTI active")
        }) {
            bail!("pid {}: the agent did not say `CUPTI active` for it", w.pid);
        }
    }
    let ledger = ctx.out.join(format!("ledger-{name}.jsonl"));
    while ctx.gate.checkpoint() {
        let t0 = Instant::now();
        let calls = w.run(run, &ledger)?;
        let gpu = if cupti {
            GPU_RECORDS_PER_ROUND * run.0 * run.1
        } else {
            0
        };
        ctx.credit(w.pid, calls, gpu);
        sleep_rest(period, t0);
    }
    w.exit()?;
    ctx.book().processes += 1;
    Ok(())
}

/// One JSON line of the agent's output: only what the accounting needs.
#[derive(Deserialize)]
struct Line<'a> {
    #[serde(rename = "type", borrow)]
    ty: Cow<'a, str>,
    #[serde(default)]
    pid: Option<Value>,
    #[serde(default, borrow)]
    scope: Option<Cow<'a, str>>,
}

/// Counts the agent's JSON lines per pid; keeps the summary lines (summary.jsonl).
fn read_output(ctx: &Ctx, out: ChildStdout) -> Result<()> {
    let mut summaries = fs::File::create(ctx.out.join("summary.jsonl"))?;
    let mut reader = BufReader::with_capacity(1 << 20, out);
    let mut buf = String::new();
    loop {
        buf.clear();
        if reader.read_line(&mut buf)? == 0 {
            return Ok(());
        }
        let text = buf.trim_end();
        let Ok(line) = serde_json::from_str::<Line>(text) else {
            let mut b = ctx.book();
            b.lines += 1;
            b.bad_lines += 1;
            continue;
        };
        let pid = line.pid.as_ref().and_then(Value::as_u64).map(|p| p as u32);
        let call = CALL_TYPES.contains(&&*line.ty);
        let gpu = line.ty.starts_with("gpu_");
        if line.ty == "summary" {
            writeln!(summaries, "{text}")?;
        }
        let mut b = ctx.book();
        b.lines += 1;
        if line.ty == "summary" && line.scope.as_deref() == Some("total") {
            b.total_summary = Some(text.to_string());
        }
        if let Some(pid) = pid.filter(|_| call || gpu) {
            let c = b.pids.entry(pid).or_default();
            if call {
                c.captured += 1;
            } else {
                c.gpu_captured += 1;
            }
        }
    }
}

/// Keeps the agent's stderr (agent.stderr) and the drop total of its warning line.
fn read_stderr(ctx: &Ctx, err: std::process::ChildStderr) -> Result<()> {
    let mut file = fs::File::create(ctx.out.join("agent.stderr"))?;
    for line in BufReader::new(err).lines() {
        let line = line?;
        writeln!(file, "{line}")?;
        let mut log = ctx.log();
        if let Some(n) = drops_in(&line) {
            log.drops = n;
        }
        log.lines.push(line);
    }
    Ok(())
}

/// The running total of the agent's drop warning, "warning: ring buffer full: N records
/// dropped so far; ..." (gpu-observer/src/main.rs).
fn drops_in(line: &str) -> Option<u64> {
    line.split_once("ring buffer full: ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// What the agent holds now.
#[derive(Clone, Copy, Default)]
struct Sample {
    rss_kib: u64,
    fds: u64,
    links: u64,
    cpu_ticks: u64,
}

fn sample(pid: u32) -> Result<Sample> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmRSS in /proc/<pid>/status")?;
    let (mut fds, mut links) = (0, 0);
    for e in fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
        fds += 1;
        // A link is an fd whose target reads `anon_inode:bpf_link`.
        if fs::read_link(e.path()).is_ok_and(|t| t.as_os_str() == "anon_inode:bpf_link") {
            links += 1;
        }
    }
    // utime and stime: fields 14 and 15, the 12th and 13th after the `(comm)` field.
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = after.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
    let cpu_ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    Ok(Sample {
        rss_kib,
        fds,
        links,
        cpu_ticks,
    })
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// One minute's line.
#[derive(Default)]
struct Row {
    minute: u64,
    elapsed_s: f64,
    s: Sample,
    cpu_pct: f64,
    processes: u64,
    t: Totals,
    dropped: u64,
    accounting: &'static str,
    close_ms: u128,
    settle_ms: u128,
}

impl Row {
    /// The CSV header: the keys of [`Row::json`], in order.
    fn csv_header() -> String {
        Self::default()
            .json()
            .as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>().join(","))
            .unwrap_or_default()
    }

    /// One CSV line: the values of [`Row::json`], in the header's order.
    fn csv(&self) -> String {
        let values = self.json().as_object().cloned().unwrap_or_default();
        values
            .values()
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn json(&self) -> Value {
        json!({
            "minute": self.minute, "elapsed_s": (self.elapsed_s * 10.0).round() / 10.0, "rss_kib": self.s.rss_kib,
            "fds": self.s.fds, "bpf_links": self.s.links, "agent_cpu_pct": (self.cpu_pct * 10.0).round() / 10.0,
            "processes_finished": self.processes, "calls": self.t.calls, "captured": self.t.captured,
            "dropped_so_far": self.dropped, "accounting": self.accounting, "pids_off": self.t.pids_off,
            "gpu_expected": self.t.gpu_expected, "gpu_captured": self.t.gpu_captured,
            "foreign_lines": self.t.foreign, "close_ms": self.close_ms, "settle_ms": self.settle_ms,
        })
    }

    fn print(&self, minutes: u64) {
        println!(
            "soak: minute {}/{minutes}: rss {} KiB, fds {}, bpf links {}, agent cpu {:.1}%, processes {}, calls {}, captured {}, dropped {}, accounting {}, gpu records {}/{} (closed in {} ms, settled in {} ms)",
            self.minute,
            self.s.rss_kib,
            self.s.fds,
            self.s.links,
            self.cpu_pct,
            self.processes,
            self.t.calls,
            self.t.captured,
            self.dropped,
            self.accounting,
            self.t.gpu_captured,
            self.t.gpu_expected,
            self.close_ms,
            self.settle_ms
        );
    }
}

/// captured + dropped = calls for everything finished: exact when every pid's lines equal its
/// calls; with ring drops, the missing lines must be no more than the drops (their split per
/// pid is known only from the final summary).
fn accounting(t: &Totals, drops: u64) -> &'static str {
    if t.pids_off == 0 {
        "exact"
    } else if t.captured <= t.calls && t.gpu_captured <= t.gpu_expected && t.calls - t.captured <= drops {
        "within-drops"
    } else {
        "MISMATCH"
    }
}

/// Waits until the agent has written a line for every call made so far, or until no new line
/// came for [`QUIET_FOR`] (drops, or a real loss: judged by the caller).
fn wait_closed(ctx: &Ctx) -> (Totals, u128) {
    let t0 = Instant::now();
    let (mut last_lines, mut last_change) = (u64::MAX, Instant::now());
    loop {
        let (t, lines) = {
            let b = ctx.book();
            (b.totals(), b.lines)
        };
        if t.pids_off == 0 {
            return (t, t0.elapsed().as_millis());
        }
        if lines != last_lines {
            (last_lines, last_change) = (lines, Instant::now());
        }
        if last_change.elapsed() >= QUIET_FOR || t0.elapsed() >= CLOSE_TIMEOUT {
            return (t, t0.elapsed().as_millis());
        }
        thread::sleep(Duration::from_millis(50));
    }
}

fn agent_alive(agent: &mut Child) -> Result<()> {
    if let Some(st) = agent.try_wait()? {
        bail!("the observer exited during the soak ({st}); see agent.stderr");
    }
    Ok(())
}

fn tail(ctx: &Ctx, n: usize) -> String {
    let log = ctx.log();
    log.lines[log.lines.len().saturating_sub(n)..].join("\n")
}

struct Check {
    name: &'static str,
    pass: bool,
    detail: String,
}

pub fn soak(o: Options) -> Result<()> {
    if o.minutes == 0 || o.minute_secs == 0 {
        bail!("--minutes and --minute-secs must be at least 1");
    }
    if !crate::is_root() {
        bail!("the soak runs the observer (eBPF programs, uprobes) and reads its /proc/<pid>/fd: run it as root");
    }
    crate::setup()?;
    let fixtures = crate::fixtures()?;
    let built = crate::build(!o.debug)?;
    let bin = o.observer.clone().unwrap_or_else(|| built.clone());
    let beside = bin.with_file_name("libgpu_observer_cupti.so");
    let cupti_lib = if beside.is_file() {
        beside
    } else {
        built.with_file_name("libgpu_observer_cupti.so")
    };
    let out = match o.out {
        Some(d) => d,
        None => crate::root().join("target/soak").join(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
                .to_string(),
        ),
    };
    fs::create_dir_all(out.join("shared"))?;
    let out = fs::canonicalize(&out)?;
    // A copy of our own (a new inode), attached up front like the driver's own files.
    let shared_lib = out.join("shared/libcuda.so.1");
    fs::copy(fixtures.join("libcuda.so.1"), &shared_lib)?;
    let ctx = Arc::new(Ctx {
        fixtures,
        out: out.clone(),
        shared_lib,
        cupti_lib,
        private_every: o.private_every,
        book: Mutex::default(),
        log: Mutex::default(),
        gate: Gate::default(),
    });

    let mut agent = Command::new(&bin)
        .args(["--format", "jsonl", "--trace-all", "--interval-ms"])
        .arg(INTERVAL_MS.to_string())
        .arg("--libcuda")
        .arg(&ctx.shared_lib)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {}", bin.display()))?;
    let agent_pid = agent.id();
    let stdout = agent.stdout.take().context("agent stdout")?;
    let stderr = agent.stderr.take().context("agent stderr")?;
    let c = ctx.clone();
    let out_reader = thread::spawn(move || read_output(&c, stdout));
    let c = ctx.clone();
    let err_reader = thread::spawn(move || read_stderr(&c, stderr));
    eprintln!(
        "xtask: soak: {} for {} × {} s, output in {}",
        bin.display(),
        o.minutes,
        o.minute_secs,
        out.display()
    );
    let ready = Instant::now();
    while !ctx.wait_log(0, Duration::from_millis(200), |l| l == "gpu-observer: ready") {
        if let Some(st) = agent.try_wait()? {
            bail!("the observer exited before `ready` ({st}):\n{}", tail(&ctx, 20));
        }
        if ready.elapsed() > Duration::from_secs(120) {
            bail!("the observer did not say `ready` within 120 s:\n{}", tail(&ctx, 20));
        }
    }

    let mut workers = Vec::new();
    type Work = fn(&Ctx) -> Result<()>;
    let jobs: [(&str, Work); 3] = [
        ("churn", churn),
        ("steady", |c| steady(c, "steady", false, STEADY_PERIOD, STEADY_RUN)),
        ("cupti", |c| steady(c, "cupti", true, CUPTI_PERIOD, CUPTI_RUN)),
    ];
    for (name, job) in jobs {
        let c = ctx.clone();
        c.gate.enter();
        workers.push(thread::spawn(move || {
            if let Err(e) = job(&c) {
                c.book().errors.push(format!("{name}: {e:#}"));
            }
            c.gate.leave();
        }));
    }

    let mut csv = fs::File::create(out.join("soak.csv"))?;
    writeln!(csv, "{}", Row::csv_header())?;
    let minute = Duration::from_secs(o.minute_secs);
    let tick = clock_ticks();
    let start = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut last = (start, sample(agent_pid)?.cpu_ticks);
    let mut died = None;
    for m in 1..=o.minutes {
        let at = start + minute * m as u32;
        let mut alive = Ok(());
        while Instant::now() < at && alive.is_ok() {
            thread::sleep(at.saturating_duration_since(Instant::now()).min(Duration::from_secs(1)));
            alive = agent_alive(&mut agent);
        }
        if let Err(e) = alive.and_then(|()| ctx.gate.pause(Duration::from_secs(60))) {
            died = Some(format!("{e:#}"));
            break;
        }
        let (t, close_ms) = wait_closed(&ctx);
        // Let the rescan see that exited processes are gone (and release what only they mapped).
        let settle = Instant::now();
        thread::sleep(Duration::from_millis(2 * INTERVAL_MS + 500));
        let mut s = sample(agent_pid)?;
        if let Some(first) = rows.first() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while (s.fds, s.links) != (first.s.fds, first.s.links) && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(250));
                s = sample(agent_pid)?;
            }
        }
        let settle_ms = settle.elapsed().as_millis();
        let now = Instant::now();
        let cpu_pct = (s.cpu_ticks - last.1) as f64 / tick / now.duration_since(last.0).as_secs_f64() * 100.0;
        last = (now, s.cpu_ticks);
        let dropped = ctx.log().drops;
        let row = Row {
            minute: m,
            elapsed_s: start.elapsed().as_secs_f64(),
            s,
            cpu_pct,
            processes: ctx.book().processes,
            t,
            dropped,
            accounting: accounting(&t, dropped),
            close_ms,
            settle_ms,
        };
        ctx.gate.resume();
        row.print(o.minutes);
        writeln!(csv, "{}", row.csv())?;
        csv.flush()?;
        rows.push(row);
    }

    ctx.gate.stop();
    for w in workers {
        let _ = w.join();
    }
    let (final_t, _) = wait_closed(&ctx);
    let stop = Instant::now();
    // SAFETY: signalling our own child, which has not been reaped (its pid is still ours).
    unsafe { libc::kill(agent_pid as i32, libc::SIGINT) };
    let status = loop {
        if let Some(st) = agent.try_wait()? {
            break Some(st);
        }
        if stop.elapsed() > EXIT_TIMEOUT * 4 {
            let _ = agent.kill();
            let _ = agent.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let exit_s = stop.elapsed().as_secs_f64();
    let _ = out_reader.join();
    let _ = err_reader.join();

    let book = ctx.book();
    let total: Option<Value> = book.total_summary.as_deref().and_then(|s| serde_json::from_str(s).ok());
    let kind = |k: &str| {
        total
            .as_ref()
            .and_then(|t| t["dropped_by_kind"][k].as_u64())
            .unwrap_or(0)
    };
    let call_drops = kind("launch") + kind("call");
    let ring_drops = total.as_ref().and_then(|t| t["dropped"].as_u64()).unwrap_or(0);

    let mut checks = Vec::new();
    let mut check = |name, pass, detail: String| checks.push(Check { name, pass, detail });
    check(
        "the observer ran to the end",
        died.is_none() && rows.len() as u64 == o.minutes,
        died.clone()
            .unwrap_or_else(|| format!("{} of {} minutes", rows.len(), o.minutes)),
    );
    if let (Some(first), Some(lastr)) = (rows.first(), rows.last()) {
        let ref_minute = if o.minutes >= SHORT_RUN_MINUTES { 5 } else { 1 };
        let r = rows.get((ref_minute - 1) as usize).unwrap_or(first);
        let delta = (lastr.s.rss_kib as f64 - r.s.rss_kib as f64) / r.s.rss_kib as f64;
        check(
            "RSS flat",
            delta.abs() <= RSS_TOLERANCE,
            format!(
                "minute {}: {} KiB, minute {ref_minute}: {} KiB ({:+.1} %, bound ±{:.0} %)",
                lastr.minute,
                lastr.s.rss_kib,
                r.s.rss_kib,
                delta * 100.0,
                RSS_TOLERANCE * 100.0
            ),
        );
        let off = |f: fn(&Row) -> u64| -> Vec<String> {
            rows.iter()
                .filter(|x| f(x) != f(first))
                .map(|x| format!("minute {}: {}", x.minute, f(x)))
                .collect()
        };
        let fds = off(|x| x.s.fds);
        check(
            "fds flat",
            fds.is_empty(),
            format!(
                "minute 1: {}; {}",
                first.s.fds,
                if fds.is_empty() {
                    "every minute the same".into()
                } else {
                    fds.join(", ")
                }
            ),
        );
        let links = off(|x| x.s.links);
        check(
            "BPF links flat",
            links.is_empty(),
            format!(
                "minute 1: {}; {}",
                first.s.links,
                if links.is_empty() {
                    "every minute the same".into()
                } else {
                    links.join(", ")
                }
            ),
        );
        let bad: Vec<String> = rows
            .iter()
            .filter(|x| x.accounting != "exact" || x.t.calls == 0)
            .map(|x| {
                format!(
                    "minute {}: {} ({} calls, {} captured)",
                    x.minute, x.accounting, x.t.calls, x.t.captured
                )
            })
            .collect();
        check(
            "captured + dropped = calls every minute",
            bad.is_empty(),
            if bad.is_empty() {
                format!("exact every minute; minute {}: {} calls", lastr.minute, lastr.t.calls)
            } else {
                bad.join(", ")
            },
        );
    }
    check(
        "captured + dropped = calls at the end (summary's drops)",
        total.is_some()
            && final_t.captured + call_drops == final_t.calls
            && final_t.gpu_captured == final_t.gpu_expected,
        format!(
            "{} calls, {} captured, {} call records dropped; CUPTI: {} GPU records owed, {} written",
            final_t.calls, final_t.captured, call_drops, final_t.gpu_expected, final_t.gpu_captured
        ),
    );
    check(
        "the observer stopped cleanly",
        status.is_some_and(|s| s.success()) && total.is_some() && exit_s <= EXIT_TIMEOUT.as_secs_f64(),
        format!(
            "{} {:.1} s after SIGINT, {}",
            match status {
                Some(s) => format!("exited with {s}"),
                None => "killed".to_string(),
            },
            exit_s,
            if total.is_some() {
                "summary written"
            } else {
                "no summary"
            }
        ),
    );
    check(
        "every line valid JSON",
        book.bad_lines == 0,
        format!("{} lines, {} not JSON", book.lines, book.bad_lines),
    );
    check(
        "workloads ran without error",
        book.errors.is_empty() && book.processes > 0,
        if book.errors.is_empty() {
            format!("{} processes", book.processes)
        } else {
            format!("{} errors, first: {}", book.errors.len(), book.errors[0])
        },
    );

    let mut failed = 0;
    for c in &checks {
        println!("{} {}: {}", if c.pass { "PASS" } else { "FAIL" }, c.name, c.detail);
        failed += usize::from(!c.pass);
    }
    println!(
        "INFO ring drops: {ring_drops} (all kinds); lines of processes the soak did not start: {}",
        final_t.foreign
    );
    let report = json!({
        "observer": bin.display().to_string(),
        "minutes": o.minutes,
        "minute_secs": o.minute_secs,
        "private_every": o.private_every,
        "rows": rows.iter().map(Row::json).collect::<Vec<_>>(),
        "checks": checks.iter().map(|c| json!({"name": c.name, "pass": c.pass, "detail": c.detail})).collect::<Vec<_>>(),
        "final": {"calls": final_t.calls, "captured": final_t.captured, "call_drops": call_drops,
                  "ring_drops": ring_drops, "gpu_expected": final_t.gpu_expected,
                  "gpu_captured": final_t.gpu_captured, "foreign_lines": final_t.foreign,
                  "processes": book.processes, "exit_s": exit_s, "errors": book.errors},
    });
    fs::write(out.join("soak.json"), serde_json::to_string_pretty(&report)?)?;
    println!(
        "soak: per-minute rows in {}, report in {}",
        out.join("soak.csv").display(),
        out.join("soak.json").display()
    );
    if failed > 0 {
        bail!("soak: {failed} of {} checks failed", checks.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_csv_is_the_report_rows_columns_in_order() {
        assert_eq!(
            Row::csv_header(),
            "minute,elapsed_s,rss_kib,fds,bpf_links,agent_cpu_pct,processes_finished,calls,captured,dropped_so_far,accounting,pids_off,gpu_expected,gpu_captured,foreign_lines,close_ms,settle_ms"
        );
        let row = Row {
            minute: 3,
            elapsed_s: 180.04,
            accounting: "exact",
            ..Row::default()
        };
        assert_eq!(row.csv(), "3,180.0,0,0,0,0.0,0,0,0,0,exact,0,0,0,0,0,0");
    }

    #[test]
    fn the_drop_warning_gives_its_running_total() {
        let line = "gpu-observer: warning: ring buffer full: 1234 records dropped so far; raise --ring-buffer-size (now 4096 bytes) or narrow with --pid";
        assert_eq!(drops_in(line), Some(1234));
        assert_eq!(drops_in("gpu-observer: ready"), None);
    }

    fn totals(calls: u64, captured: u64, pids_off: u64) -> Totals {
        Totals {
            calls,
            captured,
            pids_off,
            ..Totals::default()
        }
    }

    #[test]
    fn accounting_is_exact_within_drops_or_a_mismatch() {
        assert_eq!(accounting(&totals(300, 300, 0), 0), "exact");
        // 10 lines missing, 10 records dropped: the split per pid comes with the summary.
        assert_eq!(accounting(&totals(300, 290, 1), 10), "within-drops");
        assert_eq!(accounting(&totals(300, 290, 1), 9), "MISMATCH");
        // More lines than calls is never explained by drops.
        assert_eq!(accounting(&totals(300, 301, 1), 10), "MISMATCH");
    }

    #[test]
    fn lines_of_other_processes_are_foreign_and_each_pid_is_compared() {
        let mut b = Book::default();
        b.pids.insert(
            1,
            Counts {
                ours: true,
                calls: 5,
                captured: 5,
                ..Counts::default()
            },
        );
        b.pids.insert(
            2,
            Counts {
                ours: true,
                calls: 3,
                captured: 4,
                ..Counts::default()
            },
        );
        b.pids.insert(
            3,
            Counts {
                captured: 7,
                ..Counts::default()
            },
        );
        let t = b.totals();
        assert_eq!((t.calls, t.captured, t.pids_off, t.foreign), (8, 9, 1, 7));
    }

    #[test]
    fn an_output_line_gives_its_type_pid_and_scope() {
        let ev: Line = serde_json::from_str(
            r#"{"type":"launch","ts_ns":1,"pid":42,"tid":43,"comm":"a\"b","api":"cuLaunchKernel"}"#,
        )
        .unwrap();
        assert_eq!((&*ev.ty, ev.pid.and_then(|p| p.as_u64())), ("launch", Some(42)));
        let total: Line = serde_json::from_str(r#"{"type":"summary","scope":"total","pid":null,"events":3}"#).unwrap();
        assert_eq!(
            (total.scope.as_deref(), total.pid.and_then(|p| p.as_u64())),
            (Some("total"), None)
        );
    }
}
