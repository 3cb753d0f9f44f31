//! Everything that is not a plain `cargo build`: tool set-up, test fixtures, running the
//! observer and the tests as root, benchmarks, and the bundle for a GPU machine.

use std::{
    env,
    ffi::OsString,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod bench_dashboard;
mod portable;
mod record_fixture;
mod soak;
mod workload;

const BPF_LINKER_VERSION: &str = "0.13.0";

#[derive(Parser)]
#[command(name = "xtask", about = "gpu-observer developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building needs: rust-src, bpf-linker (into .tools/), gcc, Python packages
    /// and cargo-zigbuild with zig (into .tools/).
    Setup,
    /// Build the fake libcuda and workload into target/fixtures.
    Fixtures,
    /// Set up, build, and run the observer as root with these arguments.
    Run {
        /// Build in release mode.
        #[arg(long)]
        release: bool,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Set up, build, and run every test (unit and integration, real eBPF) as root, plus fmt,
    /// clippy and the GPU scripts' self-test.
    Test {
        /// Skip `cargo fmt --check` and clippy.
        #[arg(long)]
        no_lint: bool,
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// fmt --check and clippy -D warnings.
    Lint,
    /// Events/s the agent sustains without drops, with the fake libcuda (prints measured ratios).
    Bench {
        /// Launches per burst.
        #[arg(long, default_value_t = 2_000_000)]
        calls: u64,
    },
    /// Records tests/data/fake-workload.{rec,jsonl,...}: the debug observer's raw ring-buffer
    /// records and JSON lines for the scripted fake workload (tests/data/README.md). Run it as
    /// root, again whenever the event ABI (gpu-observer-common) changes.
    RecordFixture,
    /// Pipeline throughput without root or BPF: recorded records replayed through decode →
    /// correlate → JSON lines on one core; events/s and allocations per event against
    /// bench/pipeline-baseline.json (docs/BENCHMARKS.md, "Pipeline throughput baseline").
    BenchPipeline {
        /// A `--record-ring` recording to replay (default: tests/data/fake-workload.rec).
        #[arg(long)]
        records: Option<PathBuf>,
        /// Seconds to measure for (at least).
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Write the measurement as the new baseline (bench/pipeline-baseline.json).
        #[arg(long)]
        write_baseline: bool,
    },
    /// What the live dashboard costs the agent (issue 15): ~100 000 launches/s from the fake
    /// workload under the release agent with `--format none` and with `--format dashboard` on a
    /// pseudo-terminal, runs interleaved; both CPU medians side by side and their difference in
    /// % of a core, PASS at most --limit (docs/BENCHMARKS.md, "Dashboard cost"). As root.
    BenchDashboard {
        /// Runs of each mode.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Seconds measured per run (after the warm-up).
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Seconds of load before measuring.
        #[arg(long, default_value_t = 3.0)]
        warmup: f64,
        /// Launches a second.
        #[arg(long, default_value_t = 100_000)]
        rate: u64,
        /// The most the dashboard may add, in % of one core.
        #[arg(long, default_value_t = 1.0)]
        limit: f64,
        /// Output modes measured each round (the dashboard's cost is judged when `none` and
        /// `dashboard` are both in).
        #[arg(long, value_delimiter = ',', default_value = "none,dashboard")]
        modes: Vec<bench_dashboard::Mode>,
    },
    /// Release binary + GPU scripts in .gpu-bundle/ for a GPU machine (see gpu/README.md); its
    /// libgpu_observer_cupti.so is the portable one (glibc ≥ 2.17).
    Bundle,
    /// Build the CUPTI injection library for glibc ≥ 2.17 (cargo-zigbuild) into
    /// target/portable/{debug,release}/libgpu_observer_cupti.so and check its glibc requirement.
    PortableCupti {
        /// Build in release mode.
        #[arg(long)]
        release: bool,
    },
    /// Long-run stability (issue 10): the fake workload mix (churn, steady load, CUPTI) under one
    /// all-process observer; every minute its RSS, fds, BPF links and the event accounting;
    /// PASS/FAIL checks at the end (docs/BENCHMARKS.md, "Soak"). Run it as root.
    Soak {
        /// How many minutes to run.
        #[arg(long)]
        minutes: u64,
        /// Seconds in a "minute" (for short trials of the soak itself).
        #[arg(long, default_value_t = 60)]
        minute_secs: u64,
        /// Use a debug build of the observer instead of a release one.
        #[arg(long)]
        debug: bool,
        /// Every Nth churn process loads a private copy of the fake libcuda (a new file the
        /// observer must attach and release); 0: every one loads the shared copy.
        #[arg(long, default_value_t = 5)]
        private_every: u64,
        /// Run this observer binary instead of the one built here (e.g. an older build).
        #[arg(long)]
        observer: Option<PathBuf>,
        /// Where the CSV, the report and the agent's stderr go (default target/soak/<time>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::Setup => setup(),
        Task::Fixtures => fixtures().map(|_| ()),
        Task::Run { release, args } => run_observer(release, &args),
        Task::Test { no_lint, args } => test(!no_lint, &args),
        Task::Lint => lint(),
        Task::Bench { calls } => bench(calls),
        Task::RecordFixture => record_fixture::record_fixture(),
        Task::BenchPipeline {
            records,
            seconds,
            write_baseline,
        } => bench_pipeline(records, seconds, write_baseline),
        Task::BenchDashboard {
            runs,
            seconds,
            warmup,
            rate,
            limit,
            modes,
        } => bench_dashboard::bench_dashboard(bench_dashboard::Options {
            runs,
            seconds,
            warmup,
            rate,
            limit,
            modes,
        }),
        Task::Bundle => bundle(),
        Task::PortableCupti { release } => portable::build(release).map(|_| ()),
        Task::Soak {
            minutes,
            minute_secs,
            debug,
            private_every,
            observer,
            out,
        } => soak::soak(soak::Options {
            minutes,
            minute_secs,
            debug,
            private_every,
            observer,
            out,
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root: xtask's parent directory (its manifest dir is `<root>/xtask`).
fn root() -> PathBuf {
    let xtask = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask.parent().unwrap_or(xtask).to_path_buf()
}

fn tools() -> PathBuf {
    root().join(".tools")
}

fn cargo() -> Command {
    let mut c = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(root());
    c
}

fn status(cmd: &mut Command) -> Result<()> {
    let st = cmd.status().with_context(|| format!("spawn {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("spawn {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

fn have(bin: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {bin} >/dev/null")])
        .status()
        .is_ok_and(|s| s.success())
}

/// What the tests and benchmarks are told through the environment (kept across sudo).
const PRESERVED_ENV: [&str; 5] = [
    "GPU_OBSERVER_BIN",
    "GPU_OBSERVER_FIXTURES",
    "GPU_OBSERVER_PYTHONPATH",
    "GPU_OBSERVER_TEST_PORTABLE_CUPTI",
    "PATH",
];

/// Runs `cmd` as root: directly when we are root, else through sudo (when there is one).
fn as_root(cmd: &mut Command) -> Result<()> {
    if is_root() {
        return status(cmd);
    }
    if !have("sudo") {
        bail!("this needs root (eBPF programs and uprobes) and there is no sudo: run it as root");
    }
    let mut sudo = Command::new("sudo");
    sudo.arg(format!("--preserve-env={}", PRESERVED_ENV.join(",")))
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            sudo.env(k, v);
        }
    }
    if let Some(dir) = cmd.get_current_dir() {
        sudo.current_dir(dir);
    }
    status(&mut sudo)
}

fn setup() -> Result<()> {
    let sysroot = output(Command::new("rustc").args(["--print", "sysroot"]))?
        .trim()
        .to_string();
    if !Path::new(&sysroot).join("lib/rustlib/src/rust/library/core").is_dir() {
        eprintln!("xtask: installing rust-src");
        status(Command::new("rustup").args(["component", "add", "rust-src"]))?;
    }
    let linker = tools().join("bin/bpf-linker");
    if !linker.is_file() {
        // bpf-linker links against rustc's own libLLVM (no system LLVM): a prefix whose lib/ holds
        // libLLVM.so and the versioned name, both links to rustc's library (one to link, one for the RUNPATH).
        let lib = Path::new(&sysroot).join("lib");
        let llvm = std::fs::read_dir(&lib)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| n.starts_with("libLLVM.so.") || (n.starts_with("libLLVM-") && n.ends_with(".so")))
            .context("rustc ships no libLLVM")?;
        let real = std::fs::canonicalize(lib.join(&llvm))?;
        let prefix = tools().join("llvm");
        let plib = prefix.join("lib");
        std::fs::create_dir_all(&plib)?;
        for name in [
            "libLLVM.so".to_string(),
            real.file_name()
                .context("rustc's libLLVM has no file name")?
                .to_string_lossy()
                .into_owned(),
        ] {
            let link = plib.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&real, &link)?;
        }
        eprintln!(
            "xtask: installing bpf-linker {BPF_LINKER_VERSION} into {}",
            tools().display()
        );
        status(
            cargo()
                .args([
                    "install",
                    "bpf-linker",
                    "--version",
                    BPF_LINKER_VERSION,
                    "--locked",
                    "--no-default-features",
                ])
                .args(["--features", "llvm-22", "--root"])
                .arg(tools())
                .env("LLVM_PREFIX", &prefix),
        )?;
    }
    if !have("gcc") {
        eprintln!("xtask: installing gcc");
        apt(&["gcc", "libc6-dev"])?;
    }
    python_protos()?;
    portable::install()?;
    Ok(())
}

/// Perfetto's protos for Python (PyPI `perfetto`, and the `protobuf` it needs), pinned, in a
/// private directory: tests/perfetto/decode.py reads the --perfetto traces with them.
const PYTHON_PACKAGES: [&str; 2] = ["perfetto==0.59.1", "protobuf==7.36.2"];

fn python_dir() -> PathBuf {
    tools().join("python")
}

fn python_protos() -> Result<()> {
    pip_install(&python_dir(), &PYTHON_PACKAGES)
}

/// Installs `packages` (`name==version` each) from PyPI into the private directory `dir`, unless
/// every one is there already (its `<name>-<version>.dist-info`).
fn pip_install(dir: &Path, packages: &[&str]) -> Result<()> {
    let have = packages.iter().all(|p| {
        let (name, version) = p.split_once("==").unwrap_or((p, ""));
        // A wheel's dist-info spells the name with `_` for `-` (cargo_zigbuild-0.24.1.dist-info).
        let name = name.replace('-', "_");
        dir.join(format!("{name}-{version}.dist-info")).is_dir()
    });
    if !have {
        eprintln!("xtask: installing {} into {}", packages.join(" "), dir.display());
        status(
            Command::new("python3")
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "--upgrade",
                    "--target",
                ])
                .arg(dir)
                .args(packages),
        )?;
    }
    Ok(())
}

fn apt(pkgs: &[&str]) -> Result<()> {
    let mut update = Command::new("apt-get");
    update.arg("update").env("DEBIAN_FRONTEND", "noninteractive");
    as_root(&mut update)?;
    let mut install = Command::new("apt-get");
    install
        .args(["install", "-y", "--no-install-recommends"])
        .args(pkgs)
        .env("DEBIAN_FRONTEND", "noninteractive");
    as_root(&mut install)
}

fn fixtures() -> Result<PathBuf> {
    let out = root().join("target/fixtures");
    status(
        Command::new("bash")
            .arg(root().join("tests/fixtures/build.sh"))
            .arg(&out),
    )?;
    Ok(out)
}

/// Builds the observer and, beside it, its CUPTI injection library (what `run` loads).
fn build(release: bool) -> Result<PathBuf> {
    let mut c = cargo();
    c.args(["build", "--package", "gpu-observer", "--package", "gpu-observer-cupti"]);
    if release {
        c.arg("--release");
    }
    status(&mut c)?;
    Ok(root().join(if release {
        "target/release/gpu-observer"
    } else {
        "target/debug/gpu-observer"
    }))
}

fn run_observer(release: bool, args: &[OsString]) -> Result<()> {
    setup()?;
    let bin = build(release)?;
    as_root(Command::new(bin).args(args))
}

fn lint() -> Result<()> {
    status(cargo().args(["fmt", "--all", "--check"]))?;
    status(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))
}

fn test(lint_too: bool, args: &[OsString]) -> Result<()> {
    setup()?;
    let fx = fixtures()?;
    let bin = build(false)?;
    // tests/tests/portable_lib.rs checks the library the bundle ships, built the same way.
    let portable = portable::build(false)?;
    if lint_too {
        lint()?;
    }
    // Build the tests unprivileged, then run them as root (they load eBPF programs).
    status(cargo().args(["test", "--workspace", "--no-run"]))?;
    let log = root().join("target/test-output.log");
    let mut t = Command::new("bash");
    // tee keeps the live output; the totals are read back from the log.
    t.arg("-c")
        .arg(format!(
            "set -o pipefail; \"$0\" test --workspace \"$@\" 2>&1 | tee {}",
            log.display()
        ))
        .arg(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args(args)
        .current_dir(root())
        .env("GPU_OBSERVER_BIN", &bin)
        .env("GPU_OBSERVER_FIXTURES", &fx)
        .env("GPU_OBSERVER_PYTHONPATH", python_dir())
        .env("GPU_OBSERVER_TEST_PORTABLE_CUPTI", &portable);
    let result = as_root(&mut t);
    let (passed, failed) = test_totals(&std::fs::read_to_string(&log).unwrap_or_default());
    println!("{passed} passed, {failed} failed");
    result?;
    // The GPU validation scripts run only on a GPU machine; their logic is tested here so a
    // change to the observer's output cannot silently break them.
    if args.is_empty() {
        // Before the GPU scripts' self-test, so that its totals stay the last line.
        deploy_check()?;
        status(Command::new("bash").arg(root().join("gpu/tests/selftest.sh")))?;
    }
    Ok(())
}

/// Validates deploy/ (Kubernetes manifests, Collector configuration, metric catalogue, Grafana
/// dashboard) with the pinned validators deploy/ci/run.sh installs into .tools/deploy-check, then
/// checks that broken copies of those files are rejected (deploy/README.md, "Validation").
fn deploy_check() -> Result<()> {
    status(
        Command::new("bash")
            .arg(root().join("deploy/ci/run.sh"))
            .arg("--self-test")
            .current_dir(root()),
    )
    .context("deploy/ validation failed (see deploy/README.md, \"Validation\")")
}

/// Sums the `test result:` lines of every test binary.
fn test_totals(output: &str) -> (u64, u64) {
    let mut totals = (0, 0);
    for line in output.lines().filter(|l| l.starts_with("test result:")) {
        let count = |word: &str| -> u64 {
            let before = line.split(&format!(" {word}")).next().unwrap_or("");
            before
                .rsplit([' ', ';', '.'])
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        totals.0 += count("passed");
        totals.1 += count("failed");
    }
    totals
}

fn bench(calls: u64) -> Result<()> {
    setup()?;
    let fx = fixtures()?;
    let bin = build(true)?;
    as_root(
        Command::new("python3")
            .arg(root().join("bench/events_per_second.py"))
            .env("GPU_OBSERVER_BIN", &bin)
            .env("GPU_OBSERVER_FIXTURES", &fx)
            .env("CALLS", calls.to_string()),
    )
}

/// Builds the pipeline benchmark (release) and runs it; it prints PASS or FAIL against the
/// committed baseline and exits non-zero on FAIL.
fn bench_pipeline(records: Option<PathBuf>, seconds: f64, write_baseline: bool) -> Result<()> {
    setup()?;
    status(cargo().args([
        "build",
        "--release",
        "--package",
        "gpu-observer",
        "--example",
        "bench_pipeline",
    ]))?;
    // A recording given on the command line is relative to where the command was run.
    let records = match records {
        Some(p) => std::fs::canonicalize(&p).with_context(|| format!("--records {}", p.display()))?,
        None => PathBuf::from("tests/data/fake-workload.rec"),
    };
    let mut c = Command::new(root().join("target/release/examples/bench_pipeline"));
    c.current_dir(root())
        .arg("--records")
        .arg(records)
        .args(["--baseline", "bench/pipeline-baseline.json"])
        .args(["--seconds", &seconds.to_string()]);
    if write_baseline {
        c.arg("--write-baseline");
    }
    status(&mut c)
}

fn bundle() -> Result<()> {
    setup()?;
    let bin = build(true)?;
    status(cargo().args(["build", "--release", "--package", "cuda-ground-truth"]))?;
    // The stand-alone OTLP receiver gpu/otlp_export.sh decodes an export with.
    status(cargo().args([
        "build",
        "--release",
        "--package",
        "gpu-observer-tests",
        "--bin",
        "otlp-sink",
    ]))?;
    let dir = root().join(".gpu-bundle");
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(&bin, dir.join("gpu-observer"))?;
    // The portable build (glibc ≥ 2.17): the observer injects it into processes of any image.
    std::fs::copy(portable::build(true)?, dir.join("libgpu_observer_cupti.so"))?;
    std::fs::copy(
        root().join("target/release/cuda-ground-truth"),
        dir.join("cuda-ground-truth"),
    )?;
    std::fs::copy(root().join("target/release/otlp-sink"), dir.join("otlp-sink"))?;
    // gpu/validate_anomalies.sh judges each capture again in the other mode with it.
    status(cargo().args(["build", "--release", "--example", "anomaly_replay"]))?;
    std::fs::copy(
        root().join("target/release/examples/anomaly_replay"),
        dir.join("anomaly-replay"),
    )?;
    let commit = output(
        Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .current_dir(root()),
    )
    .unwrap_or_default();
    std::fs::write(dir.join("COMMIT"), commit)?;
    eprintln!(
        "xtask: bundle in {} (carry `.gpu-bundle`, then run `bash gpu/validate.sh`)",
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn totals_add_up_every_binary() {
        let out = "test result: ok. 12 passed; 0 failed; 0 ignored\nnoise\ntest result: FAILED. 9 passed; 1 failed; 0 ignored\n";
        assert_eq!(super::test_totals(out), (21, 1));
    }
}
