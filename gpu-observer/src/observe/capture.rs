//! Fleet mode's capture windows (`--capture-window`, `--capture-period`, `--overhead-budget`;
//! docs/DESIGN.md "Fleet mode"): the probes of launches, copies, memsets and syncs
//! ([`crate::rules::follows_capture_windows`]) are attached for one window per period and
//! closed between, so a launch outside the windows pays no uprobe trap at all. Each window
//! starts at a random point of its period (a periodic job is not aliased). Under a budget the
//! next window's length follows the call rates measured in the last one.
//!
//! Every edge is written to the capture log the verdicts scale their counts by
//! (analyze/estimate.rs) and as a `capture` line. At each edge the launching threads' system
//! time is read ([`ProbeClock`]): what the probes cost them in the window, which sizes the
//! next window under a budget and corrects the estimates of a host-paced process.

use std::{collections::HashMap, time::Duration};

use gpu_observer_common::cupti::{CuptiState, control};

use crate::{analyze::estimate::CaptureLog, clock::monotonic_ns, procinfo::ProcInfo, snapshot::Snapshot};

/// The shortest window: shorter ones cost more in attaching than they see.
const MIN_WINDOW: Duration = Duration::from_millis(50);
/// Most of a period a budget may give the windows.
const MAX_DUTY: f64 = 0.9;
/// Launching threads whose system time is read per process at an edge (the most launching).
const THREADS_READ: usize = 4;
/// Processes whose threads are read at an edge (the snapshot's first).
const PROCS_READ: usize = 1024;
/// How long before a window closes CUPTI is paused in it: the library looks at its control
/// word every 100 ms and then flushes, so its last records are of launches the still-open
/// gate recorded (a record of a launch after the gate would join nothing).
const CUPTI_LEAD: Duration = Duration::from_millis(200);

/// Processes whose CUPTI is switched at an edge (each write reads the process's maps and the
/// library's symbols).
const CUPTI_PROCS: usize = 256;

/// What the next edge does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Attach the windowed probes, open the gate, switch CUPTI on.
    Open,
    /// Pause CUPTI in the processes with the injection library ([`CUPTI_LEAD`] before the close).
    PauseCupti,
    /// Close the gate and the windowed probes.
    Close,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    pub window: Duration,
    pub period: Duration,
    /// `--overhead-budget`, percent.
    pub budget_pct: Option<f64>,
}

/// An edge of a window, for the `capture` line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Edge {
    pub ts_ns: u64,
    pub open: bool,
    /// Links attached (open) or closed (close), refused, and how long that took.
    pub links: usize,
    pub failed: usize,
    pub took_us: u64,
    /// The window's length (the one opening, or the one that closed), and the period.
    pub window_ns: u64,
    pub period_ns: u64,
    /// Captured share of the time since the first window opened.
    pub fraction: f64,
    /// Processes whose CUPTI collection was switched on (open) or paused (close: by the pause
    /// step before it).
    pub cupti: usize,
}

/// The schedule.
pub struct Capture {
    cfg: Config,
    window_ns: u64,
    period_ns: u64,
    /// Start of the current period.
    period_start: u64,
    /// The next edge, and whether it opens.
    next_ns: u64,
    next_open: bool,
    /// When the open window opened.
    opened_ns: u64,
    /// CUPTI follows the windows (the injection library is in use): when the open window
    /// pauses it.
    cupti: bool,
    cupti_pause_ns: Option<u64>,
    /// Processes the last pause step paused.
    cupti_paused: usize,
    probes: ProbeClock,
    rng: u64,
}

impl Capture {
    pub fn new(cfg: Config, now_ns: u64) -> Self {
        let seed = now_ns ^ (u64::from(std::process::id()) << 32) ^ 0x9E37_79B9_7F4A_7C15;
        let mut c = Self {
            cfg,
            window_ns: cfg.window.as_nanos() as u64,
            period_ns: cfg.period.as_nanos() as u64,
            period_start: now_ns,
            next_ns: now_ns,
            next_open: true,
            opened_ns: 0,
            cupti: false,
            cupti_pause_ns: None,
            cupti_paused: 0,
            probes: ProbeClock::default(),
            rng: seed | 1,
        };
        c.schedule_open();
        c
    }

    /// CUPTI collection follows the windows: each window pauses it [`CUPTI_LEAD`] before
    /// it closes (at half the window if that is shorter).
    pub fn with_cupti(mut self, on: bool) -> Self {
        self.cupti = on;
        self
    }

    /// When the next edge is due, on the monotonic clock.
    pub fn next_ns(&self) -> u64 {
        self.cupti_pause_ns.unwrap_or(self.next_ns)
    }

    /// How long from now until the next edge.
    pub fn until_next(&self) -> Duration {
        Duration::from_nanos(self.next_ns().saturating_sub(monotonic_ns()))
    }

