//! Fleet mode's estimates: what the capture windows saw, scaled to the whole time.
//!
//! With `--capture-window`, the probes of launches, copies, memsets and syncs are attached
//! only in windows (observe/capture.rs), and record only between the window's gate edges. A
//! counter that only those probes feed grew only in the windows, so over a stretch of time it
//! is an estimate: what the windows saw divided by the share of the stretch they covered.
//! [`CaptureLog`] knows the windows and, per process, what each cost its launching thread
//! and saw; [`CaptureLog::captured`] and [`error_bound`] are the one rule for every estimate
//! (the verdict's evidence, its rates). CPU times, NVML samples and allocations are measured
//! all the time and never scaled.
//!
//! **The probes slow what they watch.** While a window is open every launch pays its trap; a
//! thread that paces the work (the GPU waits for it) then runs slower than between windows,
//! and a rate seen in the window is low by the probes' share of its time. That share is
//! measured per window (the thread's system time above its rate between windows: the trap
//! and program run in the kernel, charged to the thread), and for a host-paced process the
//! captured time is shortened by it (docs/DESIGN.md "Fleet mode").

use std::collections::{HashMap, VecDeque};

/// Windows remembered (at one per 10 s, 11 hours; older stretches count as if captured at
/// the oldest remembered window's share).
const MAX_WINDOWS: usize = 4096;
/// Per process, its last windows' measurements (their spread bounds the estimate's error).
const MAX_PROC_WINDOWS: usize = 32;
/// Processes measured at once (the snapshot's are bounded too).
const MAX_PROCS: usize = 4096;
/// Windows with a count a spread needs (three successive differences).
const MIN_SPREAD_WINDOWS: usize = 4;

/// One process in one window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProcWindow {
    pub open_ns: u64,
    pub close_ns: u64,
    /// The probes' time on the process's busiest launching thread in the window.
    pub probe_ns: u64,
    /// Launches the window saw: known once the next window opens (none are recorded between).
    pub launches: Option<u64>,
    /// The process's launch counter when the window opened.
    launches_at_open: u64,
}

impl ProcWindow {
    /// The launch rate of the window, the probes' time taken out.
    fn rate(&self) -> Option<f64> {
        let free = self.close_ns.saturating_sub(self.open_ns).saturating_sub(self.probe_ns);
        Some(self.launches? as f64 / free.max(1) as f64)
    }

    fn probe_share(&self) -> f64 {
        self.probe_ns as f64 / self.close_ns.saturating_sub(self.open_ns).max(1) as f64
    }
}

/// What the windows captured of one process in a stretch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Captured {
    /// Captured time in the stretch.
    pub ns: u64,
    /// The probes' time on its busiest launching thread in that captured time; `None` when a
    /// window of the stretch did not measure it (its first, or /proc unreadable).
    pub probe_ns: Option<u64>,
    /// Windows overlapping the stretch.
    pub windows: usize,
    /// The relative standard deviation of its launch rate between its recent windows.
    pub spread: Option<f64>,
}

/// The capture windows so far, on the monotonic clock of the snapshots.
#[derive(Clone, Debug)]
pub struct CaptureLog {
    /// When the windows began (the agent's start in fleet mode).
    since_ns: u64,
    /// (open, close or None while open, captured time before open).
    windows: VecDeque<(u64, Option<u64>, u64)>,
    /// Per process, its launch counter at the open window's open.
    at_open: HashMap<u32, u64>,
    /// Per process, its last windows, oldest first.
    procs: HashMap<u32, VecDeque<ProcWindow>>,
}

impl CaptureLog {
    pub fn new(since_ns: u64) -> Self {
        Self {
            since_ns,
            windows: VecDeque::new(),
            at_open: HashMap::new(),
            procs: HashMap::new(),
        }
    }

    /// The share of the time since the windows began that they covered, up to `now_ns`.
    pub fn fraction(&self, now_ns: u64) -> f64 {
        let total = now_ns.saturating_sub(self.since_ns).max(1);
        (self.captured_until(now_ns) as f64 / total as f64).min(1.0)
    }

    /// A window opened at `at_ns`; `launches`: each live process's launch counter now, which
    /// completes the count of its last window.
    pub fn open(&mut self, at_ns: u64, launches: &[(u32, u64)]) {
        if self.windows.back().is_some_and(|w| w.1.is_none()) {
            return;
        }
        self.procs.retain(|pid, _| launches.iter().any(|(p, _)| p == pid));
        for (pid, now) in launches {
            if let Some(w) = self.procs.get_mut(pid).and_then(|v| v.back_mut())
                && w.launches.is_none()
            {
                w.launches = Some(now.saturating_sub(w.launches_at_open));
            }
        }
        self.at_open = launches.iter().copied().take(MAX_PROCS).collect();
        let before = self.captured_until(at_ns);
        if self.windows.len() >= MAX_WINDOWS {
            self.windows.pop_front();
        }
        self.windows.push_back((at_ns, None, before));
    }

