//! The reader thread: drains the ring buffer on a short timer (records are submitted without
//! wakeups), decodes, correlates and writes JSON lines. Nothing here blocks the eBPF side: if
//! this thread falls behind, the ring fills and the eBPF programs count what they drop.

use std::{
    io::Write,
    os::fd::AsRawFd,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::Result;
use aya::maps::{MapData, RingBuf};

use crate::{
    correlate::{
        Correlator,
        gpu::{Status, state_message},
    },
    decode::{Body, Event, decode},
    export::{jsonl::JsonlWriter, otlp},
    sample::Hub,
};

/// How often the ring is drained when no wakeup comes (the eBPF side wakes us at half full).
const POLL_INTERVAL: Duration = Duration::from_millis(10);
const FLUSH_INTERVAL: Duration = Duration::from_millis(200);
const BATCH: usize = 4096;

pub type Output = JsonlWriter<Box<dyn Write + Send>>;

/// How often processes whose memory changed get a `memory` line.
const MEMORY_INTERVAL: Duration = Duration::from_secs(1);

/// State shared between the reader and the main task.
pub struct Shared {
    pub corr: Mutex<Correlator>,
    stop: AtomicBool,
    /// Set by SIGUSR1: write a leak report for every process.
    pub dump_leaks: AtomicBool,
    /// NVML samples waiting to be written.
    pub nvml: Arc<Hub>,
    /// What the main task knows that the exporters report: drops by kind, attach failures.
    pub agent: Mutex<AgentStats>,
    /// Notified when the reader's output fails (a closed pipe, a full disk): the main task
    /// stops observing at once instead of at the next signal.
    pub output_failed: tokio::sync::Notify,
}

#[derive(Default)]
pub struct AgentStats {
    pub drops: Vec<(&'static str, u64)>,
    pub attach_failures: u64,
}

impl Shared {
    pub fn new(corr: Correlator, nvml: Arc<Hub>) -> Self {
        Self {
            corr: Mutex::new(corr),
            nvml,
            agent: Mutex::new(AgentStats::default()),
            stop: AtomicBool::new(false),
            dump_leaks: AtomicBool::new(false),
            output_failed: tokio::sync::Notify::new(),
        }
    }
}

/// A clock's reading in ns.
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid timespec out-pointer.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_MONOTONIC in ns: the clock of `bpf_ktime_get_ns`, for lines the agent makes itself.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// CLOCK_REALTIME in µs: the clock of NVML's per-process sample timestamps.
pub fn realtime_us() -> u64 {
    clock_ns(libc::CLOCK_REALTIME) / 1000
}

pub struct Reader {
    shared: Arc<Shared>,
    handle: JoinHandle<Result<Option<Output>>>,
}

impl Reader {
    pub fn spawn(
        ring: RingBuf<MapData>,
        shared: Arc<Shared>,
        output: Option<Output>,
        otlp: Option<otlp::Sender>,
    ) -> Result<Self> {
        let s = shared.clone();
        let handle = std::thread::Builder::new().name("ring-reader".into()).spawn(move || {
            let r = run(ring, &s, output, otlp.as_ref());
            if r.is_err() {
                // A permit is stored if the main task is not waiting yet: never lost.
                s.output_failed.notify_one();
            }
            r
        })?;
        Ok(Self { shared, handle })
    }

    /// Stops after a last full drain, and gives the output back for the summary.
    pub fn stop(self) -> Result<Option<Output>> {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.handle
            .join()
            .map_err(|_| anyhow::anyhow!("ring reader thread panicked"))?
    }
}

/// Tells the user (stderr, and a `cupti` line) when a process's CUPTI state changes: GPU
/// timestamps start flowing, or another profiler holds CUPTI and the process is observed with
/// uprobes only.
fn report_changes(changes: &[(u32, u64, String, Status)], output: &mut Option<Output>) -> Result<()> {
    for (pid, ts, comm, status) in changes {
        crate::say(format_args!(
            "pid {pid} ({}): {}",
            crate::export::text::Printable(comm),
            state_message(status.state)
        ));
        if let Some(out) = output.as_mut() {
            out.cupti(*pid, *ts, comm, status)?;
        }
    }
    Ok(())
}

fn run(
    mut ring: RingBuf<MapData>,
    shared: &Shared,
    mut output: Option<Output>,
    otlp: Option<&otlp::Sender>,
) -> Result<Option<Output>> {
    let fd = ring.as_raw_fd();
    let mut batch: Vec<Event> = Vec::with_capacity(BATCH);
    let mut decode_errors = 0u64;
    let mut last_flush = Instant::now();
    let mut last_memory = Instant::now();
    let mut exited: Vec<u32> = Vec::new();
    let mut gpu = Vec::new();
    let mut changes = Vec::new();
    let mut last_expire = Instant::now();
    let mut nvml_lines = Vec::new();
    let mut devices = Vec::new();
    loop {
        // Read the flag before draining: whatever was submitted before stop() is drained below.
        let stopping = shared.stop.load(Ordering::SeqCst);
        if !stopping {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, POLL_INTERVAL.as_millis() as i32) };
        }
        loop {
            let mut drained = 0;
            while let Some(item) = ring.next() {
                match decode(&item) {
                    Ok(ev) => batch.push(ev),
                    Err(_) => decode_errors += 1,
                }
                drained += 1;
                if batch.len() == BATCH {
                    break;
                }
            }
            if drained == 0 {
                break;
            }
            {
                let mut corr = shared.corr.lock().expect("correlator lock");
                corr.decode_errors += std::mem::take(&mut decode_errors);
                for ev in &mut batch {
                    corr.observe(ev);
                    if matches!(ev.body, Body::ProcessExit) {
                        exited.push(ev.pid);
                    }
                }
                std::mem::swap(&mut gpu, &mut corr.gpu_out);
                std::mem::swap(&mut changes, &mut corr.cupti_changes);
            }
            report_changes(&changes, &mut output)?;
            changes.clear();
            if let Some(o) = otlp {
                for ev in &batch {
                    o.event(ev);
                }
                for a in &gpu {
                    o.gpu(a);
                }
            }
            if let Some(out) = output.as_mut() {
                for ev in &batch {
                    out.event(ev)?;
                }
                for a in &gpu {
                    out.gpu(a)?;
                }
                // A process that exited: what it never freed.
                if !exited.is_empty() {
                    let corr = shared.corr.lock().expect("correlator lock");
                    let now = monotonic_ns();
                    for pid in &exited {
                        if let Some(p) = corr.procs.get(pid) {
                            out.leaks(now, p)?;
                        }
                    }
                }
            }
            exited.clear();
            batch.clear();
            gpu.clear();
        }
        // GPU records that waited too long for their launch's API record go out unjoined
        // (all of them at the end).
        if stopping || last_expire.elapsed() >= MEMORY_INTERVAL {
            {
                let mut corr = shared.corr.lock().expect("correlator lock");
                corr.expire_gpu(if stopping { u64::MAX } else { monotonic_ns() });
                std::mem::swap(&mut gpu, &mut corr.gpu_out);
            }
            if let Some(out) = output.as_mut() {
                for a in &gpu {
                    out.gpu(a)?;
                }
            }
            if let Some(o) = otlp {
                for a in &gpu {
                    o.gpu(a);
                }
            }
            gpu.clear();
            last_expire = Instant::now();
        }
        if let Some(out) = output.as_mut() {
            let on_demand = shared.dump_leaks.swap(false, Ordering::SeqCst);
            if on_demand || stopping || last_memory.elapsed() >= MEMORY_INTERVAL {
                let mut corr = shared.corr.lock().expect("correlator lock");
                let now = monotonic_ns();
                for m in corr.memory_samples() {
                    let comm = corr.procs.get(&m.pid).map(|p| p.comm.as_str()).unwrap_or("");
                    out.memory(now, &m, comm)?;
                }
                if on_demand {
                    for p in corr.sorted().into_iter().filter(|p| !p.exited) {
                        out.leaks(now, p)?;
                    }
                }
                last_memory = Instant::now();
            }
        }
        if let Some(out) = output.as_mut() {
            // Taken out under the lock, written without it: the sampler never waits on output.
            {
                let mut hub = shared.nvml.lock();
                nvml_lines.extend(hub.pending.drain(..));
                if devices.len() != hub.devices.len() {
                    devices = hub.devices.clone();
                }
            }
            for (line, comm) in nvml_lines.drain(..) {
                out.nvml(&line, comm.as_deref(), &devices)?;
            }
        }
        if let Some(out) = output.as_mut()
            && (stopping || last_flush.elapsed() >= FLUSH_INTERVAL)
        {
            out.flush()?;
            last_flush = Instant::now();
        }
        if stopping {
            return Ok(output);
        }
    }
}
