//! Fleet mode's estimates: what the capture windows saw, scaled to the whole time.
//!
//! With `--capture-window`, the probes of launches, copies, memsets and syncs are attached
//! only in windows (observe/capture.rs). A counter that only those probes feed grew only in
//! the windows, so over a stretch of time it is an estimate: what the windows saw divided by
//! the fraction of the stretch they covered. [`CaptureLog`] knows the windows; [`scale`] and
//! [`error_bound`] are the one rule for every estimate (the verdict's evidence, its rates).
//! CPU times, NVML samples and allocations are measured all the time and never scaled.

use std::collections::VecDeque;

/// Windows remembered (at one per 10 s, 11 hours; older stretches count as if captured at
/// the oldest remembered window's share).
const MAX_WINDOWS: usize = 4096;

/// The capture windows so far, on the monotonic clock of the snapshots.
#[derive(Clone, Debug)]
pub struct CaptureLog {
    /// When the windows began (the agent's start in fleet mode).
    since_ns: u64,
    /// (open, close or None while open, captured time before open).
    windows: VecDeque<(u64, Option<u64>, u64)>,
}

impl CaptureLog {
    pub fn new(since_ns: u64) -> Self {
        Self {
            since_ns,
            windows: VecDeque::new(),
        }
    }

    /// The share of the time since the windows began that they covered, up to `now_ns`.
    pub fn fraction(&self, now_ns: u64) -> f64 {
        let total = now_ns.saturating_sub(self.since_ns).max(1);
        (self.captured_until(now_ns) as f64 / total as f64).min(1.0)
    }

    pub fn open(&mut self, at_ns: u64) {
        if self.windows.back().is_some_and(|w| w.1.is_none()) {
            return;
        }
        let before = self.captured_until(at_ns);
        if self.windows.len() >= MAX_WINDOWS {
            self.windows.pop_front();
        }
        self.windows.push_back((at_ns, None, before));
    }

    pub fn close(&mut self, at_ns: u64) {
        if let Some(w) = self.windows.back_mut()
            && w.1.is_none()
        {
            w.1 = Some(at_ns.max(w.0));
        }
    }

    /// Windows opened so far (those remembered).
    pub fn windows(&self) -> usize {
        self.windows.len()
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
    pub fn captured(&self, a: u64, b: u64) -> u64 {
        self.captured_until(b).saturating_sub(self.captured_until(a))
    }
}

/// A count seen in `captured_ns` of a stretch `total_ns` long, scaled to the whole stretch.
pub fn scale(seen: u64, captured_ns: u64, total_ns: u64) -> u64 {
    if captured_ns == 0 || captured_ns >= total_ns {
        return seen;
    }
    (seen as f64 * total_ns as f64 / captured_ns as f64).round() as u64
}

/// The relative error of a rate estimated from `seen` events in the windows, at 95 %: the
/// Poisson bound 1.96/√n (at least one event assumed). It holds for work at a steady rate
/// across the stretch; the windows start at random points of their periods so a periodic job
/// is not aliased, but a burst that falls between windows is missed (docs/DESIGN.md
/// "Fleet mode").
pub fn error_bound(seen: u64) -> f64 {
    1.96 / (seen.max(1) as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captured_time_is_the_overlap_with_the_windows() {
        let mut log = CaptureLog::new(0);
        log.open(100);
        log.close(200);
        log.open(1000);
        log.close(1100);
        assert_eq!(log.captured(0, 2000), 200);
        assert_eq!(log.captured(150, 1050), 50 + 50);
        assert_eq!(log.captured(300, 900), 0);
        assert_eq!(log.captured(0, 100), 0);
        assert!((log.fraction(2000) - 0.1).abs() < 1e-9);
        // An open window counts up to the end of the stretch.
        log.open(3000);
        assert_eq!(log.captured(2000, 3500), 500);
        assert_eq!(log.windows(), 3);
    }

    #[test]
    fn counts_scale_by_the_captured_share_and_the_bound_shrinks_with_the_count() {
        assert_eq!(scale(100, 1_000, 10_000), 1000);
        assert_eq!(scale(100, 0, 10_000), 100, "nothing captured: nothing to scale");
        assert_eq!(scale(100, 10_000, 10_000), 100);
        assert!((error_bound(10_000) - 0.0196).abs() < 1e-9);
        assert!((error_bound(0) - 1.96).abs() < 1e-9);
    }
}
