//! Pipeline throughput baseline (`cargo xtask bench-pipeline`; docs/BENCHMARKS.md, "Pipeline
//! throughput baseline"): recorded ring-buffer records replayed through decode → correlate →
//! the JSON-lines sink (into `std::io::sink()`) on one core, without root or BPF. Prints events/s
//! and heap allocations per event, and judges them against the committed baseline:
//! FAIL (exit 1) when events/s < 0.9 × the baseline's or allocations per event > the baseline's
//! + 0.01.
//!
//! The recording (`--records`, by default the fixture tests/data/fake-workload.rec) is replayed
//! in passes until `--seconds` have gone by, `--runs` times, each run with a fresh pipeline; the
//! median run is reported. Each pass is a new set of processes: the pids of a pass are the
//! recorded ones plus pass × 1 000 003 (mod 2^32), tids and timestamps stay as recorded (they
//! only matter within a process, and a CUPTI recording still joins). A pass ends every process
//! it started (a process_exit is added for pids the recording does not end), as on a node
//! where jobs come and go: the agent keeps at most its budget of exited processes, so its state
//! stays bounded however long the run. The measured loop is what the reader thread does per
//! drain: `record` each item, `end_batch`, `tick`.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    collections::{BTreeMap, BTreeSet},
    io::BufWriter,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use clap::Parser;
use gpu_observer::{
    clock::monotonic_ns,
    correlate::{Correlator, DEFAULT_MEMORY_LIMIT_MB},
    export::{
        Sink,
        jsonl::{JsonlSink, JsonlWriter},
        perfetto::PerfettoSink,
    },
    nvml,
    pipeline::{Pipeline, recorded},
    snapshot::Publisher,
};
use gpu_observer_common::{
    event::{EventHeader, EventKind},
    limits::DEFAULT_RING_BYTES,
};
use serde_json::{Value, json};

/// Counts every allocation (and reallocation) the program makes.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: defers to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The rule (docs/BENCHMARKS.md): events/s may not drop below this fraction of the baseline…
const MIN_SPEED_RATIO: f64 = 0.9;
/// …and allocations per event may not grow by more than this.
const MAX_EXTRA_ALLOCS_PER_EVENT: f64 = 0.01;
/// The observer's default `--threshold-us`, in ns.
const THRESHOLD_NS: u64 = 100_000;

#[derive(Parser)]
#[command(
    name = "bench_pipeline",
    about = "Pipeline throughput: decode → correlate → JSON lines"
)]
struct Args {
    /// A `--record-ring` recording.
    #[arg(long, default_value = "tests/data/fake-workload.rec")]
    records: PathBuf,
    /// The committed baseline to judge against.
    #[arg(long, default_value = "bench/pipeline-baseline.json")]
    baseline: PathBuf,
    /// Seconds each run measures (at least).
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Runs (each with a fresh pipeline); the median is reported and judged.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Write the median as the new baseline instead of judging it.
    #[arg(long)]
    write_baseline: bool,
    /// Where the runs with the Perfetto sink write their trace (removed after each run).
    #[arg(long)]
    perfetto_file: Option<PathBuf>,
    /// Events a second the OTLP runs are paced to (0, the default: no OTLP runs). Reported,
    /// not judged.
    #[arg(long, default_value_t = 0)]
    otlp_rate: u64,
    /// The OTLP runs' processes: `fresh` (each pass a new set, so the per-process span budget
    /// never binds: every launch and ioctl a span, the worst case) or `long` (the recording's
    /// processes live on from pass to pass, their exits left out and each pass's timestamps
    /// moved to when it is replayed, as a node's long-running jobs do: the budget binds).
    #[arg(long, default_value = "fresh", value_parser = ["fresh", "long"])]
    otlp_processes: String,
}

/// One run's measurement.
#[derive(Clone, Copy, Debug)]
struct Measured {
    events: u64,
    passes: u64,
    secs: f64,
    allocs: u64,
    /// With the Perfetto sink: the trace's bytes per event (warm-up pass included).
    trace_bytes_per_event: f64,
}

impl Measured {
    fn events_per_s(&self) -> f64 {
        self.events as f64 / self.secs
    }

