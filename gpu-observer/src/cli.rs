//! Command line.

use std::{ffi::OsString, path::PathBuf};

use clap::{Parser, Subcommand, ValueEnum};
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
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Observe only this process (all its threads) and its descendants, those running now and
    /// those it starts later. Default: every process.
    #[arg(long, short = 'p', global = true)]
    pub pid: Option<u32>,

    /// With --pid or `run`: the process alone, not its children.
    #[arg(long, global = true)]
    pub no_children: bool,

    /// Stop after this many seconds (default: until Ctrl-C / SIGTERM); fractions allowed, at
    /// most a year.
    #[arg(long, short = 'd', value_parser = parse_duration, global = true)]
    pub duration: Option<f64>,

    /// Output: the live dashboard, a plain per-second terminal table, JSON lines (one event
    /// per line), or none (OTLP only). Default: `dashboard` when stdout is a terminal (without
    /// --output, and not for `run`, whose program shares the terminal), else `terminal`.
    #[arg(long, short = 'f', value_enum, global = true)]
    pub format: Option<Format>,

    /// Write the output to this file instead of stdout.
    #[arg(long, short = 'o', global = true)]
    pub output: Option<PathBuf>,

    /// Also write a Perfetto trace (open it in ui.perfetto.dev) to this file, as events come:
    /// CUDA calls and their ioctls per thread, GPU work per stream with a flow from each launch
    /// (`run`), NVTX ranges, NVML counters, verdicts and anomalies.
    #[arg(long, value_name = "FILE", global = true)]
    pub perfetto: Option<PathBuf>,

    /// Largest --perfetto trace, in MB (1 to 1 048 576); what comes after is left out and
    /// counted.
    #[arg(long, value_name = "MB", default_value_t = 1024,
          value_parser = clap::value_parser!(u64).range(1..=1_048_576), global = true)]
    pub perfetto_max_mb: u64,

    /// Write kernel flamegraph stacks (process;thread;NVTX ranges…;API;kernel) to this file
    /// at the end, weighted by GPU time (`run`) or else by launches: folded text, or an SVG
    /// when FILE ends in `.svg`.
    #[arg(long, value_name = "FILE", global = true)]
    pub flamegraph: Option<PathBuf>,

    /// Size of the eBPF ring buffer in bytes (a power of two from 4096 to 1 GiB). Raise it if
    /// the summary reports dropped events.
    #[arg(long, default_value_t = limits::DEFAULT_RING_BYTES, value_parser = parse_ring_size, global = true)]
    pub ring_buffer_size: u32,

    /// Also attach this libcuda file up front (repeatable); the usual driver paths and every
    /// libcuda mapped by a running process are found without it.
    #[arg(long, value_name = "PATH", value_parser = parse_library_path, global = true)]
    pub libcuda: Vec<PathBuf>,

    /// Library files (libcuda, the CUPTI injection library) the processes of one user may
    /// have attached at once; more are refused and counted. A file is released when no
    /// observed process maps it any more. Files attached up front (the driver's usual paths,
    /// --libcuda) count for nobody.
    #[arg(long, value_name = "N", default_value_t = crate::attach::attacher::DEFAULT_MAX_PER_USER,
          value_parser = clap::value_parser!(u32).range(1..=4096), global = true)]
    pub max_libraries_per_user: u32,

    /// Also record every raw ring-buffer record to this file (for a bug report, or to replay
    /// through `cargo xtask bench-pipeline`); at most 1 GiB is recorded.
    #[arg(long, value_name = "FILE", global = true)]
    pub record_ring: Option<PathBuf>,

    /// Copies, memsets and syncs that take at least this many microseconds are marked slow
    /// (`is_slow`; docs/DESIGN.md "Defaults").
    #[arg(long, default_value_t = 100, alias = "trace-gpu-threshold",
          value_parser = clap::value_parser!(u64).range(0..=MAX_THRESHOLD_US), global = true)]
    pub threshold_us: u64,

    /// How anomalies are judged: `robust` (median and MAD of a series' last values, in log
    /// space) or `sigma` (mean + N standard deviations, the design documents' rule).
    #[arg(long, value_enum, default_value_t = crate::analyze::anomaly::Mode::Robust, global = true)]
    pub anomaly_mode: crate::analyze::anomaly::Mode,

    /// A call or kernel is anomalous this many robust deviations (or σ in `sigma` mode) on
    /// the slow side of its series (default 8 robust, 2 σ).
    #[arg(long, value_name = "DEVIATIONS", value_parser = parse_threshold, global = true)]
    pub anomaly_threshold: Option<f64>,

    /// Values a series needs before it may flag.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1_000_000), global = true)]
    pub anomaly_warmup: u32,

    /// Write every copy, memset and sync. Default (duration sampling): only those taking
    /// at least --threshold-us are written one by one; all are counted in the summaries, and
    /// the total says how many were left out (`sampled_out`).
    #[arg(long, alias = "trace-gpu-all", global = true)]
    pub trace_all: bool,

    /// CUPTI activity buffer size in bytes for processes started by `run` (default 8 MiB).
    #[arg(long, default_value_t = 8 * 1024 * 1024,
          value_parser = clap::value_parser!(u64).range(4096..=1 << 30), global = true)]
    pub cuda_buffer_size: u64,

    /// Most CUPTI records per second a process started by `run` forwards (0: no limit); the
    /// rest are counted (`rate_limited`), never silently lost.
    #[arg(long, default_value_t = 1_000_000, global = true)]
    pub cupti_rate_limit: u64,

    /// The CUPTI injection library for `run` (default: libgpu_observer_cupti.so beside the
    /// gpu-observer binary).
    #[arg(long, value_name = "PATH", global = true)]
    pub cupti_lib: Option<PathBuf>,

    /// With `--pid`: GPU start/end times for a process that is already running. The CUPTI
    /// injection library is loaded into it (ptrace, one thread borrowed for well under a
    /// millisecond; needs CAP_SYS_PTRACE) and switched on; when the observer stops it is
    /// switched off (flushed, idle, still loaded) and the process runs on as before.
    #[arg(long, global = true)]
    pub gpu_timing: bool,

    /// With `--gpu-timing`: switch GPU timing off after this many seconds (from when it came
    /// on) and go on observing with uprobes only.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, global = true)]
    pub gpu_timing_for: Option<f64>,

    /// `run` without the CUPTI injection library: uprobes only.
    #[arg(long, global = true)]
    pub no_cupti: bool,

    /// Fleet mode: the probes of launches, copies, memsets and syncs are attached only during
    /// capture windows this long (e.g. 1s, 500ms), one per --capture-period at a random point
    /// of it; allocations, frees, module loads, NVML and process discovery stay on. Rates and
    /// the verdict are estimated from the windows (`capture_fraction`, `estimate_error`).
    /// Default: always on (exact), as for --pid and `run`.
    #[arg(long, value_name = "DURATION", value_parser = parse_span, global = true)]
    pub capture_window: Option<std::time::Duration>,

    /// Fleet mode: one capture window per this much time (default 10s).
    #[arg(long, value_name = "DURATION", value_parser = parse_span, global = true)]
    pub capture_period: Option<std::time::Duration>,

    /// Fleet mode: size each capture window so that the probes cost the busiest observed
    /// process at most this percentage of its time (0.1 to 50), from the call rates measured
    /// in the windows; --capture-window is then the first window's length (default 1s).
    #[arg(long, value_name = "PCT", value_parser = parse_budget, global = true)]
    pub overhead_budget: Option<f64>,

    /// Benchmarks: attach every probe but leave the programs off (they return at once), to
    /// measure what the uprobe traps alone cost. Nothing is recorded.
    #[arg(long, hide = true, global = true)]
    pub probes_floor: bool,

    /// Attach perf-event uprobes instead of uprobe-multi links (the fallback for kernels before
    /// 6.6; for troubleshooting). They take ~85 ms each to detach at exit.
    #[arg(long, hide = true, global = true)]
    pub perf_uprobes: bool,

    /// How often NVML samples every GPU (utilization, memory, power, clocks, PCIe, per-process
    /// memory and utilization), in milliseconds. Temperature, fan, power limit, link and ECC
    /// are read every 500 ms at most.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(10..=60_000), global = true)]
    pub nvml_interval_ms: u64,

    /// The NVML library (default: libnvidia-ml.so.1 from the loader path and the usual driver
    /// locations).
    #[arg(long, value_name = "PATH", value_parser = parse_library_path, global = true)]
    pub nvml_lib: Option<PathBuf>,

    /// No NVML device sampling.
    #[arg(long, global = true)]
    pub no_nvml: bool,

    /// Export traces and metrics over OTLP to this collector (e.g. http://localhost:4317 for
    /// gRPC, http://localhost:4318 for HTTP/protobuf). Without it, the standard
    /// OTEL_EXPORTER_OTLP_ENDPOINT (and _TRACES_/_METRICS_ variants) turn export on.
    #[arg(long, value_name = "URL", global = true)]
    pub otlp_endpoint: Option<String>,

    /// OTLP transport: grpc or http/protobuf (default: OTEL_EXPORTER_OTLP_PROTOCOL, else grpc).
    #[arg(long, value_name = "PROTOCOL", global = true)]
    pub otlp_protocol: Option<String>,

    /// Trace window (one trace per process per window) and metric export interval, in ms.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=3_600_000), global = true)]
    pub otlp_interval_ms: u64,

    /// Spans waiting for export at most (1 to 16 777 216); more are dropped and counted.
    #[arg(long, default_value_t = 65_536, value_parser = parse_queue, global = true)]
    pub otlp_queue: usize,

    /// Spans per second one process may export (0: no limit); the rest are counted.
    #[arg(long, default_value_t = 10_000, global = true)]
    pub otlp_max_spans_per_sec: u64,

    /// Also export each process's command line (`process.command_line`; it can hold secrets).
    #[arg(long, global = true)]
    pub otlp_command_line: bool,

    /// How often to look for new libcuda files and refresh the terminal view, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(50..=60_000), global = true)]
    pub interval_ms: u64,

    /// Ceiling for the agent's memory (MB): kernel names, live allocations and exited processes
    /// are remembered within budgets derived from it, over all processes together; what does not
    /// fit is counted in the summary's `evicted`.
    #[arg(long, env = "GPU_OBSERVER_MEMORY_LIMIT_MB", default_value_t = crate::correlate::DEFAULT_MEMORY_LIMIT_MB, value_parser = clap::value_parser!(u64).range(32..=1_048_576), global = true)]
    pub memory_limit_mb: u64,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Start CMD with the CUPTI injection library (CUDA_INJECTION64_PATH) and observe it: every
    /// launch also gets when it ran on the GPU (`gpu_kernel` lines). Ends when CMD exits, with
    /// its exit status. CMD runs as the observer's user.
    Run {
        /// The command and its arguments (after `--`).
        #[arg(
            required = true,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "CMD"
        )]
        command: Vec<OsString>,
    },
    /// List the GPUs NVML sees (index, name, UUID, memory, compute capability, driver, PCI
    /// bus, SMs, max clocks, power limit) and exit. `--format json` for JSON. Needs no root.
    Devices,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The full-screen live dashboard (a terminal on stdout): GPUs, processes, verdicts; keys.
    Dashboard,
    /// The plain per-second table (and the final summary).
    Terminal,
    Jsonl,
    /// One JSON document (`devices` only).
    Json,
    /// Nothing locally: OTLP export only (a DaemonSet), no per-event formatting cost.
    None,
}