    /// The open window closed at `at_ns`; `probes`: per process, the probes' time on its
    /// busiest launching thread in it (the processes it could be measured for).
    pub fn close(&mut self, at_ns: u64, probes: &[(u32, u64)]) {
        let Some(w) = self.windows.back_mut().filter(|w| w.1.is_none()) else {
            return;
        };
        let open_ns = w.0;
        let close_ns = at_ns.max(open_ns);
        w.1 = Some(close_ns);
        for (pid, probe_ns) in probes {
            let Some(&launches_at_open) = self.at_open.get(pid) else {
                continue;
            };
            if !self.procs.contains_key(pid) && self.procs.len() >= MAX_PROCS {
                continue;
            }
            let v = self.procs.entry(*pid).or_default();
            if v.len() >= MAX_PROC_WINDOWS {
                v.pop_front();
            }
            v.push_back(ProcWindow {
                open_ns,
                close_ns,
                probe_ns: (*probe_ns).min(close_ns - open_ns),
                launches: None,
                launches_at_open,
            });
        }
    }

    /// Windows opened so far (those remembered).
    pub fn windows(&self) -> usize {
        self.windows.len()
    }

    /// A process's last windows, oldest first.
    pub fn of_process(&self, pid: u32) -> impl Iterator<Item = &ProcWindow> {
        self.procs.get(&pid).into_iter().flatten()
    }

    /// Captured time from the start until `t`.
    fn captured_until(&self, t: u64) -> u64 {
        // The last window opened at or before t.
        let i = self.windows.partition_point(|w| w.0 <= t);
        if i == 0 {
            return self.windows.front().map_or(0, |w| w.2);
        }
        let (open, close, before) = self.windows[i - 1];
        before + close.unwrap_or(t).min(t).saturating_sub(open)
    }

    /// Captured time in `[a, b]`.
    pub fn captured_ns(&self, a: u64, b: u64) -> u64 {
        self.captured_until(b).saturating_sub(self.captured_until(a))
    }

    /// What the windows captured of process `pid` in `[a, b]`. The probes' time of a window
    /// still open is its last closed window's share of the open window's captured part.
    pub fn captured(&self, pid: u32, a: u64, b: u64) -> Captured {
        let mine = self.procs.get(&pid);
        let mut probe_ns = Some(0f64);
        let mut windows = 0;
        let first = self.windows.partition_point(|w| w.1.is_some_and(|c| c <= a));
        for &(open, close, _) in self.windows.iter().skip(first).take_while(|w| w.0 < b) {
            let overlap = close.unwrap_or(b).min(b).saturating_sub(open.max(a));
            if overlap == 0 {
                continue;
            }
            windows += 1;
            let share = match close {
                Some(_) => mine.and_then(|v| v.iter().rev().find(|w| w.open_ns == open)),
                None => mine.and_then(|v| v.back()),
            }
            .map(ProcWindow::probe_share);
            probe_ns = probe_ns.zip(share).map(|(sum, s)| sum + s * overlap as f64);
        }
        Captured {
            ns: self.captured_ns(a, b),
            probe_ns: probe_ns.map(|n| n.round() as u64),
            windows,
            spread: mine.and_then(|v| spread(v.iter().filter_map(ProcWindow::rate))),
        }
    }
}

