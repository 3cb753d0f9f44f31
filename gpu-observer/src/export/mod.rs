//! Export: where events and summaries go (terminal view, JSON lines).

pub mod attributes;
pub mod devices;
pub mod jsonl;
pub mod otlp;
pub mod otlp_metrics;
pub mod output;
pub mod terminal;
pub mod text;

/// Seeds 000/003 adaptive sampling: a timed call or GPU record is written (as a line or a
/// span) when it took at least the threshold, or with trace-all; the rest are only counted.
pub fn kept(duration_ns: u64, threshold_ns: u64, trace_all: bool) -> bool {
    trace_all || duration_ns >= threshold_ns
}

/// The CPU-side calls sampled by duration: copies, memsets, syncs (every other call is kept).
pub fn sampled_by_duration(family: gpu_observer_common::api::Family) -> bool {
    use gpu_observer_common::api::Family;
    matches!(family, Family::Memcpy | Family::Memset | Family::Sync)
}

/// Seed 003: MB/s = bytes·1e6 / (duration_us·1048576); 0 for a zero duration.
pub fn bandwidth_mbps(bytes: u64, duration_ns: u64) -> f64 {
    if duration_ns == 0 {
        return 0.0;
    }
    let duration_us = duration_ns as f64 / 1000.0;
    (bytes as f64 * 1_000_000.0) / (duration_us * 1_048_576.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn bandwidth_follows_seed_003() {
        // 11 MB in 25 ms: 419.6 MB/s; 8 MiB in 1 ms: 8000 MB/s (MB = MiB in the seed's formula).
        let mbps = super::bandwidth_mbps(11_000_000, 25_000_000);
        assert!((mbps - 419.6).abs() < 0.1, "{mbps}");
        assert_eq!(super::bandwidth_mbps(8 * 1_048_576, 1_000_000), 8000.0);
        assert_eq!(super::bandwidth_mbps(123, 0), 0.0);
    }
}
