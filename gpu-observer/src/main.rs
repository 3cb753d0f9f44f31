//! gpu-observer: see what every CUDA process on this machine does with its GPUs, through eBPF
//! uprobes on libcuda and syscall tracepoints, with no change to the observed programs.
//!
//! Data flow, one module per stage: attach → (eBPF ring buffer) → pipeline (decode → correlate)
//! → export.

mod attach;
mod cli;
mod correlate;
mod decode;
mod export;
mod ioctl_names;
mod pipeline;
mod preflight;
mod sample;
mod spawn;

use std::{
    io::{BufWriter, IsTerminal, Write},
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Result, anyhow, bail};
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};

use crate::{
    attach::{Attacher, Probes, discover, discover::LibKind},
    cli::{Cli, Command, Format},
    correlate::Correlator,
    export::{jsonl::JsonlWriter, terminal},
    pipeline::{Reader, Shared},
};

fn main() {
    let cli = Cli::parse();
    if matches!(cli.command, Some(Command::Devices)) {
        std::process::exit(match export::devices::print(&cli) {
            Ok(()) => 0,
            Err(e) => {
                say(format_args!("error: {e:#}"));
                1
            }
        });
    }
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpu-observer: error: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    match rt.block_on(observe(cli)) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            say(format_args!("error: {e:#}"));
            std::process::exit(1);
        }
    }
}

/// A line on stderr. Messages name paths and processes that observed programs control: what
/// is left of their control characters is escaped here (export/text.rs).
pub(crate) fn say(msg: impl std::fmt::Display) {
    eprintln!("gpu-observer: {}", export::text::message(&msg.to_string()));
}

