//! `--gpu-timing`: GPU times for processes that were running before the observer came. Each
//! observed process that maps libcuda gets the injection library (`attach::inject`, on a
//! thread of its own) and is switched on; `--gpu-timing-for` or the end of the run switches
//! every one off again, and waits (bounded) until each says it flushed.

use std::{
    collections::{BTreeSet, HashSet},
    sync::{Arc, mpsc},
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use gpu_observer_common::cupti::{CuptiState, control};

use super::Run;
use crate::{
    attach::inject::{self, Library, Outcome, Reason, Refusal},
    cli::Cli,
    clock::monotonic_ns,
    export::{GpuTimingEvent, GpuTimingNote},
    pipeline::Request,
    say,
};

/// How long a withdraw waits for the libraries' last flush (their control thread looks every
/// 100 ms, then flushes; the reader publishes every 250 ms).
const WITHDRAW_TIMEOUT: Duration = Duration::from_secs(3);
/// Processes injected at most in one run (each costs a thread while it runs).
const MAX_PROCESSES: usize = 256;

type Answer = mpsc::Receiver<Result<Outcome, Refusal>>;

pub(super) struct GpuTiming {
    lib: Arc<Library>,
    /// Injections under way.
    running: Vec<(u32, Answer)>,
    /// Processes tried (each once a run).
    tried: HashSet<u32>,
    /// Processes switched on.
    on: BTreeSet<u32>,
    /// Processes told already that CUPTI is held by another tool.
    busy: HashSet<u32>,
    /// `--gpu-timing-for`: how long GPU timing stays on, from the first process switched on.
    window: Option<Duration>,
    /// When to withdraw (set at the first switch-on).
    until: Option<Instant>,
    withdrawn: bool,
}

impl GpuTiming {
    /// Checks the flags; None without `--gpu-timing`.
    pub fn new(cli: &Cli) -> Result<Option<Self>> {
        if !cli.gpu_timing && cli.gpu_timing_for.is_none() {
            return Ok(None);
        }
        if cli.is_run() {
            bail!("`run` times the GPU from the program's start already: drop --gpu-timing");
        }
        if cli.pid.is_none() {
            bail!("--gpu-timing loads a library into a process: name it with --pid");
        }
        if cli.no_cupti {
            bail!("--gpu-timing needs the CUPTI injection library: drop --no-cupti");
        }
        let Some(path) = crate::spawn::injection_library(cli)? else {
            bail!("--gpu-timing needs the CUPTI injection library");
        };
        let lib = Library::load(&path).map_err(|e| anyhow::anyhow!("--gpu-timing: {e}"))?;
        Ok(Some(Self {
            lib: Arc::new(lib),
            running: Vec::new(),
            tried: HashSet::new(),
            on: BTreeSet::new(),
            busy: HashSet::new(),
            window: cli.gpu_timing_for.map(|s| Duration::from_secs_f64(s.max(0.0))),
            until: None,
            withdrawn: false,
        }))
    }

    /// Whether it switched the library in `pid` on (fleet mode switches only those).
    pub(super) fn is_on(&self, pid: u32) -> bool {
        !self.withdrawn && self.on.contains(&pid)
    }

    /// Starts injections into the processes found mapping libcuda (once each).
    fn start(&mut self, pids: impl Iterator<Item = u32>) {
        if self.withdrawn {
            return;
        }
        for pid in pids {
            if self.tried.len() >= MAX_PROCESSES || !self.tried.insert(pid) {
                continue;
            }
            let (tx, rx) = mpsc::sync_channel(1);
            let lib = self.lib.clone();
            // A thread of its own: it is the tracer, and its end detaches whatever it left.
            let spawned = std::thread::Builder::new().name("gpu-timing".into()).spawn(move || {
                let _ = tx.send(inject::inject(pid, &lib));
            });
            match spawned {
                Ok(_) => self.running.push((pid, rx)),
                Err(e) => say(format_args!("warning: --gpu-timing: no thread for pid {pid}: {e}")),
            }
        }
    }
}

fn comm(pid: u32) -> String {
    crate::procinfo::ProcInfo::host().comm(pid).unwrap_or_default()
}

impl Run {
    fn note(&self, pid: u32, tid: u32, event: GpuTimingEvent) {
        self.reader.ask(Request::GpuTiming(GpuTimingNote {
            ts_ns: monotonic_ns(),
            pid,
            tid,
            comm: comm(pid),
            event,
        }));
    }

    /// Each tick: new processes to inject, answers of injections, CUPTI refusing, the
    /// `--gpu-timing-for` deadline.
    pub(super) async fn gpu_timing_tick(&mut self) {
        let Some(mut g) = self.gpu_timing.take() else {
            return;
        };
        g.start(self.at.known_pids.iter().copied());
        let mut rescan = false;
        let mut i = 0;
        while i < g.running.len() {
            let answer = match g.running[i].1.try_recv() {
                Ok(a) => a,
                Err(mpsc::TryRecvError::Empty) => {
                    i += 1;
                    continue;
                }
                Err(mpsc::TryRecvError::Disconnected) => Err(Refusal {
                    reason: Reason::Failed,
                    message: "the injection thread ended without an answer".into(),
                }),
            };
            let pid = g.running.swap_remove(i).0;
            match answer {
                Ok(Outcome::Injected(done)) => {
                    say(format_args!(
                        "GPU timing: loaded the CUPTI library into pid {pid} (thread {} stopped {} µs, then {} ms loading it)",
                        done.tid,
                        done.pause.as_micros(),
                        done.diverted.as_millis()
                    ));
                    self.note(
                        pid,
                        done.tid as u32,
                        GpuTimingEvent::Injected {
                            pause_us: done.pause.as_micros() as u64,
                            diverted_us: done.diverted.as_micros() as u64,
                        },
                    );
                    rescan |= self.switch_on(&mut g, pid);
                }
                Ok(Outcome::AlreadyLoaded { late }) => {
                    say(format_args!(
                        "GPU timing: pid {pid} has the CUPTI library already ({})",
                        if late {
                            "loaded by an earlier --gpu-timing: switched on again"
                        } else {
                            "CUDA_INJECTION64_PATH: it times the GPU whenever observed"
                        }
                    ));
                    self.note(pid, pid, GpuTimingEvent::AlreadyLoaded { late });
                    if late {
                        rescan |= self.switch_on(&mut g, pid);
                    }
                }
                Err(r) => self.refused(pid, r.reason, r.message),
            }
        }
        if rescan {
            self.at.rescan();
        }
        // CUPTI held by another tool: said once, and switched off (nothing to collect).
        let snap = self.snapshots.load();
        let busy: Vec<u32> =
            g.on.iter()
                .copied()
                .filter(|pid| {
                    !g.busy.contains(pid)
                        && snap
                            .process(*pid)
                            .and_then(|p| p.gpu.as_ref())
                            .is_some_and(|v| v.status.state == Some(CuptiState::Busy))
                })
                .collect();
        for pid in busy {
            g.busy.insert(pid);
            g.on.remove(&pid);
            let _ = inject::set_control(pid, control::OFF);
            self.refused(
                pid,
                Reason::CuptiBusy,
                format!("CUPTI in pid {pid} is held by another profiler (CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED): stop it (nsys, ncu, an in-process profiler) to get GPU times"),
            );
        }
        if !g.withdrawn && g.until.is_some_and(|t| Instant::now() >= t) {
            self.gpu_timing = Some(g);
            self.withdraw_gpu_timing().await;
            return;
        }
        self.gpu_timing = Some(g);
    }

    fn switch_on(&self, g: &mut GpuTiming, pid: u32) -> bool {
        if g.withdrawn {
            // The window ended while this injection ran: the library stays loaded, off.
            say(format_args!(
                "GPU timing: the --gpu-timing-for window has ended; pid {pid} is left switched off"
            ));
            return false;
        }
        match inject::set_control(pid, control::ON) {
            Ok(()) => {
                g.on.insert(pid);
                if g.until.is_none() {
                    g.until = g.window.map(|w| Instant::now() + w);
                }
                true
            }
            Err(e) => {
                self.refused(pid, Reason::Failed, format!("cannot switch GPU timing on: {e}"));
                false
            }
        }
    }

    fn refused(&self, pid: u32, reason: Reason, message: String) {
        say(format_args!(
            "GPU timing refused for pid {pid}: {message}; observing it with uprobes only"
        ));
        self.note(
            pid,
            pid,
            GpuTimingEvent::Refused {
                reason: reason.as_str(),
                message,
            },
        );
    }

    /// Switches every process off, and waits (bounded) until each has flushed: its last
    /// records reach the outputs before the observer lets go of it.
    pub(super) async fn withdraw_gpu_timing(&mut self) {
        let Some(mut g) = self.gpu_timing.take() else {
            return;
        };
        g.withdrawn = true;
        let on: Vec<u32> = std::mem::take(&mut g.on).into_iter().collect();
        let mut waiting = Vec::new();
        for &pid in &on {
            match inject::set_control(pid, control::OFF) {
                Ok(()) => waiting.push(pid),
                Err(e) => say(format_args!("warning: GPU timing: {e}")),
            }
        }
        let deadline = Instant::now() + WITHDRAW_TIMEOUT;
        let state = |run: &Run, pid: u32| {
            let snap = run.snapshots.load();
            snap.process(pid)
                .and_then(|p| p.gpu.as_ref())
                .map(|v| (v.status.state, v.status.forwarded))
        };
        while Instant::now() < deadline
            && waiting.iter().any(|&pid| {
                crate::procinfo::ProcInfo::host().exists(pid)
                    && state(self, pid).is_some_and(|(s, _)| s == Some(CuptiState::Active))
            })
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for pid in waiting {
            let (s, records) = state(self, pid).unwrap_or((None, 0));
            if s == Some(CuptiState::Active) {
                say(format_args!(
                    "warning: GPU timing: pid {pid} did not confirm the withdraw within {WITHDRAW_TIMEOUT:?} (its last records may be missing)"
                ));
            }
            say(format_args!(
                "GPU timing withdrawn from pid {pid}: {records} records; its library stays loaded, idle"
            ));
            self.note(pid, pid, GpuTimingEvent::Withdrawn { records });
        }
        self.gpu_timing = Some(g);
    }
}