    /// What the next edge does.
    pub fn next_step(&self) -> Step {
        match (self.next_open, self.cupti_pause_ns) {
            (true, _) => Step::Open,
            (false, Some(_)) => Step::PauseCupti,
            (false, None) => Step::Close,
        }
    }

    /// Whether a window is open (its gate, not CUPTI).
    pub fn is_open(&self) -> bool {
        !self.next_open
    }

    /// Whether CUPTI collection follows the windows.
    pub fn cupti(&self) -> bool {
        self.cupti
    }

    /// The CUPTI pause that was due has been made, in `n` processes.
    pub fn cupti_paused(&mut self, n: usize) {
        self.cupti_pause_ns = None;
        self.cupti_paused = n;
    }

    fn random(&mut self) -> f64 {
        // xorshift64*: the jitter needs no more than this.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The window of the current period opens at a random point that leaves it room.
    fn schedule_open(&mut self) {
        let slack = self.period_ns.saturating_sub(self.window_ns);
        self.next_ns = self.period_start + (self.random() * slack as f64) as u64;
        self.next_open = true;
    }

    /// The edge that was due has been made (the probes attached or closed, the gate switched
    /// at `now_ns`): reads the launching threads' system time, writes the edge into `log` and
    /// schedules the next. `snap`: the latest snapshot (its processes and launch counters).
    pub fn made(
        &mut self,
        now_ns: u64,
        snap: &Snapshot,
        procinfo: &ProcInfo,
        change: crate::attach::WindowChange,
        log: &mut CaptureLog,
    ) -> Edge {
        let open = self.next_open;
        let window_ns = self.window_ns;
        if open {
            // A gate that could not be opened recorded nothing: not a captured window.
            if change.gated {
                let launches: Vec<(u32, u64)> = live(snap).map(|p| (p.pid, p.stats.launches)).collect();
                log.open(now_ns, &launches);
                self.probes.open(now_ns, snap, procinfo);
            }
            self.opened_ns = now_ns;
            self.next_ns = now_ns + self.window_ns;
            self.next_open = false;
            let lead = CUPTI_LEAD.as_nanos() as u64;
            self.cupti_pause_ns = self
                .cupti
                .then(|| now_ns + self.window_ns.saturating_sub(lead).max(self.window_ns / 2));
        } else {
            self.cupti_pause_ns = None;
            let probes = self.probes.close(now_ns, snap, procinfo);
            log.close(now_ns, &probes);
            let seen = now_ns.saturating_sub(self.opened_ns);
            if let Some(pct) = self.cfg.budget_pct
                && !probes.is_empty()
            {
                let worst = probes.iter().map(|p| p.1).max().unwrap_or(0);
                self.window_ns = self.budgeted(pct, worst as f64 / seen.max(1) as f64);
            }
            self.period_start += self.period_ns;
            // A late edge (a stalled agent) skips the periods it missed.
            while self.period_start + self.period_ns <= now_ns {
                self.period_start += self.period_ns;
            }
            self.schedule_open();
            self.next_ns = self.next_ns.max(now_ns);
        }
        Edge {
            ts_ns: now_ns,
            open,
            links: change.links,
            failed: change.failed,
            took_us: change.took_us,
            window_ns,
            period_ns: self.period_ns,
            fraction: log.fraction(now_ns),
            cupti: if open {
                0
            } else {
                std::mem::take(&mut self.cupti_paused)
            },
        }
    }

    /// The next window's length under a budget of `pct` percent: `load`, the largest share
    /// of a launching thread's time the probes took in the window that closed (measured),
    /// gives the share of each period the windows may take. Until a window is measured (a
    /// process's first) the length stays.
    fn budgeted(&self, pct: f64, load: f64) -> u64 {
        let duty = if load <= 0.0 {
            MAX_DUTY
        } else {
            (pct / 100.0 / load).min(MAX_DUTY)
        };
        ((duty * self.period_ns as f64) as u64).max(MIN_WINDOW.as_nanos() as u64)
    }
}

/// Fleet mode's switch of CUPTI collection (docs/DESIGN.md "Fleet mode"): the injection
/// library's control word ([`control`]) written into each process that has it — `ON` when a
/// window opens, `PAUSE` before it closes and, between windows, into a process whose library
/// started collecting (a new one) — so CUPTI's own cost is paid only in the windows, not just
/// its forwarding. A library injected late (`--gpu-timing`) is switched on only where that
/// switched it on.
#[derive(Default)]
pub struct CuptiSwitch {
    /// The word last written (or, when the write failed, tried) into each process.
    written: HashMap<u32, u32>,
    /// Writes that failed (the process gone, its memory not writable): counted (the run's
    /// summary), not retried between windows — only at the next edge.
    pub failed: u64,
}

impl CuptiSwitch {
    /// At an edge: `on` writes `ON` into every live process with a working library, else
    /// `PAUSE`. `late_on(pid)`: whether `--gpu-timing` switched a late library on. Returns
    /// how many were written.
    pub fn edge(&mut self, snap: &Snapshot, on: bool, late_on: impl Fn(u32) -> bool) -> usize {
        let word = if on { control::ON } else { control::PAUSE };
        if on {
            self.written
                .retain(|pid, _| snap.process(*pid).is_some_and(|p| !p.exited));
        }
        let targets: Vec<u32> = with_library(snap)
            .filter(|(pid, injected, _)| !injected || late_on(*pid))
            .map(|(pid, ..)| pid)
            .collect();
        targets.into_iter().filter(|&pid| self.write(pid, word)).count()
    }