/// Observes until Ctrl-C, `--duration`, or the end of the observed (or started) process; the
/// exit code: 0, or the started program's.
async fn observe(cli: Cli) -> Result<i32> {
    // Everything the user gave is checked before anything is loaded or attached.
    if cli.format == Format::Json {
        bail!("--format json is for `gpu-observer devices`; events are written with --format jsonl");
    }
    let otlp_wanted = export::otlp::wanted(cli.otlp_endpoint.as_deref());
    if cli.format == Format::None && !otlp_wanted {
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
    for w in preflight::check()? {
        say(format_args!("warning: {w}"));
    }
    // Opened now, so a refused or unwritable --output fails before anything attaches.
    let sink = Sink::open(cli.output.as_deref())?;
    let mut spawned = match &cli.command {
        Some(Command::Run { .. }) if cli.pid.is_some() => {
            bail!("`run` observes the program it starts: drop --pid")
        }
        Some(Command::Run { command }) => Some(spawn::start(command, &cli)?),
        _ => None,
    };
    let pid_filter = spawned.as_ref().map(spawn::Spawned::pid).or(cli.pid);
    let probes = Probes::load(cli.ring_buffer_size, pid_filter, cli.perf_uprobes)?;
    let mut at = Attacher::new(probes, pid_filter, cli.max_libraries_per_user);
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

    let (output, mut summary_sink) = match cli.format {
        Format::Jsonl => (
            Some(JsonlWriter::new(sink.writer, cli.threshold_us * 1000, cli.trace_all)),
            None,
        ),
        Format::Terminal | Format::Json | Format::None => (None, Some(sink.writer)),
    };
    let dest = sink.name;
    let nvml_interval = Duration::from_millis(cli.nvml_interval_ms);
    let hub = Arc::new(sample::Hub::new(
        if cli.no_nvml {
            sample::State::Off
        } else {
            sample::State::Starting
        },
        nvml_interval,
        output.is_some(),
        pid_filter,
    ));
    let sampler = if cli.no_nvml {
        None
    } else {
        let cfg = sample::Config {
            interval: nvml_interval,
            lib: cli.nvml_lib.clone(),
        };
        Some(sample::Sampler::spawn(cfg, hub.clone())?)
    };
    let shared = Arc::new(Shared::new(
        Correlator::new(cli.threshold_us * 1000).with_memory_limit_mb(cli.memory_limit_mb, cli.ring_buffer_size),
        hub.clone(),
    ));
    let otlp = if let Some(grpc) = otlp_grpc {
        // The driver version for the resource, when NVML is up in time.
        for _ in 0..20 {
            if hub.lock().state != sample::State::Starting {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let backends = match (cli.no_nvml, spawned.as_ref().and_then(|s| s.injection.as_ref())) {
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
        let o = export::otlp::start(cfg, shared.clone(), hub.clone(), backends)?;
        say(format_args!(
            "exporting OTLP ({}) to {}",
            if grpc { "gRPC" } else { "HTTP/protobuf" },
            cli.otlp_endpoint
                .as_deref()
                .unwrap_or("the OTEL_EXPORTER_OTLP_* endpoint")
        ));
        Some(o)
    } else {
        None
    };
    let reader = Reader::spawn(
        at.probes.take_ring()?,
        shared.clone(),
        output,
        otlp.as_ref().and_then(export::otlp::Otlp::sender),
    )?;
    let started = Instant::now();
    say("ready");
    if let Some(s) = spawned.as_mut() {
        s.release()?;
        say(format_args!("started pid {}", s.pid()));
    }
    let mut exit_status = None;
    let mut waiting = mapped == 0 && spawned.is_none();
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
        cli.format == Format::Terminal && cli.output.is_none() && spawned.is_none() && std::io::stdout().is_terminal();
    let mut view = terminal::LiveView::default();
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigusr1 = signal(SignalKind::user_defined1())?;
    let interval = Duration::from_millis(cli.interval_ms);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let deadline = cli.duration.map(|s| started + Duration::from_secs_f64(s.max(0.0)));
    let mut last_drops = 0;
    // Set when an output fails (a closed pipe, a full disk): observing stops at once.
    let mut output_failed = false;
    loop {
        let sleep_until = deadline.map(tokio::time::Instant::from_std);
        tokio::select! {
            _ = shared.output_failed.notified() => {
                output_failed = true;
                break;
            }
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
            _ = sigusr1.recv() => {
                // Leak report on demand: `leak` lines in the JSON output, a table on stderr.
                shared.dump_leaks.store(true, std::sync::atomic::Ordering::SeqCst);
                let corr = shared.corr.lock().expect("correlator lock");
                eprint!("{}", terminal::leak_report(&corr));
            }
            _ = async { match sleep_until { Some(t) => tokio::time::sleep_until(t).await, None => std::future::pending().await } } => break,
            _ = tick.tick() => {
                let mapped = at.rescan();
                if waiting && mapped > 0 {
                    waiting = false;
                }
                if let Some(s) = spawned.as_mut()
                    && let Some(status) = s.child.try_wait()?
                {
                    say(format_args!("process {} exited ({status})", s.pid()));
                    exit_status = Some(status);
                    break;
                }
                if let Some(pid) = cli.pid
                    && !Path::new(&format!("/proc/{pid}")).exists()
                {
                    say(format_args!("process {pid} exited"));
                    break;
                }
                let drops = at.probes.drops().unwrap_or_default();
                {
                    let mut a = shared.agent.lock().expect("agent stats lock");
                    a.drops = drops.by_kind.iter().map(|(k, n)| (export::jsonl::drop_kind_name(*k), *n)).collect();
                    a.attach_failures = at.stats().refused_total();
                }
                if drops.total > last_drops {
                    say(format_args!(
                        "warning: ring buffer full: {} records dropped so far; raise --ring-buffer-size (now {} bytes) or narrow with --pid",
                        drops.total, cli.ring_buffer_size
                    ));
                    last_drops = drops.total;
                }
                if live {
                    let corr = shared.corr.lock().expect("correlator lock");
                    let gpus = hub.lock();
                    let text = view.render(&corr, &gpus, &drops, interval.as_secs_f64(), started.elapsed().as_secs_f64());
                    drop(gpus);
                    drop(corr);
                    let mut so = std::io::stdout().lock();
                    if let Err(e) = write!(so, "\x1b[H\x1b[2J{text}").and_then(|()| so.flush()) {
                        say(format_args!("error: writing the live view to {dest} failed: {e}; stopping"));
                        output_failed = true;
                        break;
                    }
                }
            }
        }
    }

    // A started program got the same Ctrl-C: give it a moment to finish (and flush CUPTI).
    if let (Some(s), None) = (spawned.as_mut(), exit_status) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while exit_status.is_none() && Instant::now() < deadline {
            exit_status = s.child.try_wait()?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if exit_status.is_none() {
            say(format_args!("process {} still runs; no longer observed", s.pid()));
        }
    }
    // The probes stop producing first: nothing waits on a program that is still running.
    at.probes.disable()?;
    // Then the sampler, so the reader's last drain has its last samples; an NVML call that
    // hangs is left behind rather than holding the exit (the process ends without it).
    if let Some(s) = sampler
        && !s.stop(SAMPLER_STOP_TIMEOUT)
    {
        say(format_args!(
            "warning: an NVML call has not returned for {} s; exiting without waiting for it",
            SAMPLER_STOP_TIMEOUT.as_secs()
        ));
    }
    let output = match reader.stop() {
        Ok(o) => o,
        Err(e) => {
            say(format_args!(
                "error: writing JSON lines to {dest} failed: {e:#}; stopped observing"
            ));
            output_failed = true;
            None
        }
    };
    let exported = otlp.map(|o| {
        let c = o.counters.clone();
        o.shutdown(Duration::from_secs(5));
        let j = c.json();
        say(format_args!(
            "OTLP: {} spans exported, {} dropped, {} sampled out; {} metric exports, {} failed; \
             {} ioctl spans not under their call and {} trace windows closed early (bounds)",
            j["spans_exported"],
            j["spans_dropped"],
            j["spans_sampled_out"],
            j["metric_exports"],
            j["metric_export_failures"],
            j["ioctls_unparented"],
            j["windows_closed_early"]
        ));
        j
    });
    let drops = at.probes.drops()?;
    let wall_ns = started.elapsed().as_nanos() as u64;
    let corr = shared.corr.lock().expect("correlator lock");
    let unattributed = drops
        .by_pid
        .iter()
        .filter(|(pid, _)| !corr.procs.contains_key(pid))
        .map(|(_, n)| n)
        .sum();
    let gpus = hub.lock();
    let text = format!(
        "{}{}\n",
        terminal::final_summary(&corr, &gpus, &drops, wall_ns),
        at.stats()
    );
    let written = match (output, summary_sink.as_mut()) {
        (Some(mut out), _) => out
            .summary(
                &corr,
                &gpus,
                &drops,
                wall_ns,
                unattributed,
                &[
                    ("otlp", exported.clone().unwrap_or(serde_json::Value::Null)),
                    ("libraries", at.stats().json()),
                ],
            )
            .and_then(|()| out.into_inner().flush())
            .map(|()| say(format_args!("{} events, {} dropped", corr.events, drops.total))),
        (None, Some(out)) if cli.format == Format::Terminal => {
            out.write_all(text.as_bytes()).and_then(|()| out.flush())
        }
        _ if output_failed => Err(std::io::Error::other("the output had already failed")),
        _ => {
            say(format_args!("{} events, {} dropped", corr.events, drops.total));
            Ok(())
        }
    };
    if let Err(e) = written {
        if !output_failed {
            say(format_args!("error: writing the summary to {dest} failed: {e}"));
        }
        output_failed = true;
    }
    for line in terminal::evicted_lines(&corr) {
        say(line);
    }
    if output_failed {
        // The summary still reaches the person: on stderr.
        eprint!("{text}");
    }
    drop(corr);
    drop(gpus);
    say(at.stats());
    // Detaching: ~0.4 s with uprobe-multi links (see attach/multi.rs).
    drop(at);
    if output_failed {
        return Ok(1);
    }
    Ok(exit_status.map_or(0, spawn::Spawned::exit_code))
}

/// How long shutdown waits for the NVML sampler's call in progress.
const SAMPLER_STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// Where output goes: `--output` (opened safely, export/output.rs) or stdout.
struct Sink {
    writer: Box<dyn Write + Send>,
    /// For messages: the path, or "stdout".
    name: String,
}

impl Sink {
    fn open(path: Option<&Path>) -> Result<Self> {
        Ok(match path {
            Some(p) => Self {
                writer: Box::new(BufWriter::with_capacity(1 << 16, export::output::create(p)?)),
                name: export::text::printable(&p.display().to_string()),
            },
            None => Self {
                writer: Box::new(BufWriter::with_capacity(1 << 16, std::io::stdout())),
                name: "stdout".into(),
            },
        })
    }
}
