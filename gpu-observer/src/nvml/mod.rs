//! The NVML sampler: its own thread, sampling every device (and the processes on it) each
//! interval, into a bounded history (600 samples per device, docs/DESIGN.md "Defaults"). The
//! thread owns that state; after each round it publishes an immutable copy ([`View`]) that the
//! reader puts into its snapshots, and sends the samples to be written over a bounded channel.
//!
//! A thread of its own because NVML calls block (some for milliseconds), and nothing here may
//! delay the ring-buffer reader. Without NVML (no driver, no library) the observer runs on and
//! says so; a metric a GPU lacks is absent, never 0.

pub mod query;

use std::{
    collections::{HashMap, VecDeque},
    path::PathBuf,
    sync::{Arc, mpsc},
    thread::JoinHandle,
    time::{Duration, Instant},
};

pub use query::{DeviceInfo, DeviceSample, ProcessSample, QUERIES, QUERY_NAMES, QueryStat};

/// 60 s of history at 100 ms.
pub const HISTORY: usize = 600;
/// Lines waiting for the sinks; more are counted as dropped (the reader drains every 10 ms,
/// so this only fills when the output is stuck).
const PENDING_MAX: usize = 8192;
/// Processes remembered for the summary; the longest unseen go first.
const PROCS_MAX: usize = 4096;
/// The tiers of [`query::Tiers`], by what each query costs (the budget: < 0.1 % of a
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
    /// Devices it held a context on in the latest process round (empty: not listed then).
    pub devices_now: Vec<u32>,
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

/// A sample for the sinks.
#[derive(Clone, Debug)]
pub enum Line {
    /// A device's description, when the sampler started (ts_ns).
    Info(DeviceInfo, u64),
    Device(DeviceSample),
    Process(ProcessSample),
}

/// The sampler's cost, measured on its own thread (budget: < 0.1 % of a core at 100 ms, < 1 ms a
/// query; docs/DESIGN.md "Measured costs").
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

/// What the sampler knows, as published after each round (cheap to clone: the history holds
/// shared samples).
#[derive(Clone, Debug)]
pub struct View {
    pub state: State,
    /// Why NVML is unavailable, or which library is in use.
    pub message: String,
    pub interval: Duration,
    pub devices: Vec<DeviceInfo>,
    pub history: Vec<VecDeque<Arc<DeviceSample>>>,
    pub totals: Vec<DeviceTotals>,
    pub procs: HashMap<u32, ProcUse>,
    /// When the processes were last listed (0: never).
    pub procs_round_ns: u64,
    /// Samples the sinks did not get because the channel was full.
    pub lines_dropped: u64,
    pub cost: Cost,
    /// With `--pid`: only this process's per-process lines are written.
    pid: Option<u32>,
}

/// A sample on its way to the sinks, with the process's command name for per-process ones.
pub type Pending = (Line, Option<String>);
pub type LineSender = mpsc::SyncSender<Pending>;
pub type LineReceiver = mpsc::Receiver<Pending>;

/// The bounded channel samples reach the sinks by (only when a sink writes them).
pub fn lines() -> (LineSender, LineReceiver) {
    mpsc::sync_channel(PENDING_MAX)
}

/// Where the sampler publishes its [`View`]; readers never wait on the sampler.
pub struct Hub {
    view: arc_swap::ArcSwap<View>,
}

impl Hub {
    pub fn new(state: State, interval: Duration, pid: Option<u32>) -> Arc<Self> {
        Arc::new(Self {
            view: arc_swap::ArcSwap::from_pointee(View {
                state,
                message: String::new(),
                interval,
                devices: Vec::new(),
                history: Vec::new(),
                totals: Vec::new(),
                procs: HashMap::new(),
                procs_round_ns: 0,
                lines_dropped: 0,
                cost: Cost::default(),
                pid,
            }),
        })
    }

    /// The latest published state.
    pub fn view(&self) -> Arc<View> {
        self.view.load_full()
    }

    fn publish(&self, v: &View) {
        self.view.store(Arc::new(v.clone()));
    }
}

/// The sampler thread's own state: what it publishes, and where samples go.
struct Recorder {
    view: View,
    lines: Option<LineSender>,
}

impl Recorder {
    fn queue(&mut self, line: Line, comm: Option<String>) {
        let Some(tx) = &self.lines else { return };
        if tx.try_send((line, comm)).is_err() {
            self.view.lines_dropped += 1;
        }
    }

