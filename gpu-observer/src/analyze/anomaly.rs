//! Anomalies: the one slow kernel, copy, memset, sync or host function among thousands.
//!
//! Each series (a process's kernel by name, a call by API and size class, a copy direction's
//! bandwidth by size class) keeps its last [`RING`] values; a value is anomalous when it lies
//! more than `threshold` robust deviations on the slow side of their median — in log space,
//! where durations are far less skewed, with the deviation scaled from the median absolute
//! deviation (× 1.4826, a normal's σ) and floored at [`MIN_SCALE`] so that a series of identical
//! values does not flag a 1 % wobble — and beyond every value the series produced in its last
//! [`RING`]: a loop whose every 20th copy takes 1.6× is bimodal, not anomalous, and the median
//! alone cannot tell. A series flags nothing before `warmup` values. The
//! design documents' rule (mean + 2σ of every value so far) is the `sigma` mode, for
//! comparison: on heavy-tailed durations it flags a few percent of a steady loop.
//!
//! Bounded: at most [`MAX_KEYS_PER_PROCESS`] series per process, the least recently used
//! forgotten (counted), and [`MAX_KEYS`] in all (a new series past it is refused, counted).

use std::{collections::HashMap, sync::Arc};

use gpu_observer_common::{
    api::{ApiSpec, Direction, Family},
    cupti::GpuRecordKind,
};

use crate::{
    correlate::cupti_join::GpuActivity,
    decode::{Body, Call, Event, HostMemory, KernelName},
};

/// Where a finding came from in a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Event(usize),
    Gpu(usize),
}

/// Values kept per series.
pub const RING: usize = 64;
/// Series per process, and in all.
pub const MAX_KEYS_PER_PROCESS: usize = 4096;
pub const MAX_KEYS: usize = 65_536;
/// Series a full process forgets at once (its least recently used).
const EVICT: usize = MAX_KEYS_PER_PROCESS / 8;
/// Processes with series or state, at most.
pub const MAX_PROCS: usize = 65_536;
/// The smallest robust scale, in natural-log units (about 2 %: timer and scheduling jitter).
pub const MIN_SCALE: f64 = 0.02;
/// A call must take this much longer than its series' typical time to be anomalous (CPU time:
/// interrupts and preemptions add tens of µs to any call).
pub const CALL_NOISE_NS: f64 = 50_000.0;
/// The median and MAD are recomputed after this many new values (and when warm-up ends).
const RECOMPUTE_EVERY: u32 = 8;

/// How values are judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Median and MAD of the last values, in log space.
    Robust,
    /// Mean + threshold × standard deviation of every value so far (the design documents').
    Sigma,
}

impl Mode {
    pub const fn name(self) -> &'static str {
        match self {
            Mode::Robust => "robust",
            Mode::Sigma => "sigma",
        }
    }

    /// The threshold when none is given: robust deviations, or σ.
    pub const fn default_threshold(self) -> f64 {
        match self {
            Mode::Robust => 8.0,
            Mode::Sigma => 2.0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Config {
    pub mode: Mode,
    pub threshold: f64,
    /// Values a series needs before it may flag.
    pub warmup: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            mode: Mode::Robust,
            threshold: Mode::Robust.default_threshold(),
            warmup: 32,
        }
    }
}

/// What a series watches.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum What {
    /// A kernel's GPU time (CUPTI), by name (the name correlate already holds: no copy) and
    /// launch shape: one name launched on tensors of different sizes (a dropout over the
    /// hidden states and over the attention matrix) is several series, not one multimodal one.
    Kernel {
        name: Arc<KernelName>,
        grid: [i32; 3],
        block: [i32; 3],
    },
    /// A copy, memset, sync or host function's time in the call, by API and size class.
    Call { api: &'static str, size: u8 },
    /// A copy direction's bandwidth, by size class: low is slow. `on_gpu`: from the copy's
    /// CUPTI record (the transfer itself); otherwise from a call that returns only when the
    /// copy is done (a synchronous API, or pageable host memory) — an asynchronous copy from
    /// pinned memory returns after queueing it, and its "bandwidth" would be the queueing's.
    Bandwidth {
        direction: Direction,
        size: u8,
        on_gpu: bool,
    },
}

