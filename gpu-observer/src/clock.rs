//! Every clock the agent reads, in one place.
//!
//! Events carry CLOCK_MONOTONIC ns (`bpf_ktime_get_ns`), and so do CUPTI's timestamps once
//! the injection library has converted them; the agent's own lines (memory, leaks, NVML) use
//! the same clock so all lines of one run sort together. NVML stamps per-process samples with
//! CLOCK_REALTIME µs, and OTLP wants wall time: [`WallClock`] converts (docs/DESIGN.md,
//! "Clocks").

use std::time::{Duration, SystemTime};

/// A clock's reading in ns.
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec out-pointer for the duration of the call.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// CLOCK_MONOTONIC in ns: the clock of `bpf_ktime_get_ns`, for lines the agent makes itself.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CLOCK_REALTIME in µs: the clock of NVML's per-process sample timestamps.
pub fn realtime_us() -> u64 {
    clock_ns(libc::CLOCK_REALTIME) / 1000
}

/// CPU time of the calling thread in ns (what the NVML sampler costs).
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CLOCK_MONOTONIC ns → wall time, by the offset between the two read once, together.
///
/// One offset for the whole run: spans of one trace keep their order and gaps even if the
/// wall clock is stepped meanwhile (the wall times are then off by the step, not reordered).
#[derive(Clone, Copy, Debug)]
pub struct WallClock {
    pub mono_ns: u64,
    wall: SystemTime,
}

impl WallClock {
    pub fn now() -> Self {
        Self {
            mono_ns: monotonic_ns(),
            wall: SystemTime::now(),
        }
    }

    /// With a given pair of readings (tests).
    pub fn at(mono_ns: u64, wall: SystemTime) -> Self {
        Self { mono_ns, wall }
    }

    /// The wall time of a CLOCK_MONOTONIC reading.
    pub fn wall(&self, mono_ns: u64) -> SystemTime {
        if mono_ns >= self.mono_ns {
            self.wall + Duration::from_nanos(mono_ns - self.mono_ns)
        } else {
            self.wall - Duration::from_nanos(self.mono_ns - mono_ns)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wall_time_keeps_the_monotonic_offsets_both_ways() {
        let base = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let c = WallClock::at(5_000, base);
        assert_eq!(c.wall(5_000), base);
        assert_eq!(c.wall(7_500), base + Duration::from_nanos(2_500));
        assert_eq!(c.wall(1_000), base - Duration::from_nanos(4_000));
    }

    #[test]
    fn clocks_move_forward() {
        let (a, b) = (monotonic_ns(), monotonic_ns());
        assert!(b >= a && a > 0);
        assert!(realtime_us() > 1_600_000_000_000_000, "CLOCK_REALTIME is after 2020");
    }
}