/// How much a process's launch rate varies from one window to the next, relative to its
/// typical rate: the median of the successive differences over √2 × 0.6745 (a standard
/// deviation for steady noise), over the median rate. Successive differences and medians, so
/// one change of pace (a job that goes idle) does not read as noise for ever after.
fn spread(rates: impl Iterator<Item = f64>) -> Option<f64> {
    let v: Vec<f64> = rates.collect();
    if v.len() < MIN_SPREAD_WINDOWS {
        return None;
    }
    let mut diffs: Vec<f64> = v.windows(2).map(|w| (w[1] - w[0]).abs()).collect();
    let mut sorted = v.clone();
    let (d, m) = (median(&mut diffs), median(&mut sorted));
    (m > 0.0).then(|| d / (std::f64::consts::SQRT_2 * 0.6745) / m)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A count seen in `captured_ns` of a stretch `total_ns` long, scaled to the whole stretch.
pub fn scale(seen: u64, captured_ns: u64, total_ns: u64) -> u64 {
    if captured_ns == 0 || captured_ns >= total_ns {
        return seen;
    }
    (seen as f64 * total_ns as f64 / captured_ns as f64).round() as u64
}

/// The relative error at 95 % of a rate estimated from `seen` events in `c`'s windows: the
/// larger of the Poisson bound 1.96/√n (at least one event assumed) and, once the process's
/// rate has been seen in four windows, their spread over √(windows in the stretch). The
/// windows start at random points of their periods so a periodic job is not aliased, but a
/// burst that falls between windows is missed (docs/DESIGN.md "Fleet mode").
pub fn error_bound(seen: u64, c: &Captured) -> f64 {
    let poisson = 1.96 / (seen.max(1) as f64).sqrt();
    let between = c.spread.map_or(0.0, |s| 1.96 * s / (c.windows.max(1) as f64).sqrt());
    poisson.max(between)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captured_time_is_the_overlap_with_the_windows() {
        let mut log = CaptureLog::new(0);
        log.open(100, &[]);
        log.close(200, &[]);
        log.open(1000, &[]);
        log.close(1100, &[]);
        assert_eq!(log.captured_ns(0, 2000), 200);
        assert_eq!(log.captured_ns(150, 1050), 50 + 50);
        assert_eq!(log.captured_ns(300, 900), 0);
        assert_eq!(log.captured_ns(0, 100), 0);
        assert!((log.fraction(2000) - 0.1).abs() < 1e-9);
        // An open window counts up to the end of the stretch.
        log.open(3000, &[]);
        assert_eq!(log.captured_ns(2000, 3500), 500);
        assert_eq!(log.windows(), 3);
    }

    #[test]
    fn a_window_counts_its_launches_at_the_next_open_and_its_probe_time_by_overlap() {
        let mut log = CaptureLog::new(0);
        // Process 7: 1 000 launches before; the window sees 400 of them with 200 ns of probes.
        log.open(1_000, &[(7, 1_000), (8, 5)]);
        log.close(2_000, &[(7, 200)]);
        log.open(11_000, &[(7, 1_400), (8, 5)]);
        let w: Vec<_> = log.of_process(7).copied().collect();
        assert_eq!(w.len(), 1);
        assert_eq!(
            (w[0].open_ns, w[0].close_ns, w[0].probe_ns, w[0].launches),
            (1_000, 2_000, 200, Some(400))
        );
        // Process 8 was not measured: its probe time is unknown, not zero.
        let c8 = log.captured(8, 0, 10_000);
        assert_eq!((c8.ns, c8.probe_ns, c8.windows), (1_000, None, 1));
        // Half of the window: half its probe time.
        let c = log.captured(7, 1_500, 10_000);
        assert_eq!((c.ns, c.probe_ns, c.windows), (500, Some(100), 1));
        // The open window borrows the last share (20 %).
        let c = log.captured(7, 10_000, 11_500);
        assert_eq!((c.ns, c.probe_ns, c.windows), (500, Some(100), 1));
        // A process gone at an open is forgotten.
        log.close(12_000, &[(7, 0)]);
        log.open(21_000, &[(8, 5)]);
        assert_eq!(log.of_process(7).count(), 0);
    }

    #[test]
    fn the_spread_of_the_window_rates_widens_the_bound_and_a_change_of_pace_does_not_dominate_it() {
        let log_of = |counts: &[u64]| {
            let mut log = CaptureLog::new(0);
            let mut total = 0;
            // Each window: 1 100 ns, 100 of them the probes': rates per 1 000 ns free.
            for (k, n) in counts.iter().enumerate() {
                let open = k as u64 * 10_000;
                log.open(open, &[(7, total)]);
                log.close(open + 1_100, &[(7, 100)]);
                total += n;
            }
            let end = counts.len() as u64 * 10_000;
            log.open(end, &[(7, total)]);
            log.captured(7, end - 10_000, end)
        };
        // Too few windows: no spread yet.
        assert_eq!(log_of(&[100, 110, 100]).spread, None);
        // 100, 110, 100, 110: steps of 10 around a median of 105.
        let c = log_of(&[100, 110, 100, 110]);
        let s = c.spread.unwrap();
        let want = 10.0 / (std::f64::consts::SQRT_2 * 0.6745) / 105.0;
        assert!((s - want).abs() < 1e-9, "{s} {want}");
        assert_eq!(c.windows, 1);
        // 110 launches alone would claim ±19 %; the windows' spread says ±20 %.
        let e = error_bound(110, &c);
        assert!((e - 1.96 * s).abs() < 1e-9, "{e}");
        assert!((error_bound(110, &Captured::default()) - 1.96 / 110f64.sqrt()).abs() < 1e-9);
        // A job that went idle after six steady windows: one large step, the median ignores it.
        let c = log_of(&[100, 101, 100, 101, 100, 101, 0]);
        assert!(c.spread.unwrap() < 0.02, "{c:?}");
    }

    #[test]
    fn counts_scale_by_the_captured_share_and_the_bound_shrinks_with_the_count() {
        assert_eq!(scale(100, 1_000, 10_000), 1000);
        assert_eq!(scale(100, 0, 10_000), 100, "nothing captured: nothing to scale");
        assert_eq!(scale(100, 10_000, 10_000), 100);
        assert!((error_bound(10_000, &Captured::default()) - 0.0196).abs() < 1e-9);
        assert!((error_bound(0, &Captured::default()) - 1.96).abs() < 1e-9);
    }
}