    fn allocs_per_event(&self) -> f64 {
        self.allocs as f64 / self.events as f64
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let file = std::fs::read(&args.records).with_context(|| format!("read {}", args.records.display()))?;
    let records = pass_of(&file)?;
    let machine = machine();
    // The collector stands in for a remote one: started before the pinning, so it is not on
    // the measured core.
    let receiver = Receiver::start()?;
    let cpu = pin_to_one_cpu()?;
    println!(
        "bench_pipeline: {} ({} records a pass, {} bytes), one core (CPU {cpu}) of {machine}",
        args.records.display(),
        records.len(),
        file.len()
    );
    let mut runs = Vec::new();
    for run in 0..args.runs.max(1) {
        let m = measure(&records, Duration::from_secs_f64(args.seconds), None)?;
        println!(
            "  run {}: {} events in {} passes, {:.2} s: {:.0} events/s, {:.4} allocations/event",
            run + 1,
            m.events,
            m.passes,
            m.secs,
            m.events_per_s(),
            m.allocs_per_event()
        );
        runs.push(m);
    }
    let mut by_speed = runs.clone();
    by_speed.sort_by(|a, b| a.events_per_s().total_cmp(&b.events_per_s()));
    let median = by_speed[by_speed.len() / 2];
    let mut allocs: Vec<f64> = runs.iter().map(Measured::allocs_per_event).collect();
    allocs.sort_by(f64::total_cmp);
    let allocs_per_event = allocs[allocs.len() / 2];
    let events_per_s = median.events_per_s();
    println!("median: {events_per_s:.0} events/s, {allocs_per_event:.4} allocations/event");
    perfetto_runs(&args, &records, events_per_s)?;
    if args.otlp_rate > 0 {
        otlp_runs(&args, &records, &receiver)?;
    }
    let recording = json!({
        "path": args.records.display().to_string(),
        "records": records.len(),
        "bytes": file.len(),
    });
    if args.write_baseline {
        let commit = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let baseline = json!({
            "events_per_s": events_per_s.round(),
            "allocs_per_event": (allocs_per_event * 10_000.0).round() / 10_000.0,
            "runs": runs.iter().map(|m| json!({
                "events_per_s": m.events_per_s().round(),
                "allocs_per_event": (m.allocs_per_event() * 10_000.0).round() / 10_000.0,
            })).collect::<Vec<_>>(),
            "seconds_per_run": args.seconds,
            "recording": recording,
            "machine": machine,
            "commit": commit,
            "rule": format!(
                "FAIL when events/s < {MIN_SPEED_RATIO} x events_per_s or allocations/event > allocs_per_event + {MAX_EXTRA_ALLOCS_PER_EVENT}"
            ),
        });
        std::fs::write(
            &args.baseline,
            format!("{}\n", serde_json::to_string_pretty(&baseline)?),
        )?;
        println!("baseline written to {}", args.baseline.display());
        return Ok(());
    }
    judge(&args.baseline, &recording, events_per_s, allocs_per_event)
}

/// The same runs with a Perfetto sink beside the JSON lines, writing a trace file: events/s
/// side by side with the plain median, and the trace's bytes per event. Not judged.
fn perfetto_runs(args: &Args, records: &[Vec<u8>], plain_events_per_s: f64) -> Result<()> {
    let path = args
        .perfetto_file
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("bench_pipeline.{}.pftrace", std::process::id())));
    let mut runs = Vec::new();
    for run in 0..args.runs.max(1) {
        let m = measure(records, Duration::from_secs_f64(args.seconds), Some(&path));
        let _ = std::fs::remove_file(&path);
        let m = m?;
        println!(
            "  with --perfetto, run {}: {} events in {} passes, {:.2} s: {:.0} events/s, {:.4} allocations/event, {:.1} trace bytes/event",
            run + 1,
            m.events,
            m.passes,
            m.secs,
            m.events_per_s(),
            m.allocs_per_event(),
            m.trace_bytes_per_event
        );
        runs.push(m);
    }
    runs.sort_by(|a, b| a.events_per_s().total_cmp(&b.events_per_s()));
    let median = runs[runs.len() / 2];
    println!(
        "median with --perfetto: {:.0} events/s ({:.3} × the {plain_events_per_s:.0} without), {:.4} allocations/event, {:.1} trace bytes/event",
        median.events_per_s(),
        median.events_per_s() / plain_events_per_s,
        median.allocs_per_event(),
        median.trace_bytes_per_event
    );
    Ok(())
}

