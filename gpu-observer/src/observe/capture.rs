//! Fleet mode's capture windows (`--capture-window`, `--capture-period`, `--overhead-budget`;
//! docs/DESIGN.md "Fleet mode"): the probes of launches, copies, memsets and syncs
//! ([`crate::rules::follows_capture_windows`]) are attached for one window per period and
//! closed between, so a launch outside the windows pays no uprobe trap at all. Each window
//! starts at a random point of its period (a periodic job is not aliased). Under a budget the
//! next window's length follows the call rates measured in the last one.
//!
//! Every edge is written to the capture log the verdicts scale their counts by
//! (analyze/estimate.rs) and as a `capture` line.

use std::time::Duration;

use crate::{analyze::estimate::CaptureLog, clock::monotonic_ns, snapshot::Snapshot};

/// The shortest window: shorter ones cost more in attaching than they see.
const MIN_WINDOW: Duration = Duration::from_millis(50);
/// Most of a period a budget may give the windows.
const MAX_DUTY: f64 = 0.9;
/// What one probed call costs its thread, for the budget: the uprobe trap and the program, as
/// measured on the H100's driver (docs/DESIGN.md "Measured costs": entry 1.3–1.9 µs, entry
/// and return 3.2–3.9 µs; the upper ends).
const ENTRY_NS: f64 = 1_900.0;
const ENTRY_RETURN_NS: f64 = 3_900.0;

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
    /// Per process, the cost of its calls at the window's open (for the budget).
    cost_at_open: Costs,
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
            cost_at_open: Default::default(),
            rng: seed | 1,
        };
        c.schedule_open();
        c
    }

    /// When the next edge is due, on the monotonic clock.
    pub fn next_ns(&self) -> u64 {
        self.next_ns
    }

    /// How long from now until the next edge.
    pub fn until_next(&self) -> Duration {
        Duration::from_nanos(self.next_ns.saturating_sub(monotonic_ns()))
    }

    /// Whether the next edge opens a window.
    pub fn next_is_open(&self) -> bool {
        self.next_open
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

    /// The edge that was due has been made (the probes attached or closed at `now_ns`): writes
    /// it into `log` and schedules the next. `costs`: [`costs`] of the latest snapshot, for
    /// the budget.
    pub fn made(
        &mut self,
        now_ns: u64,
        costs: Costs,
        change: crate::attach::WindowChange,
        log: &mut CaptureLog,
    ) -> Edge {
        let open = self.next_open;
        let window_ns = self.window_ns;
        if open {
            log.open(now_ns);
            self.opened_ns = now_ns;
            self.cost_at_open = costs;
            self.next_ns = now_ns + self.window_ns;
            self.next_open = false;
        } else {
            log.close(now_ns);
            let seen = now_ns.saturating_sub(self.opened_ns);
            if let Some(pct) = self.cfg.budget_pct {
                self.window_ns = self.budgeted(pct, seen, &costs);
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
        }
    }

    /// The next window's length under a budget of `pct` percent: the busiest process's probe
    /// cost per second of window, measured over the window that closed (`seen_ns` long),
    /// gives the share of each period the windows may take.
    fn budgeted(&self, pct: f64, seen_ns: u64, now: &Costs) -> u64 {
        let worst = now
            .iter()
            .map(|(pid, c)| c - self.cost_at_open.get(pid).copied().unwrap_or(0.0))
            .fold(0.0f64, f64::max);
        let load = worst / seen_ns.max(1) as f64; // the share of a thread's time the probes took
        let duty = if load <= 0.0 {
            MAX_DUTY
        } else {
            (pct / 100.0 / load).min(MAX_DUTY)
        };
        ((duty * self.period_ns as f64) as u64).max(MIN_WINDOW.as_nanos() as u64)
    }
}

/// Per process, what its probed calls so far cost it (ns).
pub type Costs = std::collections::HashMap<u32, f64>;

/// Each live process's probed calls so far, weighed by what their probes cost.
pub fn costs(snap: &Snapshot) -> Costs {
    snap.procs
        .iter()
        .filter(|p| !p.exited)
        .map(|p| {
            let calls: u64 = p.stats.call_apis.values().sum();
            (
                p.pid,
                p.stats.launches as f64 * ENTRY_NS + calls as f64 * ENTRY_RETURN_NS,
            )
        })
        .collect()
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
        let mut starts = Vec::new();
        for k in 0..50u64 {
            assert!(c.next_is_open());
            let open = c.next_ns();
            assert!(open >= k * 10_000_000_000 && open + 1_000_000_000 <= (k + 1) * 10_000_000_000);
            starts.push(open - k * 10_000_000_000);
            let e = c.made(open, Costs::new(), Default::default(), &mut log);
            assert!(e.open);
            assert_eq!(c.next_ns(), open + 1_000_000_000);
            let e = c.made(c.next_ns(), Costs::new(), Default::default(), &mut log);
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
    fn a_budget_sizes_the_window_from_the_measured_call_rate() {
        // No calls: the most a budget gives.
        let c = Capture::new(cfg(1000, 10_000, Some(2.0)), 0);
        assert_eq!(c.budgeted(2.0, 1_000_000_000, &Costs::new()), 9_000_000_000);
        // 100 000 launches in a 1 s window: 19 % of a thread while captured; a 2 % budget
        // allows about a tenth of the period.
        let mut c = Capture::new(cfg(1000, 10_000, Some(2.0)), 0);
        c.cost_at_open = [(7u32, 0.0)].into();
        let now: Costs = [(7u32, 100_000.0 * ENTRY_NS)].into();
        let w = c.budgeted(2.0, 1_000_000_000, &now);
        assert!((w as f64 - 1_052_631_578.0).abs() < 1e3, "{w}");
    }
}