impl What {
    pub const fn kind(&self) -> &'static str {
        match self {
            What::Kernel { .. } => "kernel",
            What::Call { .. } => "call",
            What::Bandwidth { .. } => "bandwidth",
        }
    }

    /// The unit of its values.
    pub const fn unit(&self) -> &'static str {
        match self {
            What::Bandwidth { .. } => "B/s",
            _ => "ns",
        }
    }

    /// For bandwidth a low value is slow; for the rest a high one.
    const fn slow_is_low(&self) -> bool {
        matches!(self, What::Bandwidth { .. })
    }
}

/// The size class of a sized call: 1 + ⌊log2 bytes⌋ (0: not sized). Copies of 4 KiB and of
/// 256 MiB are different series: their times and rates differ by design, not by accident.
pub fn size_class(bytes: Option<u64>) -> u8 {
    match bytes {
        Some(b) if b > 0 => 64 - b.leading_zeros() as u8,
        _ => 0,
    }
}

/// One value found anomalous.
#[derive(Clone, Debug, PartialEq)]
pub struct Finding {
    pub what: What,
    pub observed: f64,
    /// The series' typical value: its median (robust) or mean (sigma).
    pub typical: f64,
    /// How many robust deviations (or σ) it lies on the slow side.
    pub deviation: f64,
}

/// What the detector did, for the summaries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub checked: u64,
    pub flagged: u64,
    /// Series live now.
    pub keys: u64,
    /// Series forgotten for a process's newer ones (its 4 096 were in use).
    pub keys_evicted: u64,
    /// Series not started: all 65 536 in use.
    pub keys_refused: u64,
}

#[derive(Clone, Debug)]
struct Series {
    /// ln(value) of the last values, a ring.
    ring: [f32; RING],
    len: u8,
    next: u8,
    seen: u64,
    /// Median and robust scale of `ring` (ln units), as last computed.
    center: f64,
    scale: f64,
    fresh: u32,
    /// Every value so far (sigma mode): Welford's mean and sum of squared deviations.
    mean: f64,
    m2: f64,
    touched: u64,
}

impl Series {
    fn new(touched: u64) -> Self {
        Self {
            ring: [0.0; RING],
            len: 0,
            next: 0,
            seen: 0,
            center: 0.0,
            scale: MIN_SCALE,
            fresh: 0,
            mean: 0.0,
            m2: 0.0,
            touched,
        }
    }

    /// How many robust deviations (or σ) `x` lies on the slow side of the series' typical
    /// value, when it is anomalous (before `x` counts).
    fn judge(&self, x: f64, slow_is_low: bool, mode: Mode, threshold: f64) -> Option<f64> {
        let sign = if slow_is_low { -1.0 } else { 1.0 };
        match mode {
            Mode::Robust => {
                let l = x.ln();
                let deviation = sign * (l - self.center) / self.scale;
                if deviation < threshold {
                    return None;
                }
                // Past the slowest recent value by the same margin, too: a series whose every
                // third value is 4× (one name, two tensor sizes) keeps setting new maxima a
                // percent over the last ones, and those are its tail, not anomalies.
                let kept = self.ring[..usize::from(self.len)].iter().map(|&k| f64::from(k));
                let slowest = if slow_is_low {
                    kept.fold(f64::INFINITY, f64::min)
                } else {
                    kept.fold(f64::NEG_INFINITY, f64::max)
                };
                (sign * (l - slowest) / self.scale >= threshold).then_some(deviation)
            }
            Mode::Sigma => {
                let sd = (self.m2 / self.seen.max(1) as f64).sqrt();
                // A series of identical values: the smallest spread that is not zero.
                let sd = sd.max(self.mean.abs() * 1e-9).max(f64::MIN_POSITIVE);
                let deviation = sign * (x - self.mean) / sd;
                (deviation >= threshold).then_some(deviation)
            }
        }
    }

    /// The series' typical value: its median (robust) or mean (sigma).
    fn typical(&self, mode: Mode) -> f64 {
        match mode {
            Mode::Robust => self.center.exp(),
            Mode::Sigma => self.mean,
        }
    }