/// A stand-in OTLP/HTTP collector on the loopback: reads each request (Content-Length bodies,
/// keep-alive) and answers 200 with an empty protobuf response, counting the bytes.
struct Receiver {
    port: u16,
    bytes: std::sync::Arc<AtomicU64>,
    /// CPU time its threads took, ns (not the agent's: subtracted from the process's).
    cpu_ns: std::sync::Arc<AtomicU64>,
}

impl Receiver {
    fn start() -> Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let bytes = std::sync::Arc::new(AtomicU64::new(0));
        let cpu_ns = std::sync::Arc::new(AtomicU64::new(0));
        let (b, c) = (bytes.clone(), cpu_ns.clone());
        std::thread::Builder::new()
            .name("otlp-receiver".into())
            .spawn(move || {
                for conn in listener.incoming().flatten() {
                    let (b, c) = (b.clone(), c.clone());
                    std::thread::spawn(move || {
                        let before = thread_cpu_ns();
                        let _ = serve(conn, &b, &c, before);
                    });
                }
            })?;
        Ok(Self { port, bytes, cpu_ns })
    }
}

/// One connection's requests, until it closes.
fn serve(conn: std::net::TcpStream, bytes: &AtomicU64, cpu_ns: &AtomicU64, mut cpu_mark: u64) -> Result<()> {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut out = conn.try_clone()?;
    let mut r = BufReader::with_capacity(1 << 16, conn);
    let mut line = String::new();
    let mut body = Vec::new();
    loop {
        let mut len = 0usize;
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                return Ok(());
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v.trim().parse().context("content-length")?;
            }
        }
        body.resize(len, 0);
        r.read_exact(&mut body)?;
        bytes.fetch_add(len as u64, Ordering::Relaxed);
        out.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n")?;
        let now = thread_cpu_ns();
        cpu_ns.fetch_add(now - cpu_mark, Ordering::Relaxed);
        cpu_mark = now;
    }
}

