//! The NVML sampler: its own thread, sampling every device (and the processes on it) each
//! interval, into a bounded history (seed 002: 600 samples per device) that the terminal view,
//! the summaries and the JSON lines read.
//!
//! A thread of its own because NVML calls block (some for milliseconds), and nothing here may
//! delay the ring-buffer reader. Without NVML (no driver, no library) the observer runs on and
//! says so; a metric a GPU lacks is absent, never 0.

pub mod nvml;

use std::{
    collections::{HashMap, VecDeque},
    path::PathBuf,
    sync::{Arc, Mutex, mpsc},
    thread::JoinHandle,
    time::{Duration, Instant},
};

pub use nvml::{DeviceInfo, DeviceSample, ProcessSample, QUERIES, QUERY_NAMES, QueryStat};

/// Seed 002: 60 s of history at 100 ms.
pub const HISTORY: usize = 600;
/// Lines waiting for the JSON writer; more are counted as dropped (the writer drains every
/// 10 ms, so this only fills when the output is stuck).
const PENDING_MAX: usize = 8192;
/// Processes remembered for the summary; the longest unseen go first.
const PROCS_MAX: usize = 4096;
/// The tiers of [`nvml::Tiers`], by what each query costs (the budget: < 0.1 % of a
/// core at a 100 ms interval).
const MEDIUM_INTERVAL: Duration = Duration::from_millis(500);
const SLOW_INTERVAL: Duration = Duration::from_secs(2);
const PCIE_INTERVAL: Duration = Duration::from_secs(5);
const RARE_INTERVAL: Duration = Duration::from_secs(10);

/// A period that is due on the first call, then every `period` (at least the interval).
struct Every {
    period: Duration,
    last: Option<Instant>,
}

impl Every {
    fn new(period: Duration, interval: Duration) -> Self {
        Self {
            period: period.max(interval),
            last: None,
        }
    }

    fn due(&mut self, now: Instant) -> bool {
        // Half an interval of slack: a round that comes a little early still counts.
        let due = self.last.is_none_or(|t| now + self.period / 20 >= t + self.period);
        if due {
            self.last = Some(now);
        }
        due
    }
}

pub struct Config {
    pub interval: Duration,
    pub lib: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// `--no-nvml`.
    Off,
    Starting,
    Unavailable,
    Active,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::Off => "off",
            State::Starting => "starting",
            State::Unavailable => "unavailable",
            State::Active => "active",
        }
    }
}

/// What NVML said about one process over the run.
#[derive(Clone, Debug, Default)]
pub struct ProcUse {
    pub comm: String,
    /// Devices it was seen on, ascending.
    pub devices: Vec<u32>,
    /// Latest memory over all its devices, and the most seen at once.
    pub memory_bytes: u64,
    pub memory_max_bytes: u64,
    /// SM utilization (percent) of the samples NVML had for it.
    pub sm_util_sum: u64,
    pub sm_util_samples: u64,
    pub sm_util_max: u32,
    /// Latest SM utilization and when it was seen.
    pub sm_util_last: Option<u32>,
    pub last_ns: u64,
}

impl ProcUse {
    pub fn sm_util_mean(&self) -> Option<f64> {
        (self.sm_util_samples > 0).then(|| self.sm_util_sum as f64 / self.sm_util_samples as f64)
    }
}

/// A metric over the run: mean and max of the samples that had it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Agg {
    pub n: u64,
    pub sum: f64,
    pub max: f64,
}

impl Agg {
    fn add(&mut self, v: Option<f64>) {
        if let Some(v) = v {
            self.max = if self.n == 0 { v } else { self.max.max(v) };
            self.n += 1;
            self.sum += v;
        }
    }

    pub fn mean(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }

    pub fn max(&self) -> Option<f64> {
        (self.n > 0).then_some(self.max)
    }
}

/// One device over the whole run (the history ring only holds the last minute).
#[derive(Clone, Debug, Default)]
pub struct DeviceTotals {
    pub samples: u64,
    pub util_gpu: Agg,
    pub util_memory: Agg,
    pub memory_used: Agg,
    pub power_w: Agg,
    pub temperature_c: Agg,
    pub sm_clock_mhz: Agg,
    pub throttled_samples: u64,
}

