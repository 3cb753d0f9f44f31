//! A run of the observer, in three steps: [`start`] checks what the user gave, loads and
//! attaches the probes and starts the threads; [`Run::watch`] waits for signals, the end of
//! the run and ticks ([`tick`]); [`shutdown`] stops everything in order and writes the
//! summaries.

pub mod capture;
mod dashboard;
mod gpu_timing;
mod shutdown;
mod start;
mod tick;

use std::{
    io::Write,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Result;
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    attach::Attacher,
    cli::{Cli, Format},
    export::{otlp::Otlp, terminal},
    nvml::Sampler,
    pipeline::{Reader, Request},
    say,
    snapshot::Snapshots,
    spawn::Spawned,
};

/// Observes until Ctrl-C, `--duration`, or the end of the observed (or started) process; the
/// exit code: 0, or the started program's.
pub async fn observe(cli: Cli) -> Result<i32> {
    let mut run = start::start(cli).await?;
    let end = run.watch().await?;
    shutdown::shutdown(run, end).await
}

/// Everything a run holds.
struct Run {
    cli: Cli,
    /// The output format, resolved (Cli::output_format).
    format: Format,
    /// The live dashboard (`--format dashboard`), holding the terminal.
    dashboard: Option<dashboard::Dashboard>,
    /// Notified when the dashboard ends by itself (a quit key, a failure).
    dashboard_ended: Arc<tokio::sync::Notify>,
    at: Attacher,
    spawned: Option<Spawned>,
    sampler: Option<Sampler>,
    reader: Reader,
    /// Notified when a sink fails.
    failed: Arc<tokio::sync::Notify>,
    otlp: Option<Otlp>,
    snapshots: Snapshots,
    /// Where the terminal summary goes (`--format terminal`); JSON lines write their own.
    summary_out: Option<Box<dyn Write + Send>>,
    /// For messages: the output's path, or "stdout".
    dest: String,
    started: Instant,
    /// The terminal table refreshes every tick.
    live: bool,
    view: terminal::LiveView,
    /// No libcuda mapped yet (told once).
    waiting: bool,
    last_drops: u64,
    /// The observed process (`--pid`, `run`) exited: why; the run ends with its last descendant.
    root_gone: Option<String>,
    told_descendants: bool,
    last_follow_missed: u64,
    /// Verdict windows, and the latest verdict of each process.
    tracker: crate::analyze::window::Tracker,
    verdicts: std::collections::HashMap<u32, crate::analyze::window::ProcessVerdict>,
    /// When each process's verdict was last written (a line per window, or on a new class).
    verdict_written: std::collections::HashMap<u32, (u64, crate::analyze::verdict::Class)>,
    /// `--gpu-timing`: injections, and the processes switched on.
    gpu_timing: Option<gpu_timing::GpuTiming>,
    /// Fleet mode's capture windows, and its switch of CUPTI collection.
    capture: Option<capture::Capture>,
    cupti_switch: capture::CuptiSwitch,
}

/// Why watching ended.
struct End {
    exit_status: Option<std::process::ExitStatus>,
    /// An output failed (a closed pipe, a full disk).
    output_failed: bool,
}

impl Run {
    /// Waits for a signal, the deadline, the end of the observed process or a failed output;
    /// ticks meanwhile.
    async fn watch(&mut self) -> Result<End> {
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut sigusr1 = signal(SignalKind::user_defined1())?;
        let mut tick = tokio::time::interval(Duration::from_millis(self.cli.interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let deadline = self
            .cli
            .duration
            .map(|s| tokio::time::Instant::from_std(self.started + Duration::from_secs_f64(s.max(0.0))));
        let failed = self.failed.clone();
        let dashboard_ended = self.dashboard_ended.clone();
        let mut end = End {
            exit_status: None,
            output_failed: false,
        };
        loop {
            let capture_in = self.capture.as_ref().map(capture::Capture::until_next);
            tokio::select! {
                _ = async { match capture_in { Some(d) => tokio::time::sleep(d).await, None => std::future::pending().await } } => self.capture_edge(),
                _ = failed.notified() => {
                    end.output_failed = true;
                    return Ok(end);
                }
                _ = sigint.recv() => return Ok(end),
                // `q` or Ctrl-C on the dashboard: the same way out as SIGINT.
                _ = dashboard_ended.notified() => return Ok(end),
                _ = sigterm.recv() => return Ok(end),
                _ = sigusr1.recv() => self.dump_leaks().await,
                _ = async { match deadline { Some(t) => tokio::time::sleep_until(t).await, None => std::future::pending().await } } => return Ok(end),
                _ = tick.tick() => {
                    if let Some(why) = self.tick(&mut end)? {
                        say(why);
                        return Ok(end);
                    }
                    self.gpu_timing_tick().await;
                }
            }
        }
    }

    /// The capture window edge that is due: the windowed probes attached or closed, the
    /// edge logged for the verdicts and written as a `capture` line.
    fn capture_edge(&mut self) {
        let (Some(c), Some(log)) = (self.capture.as_mut(), self.tracker.capture.as_mut()) else {
            return;
        };
        let step = c.next_step();
        let snap = self.snapshots.load();
        let gpu_timing = self.gpu_timing.as_ref();
        let late_on = |pid| gpu_timing.is_some_and(|g| g.is_on(pid));
        if step == capture::Step::PauseCupti {
            let n = self.cupti_switch.edge(&snap, false, late_on);
            c.cupti_paused(n);
            return;
        }
        let open = step == capture::Step::Open;
        let change = self.at.probes.set_window(open);
        let now = if change.at_ns > 0 {
            change.at_ns
        } else {
            crate::clock::monotonic_ns()
        };
        if open && !change.gated {
            say("warning: a capture window's gate could not be opened: that window records nothing");
        }
        let procinfo = crate::procinfo::ProcInfo::host();
        let mut edge = c.made(now, &snap, &procinfo, change, log);
        // CUPTI on after the gate: its first records are of launches the gate recorded.
        if open && c.cupti() {
            edge.cupti = self.cupti_switch.edge(&snap, true, late_on);
        }
        self.reader.ask(Request::Capture(edge));
    }

    /// Leak report on demand: `leak` lines in the JSON output, a table on stderr, from a
    /// snapshot the reader takes after writing them.
    async fn dump_leaks(&mut self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if !self.reader.ask(Request::DumpLeaks(tx)) {
            return;
        }
        match tokio::time::timeout(LEAK_REPORT_TIMEOUT, rx).await {
            Ok(Ok(snap)) => eprint!("{}", terminal::leak_report(&snap)),
            _ => say("warning: the reader did not answer the leak report request in time"),
        }
    }
}

/// How long a leak report waits for the reader (it answers within one drain, ~10 ms).
const LEAK_REPORT_TIMEOUT: Duration = Duration::from_secs(2);
