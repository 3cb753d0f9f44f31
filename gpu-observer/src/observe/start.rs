//! The start of a run: everything the user gave is checked before anything is loaded or
//! attached; then the probes, the sinks, the NVML sampler, the reader and the OTLP exporter.

use std::{
    io::{BufWriter, IsTerminal, Write},
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Result, anyhow, bail};

use super::Run;
use crate::{
    attach::{Attacher, Probes, Scope, discover, discover::LibKind, follow},
    cli::{Cli, Command, Format},
    clock::monotonic_ns,
    correlate::Correlator,
    export::{
        self, Sink,
        jsonl::{JsonlSink, JsonlWriter},
        terminal,
    },
    nvml,
    pipeline::{Pipeline, Reader, Recording, nvml_channel},
    preflight,
    procinfo::ProcInfo,
    say,
    snapshot::{Publisher, Snapshots},
    spawn,
};

pub(super) async fn start(cli: Cli) -> Result<Run> {
    let format = cli.output_format(std::io::stdout().is_terminal());
    if format == Format::Dashboard {
        // The dashboard owns the terminal: nothing else may write there or read its keys.
        if cli.output.is_some() {
            bail!(
                "--format dashboard draws on the terminal: leave --output out, or use --format terminal or jsonl with it"
            );
        }
        if cli.is_run() {
            bail!(
                "`run` shares the terminal with the program it starts: use --format terminal (the default there) or jsonl"
            );
        }
        if !std::io::stdout().is_terminal() {
            bail!("--format dashboard needs a terminal on stdout; use --format terminal or jsonl otherwise");
        }
    }
    if format == Format::Json {
        bail!("--format json is for `gpu-observer devices`; events are written with --format jsonl");
    }
    let otlp_wanted = export::otlp::wanted(cli.otlp_endpoint.as_deref());
    if format == Format::None && !otlp_wanted {
        bail!("--format none writes nothing locally: use it with --otlp-endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT)");
    }
    let otlp_grpc = if otlp_wanted {
        export::otlp::check_endpoints(cli.otlp_endpoint.as_deref())?;
        Some(export::otlp::grpc(cli.otlp_protocol.as_deref())?)
    } else {
        None
    };
    if let Some(pid) = cli.pid {
        preflight::check_pid(pid)?;
    }
    let gpu_timing = super::gpu_timing::GpuTiming::new(&cli)?;
    for w in preflight::check()? {
        say(format_args!("warning: {w}"));
    }
    // Opened now, so a refused or unwritable --output fails before anything attaches.
    let (writer, dest) = open_output(cli.output.as_deref())?;
    let recording = match &cli.record_ring {
        Some(p) => Some(Recording::create(p).map_err(|e| anyhow!("--record-ring {}: {e:#}", p.display()))?),
        None => None,
    };
    let mut spawned = match &cli.command {
        Some(Command::Run { .. }) if cli.pid.is_some() => {
            bail!("`run` observes the program it starts: drop --pid")
        }
        Some(Command::Run { command }) => Some(spawn::start(command, &cli)?),
        _ => None,
    };
    let pid_filter = spawned.as_ref().map(spawn::Spawned::pid).or(cli.pid);
    let scope = match pid_filter {
        None => Scope::All,
        Some(p) if cli.no_children => Scope::One(p),
        Some(p) => Scope::Tree(p),
    };
    let capture = cli.capture().map_err(|e| anyhow::anyhow!(e))?;
    let cupti_follows = !cli.no_cupti;
    let mut probes = Probes::load(cli.ring_buffer_size, scope, cli.perf_uprobes, capture.is_some())?;
    if cli.probes_floor {
        probes.disable()?;
        say("--probes-floor: every probe attached, every program off (the uprobe traps alone); nothing is recorded");
    }
    if let Scope::Tree(root) = scope {
        let n = follow::seed(&mut probes, root, &ProcInfo::host())?;
        if n > 0 {
            say(format_args!("following pid {root} and its {n} descendants"));
        }
    }
    let mut at = Attacher::new(probes, scope, cli.max_libraries_per_user);
    if let Some(lib) = spawned.as_ref().and_then(|s| s.injection.clone())
        && let Err(e) = at.attach_up_front(&lib, LibKind::Hooks)
    {
        say(format_args!("warning: cannot attach the CUPTI hooks: {e}"));
    }
    for path in &cli.libcuda {
        at.attach_up_front(path, LibKind::Cuda)
            .map_err(|e| anyhow!("--libcuda {}: {e}", path.display()))?;
    }
    // In --pid mode the process's own mapping is what counts; otherwise (and for a program we
    // start) pre-attach the host's driver so new processes are seen from their first call.
    if cli.pid.is_none() {
        for path in discover::well_known() {
            if let Err(e) = at.attach_up_front(&path, LibKind::Cuda) {
                say(format_args!("warning: cannot attach {}: {e}", path.display()));
            }
        }
    }
    let mapped = at.rescan();

    // The event outputs: notices on stderr always, JSON lines with --format jsonl, OTLP spans.
    let mut sinks: Vec<Box<dyn Sink>> = vec![Box::new(terminal::StderrNotices)];
    let summary_out = match format {
        Format::Jsonl => {
            sinks.push(Box::new(JsonlSink {
                writer: JsonlWriter::new(writer, cli.threshold_us * 1000, cli.trace_all),
                dest: dest.clone(),
            }));
            None
        }
        Format::Dashboard | Format::Terminal | Format::Json | Format::None => Some(writer),
    };
    // The timeline and the flamegraph: files of their own, alongside any format.
    if (cli.perfetto.is_some() || cli.flamegraph.is_some()) && !cli.is_run() {
        say(
            "note: GPU execution times and NVTX ranges come only from processes started with `gpu-observer run` (its injection library is their CUPTI and NVTX tool); the others show their CPU calls",
        );
    }
    if let Some(p) = &cli.perfetto {
        sinks.push(Box::new(export::perfetto::PerfettoSink::create(
            p,
            cli.perfetto_max_mb << 20,
        )?));
    }
    if let Some(p) = &cli.flamegraph {
        sinks.push(Box::new(export::flamegraph::FlamegraphSink::create(p)?));
    }
    let nvml_interval = Duration::from_millis(cli.nvml_interval_ms);
    let hub = nvml::Hub::new(
        if cli.no_nvml {
            nvml::State::Off
        } else {
            nvml::State::Starting
        },
        nvml_interval,
        pid_filter,
    );
    let (nvml_tx, nvml_rx) = nvml_channel(&sinks);
    let sampler = if cli.no_nvml {
        None
    } else {
        let cfg = nvml::Config {
            interval: nvml_interval,
            lib: cli.nvml_lib.clone(),
        };
        Some(nvml::Sampler::spawn(cfg, hub.clone(), nvml_tx)?)
    };
    let corr = Correlator::new(cli.threshold_us * 1000)
        .with_memory_limit_mb(cli.memory_limit_mb, cli.ring_buffer_size)
        .with_lookup(Box::new(ProcInfo::host()));
    let (publisher, snapshots) = Publisher::new(hub.view());
    // GPU time by verdict class: the tracker counts it, the OTLP metrics read it.
    let gpu_time = crate::analyze::gpu_time::Published::default();
    let otlp = match otlp_grpc {
        Some(grpc) => Some(start_otlp(&cli, grpc, &hub, snapshots.clone(), gpu_time.clone(), spawned.as_ref()).await?),
        None => None,
    };
    if let Some(o) = &otlp
        && let Some(s) = o.sender()
    {
        sinks.push(Box::new(s));
    }
    let pipe = Pipeline::new(corr, sinks, hub, nvml_rx, publisher, cli.anomalies(), monotonic_ns());
    let failed = Arc::new(tokio::sync::Notify::new());
    let reader = Reader::spawn(at.probes.take_ring()?, pipe, recording, failed.clone())?;
    let started = Instant::now();
    say("ready");
    if let Some(s) = spawned.as_mut() {
        s.release()?;
        say(format_args!("started pid {}", s.pid()));
    }
    let waiting = mapped == 0 && spawned.is_none();
    if waiting {
        match cli.pid {
            Some(pid) => say(format_args!(
                "process {pid} has no libcuda mapped yet; waiting for it to load CUDA (checking every {} ms)",
                cli.interval_ms
            )),
            None if at.probes.attached_count() == 0 => say(format_args!(
                "no libcuda found yet (no process maps one, none in the usual driver paths); waiting (checking every {} ms)",
                cli.interval_ms
            )),
            None => {}
        }
    }
    // A started program shares the terminal: no screen refreshes over its output, the summary
    // comes when it exits.
    let live =
        format == Format::Terminal && cli.output.is_none() && spawned.is_none() && std::io::stdout().is_terminal();
    let dashboard_ended = Arc::new(tokio::sync::Notify::new());
    let dashboard = if format == Format::Dashboard {
        // NO_COLOR (no-color.org, as the issue asks): set and not empty.
        let color = std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        let first = super::dashboard::Published {
            attach: attach_line(&at, waiting),
            ..Default::default()
        };
        Some(super::dashboard::Dashboard::start(
            snapshots.clone(),
            started,
            color,
            first,
            dashboard_ended.clone(),
        )?)
    } else {
        None
    };
    Ok(Run {
        cli,
        format,
        dashboard,
        dashboard_ended,
        at,
        spawned,
        sampler,
        reader,
        failed,
        otlp,
        snapshots,
        summary_out,
        dest,
        started,
        live,
        view: terminal::LiveView::default(),
        waiting,
        last_drops: 0,
        root_gone: None,
        told_descendants: false,
        last_follow_missed: 0,
        tracker: {
            let mut t = crate::analyze::window::Tracker::new(gpu_time);
            t.capture = capture.map(|_| crate::analyze::estimate::CaptureLog::new(crate::clock::monotonic_ns()));
            t
        },
        capture: capture.map(|c| {
            say(format_args!(
                "fleet mode: launch, copy, memset and sync probes attached {:?} in every {:?}{}",
                c.window,
                c.period,
                c.budget_pct
                    .map(|b| format!(" (adapted to a {b}% overhead budget)"))
                    .unwrap_or_default()
            ));
            super::capture::Capture::new(c, crate::clock::monotonic_ns()).with_cupti(cupti_follows)
        }),
        cupti_switch: Default::default(),
        verdicts: Default::default(),
        verdict_written: Default::default(),
        gpu_timing,
    })
}