/// A line for the JSON writer.
pub enum Line {
    /// A device's description, when the sampler started (ts_ns).
    Info(DeviceInfo, u64),
    Device(DeviceSample),
    Process(ProcessSample),
}

/// The sampler's cost, measured on its own thread (seed 002 §9.1).
#[derive(Clone, Copy, Debug, Default)]
pub struct Cost {
    pub samples: u64,
    pub cpu_ns: u64,
    pub wall_ns: u64,
    pub stats: [QueryStat; QUERIES],
}

impl Cost {
    pub fn cpu_ratio(&self) -> f64 {
        if self.wall_ns == 0 {
            0.0
        } else {
            self.cpu_ns as f64 / self.wall_ns as f64
        }
    }
}

pub struct HubState {
    pub state: State,
    /// Why NVML is unavailable, or which library is in use.
    pub message: String,
    pub interval: Duration,
    pub devices: Vec<DeviceInfo>,
    pub history: Vec<VecDeque<DeviceSample>>,
    pub totals: Vec<DeviceTotals>,
    pub procs: HashMap<u32, ProcUse>,
    pub pending: VecDeque<(Line, Option<String>)>,
    pub lines_dropped: u64,
    pub cost: Cost,
    /// JSON lines output: queue every sample for the writer.
    lines: bool,
    /// With `--pid`: only this process's per-process lines are written.
    pid: Option<u32>,
}

/// Shared between the sampler thread and its readers.
pub struct Hub {
    pub inner: Mutex<HubState>,
}

impl Hub {
    pub fn new(state: State, interval: Duration, lines: bool, pid: Option<u32>) -> Self {
        Self {
            inner: Mutex::new(HubState {
                state,
                message: String::new(),
                interval,
                devices: Vec::new(),
                history: Vec::new(),
                totals: Vec::new(),
                procs: HashMap::new(),
                pending: VecDeque::new(),
                lines_dropped: 0,
                cost: Cost::default(),
                lines,
                pid,
            }),
        }
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, HubState> {
        self.inner.lock().expect("nvml hub lock")
    }
}

impl HubState {
    fn queue(&mut self, line: Line, comm: Option<String>) {
        if !self.lines {
            return;
        }
        if self.pending.len() >= PENDING_MAX {
            self.lines_dropped += 1;
            return;
        }
        self.pending.push_back((line, comm));
    }

    fn started(&mut self, devices: Vec<DeviceInfo>, message: String) {
        self.state = State::Active;
        self.message = message;
        self.history = devices.iter().map(|_| VecDeque::with_capacity(HISTORY)).collect();
        self.totals = vec![DeviceTotals::default(); devices.len()];
        for d in &devices {
            self.queue(Line::Info(d.clone(), crate::pipeline::monotonic_ns()), None);
        }
        self.devices = devices;
    }

    fn record(&mut self, s: DeviceSample) {
        let i = s.device as usize;
        let t = &mut self.totals[i];
        t.samples += 1;
        t.util_gpu.add(s.util_gpu.map(f64::from));
        t.util_memory.add(s.util_memory.map(f64::from));
        t.memory_used.add(s.memory_used.map(|b| b as f64));
        t.power_w.add(s.power_mw.map(|mw| f64::from(mw) / 1000.0));
        t.temperature_c.add(s.temperature_c.map(f64::from));
        t.sm_clock_mhz.add(s.clocks.sm.map(f64::from));
        // Idle is not a slowdown worth counting.
        if s.throttle_reasons.is_some_and(|r| r & !0x1 != 0) {
            t.throttled_samples += 1;
        }
        let h = &mut self.history[i];
        if h.len() == HISTORY {
            h.pop_front();
        }
        h.push_back(s.clone());
        self.queue(Line::Device(s), None);
    }