    /// Between windows: pauses a library that reports collecting and was not paused since the
    /// last window (a process that came in between).
    pub fn between(&mut self, snap: &Snapshot) -> usize {
        let targets: Vec<u32> = with_library(snap)
            .filter(|(pid, _, active)| *active && self.written.get(pid) != Some(&control::PAUSE))
            .map(|(pid, ..)| pid)
            .collect();
        targets
            .into_iter()
            .filter(|&pid| self.write(pid, control::PAUSE))
            .count()
    }

    /// Writes `word` into `pid`, remembered either way: a process whose write fails (its
    /// memory, its library are its own) is not read again at every tick between windows.
    fn write(&mut self, pid: u32, word: u32) -> bool {
        self.written.insert(pid, word);
        let ok = crate::attach::inject::set_control(pid, word).is_ok();
        if !ok {
            self.failed += 1;
        }
        ok
    }
}

/// Live processes whose injection library reported a working CUPTI (at most
/// [`CUPTI_PROCS`]): (pid, injected late, collecting now).
fn with_library(snap: &Snapshot) -> impl Iterator<Item = (u32, bool, bool)> + '_ {
    live(snap)
        .filter_map(|p| {
            let s = &p.gpu.as_ref()?.status;
            matches!(s.state, Some(CuptiState::Active | CuptiState::Idle)).then_some((
                p.pid,
                s.injected,
                s.state == Some(CuptiState::Active),
            ))
        })
        .take(CUPTI_PROCS)
}

fn live(snap: &Snapshot) -> impl Iterator<Item = &crate::snapshot::ProcessView> {
    snap.procs.iter().map(|p| &**p).filter(|p| !p.exited).take(PROCS_READ)
}

/// The probes' time on the launching threads, from their system time: a uprobe's trap and
/// program run in the kernel and are charged to the thread as system time (measured: a
/// launch loop under the probes ran 87 % system, without them 0 %; docs/DESIGN.md "Fleet
/// mode"). What a thread's system time grows in a window beyond its rate between windows
/// (its own system calls) is the probes'. A thread is measured from its second window on:
/// its first gives the baseline's start.
#[derive(Default)]
struct ProbeClock {
    /// (pid, tid) → (when, system ns) at the last close, and at the open window's open.
    closed: HashMap<(u32, u32), (u64, u64)>,
    opened: HashMap<(u32, u32), (u64, u64)>,
}

