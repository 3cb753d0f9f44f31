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
    correlate::Correlator,
    decode::{Event, decode},
    export::jsonl::JsonlWriter,
};

/// How often the ring is drained when no wakeup comes (the eBPF side wakes us at half full).
const POLL_INTERVAL: Duration = Duration::from_millis(10);
const FLUSH_INTERVAL: Duration = Duration::from_millis(200);
const BATCH: usize = 4096;

pub type Output = JsonlWriter<Box<dyn Write + Send>>;

/// State shared between the reader and the main task.
#[derive(Default)]
pub struct Shared {
    pub corr: Mutex<Correlator>,
    stop: AtomicBool,
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
    ) -> Result<Self> {
        let s = shared.clone();
        let handle = std::thread::Builder::new()
            .name("ring-reader".into())
            .spawn(move || run(ring, &s, output))?;
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

fn run(
    mut ring: RingBuf<MapData>,
    shared: &Shared,
    mut output: Option<Output>,
) -> Result<Option<Output>> {
    let fd = ring.as_raw_fd();
    let mut batch: Vec<Event> = Vec::with_capacity(BATCH);
    let mut decode_errors = 0u64;
    let mut last_flush = Instant::now();
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
                }
            }
            if let Some(out) = output.as_mut() {
                for ev in &batch {
                    out.event(ev)?;
                }
            }
            batch.clear();
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
