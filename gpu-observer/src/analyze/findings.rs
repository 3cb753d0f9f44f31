//! A process's anomalies as the views see them: how many the detector flagged, the latest few,
//! and what any recent stretch's most severe one was — for the live table, the final summary
//! and the verdict's evidence (docs/DESIGN.md, "Anomalies").
//!
//! The snapshot publisher keeps one [`Findings`] per process from the findings of each batch
//! (`pipeline.rs`), beside the correlator's state rather than in the detector: the detector
//! forgets a process when it exits, and the final summary still lists it with its count.
//! Bounded: [`LATEST`] + [`SEVERE`] findings per process, whatever it does.

use std::collections::VecDeque;

use super::anomaly::Finding;

/// Findings kept for the live view's lines, per process.
pub const LATEST: usize = 3;
/// Findings kept to answer "the most severe since the n-th", per process (see
/// [`Findings::worst_after`]).
pub const SEVERE: usize = 32;

/// One finding, numbered and stamped.
#[derive(Clone, Debug, PartialEq)]
pub struct Noted {
    /// Which of the process's findings it is: 1 for its first ([`Findings::count`] once noted).
    pub seq: u64,
    /// When the flagged call began (a GPU record: when it started on the GPU).
    pub ts_ns: u64,
    pub finding: Finding,
}

/// What the detector flagged of one process.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Findings {
    /// Findings so far.
    pub count: u64,
    /// The latest, oldest first.
    latest: VecDeque<Noted>,
    /// The findings more severe than every later one, oldest first (so each is more severe than
    /// those after it): the most severe finding after the n-th is the first here numbered past
    /// n. A verdict window asks for the findings after the count its first sample read, so the
    /// answer is exact for any window in which fewer than [`SEVERE`] findings each set a new
    /// low of severity; past that the oldest (most severe) entry goes, and windows that began
    /// before it get the most severe of those kept.
    severe: VecDeque<Noted>,
}

impl Findings {
    /// Adds a finding (per finding, not per event: findings are rare).
    pub fn note(&mut self, ts_ns: u64, finding: &Finding) {
        self.count += 1;
        let n = Noted {
            seq: self.count,
            ts_ns,
            finding: finding.clone(),
        };
        if self.latest.len() >= LATEST {
            self.latest.pop_front();
        }
        self.latest.push_back(n.clone());
        // A finding at least as severe replaces the earlier ones it equals or beats: for any
        // stretch that holds them it holds this one too.
        while self
            .severe
            .back()
            .is_some_and(|s| s.finding.deviation <= n.finding.deviation)
        {
            self.severe.pop_back();
        }
        if self.severe.len() >= SEVERE {
            self.severe.pop_front();
        }
        self.severe.push_back(n);
    }

    /// The latest findings, newest first.
    pub fn latest(&self) -> impl Iterator<Item = &Noted> {
        self.latest.iter().rev()
    }

    /// The most severe (largest deviation) of the findings after the `after`-th; the latest of
    /// equally severe ones.
    pub fn worst_after(&self, after: u64) -> Option<&Noted> {
        self.severe.iter().find(|n| n.seq > after)
    }
}

/// The more severe of two findings (the later one when equal).
pub fn worse<'a>(a: Option<&'a Noted>, b: Option<&'a Noted>) -> Option<&'a Noted> {
    match (a, b) {
        (Some(x), Some(y)) if x.finding.deviation > y.finding.deviation => Some(x),
        (x, None) => x,
        (_, y) => y,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{analyze::anomaly::What, decode::KernelName};

    fn finding(deviation: f64) -> Finding {
        Finding {
            what: What::Kernel {
                name: Arc::new(KernelName::new("k")),
                grid: [1, 1, 1],
                block: [1, 1, 1],
            },
            observed: 10.0,
            typical: 1.0,
            deviation,
        }
    }

    fn noted(devs: &[f64]) -> Findings {
        let mut f = Findings::default();
        for (i, d) in devs.iter().enumerate() {
            f.note(100 + i as u64, &finding(*d));
        }
        f
    }

    fn worst(f: &Findings, after: u64) -> Option<(u64, f64)> {
        f.worst_after(after).map(|n| (n.seq, n.finding.deviation))
    }

    #[test]
    fn the_most_severe_after_any_count_is_exact() {
        let f = noted(&[9.0, 30.0, 12.0, 20.0, 11.0, 11.0, 10.0]);
        assert_eq!(f.count, 7);
        // Seq 1..7: 9, 30, 12, 20, 11, 11, 10.
        assert_eq!(worst(&f, 0), Some((2, 30.0)));
        assert_eq!(worst(&f, 1), Some((2, 30.0)));
        assert_eq!(worst(&f, 2), Some((4, 20.0)));
        assert_eq!(worst(&f, 3), Some((4, 20.0)));
        // Equally severe: the later one.
        assert_eq!(worst(&f, 4), Some((6, 11.0)));
        assert_eq!(worst(&f, 6), Some((7, 10.0)));
        assert_eq!(worst(&f, 7), None);
        // Only what can still answer is kept: 30, 20, 11 (the later), 10.
        assert_eq!(f.severe.iter().map(|n| n.seq).collect::<Vec<_>>(), [2, 4, 6, 7]);
        assert_eq!(f.severe[0].ts_ns, 101);
    }

    #[test]
    fn the_latest_three_newest_first() {
        let f = noted(&[9.0, 30.0, 12.0, 20.0]);
        let seqs: Vec<u64> = f.latest().map(|n| n.seq).collect();
        assert_eq!(seqs, [4, 3, 2]);
    }

    #[test]
    fn memory_is_bounded_whatever_the_order_of_severities() {
        // Every finding less severe than the one before: each must be kept, up to the bound.
        let devs: Vec<f64> = (0..1000).map(|i| 2000.0 - f64::from(i)).collect();
        let f = noted(&devs);
        assert_eq!((f.count, f.severe.len(), f.latest.len()), (1000, SEVERE, LATEST));
        // Exact for the last SEVERE findings' stretches; before that, the most severe kept.
        assert_eq!(worst(&f, 1000 - SEVERE as u64), Some((969, 1032.0)));
        assert_eq!(worst(&f, 0), Some((969, 1032.0)));
    }

    #[test]
    fn worse_prefers_the_larger_deviation_and_the_later_when_equal() {
        let f = noted(&[5.0, 7.0]);
        let (a, b) = (f.latest.front(), f.latest.back());
        assert_eq!(worse(a, b).map(|n| n.seq), Some(2));
        assert_eq!(worse(b, a).map(|n| n.seq), Some(2));
        assert_eq!(worse(a, None).map(|n| n.seq), Some(1));
        assert_eq!(worse(None, a).map(|n| n.seq), Some(1));
        let g = noted(&[5.0, 5.0]);
        assert_eq!(worse(g.latest.front(), g.latest.back()).map(|n| n.seq), Some(2));
        assert_eq!(worse(None, None), None);
    }
}