    fn add(&mut self, x: f64, warmup: u32) {
        self.ring[usize::from(self.next)] = x.ln() as f32;
        self.next = ((usize::from(self.next) + 1) % RING) as u8;
        self.len = (usize::from(self.len) + 1).min(RING) as u8;
        self.seen += 1;
        let d = x - self.mean;
        self.mean += d / self.seen as f64;
        self.m2 += d * (x - self.mean);
        self.fresh += 1;
        if self.seen == u64::from(warmup.max(1)) || self.fresh >= RECOMPUTE_EVERY {
            self.recompute();
        }
    }

    fn recompute(&mut self) {
        self.fresh = 0;
        // On the stack: this runs every few values of every series (no allocation per event).
        let mut buf = self.ring;
        let v = &mut buf[..usize::from(self.len)];
        let center = median(v);
        for x in v.iter_mut() {
            *x = (*x - center).abs();
        }
        let mad = median(v);
        self.center = f64::from(center);
        self.scale = (1.4826 * f64::from(mad)).max(MIN_SCALE);
    }
}

/// Judges `value` against the series (once it is warm), then adds it. Flagged values are
/// counted by the caller, which may still set a finding aside (the calls' noise floor).
fn step(cfg: &Config, counts: &mut Counts, s: &mut Series, what: What, value: f64) -> Option<Finding> {
    counts.checked += 1;
    // Judged before it counts: the typical value is the series' without it.
    let flagged = (s.seen >= u64::from(cfg.warmup))
        .then(|| s.judge(value, what.slow_is_low(), cfg.mode, cfg.threshold))
        .flatten()
        .map(|d| (d, s.typical(cfg.mode)));
    s.add(value, cfg.warmup);
    let (deviation, typical) = flagged?;
    Some(Finding {
        what,
        observed: value,
        typical,
        deviation,
    })
}

/// The direction of a CUPTI memcpy kind (correlate/cupti_join.rs names them): host to device
/// (or array), device to host, device to device; the rest unknown.
fn copy_direction(kind: u32) -> Direction {
    match kind {
        1 | 3 => Direction::CpuToGpu,
        2 | 4 => Direction::GpuToCpu,
        5..=8 | 10 => Direction::GpuToGpu,
        _ => Direction::Unknown,
    }
}

