//! `cargo xtask bench-dashboard` (issue 15): what the live dashboard costs the agent; with
//! `--modes` and `--rate`, what the agent costs at a given launch rate in any output mode
//! (CPU and peak RSS; issue 18's 10 000 launches/s).
//!
//! The fake workload launches ~100 000 kernels a second (`burst 1000` every 10 ms) under the
//! release agent, run alternately with `--format none` and with `--format dashboard` on a
//! pseudo-terminal (100×30, drained as a terminal would read it), five runs each. Each run's
//! CPU is the agent's utime + stime (/proc/PID/stat, every thread) over a fixed window after a
//! warm-up, in % of one core. Printed side by side with both medians; the dashboard's
//! marginal cost is the difference of the medians, PASS when at most 1 % of a core.
//!
//! `--format none` writes nothing locally and needs an OTLP endpoint: both modes get the same
//! one, a closed port on the loopback, with span export limited to 1 a second and metrics
//! every hour, so OTLP costs both sides alike and next to nothing (docs/BENCHMARKS.md).

use std::{
    fs,
    io::Read,
    os::{
        fd::{FromRawFd, OwnedFd},
        unix::process::CommandExt,
    },
    path::Path,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::workload::Workload;

pub struct Options {
    pub runs: usize,
    pub seconds: f64,
    pub warmup: f64,
    /// Launches a second the workload is paced to.
    pub rate: u64,
    /// The most the dashboard may add, in % of a core.
    pub limit: f64,
    /// The modes measured, in this order each round.
    pub modes: Vec<Mode>,
}

/// Launches per `burst` command; bursts are paced to make [`Options::rate`].
const BURST: u64 = 1000;

#[derive(Clone, Copy, PartialEq, Debug, clap::ValueEnum)]
pub enum Mode {
    /// `--format none` (OTLP only, to the closed port).
    None,
    /// `--format dashboard` on the pseudo-terminal.
    Dashboard,
    /// `--format jsonl --output /dev/null` with the default adaptive sampling: every JSON
    /// line the agent writes is formatted and written.
    Jsonl,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Dashboard => "dashboard",
            Mode::Jsonl => "jsonl",
        }
    }
}

/// One run's measurement.
struct Measured {
    cpu_pct: f64,
    launches_per_s: f64,
    /// Bytes the agent wrote to its terminal a second (the dashboard's redraws).
    tty_bytes_per_s: f64,
    /// (events, dropped) as the agent's summary counts them, over the whole run.
    events: (u64, u64),
    /// The agent's peak resident set (VmHWM) at the end of the measured window, KiB.
    peak_rss_kib: u64,
}