/// Largest `--threshold-us`: an hour (the threshold is kept in ns, which must not overflow).
pub const MAX_THRESHOLD_US: u64 = 3_600_000_000;
/// Largest `--duration`: a year, in seconds.
const MAX_DURATION_S: f64 = 365.0 * 86_400.0;
/// Largest ring buffer: 1 GiB of kernel memory, locked while the observer runs.
const MAX_RING_BYTES: u64 = 1 << 30;

fn parse_duration(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds (e.g. 30 or 0.5)"))?;
    if !v.is_finite() || v <= 0.0 || v > MAX_DURATION_S {
        return Err(format!(
            "{s} seconds is out of range: give more than 0 and at most {MAX_DURATION_S} (a year); leave --duration out to observe until Ctrl-C"
        ));
    }
    Ok(v)
}

/// A span of time: `1s`, `500ms`, `1.5` (seconds); from 10 ms to an hour.
fn parse_span(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a time span (e.g. 1s, 500ms, 2.5)"))?;
    let secs = v * scale;
    if !secs.is_finite() || !(0.01..=3600.0).contains(&secs) {
        return Err(format!("{s} is out of range: from 10ms to 3600s"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

fn parse_budget(s: &str) -> Result<f64, String> {
    match s.trim().trim_end_matches('%').parse::<f64>() {
        Ok(v) if (0.1..=50.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a percentage from 0.1 to 50")),
    }
}

fn parse_queue(s: &str) -> Result<usize, String> {
    match s.trim().parse::<u64>() {
        Ok(v @ 1..=16_777_216) => Ok(v as usize),
        _ => Err(format!("`{s}` is not a span count from 1 to 16777216")),
    }
}

/// A library file named on the command line: made absolute (the loader would take a relative
/// name without a `/` as a name to search for), and refused at once if it is a FIFO, device
/// or directory — opening a FIFO blocks. A path that does not exist passes: what loads it says
/// so, and the agent runs on without it.
fn parse_library_path(s: &str) -> Result<PathBuf, String> {
    let p = std::path::absolute(s).map_err(|e| format!("{s}: {e}"))?;
    match crate::attach::open::not_a_file(p.as_os_str()) {
        Some(what) => Err(format!("{s} is {what}, not a library file")),
        None => Ok(p),
    }
}

fn parse_ring_size(s: &str) -> Result<u32, String> {
    let v: u64 = s.trim().parse().map_err(|_| format!("`{s}` is not a byte count"))?;
    if v > MAX_RING_BYTES {
        return Err(format!(
            "{v} bytes is too large: the ring buffer is at most {MAX_RING_BYTES} (1 GiB) of locked kernel memory"
        ));
    }
    let v = v as u32;
    if v < 4096 || !v.is_power_of_two() {
        return Err(format!(
            "{v} is not a power of two of at least 4096 (try 8388608 for 8 MiB)"
        ));
    }
    Ok(v)
}

/// A positive, finite number of deviations.
fn parse_threshold(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1000.0 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of deviations between 0 and 1000 (e.g. 8)"
        )),
    }
}

impl Cli {
    /// The output format of an observing run: the one given, else the dashboard when stdout
    /// is a terminal and nothing else owns it (no --output; not `run`, whose program writes to
    /// the same terminal and may read keys from it), else the plain terminal view.
    pub fn output_format(&self, stdout_is_terminal: bool) -> Format {
        match self.format {
            Some(f) => f,
            None if stdout_is_terminal && self.output.is_none() && !self.is_run() => Format::Dashboard,
            None => Format::Terminal,
        }
    }

    /// `gpu-observer run …`.
    pub fn is_run(&self) -> bool {
        matches!(self.command, Some(Command::Run { .. }))
    }

    /// Fleet mode's windows (`--capture-window`, `--capture-period`, `--overhead-budget`), or
    /// None (always on); an error says what to change.
    pub fn capture(&self) -> Result<Option<crate::observe::capture::Config>, String> {
        if self.capture_window.is_none() && self.overhead_budget.is_none() {
            if self.capture_period.is_some() {
                return Err("--capture-period needs --capture-window or --overhead-budget".into());
            }
            return Ok(None);
        }
        let period = self.capture_period.unwrap_or(std::time::Duration::from_secs(10));
        let window = self
            .capture_window
            .unwrap_or(std::time::Duration::from_secs(1))
            .min(period);
        if self.capture_window.is_some_and(|w| w >= period) {
            return Err(format!(
                "--capture-window ({:?}) must be shorter than --capture-period ({period:?}); leave both out to capture always",
                window
            ));
        }
        Ok(Some(crate::observe::capture::Config {
            window,
            period,
            budget_pct: self.overhead_budget,
        }))
    }

    /// The anomaly detector's settings.
    pub fn anomalies(&self) -> crate::analyze::anomaly::Config {
        crate::analyze::anomaly::Config {
            mode: self.anomaly_mode,
            threshold: self.anomaly_threshold.unwrap_or(self.anomaly_mode.default_threshold()),
            warmup: self.anomaly_warmup,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_spans_take_units_and_the_window_must_fit_the_period() {
        assert_eq!(parse_span("1s"), Ok(std::time::Duration::from_secs(1)));
        assert_eq!(parse_span("250ms"), Ok(std::time::Duration::from_millis(250)));
        assert_eq!(parse_span("2.5"), Ok(std::time::Duration::from_millis(2500)));
        assert!(parse_span("5ms").is_err());
        assert!(parse_span("2h").is_err());
        assert!(parse_budget("2%").is_ok() && parse_budget("0").is_err());
        let cli = Cli::parse_from(["gpu-observer", "--capture-window", "1s", "--capture-period", "10s"]);
        let c = cli.capture().unwrap().unwrap();
        assert_eq!(
            (c.window.as_millis(), c.period.as_millis(), c.budget_pct),
            (1000, 10_000, None)
        );
        let cli = Cli::parse_from(["gpu-observer", "--capture-window", "10s", "--capture-period", "10s"]);
        assert!(cli.capture().unwrap_err().contains("shorter"));
        let cli = Cli::parse_from(["gpu-observer", "--capture-period", "10s"]);
        assert!(cli.capture().is_err());
        assert!(Cli::parse_from(["gpu-observer"]).capture().unwrap().is_none());
        let cli = Cli::parse_from(["gpu-observer", "--overhead-budget", "2"]);
        assert_eq!(cli.capture().unwrap().unwrap().budget_pct, Some(2.0));
    }

    #[test]
    fn ring_size_must_be_a_page_power_of_two() {
        assert_eq!(parse_ring_size("4096"), Ok(4096));
        assert!(parse_ring_size("5000").is_err());
        assert!(parse_ring_size("2048").is_err());
        assert!(parse_ring_size("lots").is_err());
        assert_eq!(parse_ring_size("1073741824"), Ok(1 << 30));
        let e = parse_ring_size("2147483648").unwrap_err();
        assert!(e.contains("too large"), "{e}");
        assert!(parse_ring_size("8589934592").unwrap_err().contains("too large"));
    }

    #[test]
    fn numbers_that_would_overflow_or_never_end_are_refused() {
        assert_eq!(parse_duration("2.5"), Ok(2.5));
        for bad in ["inf", "-1", "0", "nan", "1e300", "soon"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert!(Cli::try_parse_from(["gpu-observer", "--threshold-us", "18446744073709551615"]).is_err());
        assert!(Cli::try_parse_from(["gpu-observer", "--threshold-us", "3600000000"]).is_ok());
        assert!(Cli::try_parse_from(["gpu-observer", "--otlp-queue", "0"]).is_err());
        assert!(Cli::try_parse_from(["gpu-observer", "--otlp-queue", "18446744073709551615"]).is_err());
    }

    #[test]
    fn run_takes_options_before_and_after_it_and_the_command_verbatim() {
        let c = Cli::parse_from([
            "gpu-observer",
            "--format",
            "jsonl",
            "run",
            "--trace-all",
            "--",
            "python3",
            "-u",
            "train.py",
        ]);
        assert_eq!(c.format, Some(Format::Jsonl));
        assert!(c.trace_all);
        match c.command {
            Some(Command::Run { command }) => assert_eq!(command, ["python3", "-u", "train.py"]),
            _ => panic!("no run"),
        }
        assert_eq!(
            (c.cuda_buffer_size, c.cupti_rate_limit, c.no_cupti),
            (8 << 20, 1_000_000, false)
        );
    }

    #[test]
    fn format_none_is_accepted() {
        let c = Cli::parse_from(["gpu-observer", "--format", "none", "--otlp-endpoint", "http://c:4317"]);
        assert_eq!(c.format, Some(Format::None));
    }

    #[test]
    fn library_paths_are_absolute_and_regular_files() {
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(parse_library_path("x/libcuda.so.1"), Ok(cwd.join("x/libcuda.so.1")));
        assert_eq!(parse_library_path("/a/b.so"), Ok(PathBuf::from("/a/b.so")));
        assert_eq!(
            parse_library_path("/dev/null"),
            Err("/dev/null is a character device, not a library file".to_string())
        );
        assert_eq!(
            parse_library_path("/"),
            Err("/ is a directory, not a library file".to_string())
        );
    }

    #[test]
    fn defaults() {
        let c = Cli::parse_from(["gpu-observer"]);
        assert_eq!(
            (c.pid, c.format, c.ring_buffer_size, c.max_libraries_per_user),
            (None, None, 8 * 1024 * 1024, 8)
        );
    }

    #[test]
    fn the_dashboard_is_the_default_on_a_terminal_that_nothing_else_owns() {
        let parse = |args: &[&str]| Cli::parse_from([&["gpu-observer"], args].concat());
        assert_eq!(parse(&[]).output_format(true), Format::Dashboard);
        assert_eq!(parse(&[]).output_format(false), Format::Terminal);
        assert_eq!(parse(&["--output", "f"]).output_format(true), Format::Terminal);
        assert_eq!(parse(&["run", "--", "x"]).output_format(true), Format::Terminal);
        assert_eq!(parse(&["--format", "terminal"]).output_format(true), Format::Terminal);
        assert_eq!(
            parse(&["--format", "dashboard"]).output_format(false),
            Format::Dashboard
        );
        assert_eq!(parse(&["-f", "jsonl"]).output_format(true), Format::Jsonl);
    }
}