/// The attach state in one line, for the dashboard.
pub(super) fn attach_line(at: &Attacher, waiting: bool) -> String {
    if waiting {
        format!("no libcuda mapped yet, waiting; {}", at.stats())
    } else {
        at.stats().to_string()
    }
}

async fn start_otlp(
    cli: &Cli,
    grpc: bool,
    hub: &nvml::Hub,
    snapshots: Snapshots,
    gpu_time: crate::analyze::gpu_time::Published,
    spawned: Option<&spawn::Spawned>,
) -> Result<export::otlp::Otlp> {
    // The driver version for the resource, when NVML is up in time.
    for _ in 0..20 {
        if hub.view().state != nvml::State::Starting {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let backends = match (cli.no_nvml, spawned.and_then(|s| s.injection.as_ref())) {
        (true, None) => "uprobes",
        (true, Some(_)) => "uprobes,cupti",
        (false, None) => "uprobes,nvml",
        (false, Some(_)) => "uprobes,cupti,nvml",
    };
    let cfg = export::otlp::Config {
        endpoint: cli.otlp_endpoint.clone(),
        grpc,
        interval: Duration::from_millis(cli.otlp_interval_ms),
        queue: cli.otlp_queue.max(1),
        timeout: Duration::from_secs(5),
        command_line: cli.otlp_command_line,
        threshold_ns: cli.threshold_us * 1000,
        trace_all: cli.trace_all,
        max_spans_per_sec: cli.otlp_max_spans_per_sec,
    };
    let o = export::otlp::start(cfg, snapshots, gpu_time, &hub.view(), backends)?;
    say(format_args!(
        "exporting OTLP ({}) to {}",
        if grpc { "gRPC" } else { "HTTP/protobuf" },
        cli.otlp_endpoint
            .as_deref()
            .unwrap_or("the OTEL_EXPORTER_OTLP_* endpoint")
    ));
    Ok(o)
}

/// Where output goes: `--output` (opened safely, export/output.rs) or stdout; and its name for
/// messages (the path, or "stdout").
fn open_output(path: Option<&Path>) -> Result<(Box<dyn Write + Send>, String)> {
    Ok(match path {
        Some(p) => (
            Box::new(BufWriter::with_capacity(
                1 << 16,
                export::output::create("--output", p)?,
            )),
            export::text::printable(&p.display().to_string()),
        ),
        None => (
            Box::new(BufWriter::with_capacity(1 << 16, std::io::stdout())),
            "stdout".into(),
        ),
    })
}