pub fn bench_dashboard(o: Options) -> Result<()> {
    if !crate::is_root() {
        bail!("the benchmark runs the observer (eBPF programs, uprobes): run it as root");
    }
    if o.runs == 0 || o.seconds <= 0.0 || o.rate < BURST || o.modes.is_empty() {
        bail!("--runs must be at least 1, --seconds above 0, --rate at least {BURST}, --modes not empty");
    }
    crate::setup()?;
    let fixtures = crate::fixtures()?;
    let bin = crate::build(true)?;
    let dir = crate::root().join("target/bench-dashboard");
    fs::create_dir_all(dir.join("lib"))?;
    // A copy of our own (a new inode), attached up front with --libcuda.
    let lib = dir.join("lib/libcuda.so.1");
    fs::copy(fixtures.join("libcuda.so.1"), &lib)?;
    let nvml = fixtures.join("nvml/libnvidia-ml.so.1");
    let mut w = Workload::start(&fixtures.join("cuda_workload"), &[])?;
    w.cmd(&format!("load {}", lib.display()))?;
    w.cmd("init")?;
    let mut got: Vec<(Mode, Measured)> = Vec::new();
    println!(
        "bench-dashboard: {} runs of each, {} s measured after {} s, {} launches/s paced; agent CPU in % of one core",
        o.runs, o.seconds, o.warmup, o.rate
    );
    for i in 0..o.runs {
        for &mode in &o.modes {
            let (back, m) = one_run(&o, mode, &bin, &lib, &nvml, w)?;
            w = back;
            println!(
                "  run {} {:<9} {:6.2} %  peak RSS {:.1} MB  ({:.0} launches/s paced; the agent counted {} events, {} dropped; {:.0} terminal bytes/s)",
                i + 1,
                mode.name(),
                m.cpu_pct,
                m.peak_rss_kib as f64 / 1024.0,
                m.launches_per_s,
                m.events.0,
                m.events.1,
                m.tty_bytes_per_s
            );
            if m.events.0 == 0 {
                bail!("the agent saw no events: the load did not reach it");
            }
            got.push((mode, m));
        }
    }
    let _ = w.cmd("exit");
    let of = |mode: Mode| -> Vec<f64> { got.iter().filter(|(m, _)| *m == mode).map(|(_, r)| r.cpu_pct).collect() };
    print!("\n  run ");
    for mode in &o.modes {
        print!("  {:>18}", format!("--format {}", mode.name()));
    }
    println!();
    let cols: Vec<Vec<f64>> = o.modes.iter().map(|&m| of(m)).collect();
    for i in 0..o.runs {
        print!("  {:>3} ", i + 1);
        for c in &cols {
            print!("  {:>16.2} %", c[i]);
        }
        println!();
    }
    print!("  median");
    for c in &cols {
        print!("  {:>16.2} %", median(c));
    }
    println!();
    for &mode in &o.modes {
        let rss: Vec<f64> = got
            .iter()
            .filter(|(m, _)| *m == mode)
            .map(|(_, r)| r.peak_rss_kib as f64 / 1024.0)
            .collect();
        println!(
            "  --format {}: peak RSS median {:.1} MB, largest {:.1} MB",
            mode.name(),
            median(&rss),
            rss.iter().copied().fold(0.0, f64::max)
        );
    }
    // The dashboard's cost is judged when both it and `none` were measured.
    if !(o.modes.contains(&Mode::None) && o.modes.contains(&Mode::Dashboard)) {
        return Ok(());
    }
    let (none, dash) = (of(Mode::None), of(Mode::Dashboard));
    let (mn, md) = (median(&none), median(&dash));
    let diff = md - mn;
    let verdict = if diff <= o.limit { "PASS" } else { "FAIL" };
    println!(
        "\ndashboard marginal cost: {diff:+.2} % of a core (median dashboard − median none; limit {} %): {verdict}",
        o.limit
    );
    if verdict == "FAIL" {
        bail!("the dashboard costs {diff:.2} % of a core, above {} %", o.limit);
    }
    Ok(())
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// What the agent wrote (stderr, or the terminal): for `ready`, and for a failure's message.
#[derive(Default)]
struct Seen {
    tail: Vec<u8>,
    total: u64,
}

fn drain(mut r: impl Read + Send + 'static, seen: Arc<Mutex<Seen>>) {
    thread::spawn(move || {
        let mut buf = [0u8; 65536];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
            s.total += n as u64;
            s.tail.extend_from_slice(&buf[..n]);
            let excess = s.tail.len().saturating_sub(1 << 16);
            s.tail.drain(..excess);
        }
    });
}

