//! cuda-ground-truth: a CUDA driver-API program whose every call is known in advance (its checks:
//! H1 module loading, H2 kernel results, H3 copy round trip, H9 error on invalid PTX), written
//! to be run under gpu-observer and compared with what it captured.
//!
//! It carries its own driver FFI ([`driver`]), `dlopen`s libcuda at run time and never panics
//! for want of a GPU: no library or no device is a message and exit status 2.

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod args;
pub mod driver;
#[cfg(test)]
mod emu;
pub mod gpu;
pub mod ledger;
pub mod ptx;
pub mod report;
pub mod workload;

use std::path::Path;
use std::time::{Duration, Instant};

/// CLOCK_MONOTONIC in ns: the clock of the observer's `ts_ns` (bpf_ktime_get_ns).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Polls every 10 ms until `file` exists; false after `timeout`.
pub fn wait_for(file: &Path, timeout: Duration) -> bool {
    let t0 = Instant::now();
    loop {
        if file.exists() {
            return true;
        }
        if t0.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Writes `v` as pretty JSON to `path` through a temporary file and a rename.
pub fn write_atomically(path: &Path, v: &serde_json::Value) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let text = serde_json::to_string_pretty(v).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, text + "\n")?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_advances() {
        let a = monotonic_ns();
        std::thread::sleep(Duration::from_millis(2));
        let b = monotonic_ns();
        assert!(a > 0 && b >= a + 1_000_000, "{a} {b}");
    }

    #[test]
    fn wait_for_sees_a_file_and_times_out_without_one() {
        let dir = std::env::temp_dir().join(format!("cgt-wait-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("go");
        let t0 = Instant::now();
        assert!(!wait_for(&f, Duration::from_millis(50)));
        assert!(t0.elapsed() >= Duration::from_millis(50));
        let f2 = f.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            std::fs::write(&f2, b"").unwrap();
        });
        assert!(wait_for(&f, Duration::from_secs(5)));
        h.join().unwrap();
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn json_is_written_atomically() {
        let dir = std::env::temp_dir().join(format!("cgt-out-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("gt.json");
        write_atomically(&p, &serde_json::json!({"pid": 1})).unwrap();
        let back: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(back["pid"], 1);
        assert!(!dir.join("gt.json.tmp").exists());
        std::fs::remove_dir_all(&dir).ok();
    }
}
