//! Analyze: what the counters mean — the bottleneck verdict of a process over a window.
//! Reads snapshots only (docs/DESIGN.md, "Verdicts").

pub mod verdict;
pub mod window;
