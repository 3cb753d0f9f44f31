//! Analyze: what the counters mean — the bottleneck verdict of a process over a window, and
//! GPU time by verdict class for fleets. Reads snapshots only (docs/DESIGN.md, "Verdicts").

pub mod anomaly;
pub mod estimate;
pub mod findings;
pub mod gpu_time;
pub mod verdict;
pub mod window;