    /// One round of process samples (all devices), `ts_ns` the round's time.
    fn record_procs(&mut self, ts_ns: u64, procs: Vec<ProcessSample>) {
        // Latest memory is the sum over the devices of this round.
        let mut round: HashMap<u32, u64> = HashMap::new();
        for p in &procs {
            *round.entry(p.pid).or_default() += p.memory_bytes.unwrap_or(0);
        }
        for p in procs {
            if !self.procs.contains_key(&p.pid) && self.procs.len() >= PROCS_MAX {
                let oldest = self.procs.iter().min_by_key(|(_, u)| u.last_ns).map(|(pid, _)| *pid);
                if let Some(pid) = oldest {
                    self.procs.remove(&pid);
                }
            }
            let u = self.procs.entry(p.pid).or_insert_with(|| ProcUse {
                comm: comm_of(p.pid),
                ..ProcUse::default()
            });
            if let Err(at) = u.devices.binary_search(&p.device) {
                u.devices.insert(at, p.device);
            }
            u.memory_bytes = round[&p.pid];
            u.memory_max_bytes = u.memory_max_bytes.max(u.memory_bytes);
            if let Some(sm) = p.util_sm {
                u.sm_util_sum += u64::from(sm);
                u.sm_util_samples += 1;
                u.sm_util_max = u.sm_util_max.max(sm);
            }
            u.sm_util_last = p.util_sm;
            u.last_ns = ts_ns;
            let comm = u.comm.clone();
            if self.wants(p.pid) {
                self.queue(Line::Process(p), Some(comm));
            }
        }
    }

    /// Whether a process is in the observer's scope (`--pid`).
    pub fn wants(&self, pid: u32) -> bool {
        self.pid.is_none_or(|p| p == pid)
    }

    /// The latest sample of each device.
    pub fn latest(&self) -> impl Iterator<Item = (&DeviceInfo, Option<&DeviceSample>)> {
        self.devices.iter().zip(self.history.iter()).map(|(d, h)| (d, h.back()))
    }
}

fn comm_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim_end().to_string())
        .unwrap_or_default()
}

/// The running sampler thread.
pub struct Sampler {
    stop: mpsc::Sender<()>,
    handle: JoinHandle<()>,
}

impl Sampler {
    pub fn spawn(cfg: Config, hub: Arc<Hub>) -> std::io::Result<Self> {
        let (stop, stopped) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("nvml-sampler".into())
            .spawn(move || run(cfg, &hub, &stopped))?;
        Ok(Self { stop, handle })
    }

    /// Stops after the sample in progress, waiting at most `timeout` for it: an NVML call can
    /// hang in the driver, and must not hold the observer's exit. False when it did not stop
    /// in time (the thread is left to the process's exit).
    pub fn stop(self, timeout: Duration) -> bool {
        drop(self.stop);
        let deadline = Instant::now() + timeout;
        while !self.handle.is_finished() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.handle.join();
        true
    }
}