fn thread_cpu_ns() -> u64 {
    cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn process_cpu_ns() -> u64 {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_clock(clock: libc::clockid_t) -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(clock, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The OTLP runs: the pipeline as the agent runs it with `--format none` and an OTLP endpoint
/// (the DaemonSet's), the default adaptive sampling (100 µs threshold, 10 000 spans a second
/// per process), paced to `--otlp-rate` events a second for `--seconds`, then drained (the
/// span thread exports what is queued). Reported: whether nothing was dropped and the pace
/// held, and the core's share the agent's threads took (the receiver's CPU left out). The
/// processes are new each pass or long-lived (`--otlp-processes`). Spans go to [`Receiver`]
/// over HTTP/protobuf.
fn otlp_runs(args: &Args, records: &[Vec<u8>], receiver: &Receiver) -> Result<()> {
    use gpu_observer::export::otlp;
    let rate = args.otlp_rate as f64;
    let long = args.otlp_processes == "long";
    // Long-lived: no exits, and each pass's timestamps squeezed into the time it takes at the
    // pace, after the last pass's (the span budget counts seconds of these timestamps).
    let kept: Vec<Vec<u8>>;
    let (records, mut clock) = if long {
        kept = records
            .iter()
            .filter(|r| {
                gpu_observer_common::event::read_record::<EventHeader>(r)
                    .is_none_or(|h| h.kind != EventKind::ProcessExit as u32)
            })
            .cloned()
            .collect();
        let ts = || {
            kept.iter()
                .filter_map(|r| gpu_observer_common::event::read_record::<EventHeader>(r))
                .map(|h| h.ts_ns)
        };
        let (first, last) = (ts().min().unwrap_or(0), ts().max().unwrap_or(0));
        let pass_ns = (kept.len() as f64 / rate * 1e9) as u64;
        let clock = PassClock {
            first,
            span: (last - first).max(1),
            pass_ns,
            base: 0,
        };
        (&kept[..], Some(clock))
    } else {
        (records, None)
    };
    println!(
        "with OTLP: {} processes",
        if long { "long-lived" } else { "new each pass" }
    );
    let mut failed = false;
    for run in 0..args.runs.max(1) {
        let hub = nvml::Hub::new(nvml::State::Off, Duration::from_millis(100), None);
        let (publisher, snapshots) = Publisher::new(hub.view());
        let cfg = otlp::Config {
            endpoint: Some(format!("http://127.0.0.1:{}", receiver.port)),
            grpc: false,
            interval: Duration::from_secs(10),
            queue: 65_536,
            timeout: Duration::from_secs(5),
            command_line: false,
            threshold_ns: THRESHOLD_NS,
            trace_all: false,
            max_spans_per_sec: 10_000,
        };
        let exporter = otlp::start(cfg, snapshots, Default::default(), &hub.view(), "cuda")?;
        let sender = exporter.sender().context("the OTLP sender")?;
        let corr = Correlator::new(THRESHOLD_NS).with_memory_limit_mb(DEFAULT_MEMORY_LIMIT_MB, DEFAULT_RING_BYTES);
        let mut pipe = Pipeline::new(
            corr,
            vec![Box::new(sender)],
            hub,
            None,
            publisher,
            Default::default(),
            monotonic_ns(),
        );
        let (cpu0, recv_cpu0, bytes0, allocs0) = (
            process_cpu_ns(),
            receiver.cpu_ns.load(Ordering::Relaxed),
            receiver.bytes.load(Ordering::Relaxed),
            ALLOCS.load(Ordering::Relaxed),
        );
        let start = Instant::now();
        if let Some(c) = &mut clock {
            c.base = monotonic_ns();
        }
        let (mut events, mut pass, mut item) = (0u64, 0u32, Vec::new());
        while start.elapsed().as_secs_f64() < args.seconds {
            // Paced: a pass is due when the events before it are, at the rate.
            let due = Duration::from_secs_f64(events as f64 / rate);
            if let Some(ahead) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(ahead);
            }
            if let Some(c) = &clock {
                replay_later(&mut pipe, records, c, u64::from(pass), &mut item)?;
            } else {
                replay_pass(&mut pipe, records, pass, &mut item)?;
            }
            events += records.len() as u64;
            pass = pass.wrapping_add(1);
        }
        let replayed = start.elapsed().as_secs_f64();
        drop(pipe.finish(monotonic_ns())?);
        let counters = exporter.counters.clone();
        exporter.shutdown(Duration::from_secs(10));
        let wall = start.elapsed().as_secs_f64();
        let recv_cpu = receiver.cpu_ns.load(Ordering::Relaxed) - recv_cpu0;
        let cpu = (process_cpu_ns() - cpu0).saturating_sub(recv_cpu) as f64 / 1e9;
        let allocs = ALLOCS.load(Ordering::Relaxed) - allocs0;
        let c = counters.json();
        let (exported, dropped, sampled_out, failures) = (
            c["spans_exported"].as_u64().unwrap_or(0),
            c["spans_dropped"].as_u64().unwrap_or(0),
            c["spans_sampled_out"].as_u64().unwrap_or(0),
            c["trace_export_failures"].as_u64().unwrap_or(0),
        );
        let paced = events as f64 / replayed;
        println!(
            "  with OTLP, run {}: {events} events paced at {paced:.0}/s over {replayed:.2} s, drained by {wall:.2} s; agent threads {:.1} % of the core; {exported} spans exported ({:.1} MB), {sampled_out} sampled out, {dropped} dropped, {failures} failed exports; {:.3} allocations/event",
            run + 1,
            cpu / wall * 100.0,
            (receiver.bytes.load(Ordering::Relaxed) - bytes0) as f64 / 1e6,
            allocs as f64 / events as f64,
        );
        if dropped > 0 || failures > 0 || exported == 0 || paced < 0.98 * rate {
            failed = true;
        }
    }
    if failed {
        println!("with OTLP at {rate:.0} events/s: NOT HELD (a run dropped, failed to export or fell behind the pace)");
    } else {
        println!("with OTLP at {rate:.0} events/s: held (every run kept the pace, dropped nothing)");
    }
    Ok(())
}

/// One pass of the recording as a new set of processes (see [`measure`]).
fn replay_pass(pipe: &mut Pipeline, records: &[Vec<u8>], pass: u32, item: &mut Vec<u8>) -> Result<()> {
    let offset = pass.wrapping_mul(1_000_003);
    replay(pipe, records, item, |item| {
        patch::<4>(item, PID_AT, |old| {
            u32::from_ne_bytes(old).wrapping_add(offset).to_ne_bytes()
        })
    })
}

/// Where the long-lived replay puts a pass's timestamps: pass k's `[first, first + span]`
/// onto `[base + k × pass_ns, base + (k + 1) × pass_ns)`, `base` the run's start on the
/// monotonic clock: the replay's time runs with the clock the trace windows close by.
struct PassClock {
    first: u64,
    span: u64,
    pass_ns: u64,
    base: u64,
}

/// Pass `pass` of the recording by the same processes, at the time [`PassClock`] gives it.
fn replay_later(pipe: &mut Pipeline, records: &[Vec<u8>], c: &PassClock, pass: u64, item: &mut Vec<u8>) -> Result<()> {
    replay(pipe, records, item, |item| {
        patch::<8>(item, TS_AT, |old| {
            let into = u128::from(u64::from_ne_bytes(old).saturating_sub(c.first)) * u128::from(c.pass_ns)
                / u128::from(c.span);
            (c.base + pass * c.pass_ns + into as u64).to_ne_bytes()
        })
    })
}

/// One pass of the recording through the pipeline, each record changed by `change` first;
/// then what the reader does after a drain.
fn replay(pipe: &mut Pipeline, records: &[Vec<u8>], item: &mut Vec<u8>, change: impl Fn(&mut [u8])) -> Result<()> {
    for r in records {
        item.clear();
        item.extend_from_slice(r);
        change(item);
        pipe.record(item)?;
    }
    pipe.end_batch()?;
    pipe.tick(monotonic_ns(), false)
}

/// Rewrites the `N` header bytes at `at` of a record (one too short is left as it is).
fn patch<const N: usize>(item: &mut [u8], at: usize, f: impl Fn([u8; N]) -> [u8; N]) {
    if let Some(field) = item.get_mut(at..at + N)
        && let Ok(old) = <[u8; N]>::try_from(&*field)
    {
        field.copy_from_slice(&f(old));
    }
}

/// Compares with the baseline; exits 1 on FAIL.
fn judge(path: &Path, recording: &Value, events_per_s: f64, allocs_per_event: f64) -> Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read the baseline {}", path.display()))?;
    let base: Value = serde_json::from_str(&text)?;
    let (Some(base_speed), Some(base_allocs)) = (base["events_per_s"].as_f64(), base["allocs_per_event"].as_f64())
    else {
        bail!("{}: no events_per_s / allocs_per_event", path.display());
    };
    let speed = events_per_s / base_speed;
    println!(
        "baseline ({}, commit {}): {base_speed:.0} events/s, {base_allocs:.4} allocations/event",
        base["machine"].as_str().unwrap_or("?"),
        base["commit"].as_str().unwrap_or("?")
    );
    println!(
        "ratio: {speed:.3} × the baseline's events/s, {:+.4} allocations/event",
        allocs_per_event - base_allocs
    );
    if base["recording"]["records"] != recording["records"] || base["recording"]["bytes"] != recording["bytes"] {
        println!(
            "not judged: the baseline was measured on another recording ({})",
            base["recording"]
        );
        return Ok(());
    }
    let mut failed = Vec::new();
    if speed < MIN_SPEED_RATIO {
        failed.push(format!(
            "events/s {events_per_s:.0} < {MIN_SPEED_RATIO} × {base_speed:.0}"
        ));
    }
    if allocs_per_event > base_allocs + MAX_EXTRA_ALLOCS_PER_EVENT {
        failed.push(format!(
            "allocations/event {allocs_per_event:.4} > {base_allocs:.4} + {MAX_EXTRA_ALLOCS_PER_EVENT}"
        ));
    }
    if failed.is_empty() {
        println!("PASS");
        Ok(())
    } else {
        println!("FAIL: {}", failed.join("; "));
        std::process::exit(1);
    }
}

/// The records of one pass: the recording's, then a process_exit for every pid it leaves
/// running.
fn pass_of(file: &[u8]) -> Result<Vec<Vec<u8>>> {
    let mut records: Vec<Vec<u8>> = recorded(file)?.map(<[u8]>::to_vec).collect();
    if records.is_empty() {
        bail!("the recording holds no records");
    }
    let mut seen: BTreeMap<u32, EventHeader> = BTreeMap::new();
    let mut ended = BTreeSet::new();
    for r in &records {
        let Some(h) = gpu_observer_common::event::read_record::<EventHeader>(r) else {
            continue;
        };
        if h.kind == EventKind::ProcessExit as u32 {
            ended.insert(h.pid);
        }
        let last = seen.entry(h.pid).or_insert(h);
        if h.ts_ns >= last.ts_ns {
            *last = h;
        }
    }
    for (pid, last) in seen {
        if !ended.contains(&pid) {
            let exit = EventHeader {
                kind: EventKind::ProcessExit as u32,
                api: 0,
                pid,
                tid: pid,
                ts_ns: last.ts_ns,
                comm: last.comm,
            };
            // SAFETY: viewing a plain #[repr(C)] record of integers as its bytes.
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    (&exit as *const EventHeader).cast::<u8>(),
                    std::mem::size_of::<EventHeader>(),
                )
            };
            records.push(bytes.to_vec());
        }
    }
    Ok(records)
}

