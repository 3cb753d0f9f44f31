//! The rules every output shares, each written once: what is slow, what span sampling keeps,
//! how bandwidth and mean queue delay are computed, how a command name's bytes are read.
//! JSON lines, OTLP, the terminal and the correlator's counters all call these.

use std::borrow::Cow;

use gpu_observer_common::api::{ApiSpec, Family};

/// A call or GPU record is slow when it took at least the threshold (`--threshold-us`,
/// 100 µs by default, docs/DESIGN.md "Defaults"). Equality is slow.
pub fn is_slow(duration_ns: u64, threshold_ns: u64) -> bool {
    duration_ns >= threshold_ns
}

/// Adaptive sampling: a timed call or GPU record is written (as a line or a span) when it is
/// slow, anomalous (a 4 µs kernel slowed 10× is still under the threshold), or with
/// `--trace-all`; the rest are only counted.
pub fn kept(duration_ns: u64, threshold_ns: u64, trace_all: bool, anomalous: bool) -> bool {
    trace_all || anomalous || is_slow(duration_ns, threshold_ns)
}

/// The CPU-side calls sampled by duration: copies, memsets, syncs (every other call is kept).
pub fn sampled_by_duration(family: Family) -> bool {
    matches!(family, Family::Memcpy | Family::Memset | Family::Sync)
}

/// Fleet mode (`--capture-window`): the entry points whose probes are attached only during
/// capture windows. They are the ones called at the rate of the work itself: launches, copies,
/// memsets, syncs, host functions, and `cuKernelGetFunction`, which PyTorch calls before its
/// launches (measured on the H100: 8 a step of a 61-launch training step, docs/BENCHMARKS.md
/// "Fleet mode"); its trap is paid again in the next window, so nothing is lost by it.
/// Allocations and frees (leak tracking stays exact), initialization, module loads and the
/// other naming calls (made once per kernel: JAX and CuPy name every kernel at load) stay
/// attached.
pub fn follows_capture_windows(spec: &ApiSpec) -> bool {
    matches!(
        spec.family,
        Family::Launch
            | Family::LaunchEx
            | Family::GraphLaunch
            | Family::Memcpy
            | Family::Memset
            | Family::Sync
            | Family::HostFunc
    ) || spec.name == "cuKernelGetFunction"
}

/// MB/s = bytes·1e6 / (duration_us·1048576) (MB = MiB, as the design documents define it);
/// 0 for a zero duration.
pub fn bandwidth_mbps(bytes: u64, duration_ns: u64) -> f64 {
    if duration_ns == 0 {
        return 0.0;
    }
    let duration_us = duration_ns as f64 / 1000.0;
    (bytes as f64 * 1_000_000.0) / (duration_us * 1_048_576.0)
}

/// The mean of `n` values summing to `sum`, 0 when there are none (mean queue delay, in ns).
pub fn mean_ns(sum: u64, n: u64) -> u64 {
    sum.checked_div(n).unwrap_or(0)
}

/// A command name's bytes (`comm`, NUL-padded, from the kernel or an injection library) as a
/// string: up to the first NUL; invalid UTF-8 replaced, not dropped. Borrowed when valid, so
/// the per-event path does not allocate.
pub fn comm(bytes: &[u8]) -> Cow<'_, str> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_the_threshold_is_slow_and_kept() {
        assert!(is_slow(100_000, 100_000));
        assert!(!is_slow(99_999, 100_000));
        assert!(kept(100_000, 100_000, false, false));
        assert!(!kept(99_999, 100_000, false, false));
        assert!(kept(0, 100_000, true, false));
        // An anomalous call under the threshold is kept.
        assert!(kept(40_000, 100_000, false, true));
    }

    #[test]
    fn only_copies_memsets_and_syncs_are_sampled_by_duration() {
        assert!(sampled_by_duration(Family::Memcpy));
        assert!(sampled_by_duration(Family::Memset));
        assert!(sampled_by_duration(Family::Sync));
        assert!(!sampled_by_duration(Family::Launch));
        assert!(!sampled_by_duration(Family::Alloc));
    }

    #[test]
    fn bandwidth_uses_mib_per_second() {
        // 11 MB in 25 ms: 419.6 MB/s; 8 MiB in 1 ms: 8000 MB/s.
        let mbps = bandwidth_mbps(11_000_000, 25_000_000);
        assert!((mbps - 419.6).abs() < 0.1, "{mbps}");
        assert_eq!(bandwidth_mbps(8 * 1_048_576, 1_000_000), 8000.0);
        assert_eq!(bandwidth_mbps(123, 0), 0.0);
    }

    #[test]
    fn mean_of_nothing_is_zero() {
        assert_eq!(mean_ns(0, 0), 0);
        assert_eq!(mean_ns(10, 4), 2);
    }

    #[test]
    fn comm_stops_at_the_first_nul_and_replaces_bad_bytes() {
        assert_eq!(comm(b"python3\0\0\0\0\0\0\0\0\0"), "python3");
        assert!(matches!(comm(b"python3\0"), Cow::Borrowed(_)));
        assert_eq!(comm(b"a\xffb\0"), "a\u{fffd}b");
        assert_eq!(comm(b"0123456789abcdef"), "0123456789abcdef");
    }
}