/// The median of `v` (reordered); 0 when empty.
fn median(v: &mut [f32]) -> f32 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable_by(f32::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[derive(Default)]
struct Proc {
    series: HashMap<What, Series>,
    /// Work was queued (a launch, an asynchronous copy or memset) since the last synchronize.
    queued: bool,
}

/// Every process's series.
pub struct Detector {
    cfg: Config,
    procs: HashMap<u32, Proc>,
    keys: usize,
    clock: u64,
    counts: Counts,
}

impl Detector {
    pub fn new(cfg: Config) -> Self {
        Self {
            cfg,
            procs: HashMap::new(),
            keys: 0,
            clock: 0,
            counts: Counts::default(),
        }
    }

    pub fn config(&self) -> Config {
        self.cfg
    }

    pub fn counts(&self) -> Counts {
        Counts {
            keys: self.keys as u64,
            ..self.counts
        }
    }

    /// Judges one value of a process's series, then adds it. Values that are not positive and
    /// finite (a zero duration) are not judged.
    pub fn observe(&mut self, pid: u32, what: What, value: f64) -> Option<Finding> {
        let f = self.value(pid, what, value)?;
        self.counts.flagged += 1;
        Some(f)
    }

    /// [`Detector::observe`] without counting a finding.
    fn value(&mut self, pid: u32, what: What, value: f64) -> Option<Finding> {
        if !(value.is_finite() && value > 0.0) {
            return None;
        }
        self.clock += 1;
        let clock = self.clock;
        if !self.room_for(pid) {
            self.counts.keys_refused += 1;
            return None;
        }
        let p = self.procs.entry(pid).or_default();
        // A series seen before: one lookup (this runs for every copy, sync and kernel).
        if let Some(s) = p.series.get_mut(&what) {
            s.touched = clock;
            return step(&self.cfg, &mut self.counts, s, what, value);
        }
        if self.keys >= MAX_KEYS {
            self.counts.keys_refused += 1;
            return None;
        }
        // The least recently used eighth goes at once: one scan when a process has all its
        // series in use and starts another (no ordered index to update on every value), and a
        // process that starts a new series with every launch (a new grid each time) pays
        // that scan once per 512 of them, not each time.
        if p.series.len() >= MAX_KEYS_PER_PROCESS {
            let mut ages: Vec<u64> = p.series.values().map(|s| s.touched).collect();
            let (_, &mut cut, _) = ages.select_nth_unstable(EVICT - 1);
            let before = p.series.len();
            p.series.retain(|_, s| s.touched > cut);
            let gone = before - p.series.len();
            self.keys -= gone;
            self.counts.keys_evicted += gone as u64;
        }
        self.keys += 1;
        let s = p.series.entry(what.clone()).or_insert(Series::new(clock));
        step(&self.cfg, &mut self.counts, s, what, value)
    }

    /// Judges a correlated batch: copies, memsets, syncs and host functions by their time in
    /// the call (blocking copies by their bandwidth too), kernels by their GPU time, copies with
    /// a CUPTI record by the transfer's bandwidth. Flagged ones are marked `anomalous` (always
    /// written) and listed in `out`; a process that exited in the batch loses its series after
    /// its last call.
    pub fn batch(&mut self, events: &mut [Event], gpu: &mut [GpuActivity], out: &mut Vec<(Source, Finding)>) {
        for (i, ev) in events.iter_mut().enumerate() {
            let (Body::Call(c), Some(spec)) = (&mut ev.body, ev.api) else {
                if matches!(ev.body, Body::ProcessExit) {
                    self.forget(ev.pid);
                }
                continue;
            };
            let found = out.len();
            self.call(ev.pid, spec, c, |f| out.push((Source::Event(i), f)));
            c.anomalous |= out.len() > found;
        }
        for (i, a) in gpu.iter_mut().enumerate() {
            let r = &a.rec;
            let f = match a.kind() {
                Some(GpuRecordKind::Kernel) => a
                    .kernel
                    .as_ref()
                    .and_then(|k| self.kernel(a.pid, k, r.grid, r.block, a.duration_ns())),
                Some(GpuRecordKind::Memcpy) => self.gpu_copy(a.pid, r.copy_kind, r.bytes, a.duration_ns()),
                _ => None,
            };
            if let Some(f) = f {
                a.anomalous = true;
                out.push((Source::Gpu(i), f));
            }
        }
    }

    /// A call: copies, memsets, syncs and host functions by their time in the call; copies
    /// that return only when done (a synchronous API, or pageable host memory) by their
    /// bandwidth too. Findings go to `found`.
    ///
    /// A copy or memset that only queues its work (asynchronous, device or pinned memory) is
    /// judged only when nothing the process queued is outstanding (none since its last
    /// synchronize): otherwise its time may be the wait for room in a full queue — a GPU-bound
    /// loop's 4-byte `cuMemsetD8Async` waits 0.1–7 ms whenever the queue is full
    /// (docs/VALIDATION.md, "Anomalies"), which is the GPU being busy, not the call being slow.
    pub fn call(&mut self, pid: u32, spec: &ApiSpec, c: &Call, mut found: impl FnMut(Finding)) {
        let sized = matches!(spec.family, Family::Memcpy | Family::Memset);
        let queues = match spec.family {
            Family::Launch | Family::HostFunc => true,
            Family::Memcpy | Family::Memset => spec.is_async() && c.host_memory != Some(HostMemory::Pageable),
            _ => false,
        };
        // A process past the bound of processes: as if work were always outstanding (and its
        // series are refused, counted).
        let behind_queued = !self.room_for(pid) || {
            let p = self.procs.entry(pid).or_default();
            let before = p.queued;
            p.queued = (before || queues) && !(spec.family == Family::Sync && c.result == 0 && !c.abandoned);
            before
        };
        let watched = match spec.family {
            Family::Sync | Family::HostFunc => true,
            Family::Memcpy | Family::Memset => !(queues && behind_queued),
            _ => false,
        };
        if !watched || c.abandoned || c.result != 0 {
            return;
        }
        let size = if sized { size_class(c.bytes) } else { 0 };
        let took = c.duration_ns as f64;
        // A call's time is the CPU's: an interrupt or a preemption adds tens of µs to any call,
        // whatever its usual time. Findings under the floor are set aside (counted as checked).
        let over_floor = |typical_ns: f64| took - typical_ns >= CALL_NOISE_NS;
        if let Some(f) = self.value(pid, What::Call { api: spec.name, size }, took)
            && over_floor(f.typical)
        {
            self.counts.flagged += 1;
            found(f);
        }
        if spec.family == Family::Memcpy
            && !queues
            && let Some(bytes) = c.bytes.filter(|b| *b > 0)
            && c.duration_ns > 0
        {
            let what = What::Bandwidth {
                direction: c.direction,
                size,
                on_gpu: false,
            };
            if let Some(f) = self.value(pid, what, bytes as f64 * 1e9 / took)
                && over_floor(bytes as f64 * 1e9 / f.typical)
            {
                self.counts.flagged += 1;
                found(f);
            }
        }
    }

    /// A kernel's GPU time, by name and launch shape.
    pub fn kernel(
        &mut self,
        pid: u32,
        name: &Arc<KernelName>,
        grid: [i32; 3],
        block: [i32; 3],
        duration_ns: u64,
    ) -> Option<Finding> {
        let what = What::Kernel {
            name: name.clone(),
            grid,
            block,
        };
        self.observe(pid, what, duration_ns as f64)
    }

    /// A copy's transfer bandwidth from its CUPTI record (`copy_kind`: CUPTI's memcpy kind).
    pub fn gpu_copy(&mut self, pid: u32, copy_kind: u32, bytes: u64, duration_ns: u64) -> Option<Finding> {
        if bytes == 0 || duration_ns == 0 {
            return None;
        }
        let what = What::Bandwidth {
            direction: copy_direction(copy_kind),
            size: size_class(Some(bytes)),
            on_gpu: true,
        };
        self.observe(pid, what, bytes as f64 * 1e9 / duration_ns as f64)
    }

    /// Whether `pid` is known or there is room for one more process.
    fn room_for(&self, pid: u32) -> bool {
        self.procs.len() < MAX_PROCS || self.procs.contains_key(&pid)
    }

    /// A process exited: its series go.
    pub fn forget(&mut self, pid: u32) {
        if let Some(p) = self.procs.remove(&pid) {
            self.keys -= p.series.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call() -> What {
        What::Call {
            api: "cuMemcpyHtoD_v2",
            size: 21,
        }
    }

    fn kernel_named(name: &str) -> What {
        What::Kernel {
            name: Arc::new(KernelName::new(name)),
            grid: [1, 1, 1],
            block: [32, 1, 1],
        }
    }

    /// A steady series with ±1 % jitter: 1000, 1010, 990, ...
    fn steady(i: u64) -> f64 {
        1000.0 + [0.0, 10.0, -10.0, 5.0, -5.0][(i % 5) as usize]
    }

    #[test]
    fn nothing_flags_during_warm_up_and_the_first_value_after_it_can() {
        let mut d = Detector::new(Config::default());
        for i in 0..31 {
            assert_eq!(d.observe(1, call(), steady(i)), None);
        }
        // (The warm-up is 32 values; the ring keeps 64.)
        // The 32nd value is the last of the warm-up: even 10× is not judged.
        assert_eq!(d.observe(1, call(), 10_000.0), None);
        // The 33rd is judged against the 32 before it (their median is 1000) — and the 32nd
        // was 10 000 too, so it is not beyond what the series did lately.
        assert_eq!(d.observe(1, call(), 10_000.0), None);
        let f = d.observe(1, call(), 20_000.0).expect("flagged");
        assert_eq!(f.typical.round(), 1000.0);
        assert!(f.deviation > 8.0, "{f:?}");
        assert_eq!(d.counts().flagged, 1);
        assert_eq!(d.counts().checked, 34);
    }

    #[test]
    fn a_steady_series_flags_exactly_the_planted_outliers() {
        let mut d = Detector::new(Config::default());
        let mut flagged = Vec::new();
        for i in 0..10_000u64 {
            // One in 1000 is 10× slower.
            let v = if i % 1000 == 999 { 10.0 * steady(i) } else { steady(i) };
            if d.observe(7, call(), v).is_some() {
                flagged.push(i);
            }
        }
        assert_eq!(flagged, (0..10).map(|k| k * 1000 + 999).collect::<Vec<_>>());
    }

    #[test]
    fn the_scale_floor_keeps_identical_values_from_flagging_a_small_wobble() {
        let flat = || {
            let mut d = Detector::new(Config::default());
            for _ in 0..100 {
                assert_eq!(d.observe(1, call(), 1000.0), None);
            }
            d
        };
        // ln(1.15) / 0.02 = 6.99 robust deviations: under 8.
        assert_eq!(flat().observe(1, call(), 1150.0), None);
        // ln(1.2) / 0.02 = 9.1: over.
        assert!(flat().observe(1, call(), 1200.0).is_some());
    }

    #[test]
    fn a_series_with_two_sizes_under_one_name_flags_only_what_is_beyond_both() {
        // Every third value 4× (a kernel launched on two tensor sizes), each with ±1 % jitter:
        // the large ones keep setting new maxima a percent over the last, never anomalous.
        let value = |i: u64| if i % 3 == 1 { 4.0 * steady(i / 3) } else { steady(i) };
        let mut d = Detector::new(Config::default());
        let mut flagged = Vec::new();
        for i in 0..6000u64 {
            let v = if i == 4000 { 10.0 * steady(i) } else { value(i) };
            if let Some(f) = d.observe(1, call(), v) {
                flagged.push((i, f.typical.round()));
            }
        }
        // The 10× one is 2.5× past the largest recent value; its typical is the median of the
        // last 64 (jittered 1 000s and 4 000s: 1 005).
        assert_eq!(flagged, [(4000, 1005.0)]);
    }

    #[test]
    fn low_bandwidth_is_the_slow_side_and_faster_is_never_anomalous() {
        let mut d = Detector::new(Config::default());
        let bw = What::Bandwidth {
            direction: Direction::CpuToGpu,
            size: 29,
            on_gpu: true,
        };
        for i in 0..64 {
            d.observe(1, bw.clone(), 25e9 + steady(i));
        }
        assert_eq!(d.observe(1, bw.clone(), 100e9), None, "faster: not anomalous");
        let f = d.observe(1, bw.clone(), 8e9).expect("pageable-like rate flagged");
        assert_eq!(f.what.unit(), "B/s");
        // And for durations, faster is never anomalous either.
        for i in 0..64 {
            d.observe(1, call(), steady(i));
        }
        assert_eq!(d.observe(1, call(), 10.0), None);
    }

    #[test]
    fn sigma_mode_flags_a_heavy_tailed_steady_loop_where_robust_flags_nothing() {
        // A bimodal loop: most at 1000, every 20th at 1600 (its normal tail, not an anomaly).
        let value = |i: u64| if i.is_multiple_of(20) { 1600.0 } else { steady(i) };
        let count = |mode: Mode| {
            let mut d = Detector::new(Config {
                mode,
                threshold: mode.default_threshold(),
                warmup: 32,
            });
            (0..10_000)
                .filter(|&i| d.observe(1, call(), value(i)).is_some())
                .count()
        };
        assert_eq!(count(Mode::Robust), 0);
        // Every 1600 lies ~4.4σ over the mean: all ~500 after warm-up are flagged.
        assert_eq!(count(Mode::Sigma), 498);
    }

    #[test]
    fn series_are_bounded_per_process_and_the_least_recently_used_goes() {
        let mut d = Detector::new(Config::default());
        let kernel = |i: usize| kernel_named(&format!("k{i}"));
        for i in 0..MAX_KEYS_PER_PROCESS {
            d.observe(1, kernel(i), 100.0);
        }
        // k0 used again: k1..=k512 are now the least recently used eighth.
        d.observe(1, kernel(0), 100.0);
        d.observe(1, kernel(MAX_KEYS_PER_PROCESS), 100.0);
        let c = d.counts();
        assert_eq!((c.keys, c.keys_evicted), ((MAX_KEYS_PER_PROCESS - 512 + 1) as u64, 512));
        let kept = |i: usize| d.procs[&1].series.contains_key(&kernel(i));
        assert!(kept(0) && !kept(1) && !kept(512) && kept(513) && kept(MAX_KEYS_PER_PROCESS));
        d.forget(1);
        assert_eq!(d.counts().keys, 0);
    }

    #[test]
    fn series_past_the_global_bound_are_refused_and_counted() {
        let mut d = Detector::new(Config::default());
        let per = MAX_KEYS / MAX_KEYS_PER_PROCESS;
        for pid in 0..per as u32 {
            for i in 0..MAX_KEYS_PER_PROCESS {
                d.observe(pid, kernel_named(&format!("k{i}")), 1.0);
            }
        }
        assert_eq!(d.counts().keys, MAX_KEYS as u64);
        assert_eq!(d.observe(99_999, call(), 1.0), None);
        assert_eq!(d.counts().keys_refused, 1);
    }

    fn spec(name: &str) -> &'static ApiSpec {
        gpu_observer_common::api::id_of(name)
            .and_then(gpu_observer_common::api::by_id)
            .expect(name)
    }

    /// Feeds `(api, duration in µs, pageable)` calls of one process; the indices flagged.
    fn calls(d: &mut Detector, script: &[(&str, u64, bool)]) -> Vec<usize> {
        let mut flagged = Vec::new();
        for (i, &(api, us, pageable)) in script.iter().enumerate() {
            let s = spec(api);
            let mut c = Call::returned(s, us * 1000);
            c.bytes = s.bytes_arg.ne(&gpu_observer_common::api::NO_ARG).then_some(4 << 20);
            c.host_memory = pageable.then_some(HostMemory::Pageable);
            if c.bytes.is_some() && !pageable {
                c.host_memory = Some(HostMemory::Pinned);
            }
            d.call(1, s, &c, |_| flagged.push(i));
        }
        flagged
    }

    #[test]
    fn a_queueing_call_is_judged_only_when_nothing_is_outstanding() {
        let mut d = Detector::new(Config::default());
        // Warm: 64 × (a 3 µs async memset after a synchronize, a launch, a 200 µs synchronize).
        let mut script: Vec<(&str, u64, bool)> = Vec::new();
        for _ in 0..64 {
            script.extend([
                ("cuMemsetD8Async", 3, false),
                ("cuLaunchKernel", 4, false),
                ("cuCtxSynchronize", 200, false),
            ]);
        }
        let warm = script.len();
        // A 5 ms memset behind a launch (the queue may be full): not judged.
        script.extend([("cuLaunchKernel", 4, false), ("cuMemsetD8Async", 5000, false)]);
        // A 5 ms memset right after a synchronize: nothing outstanding, flagged.
        script.extend([("cuCtxSynchronize", 200, false), ("cuMemsetD8Async", 5000, false)]);
        assert_eq!(calls(&mut d, &script), [warm + 3]);
        // Checked: the 64 warm memsets and 64 synchronizes, one more synchronize, one memset.
        assert_eq!(d.counts().checked, 130);
    }

    #[test]
    fn a_call_must_be_slower_than_the_noise_floor_and_a_pageable_copy_among_pinned_flags() {
        let mut d = Detector::new(Config::default());
        let mut script: Vec<(&str, u64, bool)> = Vec::new();
        for _ in 0..64 {
            script.extend([("cuMemcpyHtoDAsync_v2", 3, false), ("cuStreamSynchronize", 22, false)]);
        }
        let warm = script.len();
        script.extend([
            // 3× a 22 µs synchronize is 66 µs: 49 deviations, but 44 µs over (floor 50): kept.
            ("cuStreamSynchronize", 66, false),
            // The same 4 MiB from pageable memory: the call does the copy (400 µs).
            ("cuMemcpyHtoDAsync_v2", 400, true),
            ("cuStreamSynchronize", 200, false),
        ]);
        assert_eq!(calls(&mut d, &script), [warm + 1, warm + 2]);
        assert_eq!(d.counts().flagged, 2);
    }

    #[test]
    fn size_classes_are_octaves() {
        assert_eq!(size_class(None), 0);
        assert_eq!(size_class(Some(0)), 0);
        assert_eq!(size_class(Some(1)), 1);
        assert_eq!(size_class(Some(4096)), 13);
        assert_eq!(size_class(Some(8191)), 13);
        assert_eq!(size_class(Some(u64::MAX)), 64);
    }
}