    fn started(&mut self, devices: Vec<DeviceInfo>, message: String) {
        let v = &mut self.view;
        v.state = State::Active;
        v.message = message;
        v.history = devices.iter().map(|_| VecDeque::with_capacity(HISTORY)).collect();
        v.totals = vec![DeviceTotals::default(); devices.len()];
        for d in &devices {
            self.queue(Line::Info(d.clone(), crate::clock::monotonic_ns()), None);
        }
        self.view.devices = devices;
    }

    fn record(&mut self, s: DeviceSample) {
        let i = s.device as usize;
        let Some(t) = self.view.totals.get_mut(i) else { return };
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
        if let Some(h) = self.view.history.get_mut(i) {
            if h.len() == HISTORY {
                h.pop_front();
            }
            h.push_back(Arc::new(s.clone()));
        }
        self.queue(Line::Device(s), None);
    }

    /// One round of process samples (all devices), `ts_ns` the round's time; `listed`: whether
    /// this round listed the processes (their tier was due), so that who holds a context now
    /// is known.
    fn record_procs(
        &mut self,
        ts_ns: u64,
        procs: Vec<ProcessSample>,
        listed: bool,
        procinfo: &crate::procinfo::ProcInfo,
    ) {
        // Latest memory is the sum over the devices of this round.
        let mut round: HashMap<u32, u64> = HashMap::new();
        for p in &procs {
            *round.entry(p.pid).or_default() += p.memory_bytes.unwrap_or(0);
        }
        if listed {
            self.view.procs_round_ns = ts_ns;
            for u in self.view.procs.values_mut() {
                u.devices_now.clear();
            }
        }
        for p in procs {
            let v = &mut self.view;
            if !v.procs.contains_key(&p.pid) && v.procs.len() >= PROCS_MAX {
                let oldest = v.procs.iter().min_by_key(|(_, u)| u.last_ns).map(|(pid, _)| *pid);
                if let Some(pid) = oldest {
                    v.procs.remove(&pid);
                }
            }
            let u = v.procs.entry(p.pid).or_insert_with(|| ProcUse {
                comm: procinfo.comm(p.pid).unwrap_or_default(),
                ..ProcUse::default()
            });
            if let Err(at) = u.devices.binary_search(&p.device) {
                u.devices.insert(at, p.device);
            }
            if let Err(at) = u.devices_now.binary_search(&p.device) {
                u.devices_now.insert(at, p.device);
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
            if v.wants(p.pid) {
                self.queue(Line::Process(p), Some(comm));
            }
        }
    }
}

impl View {
    /// Whether a process is in the observer's scope (`--pid`).
    pub fn wants(&self, pid: u32) -> bool {
        self.pid.is_none_or(|p| p == pid)
    }

