//! Command line.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use gpu_observer_common::limits;

#[derive(Parser, Debug)]
#[command(
    name = "gpu-observer",
    version,
    args_override_self = true,
    about = "See what every CUDA process on this machine does with its GPUs — no change to the programs.",
    long_about = "Attaches eBPF uprobes to libcuda in every process (or one, with --pid) and shows each \
                  kernel launch, memory copy, memset, allocation and synchronization, with the nvidia \
                  ioctls they issue. Needs root (or CAP_BPF + CAP_PERFMON)."
)]
pub struct Cli {
    /// Observe only this process (all its threads). Default: every process.
    #[arg(long, short = 'p')]
    pub pid: Option<u32>,

    /// Stop after this many seconds (default: until Ctrl-C / SIGTERM).
    #[arg(long, short = 'd')]
    pub duration: Option<f64>,

    /// Output: a live terminal table, or JSON lines (one event per line).
    #[arg(long, short = 'f', value_enum, default_value_t = Format::Terminal)]
    pub format: Format,

    /// Write the output to this file instead of stdout.
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,

    /// Size of the eBPF ring buffer in bytes (a power of two, at least 4096). Raise it if the
    /// summary reports dropped events.
    #[arg(long, default_value_t = limits::DEFAULT_RING_BYTES, value_parser = parse_ring_size)]
    pub ring_buffer_size: u32,

    /// Also attach this libcuda file up front (repeatable); the usual driver paths and every
    /// libcuda mapped by a running process are found without it.
    #[arg(long, value_name = "PATH")]
    pub libcuda: Vec<PathBuf>,

    /// Copies, memsets and syncs longer than this many microseconds are marked slow
    /// (`is_slow`, seed 003: 100 µs).
    #[arg(long, default_value_t = 100, alias = "trace-gpu-threshold")]
    pub threshold_us: u64,

    /// Write every copy, memset and sync. Default (seed adaptive sampling): only those taking
    /// at least --threshold-us are written one by one; all are counted in the summaries, and
    /// the total says how many were left out (`sampled_out`).
    #[arg(long, alias = "trace-gpu-all")]
    pub trace_all: bool,

    /// Attach perf-event uprobes instead of uprobe-multi links (the fallback for kernels before
    /// 6.6; for troubleshooting). They take ~85 ms each to detach at exit.
    #[arg(long, hide = true)]
    pub perf_uprobes: bool,

    /// How often to look for new libcuda files and refresh the terminal view, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(50..=60_000))]
    pub interval_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Terminal,
    Jsonl,
}

fn parse_ring_size(s: &str) -> Result<u32, String> {
    let v: u32 = s.parse().map_err(|_| format!("`{s}` is not a byte count"))?;
    if v < 4096 || !v.is_power_of_two() {
        return Err(format!(
            "{v} is not a power of two of at least 4096 (try 8388608 for 8 MiB)"
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_size_must_be_a_page_power_of_two() {
        assert_eq!(parse_ring_size("4096"), Ok(4096));
        assert!(parse_ring_size("5000").is_err());
        assert!(parse_ring_size("2048").is_err());
        assert!(parse_ring_size("lots").is_err());
    }

    #[test]
    fn defaults() {
        let c = Cli::parse_from(["gpu-observer"]);
        assert_eq!(
            (c.pid, c.format, c.ring_buffer_size),
            (None, Format::Terminal, 8 * 1024 * 1024)
        );
    }
}
