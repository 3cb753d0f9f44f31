//! GPU busy time: the union of a process's kernel, copy and memset intervals per device.
//!
//! Records are counted as CUPTI delivers them (before the join, which holds a record back
//! until its API record comes, a buffer later at times): nearly in time order, but not exactly
//! (streams complete out of order, copies and kernels interleave). The union therefore keeps
//! the latest intervals it counted, merged and disjoint, and counts only the part of a new
//! interval none of them covers. It keeps at most [`KEPT`] per device; past that the
//! oldest are forgotten, and a record older than everything kept counts in full. Records come
//! out of order by up to a buffer (on the H100 a training loop's records arrived up to 1 s,
//! ~12 000 records, late), so a record behind the kept ones is far more often late than
//! overlapping forgotten work: clipping such records at the forgotten end counted half of that
//! loop's busy time. Work overlapping on concurrent streams and delivered that late can be
//! counted twice; the verdict caps busy at the window.

use std::collections::BTreeMap;

/// Merged intervals kept per device.
pub const KEPT: usize = 512;
use super::cupti_join::MAX_DEVICES;

#[derive(Clone, Debug, Default)]
pub struct BusyUnion {
    devices: BTreeMap<u32, Device>,
}

#[derive(Clone, Debug, Default)]
struct Device {
    /// start → end, disjoint.
    kept: BTreeMap<u64, u64>,
}

impl BusyUnion {
    /// Adds `[start, end)` on `device`; returns how much of it was not busy yet.
    pub fn add(&mut self, device: u32, start: u64, end: u64) -> u64 {
        if !self.devices.contains_key(&device) && self.devices.len() >= MAX_DEVICES {
            return 0;
        }
        let d = self.devices.entry(device).or_default();
        if end <= start {
            return 0;
        }
        // The kept intervals that overlap or touch [start, end]: the last one starting at or
        // before `start`, then those starting inside.
        let mut hit: Vec<(u64, u64)> = Vec::new();
        if let Some((&s, &e)) = d.kept.range(..=start).next_back()
            && e >= start
        {
            hit.push((s, e));
        }
        hit.extend(d.kept.range(start.saturating_add(1)..=end).map(|(&s, &e)| (s, e)));
        let covered: u64 = hit.iter().map(|&(s, e)| e.min(end).saturating_sub(s.max(start))).sum();
        let (mut lo, mut hi) = (start, end);
        for (s, e) in hit {
            d.kept.remove(&s);
            lo = lo.min(s);
            hi = hi.max(e);
        }
        d.kept.insert(lo, hi);
        while d.kept.len() > KEPT {
            d.kept.pop_first();
        }
        (end - start) - covered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_union_counts_overlaps_once_in_any_order() {
        let mut u = BusyUnion::default();
        assert_eq!(u.add(0, 300, 400), 100);
        // Earlier, delivered later (held back for its API record): all of it counts.
        assert_eq!(u.add(0, 100, 200), 100);
        assert_eq!(u.add(0, 150, 250), 50);
        assert_eq!(u.add(0, 120, 180), 0);
        // Bridging two intervals: only the gap.
        assert_eq!(u.add(0, 240, 310), 50);
        assert_eq!(u.add(1, 100, 200), 100, "another device: its own union");
        assert_eq!(u.add(0, 50, 500), 50 + 100);
        assert_eq!(u.add(0, 500, 500), 0);
        assert_eq!(u.add(0, 600, 550), 0);
    }

    #[test]
    fn it_keeps_a_bounded_number_of_intervals_and_counts_a_late_record_behind_them_in_full() {
        let mut u = BusyUnion::default();
        for i in 0..KEPT as u64 + 10 {
            assert_eq!(u.add(0, i * 10 + 1000, i * 10 + 1005), 5);
        }
        assert_eq!(u.devices[&0].kept.len(), KEPT);
        // A record from before all of them (late by more than the kept ones): all of it.
        assert_eq!(u.add(0, 0, 500), 500);
        // One over the kept ones still counts only the gaps between them.
        let first_kept = *u.devices[&0].kept.first_key_value().unwrap().0;
        assert_eq!(u.add(0, first_kept, first_kept + 10), 5);
    }
}