/// Byte offset of the pid in a record's header.
const PID_AT: usize = std::mem::offset_of!(EventHeader, pid);
/// Byte offset of the timestamp in a record's header.
const TS_AT: usize = std::mem::offset_of!(EventHeader, ts_ns);

/// One run: a fresh pipeline (as the agent configures it with `--format jsonl --trace-all`,
/// the default memory limit, no NVML), a pass to warm up, then passes until `min` has gone by.
fn measure(records: &[Vec<u8>], min: Duration, perfetto: Option<&Path>) -> Result<Measured> {
    let corr = Correlator::new(THRESHOLD_NS).with_memory_limit_mb(DEFAULT_MEMORY_LIMIT_MB, DEFAULT_RING_BYTES);
    // The agent's writer: a 64 KiB buffer in front of the output (export/output.rs).
    let out = BufWriter::with_capacity(1 << 16, std::io::sink());
    let sinks: Vec<Box<dyn Sink>> = vec![Box::new(JsonlSink {
        writer: JsonlWriter::new(out, THRESHOLD_NS, true),
        dest: "std::io::sink()".into(),
    })];
    let mut sinks = sinks;
    if let Some(path) = perfetto {
        let _ = std::fs::remove_file(path);
        sinks.push(Box::new(PerfettoSink::create(path, u64::MAX)?));
    }
    let hub = nvml::Hub::new(nvml::State::Off, Duration::from_millis(100), None);
    let (publisher, _snapshots) = Publisher::new(hub.view());
    let mut pipe = Pipeline::new(corr, sinks, hub, None, publisher, Default::default(), monotonic_ns());
    let longest = records.iter().map(Vec::len).max().unwrap_or(0);
    let mut item = Vec::with_capacity(longest);
    let mut pass = 0u32;
    let mut one_pass = |pipe: &mut Pipeline, pass: u32| replay_pass(pipe, records, pass, &mut item);
    one_pass(&mut pipe, pass)?;
    pass += 1;
    let (start, allocs) = (Instant::now(), ALLOCS.load(Ordering::Relaxed));
    let mut passes = 0u64;
    while passes == 0 || start.elapsed() < min {
        one_pass(&mut pipe, pass)?;
        pass = pass.wrapping_add(1);
        passes += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let allocs = ALLOCS.load(Ordering::Relaxed) - allocs;
    // Closes the sinks: the trace is flushed.
    drop(pipe.finish(monotonic_ns())?);
    let trace_bytes = perfetto.and_then(|p| std::fs::metadata(p).ok()).map_or(0, |m| m.len());
    Ok(Measured {
        events: passes * records.len() as u64,
        passes,
        secs,
        allocs,
        trace_bytes_per_event: trace_bytes as f64 / ((passes + 1) * records.len() as u64) as f64,
    })
}

/// Pins this (single-threaded) process to the last CPU it may run on; returns that CPU.
fn pin_to_one_cpu() -> Result<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the calls get its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            bail!("sched_getaffinity: {}", std::io::Error::last_os_error());
        }
        let cpu = (0..libc::CPU_SETSIZE as usize)
            .rev()
            .find(|&c| libc::CPU_ISSET(c, &set))
            .context("no CPU in the affinity mask")?;
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one) != 0 {
            bail!("sched_setaffinity: {}", std::io::Error::last_os_error());
        }
        Ok(cpu)
    }
}

/// "AMD EPYC, 2 CPUs, x86_64, Linux 6.18.44" from /proc.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split(':').nth(1)))
        .map_or("unknown CPU", str::trim);
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{model}, {cpus} CPUs, {}, Linux {}",
        std::env::consts::ARCH,
        kernel.trim()
    )
}