impl ProbeClock {
    /// Each live process's most launching threads.
    fn threads(snap: &Snapshot) -> impl Iterator<Item = (u32, u32)> + '_ {
        live(snap).flat_map(|p| {
            let mut tids: Vec<(u32, u64)> = p.stats.launch_tids.iter().map(|(t, n)| (*t, *n)).collect();
            tids.sort_by_key(|t| std::cmp::Reverse(t.1));
            tids.into_iter().take(THREADS_READ).map(move |(t, _)| (p.pid, t))
        })
    }

    fn open(&mut self, now_ns: u64, snap: &Snapshot, procinfo: &ProcInfo) {
        self.opened = Self::threads(snap)
            .filter(|k| self.closed.contains_key(k))
            .filter_map(|(pid, tid)| Some(((pid, tid), (now_ns, procinfo.thread_sys_ns(pid, tid)?))))
            .collect();
    }

    /// Per process measured, the probes' time on its busiest launching thread in the window
    /// that closes at `now_ns`.
    fn close(&mut self, now_ns: u64, snap: &Snapshot, procinfo: &ProcInfo) -> Vec<(u32, u64)> {
        let mut probes: HashMap<u32, u64> = HashMap::new();
        let mut closed = HashMap::new();
        for ((pid, tid), (t_open, s_open)) in self.opened.drain() {
            let Some(s_close) = procinfo.thread_sys_ns(pid, tid) else {
                continue;
            };
            closed.insert((pid, tid), (now_ns, s_close));
            let Some(&(t_prev, s_prev)) = self.closed.get(&(pid, tid)) else {
                continue;
            };
            let base = s_open.saturating_sub(s_prev) as f64 / t_open.saturating_sub(t_prev).max(1) as f64;
            let own = base * now_ns.saturating_sub(t_open) as f64;
            let probe = (s_close.saturating_sub(s_open) as f64 - own).max(0.0) as u64;
            let e = probes.entry(pid).or_default();
            *e = (*e).max(probe);
        }
        // Threads first seen launching in this window start their baseline now.
        for k in Self::threads(snap) {
            if let std::collections::hash_map::Entry::Vacant(v) = closed.entry(k)
                && let Some(s) = procinfo.thread_sys_ns(k.0, k.1)
            {
                v.insert((now_ns, s));
            }
        }
        self.closed = closed;
        let mut v: Vec<(u32, u64)> = probes.into_iter().collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(window_ms: u64, period_ms: u64, budget: Option<f64>) -> Config {
        Config {
            window: Duration::from_millis(window_ms),
            period: Duration::from_millis(period_ms),
            budget_pct: budget,
        }
    }

    #[test]
    fn one_window_per_period_at_a_random_point_that_leaves_it_room() {
        let mut c = Capture::new(cfg(1000, 10_000, None), 0);
        let mut log = CaptureLog::new(0);
        use crate::export::dashboard::testing::{nvml_view, snapshot};
        let (snap, procinfo) = (snapshot(1, 0, Vec::new(), nvml_view(Vec::new())), ProcInfo::host());
        let mut starts = Vec::new();
        for k in 0..50u64 {
            assert_eq!(c.next_step(), Step::Open);
            let open = c.next_ns();
            assert!(open >= k * 10_000_000_000 && open + 1_000_000_000 <= (k + 1) * 10_000_000_000);
            starts.push(open - k * 10_000_000_000);
            let e = c.made(open, &snap, &procinfo, gated(), &mut log);
            assert!(e.open);
            assert_eq!(c.next_ns(), open + 1_000_000_000);
            let e = c.made(c.next_ns(), &snap, &procinfo, gated(), &mut log);
            assert!(!e.open);
        }
        // Jittered: the starts spread over the period's room.
        let (lo, hi) = (starts.iter().min().unwrap(), starts.iter().max().unwrap());
        assert!(hi - lo > 5_000_000_000, "{starts:?}");
        assert_eq!(log.windows(), 50);
        let f = log.fraction(50 * 10_000_000_000);
        assert!((f - 0.1).abs() < 0.01, "{f}");
    }

    #[test]
    fn cupti_is_paused_before_each_window_closes() {
        use crate::export::dashboard::testing::{nvml_view, snapshot};
        let (snap, procinfo) = (snapshot(1, 0, Vec::new(), nvml_view(Vec::new())), ProcInfo::host());
        let mut log = CaptureLog::new(0);
        for (window_ms, pause_after_ms) in [(1000, 800), (300, 150), (100, 50)] {
            let mut c = Capture::new(cfg(window_ms, 10_000, None), 0).with_cupti(true);
            let open = c.next_ns();
            c.made(open, &snap, &procinfo, gated(), &mut log);
            assert_eq!(c.next_step(), Step::PauseCupti);
            assert_eq!(c.next_ns(), open + pause_after_ms * 1_000_000, "{window_ms} ms window");
            c.cupti_paused(1);
            assert_eq!(
                (c.next_step(), c.next_ns()),
                (Step::Close, open + window_ms * 1_000_000)
            );
            c.made(c.next_ns(), &snap, &procinfo, gated(), &mut log);
            assert_eq!(c.next_step(), Step::Open);
        }
        // Without the injection library in use there is no pause step.
        let mut c = Capture::new(cfg(1000, 10_000, None), 0);
        c.made(c.next_ns(), &snap, &procinfo, gated(), &mut log);
        assert_eq!(c.next_step(), Step::Close);
    }

    #[test]
    fn a_budget_sizes_the_window_from_the_measured_probe_share() {
        let c = Capture::new(cfg(1000, 10_000, Some(2.0)), 0);
        // Nothing measured: the most a budget gives.
        assert_eq!(c.budgeted(2.0, 0.0), 9_000_000_000);
        // The probes took 19 % of a thread while captured: a 2 % budget allows about a
        // tenth of the period.
        let w = c.budgeted(2.0, 0.19);
        assert!((w as f64 - 1_052_631_578.0).abs() < 1e3, "{w}");
        // Never below the shortest window.
        assert_eq!(c.budgeted(2.0, 100.0), MIN_WINDOW.as_nanos() as u64);
    }

    fn gated() -> crate::attach::WindowChange {
        crate::attach::WindowChange {
            gated: true,
            ..Default::default()
        }
    }
}