fn one_run(o: &Options, mode: Mode, bin: &Path, lib: &Path, nvml: &Path, w: Workload) -> Result<(Workload, Measured)> {
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let mut cmd = Command::new(bin);
    cmd.args(["--format", mode.name()])
        .args(if mode == Mode::Jsonl {
            &["--output", "/dev/null"][..]
        } else {
            &[]
        })
        .arg("--libcuda")
        .arg(lib)
        .arg("--nvml-lib")
        .arg(nvml)
        .args([
            "--otlp-endpoint",
            "http://127.0.0.1:9",
            "--otlp-max-spans-per-sec",
            "1",
            "--otlp-interval-ms",
            "3600000",
        ])
        .env_remove("NO_COLOR")
        .env("TERM", "xterm-256color");
    let (mut agent, _master) = match mode {
        Mode::None | Mode::Jsonl => {
            let mut child = cmd
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .with_context(|| format!("spawn {}", bin.display()))?;
            drain(child.stderr.take().context("agent stderr")?, seen.clone());
            (Guard(child), None)
        }
        Mode::Dashboard => {
            let (master, slave) = pty(30, 100)?;
            cmd.stdin(Stdio::from(slave.try_clone()?))
                .stdout(Stdio::from(slave.try_clone()?))
                .stderr(Stdio::from(slave));
            // SAFETY: between fork and exec only async-signal-safe calls (setsid, ioctl): the
            // pty becomes the agent's controlling terminal, as a login shell's would be.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let child = cmd.spawn().with_context(|| format!("spawn {}", bin.display()))?;
            // The command's copies of the terminal side are closed now that it has started.
            drop(cmd);
            drain(fs::File::from(master.try_clone()?), seen.clone());
            (Guard(child), Some(master))
        }
    };
    let shown =
        |s: &Arc<Mutex<Seen>>| String::from_utf8_lossy(&s.lock().unwrap_or_else(|e| e.into_inner()).tail).into_owned();
    let start = Instant::now();
    while !shown(&seen).contains("gpu-observer: ready") {
        if let Some(st) = agent.0.try_wait()? {
            bail!(
                "the agent ({}) exited before `ready` ({st}):\n{}",
                mode.name(),
                shown(&seen)
            );
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("the agent ({}) was not ready in 60 s:\n{}", mode.name(), shown(&seen));
        }
        thread::sleep(Duration::from_millis(50));
    }
    let pid = agent.0.id();
    let stop = Arc::new(AtomicBool::new(false));
    let period = Duration::from_secs_f64(BURST as f64 / o.rate as f64);
    let pacer = {
        let stop = stop.clone();
        let mut w = w;
        thread::spawn(move || -> Result<(Workload, u64, Duration)> {
            let began = Instant::now();
            let mut next = began;
            let mut launched = 0;
            while !stop.load(Ordering::Relaxed) {
                w.cmd(&format!("burst {BURST}"))?;
                launched += BURST;
                next += period;
                let now = Instant::now();
                if next > now {
                    thread::sleep(next - now);
                } else {
                    // Behind: start again from now rather than burst back to back.
                    next = now;
                }
            }
            Ok((w, launched, began.elapsed()))
        })
    };
    thread::sleep(Duration::from_secs_f64(o.warmup));
    let (c0, t0, l0) = (
        cpu_ticks(pid)?,
        Instant::now(),
        seen.lock().unwrap_or_else(|e| e.into_inner()).total,
    );
    thread::sleep(Duration::from_secs_f64(o.seconds));
    let (c1, t1, l1) = (
        cpu_ticks(pid)?,
        Instant::now(),
        seen.lock().unwrap_or_else(|e| e.into_inner()).total,
    );
    let peak_rss_kib = peak_rss_kib(pid)?;
    stop.store(true, Ordering::Relaxed);
    let (w, launched, paced) = pacer.join().map_err(|_| anyhow::anyhow!("the pacer panicked"))??;
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    let st = loop {
        if let Some(st) = agent.0.try_wait()? {
            break st;
        }
        if Instant::now() > deadline {
            bail!("the agent ({}) did not exit after SIGTERM", mode.name());
        }
        thread::sleep(Duration::from_millis(20));
    };
    if !st.success() {
        bail!("the agent ({}) exited {st}:\n{}", mode.name(), shown(&seen));
    }
    // Let the drain read the summary written just before the exit.
    thread::sleep(Duration::from_millis(300));
    let window = (t1 - t0).as_secs_f64();
    Ok((
        w,
        Measured {
            cpu_pct: (c1 - c0) as f64 / clock_ticks() / window * 100.0,
            launches_per_s: launched as f64 / paced.as_secs_f64(),
            events: counted(&shown(&seen)),
            peak_rss_kib,
            tty_bytes_per_s: if mode == Mode::Dashboard {
                (l1 - l0) as f64 / window
            } else {
                0.0
            },
        },
    ))
}

/// The last `N events, M dropped` the agent wrote: its summary (the terminal's first line, or
/// the line on stderr with `--format none`).
fn counted(text: &str) -> (u64, u64) {
    let Some(at) = text.rfind(" events, ") else {
        return (0, 0);
    };
    let events = text[..at]
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let dropped = text[at + " events, ".len()..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    (events, dropped)
}

/// Kills the agent if a run fails half-way.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A pseudo-terminal of `rows`×`cols`: (master, terminal side).
fn pty(rows: u16, cols: u16) -> Result<(OwnedFd, OwnedFd)> {
    let (mut m, mut s) = (0, 0);
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes two descriptors; no name buffer, default line discipline modes,
    // the size from our winsize.
    if unsafe { libc::openpty(&mut m, &mut s, std::ptr::null_mut(), std::ptr::null(), &ws) } != 0 {
        return Err(std::io::Error::last_os_error()).context("openpty");
    }
    // SAFETY: both descriptors were just opened by openpty and are owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) })
}

/// utime + stime of the whole process (every thread), in clock ticks.
/// VmHWM of a process, KiB.
fn peak_rss_kib(pid: u32) -> Result<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/PID/status")
}

fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields 14 and 15: the 12th and 13th after the `(comm)` field.
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = after.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
    Ok(f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0))
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}