/// CPU time of the calling thread (what the sampler costs, NVML's work in it included).
fn thread_cpu_ns() -> u64 {
    crate::pipeline::clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn run(cfg: Config, hub: &Hub, stopped: &mpsc::Receiver<()>) {
    let nvml = match nvml::open(cfg.lib.as_deref()).and_then(|n| n.discover().map(|d| (n, d))) {
        Ok(v) => v,
        Err(why) => {
            eprintln!("gpu-observer: NVML unavailable: {why}; GPU device metrics are off, everything else runs");
            let mut h = hub.lock();
            h.state = State::Unavailable;
            h.message = why;
            return;
        }
    };
    let (nvml, devices) = nvml;
    let names: Vec<String> = devices.iter().map(|d| format!("{} {}", d.index, d.name)).collect();
    eprintln!(
        "gpu-observer: NVML {}: {} device(s) [{}], sampled every {} ms",
        nvml.path,
        devices.len(),
        names.join(", "),
        cfg.interval.as_millis()
    );
    let count = devices.len() as u32;
    hub.lock().started(devices, format!("NVML from {}", nvml.path));
    let mut sampler = nvml::Sampler::new(&nvml, count);
    let (cpu0, wall0) = (thread_cpu_ns(), Instant::now());
    let mut next = Instant::now();
    let mut medium = Every::new(MEDIUM_INTERVAL, cfg.interval);
    let mut slow = Every::new(SLOW_INTERVAL, cfg.interval);
    let mut pcie = Every::new(PCIE_INTERVAL, cfg.interval);
    let mut rare = Every::new(RARE_INTERVAL, cfg.interval);
    let mut procs = Vec::new();
    loop {
        let ts_ns = crate::pipeline::monotonic_ns();
        let now = Instant::now();
        let tiers = nvml::Tiers {
            medium: medium.due(now),
            slow: slow.due(now),
            pcie: pcie.due(now),
            rare: rare.due(now),
        };
        let samples: Vec<DeviceSample> = (0..count as usize)
            .filter_map(|i| sampler.sample(i, ts_ns, tiers, &mut procs))
            .collect();
        {
            let mut h = hub.lock();
            for s in samples {
                h.record(s);
            }
            h.record_procs(ts_ns, std::mem::take(&mut procs));
            h.cost = Cost {
                samples: h.cost.samples + 1,
                cpu_ns: thread_cpu_ns() - cpu0,
                wall_ns: wall0.elapsed().as_nanos() as u64,
                stats: sampler.stats,
            };
        }
        next += cfg.interval;
        let now = Instant::now();
        if next < now {
            // Fell behind (a slow query): skip the missed rounds rather than burst.
            next = now + cfg.interval;
        }
        match stopped.recv_timeout(next - now) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => break,
        }
    }
    let mut h = hub.lock();
    h.cost.cpu_ns = thread_cpu_ns() - cpu0;
    h.cost.wall_ns = wall0.elapsed().as_nanos() as u64;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(device: u32, used: u64, util: Option<u32>) -> DeviceSample {
        DeviceSample {
            device,
            memory_used: Some(used),
            util_gpu: util,
            ..DeviceSample::default()
        }
    }

    #[test]
    fn history_keeps_the_last_600_samples_and_totals_keep_all() {
        let hub = Hub::new(State::Starting, Duration::from_millis(100), false, None);
        let mut h = hub.lock();
        h.started(
            vec![DeviceInfo {
                index: 0,
                ..DeviceInfo::default()
            }],
            String::new(),
        );
        for i in 0..(HISTORY as u64 + 5) {
            h.record(sample(0, i, (i % 2 == 0).then_some(50)));
        }
        assert_eq!(h.history[0].len(), HISTORY);
        assert_eq!(h.history[0].front().unwrap().memory_used, Some(5));
        assert_eq!(h.history[0].back().unwrap().memory_used, Some(HISTORY as u64 + 4));
        let t = &h.totals[0];
        assert_eq!(t.samples, HISTORY as u64 + 5);
        assert_eq!(t.memory_used.max(), Some((HISTORY + 4) as f64));
        // Samples without utilization do not pull the mean down.
        assert_eq!(t.util_gpu.n, 303);
        assert_eq!(t.util_gpu.mean(), Some(50.0));
        // No JSON output: nothing queued.
        assert!(h.pending.is_empty());
    }

    #[test]
    fn a_metric_never_sampled_has_no_mean() {
        let a = Agg::default();
        assert_eq!((a.mean(), a.max()), (None, None));
    }

    #[test]
    fn process_memory_sums_devices_and_the_pid_filter_limits_lines() {
        let hub = Hub::new(State::Starting, Duration::from_millis(100), true, Some(7));
        let mut h = hub.lock();
        h.started(Vec::new(), String::new());
        let p = |pid, device, mem, sm| ProcessSample {
            pid,
            device,
            memory_bytes: Some(mem),
            util_sm: sm,
            ..ProcessSample::default()
        };
        h.record_procs(1, vec![p(7, 0, 100, Some(10)), p(7, 1, 50, None), p(8, 0, 9, Some(90))]);
        h.record_procs(2, vec![p(7, 0, 20, Some(30))]);
        let u = &h.procs[&7];
        assert_eq!(u.devices, [0, 1]);
        assert_eq!((u.memory_bytes, u.memory_max_bytes), (20, 150));
        assert_eq!((u.sm_util_mean(), u.sm_util_max), (Some(20.0), 30));
        assert_eq!(h.procs[&8].sm_util_max, 90);
        // Only pid 7's three lines are queued.
        assert_eq!(h.pending.len(), 3);
    }
}