    /// The latest sample of each device.
    pub fn latest(&self) -> impl Iterator<Item = (&DeviceInfo, Option<&DeviceSample>)> {
        self.devices
            .iter()
            .zip(self.history.iter())
            .map(|(d, h)| (d, h.back().map(|s| &**s)))
    }
}

/// The running sampler thread.
pub struct Sampler {
    stop: mpsc::Sender<()>,
    handle: JoinHandle<()>,
}

impl Sampler {
    /// Starts sampling; samples go to `lines` when a sink writes them.
    pub fn spawn(cfg: Config, hub: Arc<Hub>, lines: Option<LineSender>) -> std::io::Result<Self> {
        let (stop, stopped) = mpsc::channel();
        let mut rec = Recorder {
            view: (*hub.view()).clone(),
            lines,
        };
        let handle = std::thread::Builder::new()
            .name("nvml-sampler".into())
            .spawn(move || run(cfg, &hub, &mut rec, &stopped))?;
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

fn run(cfg: Config, hub: &Hub, rec: &mut Recorder, stopped: &mpsc::Receiver<()>) {
    let procinfo = crate::procinfo::ProcInfo::host();
    let nvml = match query::open(cfg.lib.as_deref()).and_then(|n| n.discover().map(|d| (n, d))) {
        Ok(v) => v,
        Err(why) => {
            eprintln!("gpu-observer: NVML unavailable: {why}; GPU device metrics are off, everything else runs");
            rec.view.state = State::Unavailable;
            rec.view.message = why;
            hub.publish(&rec.view);
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
    rec.started(devices, format!("NVML from {}", nvml.path));
    hub.publish(&rec.view);
    let mut sampler = query::Sampler::new(&nvml, count);
    let (cpu0, wall0) = (crate::clock::thread_cpu_ns(), Instant::now());
    let mut next = Instant::now();
    let mut medium = Every::new(MEDIUM_INTERVAL, cfg.interval);
    let mut slow = Every::new(SLOW_INTERVAL, cfg.interval);
    let mut pcie = Every::new(PCIE_INTERVAL, cfg.interval);
    let mut rare = Every::new(RARE_INTERVAL, cfg.interval);
    let mut procs = Vec::new();
    loop {
        let ts_ns = crate::clock::monotonic_ns();
        let now = Instant::now();
        let tiers = query::Tiers {
            medium: medium.due(now),
            slow: slow.due(now),
            pcie: pcie.due(now),
            rare: rare.due(now),
        };
        let samples: Vec<DeviceSample> = (0..count as usize)
            .filter_map(|i| sampler.sample(i, ts_ns, tiers, &mut procs))
            .collect();
        for s in samples {
            rec.record(s);
        }
        rec.record_procs(ts_ns, std::mem::take(&mut procs), tiers.medium, &procinfo);
        rec.view.cost = Cost {
            samples: rec.view.cost.samples + 1,
            cpu_ns: crate::clock::thread_cpu_ns() - cpu0,
            wall_ns: wall0.elapsed().as_nanos() as u64,
            stats: sampler.stats,
        };
        hub.publish(&rec.view);
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
    rec.view.cost.cpu_ns = crate::clock::thread_cpu_ns() - cpu0;
    rec.view.cost.wall_ns = wall0.elapsed().as_nanos() as u64;
    hub.publish(&rec.view);
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

    fn recorder(pid: Option<u32>, lines: Option<LineSender>) -> Recorder {
        Recorder {
            view: (*Hub::new(State::Starting, Duration::from_millis(100), pid).view()).clone(),
            lines,
        }
    }

    #[test]
    fn history_keeps_the_last_600_samples_and_totals_keep_all() {
        let mut rec = recorder(None, None);
        rec.started(
            vec![DeviceInfo {
                index: 0,
                ..DeviceInfo::default()
            }],
            String::new(),
        );
        for i in 0..(HISTORY as u64 + 5) {
            rec.record(sample(0, i, (i % 2 == 0).then_some(50)));
        }
        let h = &rec.view;
        assert_eq!(h.history[0].len(), HISTORY);
        assert_eq!(h.history[0].front().unwrap().memory_used, Some(5));
        assert_eq!(h.history[0].back().unwrap().memory_used, Some(HISTORY as u64 + 4));
        let t = &h.totals[0];
        assert_eq!(t.samples, HISTORY as u64 + 5);
        assert_eq!(t.memory_used.max(), Some((HISTORY + 4) as f64));
        // Samples without utilization do not pull the mean down.
        assert_eq!(t.util_gpu.n, 303);
        assert_eq!(t.util_gpu.mean(), Some(50.0));
        // No sink wants samples: nothing queued, nothing dropped.
        assert_eq!(h.lines_dropped, 0);
    }

    #[test]
    fn a_metric_never_sampled_has_no_mean() {
        let a = Agg::default();
        assert_eq!((a.mean(), a.max()), (None, None));
    }

    #[test]
    fn process_memory_sums_devices_and_the_pid_filter_limits_lines() {
        let (tx, rx) = lines();
        let mut rec = recorder(Some(7), Some(tx));
        rec.started(Vec::new(), String::new());
        let info = crate::procinfo::ProcInfo::host();
        let p = |pid, device, mem, sm| ProcessSample {
            pid,
            device,
            memory_bytes: Some(mem),
            util_sm: sm,
            ..ProcessSample::default()
        };
        rec.record_procs(
            1,
            vec![p(7, 0, 100, Some(10)), p(7, 1, 50, None), p(8, 0, 9, Some(90))],
            true,
            &info,
        );
        rec.record_procs(2, vec![p(7, 0, 20, Some(30))], true, &info);
        let h = &rec.view;
        let u = &h.procs[&7];
        assert_eq!(u.devices, [0, 1]);
        // Who holds a context now: the latest listing only (8 was not listed at 2).
        assert_eq!((u.devices_now.as_slice(), h.procs_round_ns), (&[0][..], 2));
        assert!(h.procs[&8].devices_now.is_empty());
        assert_eq!((u.memory_bytes, u.memory_max_bytes), (20, 150));
        assert_eq!((u.sm_util_mean(), u.sm_util_max), (Some(20.0), 30));
        assert_eq!(h.procs[&8].sm_util_max, 90);
        // Only pid 7's three lines are queued.
        assert_eq!(rx.try_iter().count(), 3);
    }
}
