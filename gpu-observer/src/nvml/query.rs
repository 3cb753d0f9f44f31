//! NVML access: device discovery and one sample of every device and of the processes on it.
//!
//! Through nvml-wrapper, which loads libnvidia-ml at run time (no link-time dependency), except
//! per-process memory: `nvmlDeviceGetComputeRunningProcesses_v3` changed its struct stride
//! between drivers without a version bump (R535 wrote 32-byte entries where the header says 24),
//! so the versioned `nvmlDeviceGetRunningProcessDetailList` (R550+) is called through the raw
//! bindings first, and the wrapper's v3 call is only the fallback for older drivers.
//!
//! Every query is timed (budget < 1 ms each; docs/DESIGN.md "Measured costs") and a query the GPU does not support is
//! not asked again: its metric stays absent, never 0.

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    time::Instant,
};

use nvml_wrapper::{
    Device, EventSet, Nvml as Lib,
    bitmasks::event::EventTypes,
    enum_wrappers::device::{Clock, EccCounter, MemoryError, PcieUtilCounter, TemperatureSensor},
    enums::{
        device::{SampleValue, UsedGpuMemory},
        event::XidError,
    },
    error::NvmlError,
    structs::device::FieldId,
    sys_exports::field_id::{NVML_FI_DEV_PCIE_COUNT_RX_BYTES, NVML_FI_DEV_PCIE_COUNT_TX_BYTES},
};
use serde::Serialize;

/// Where libnvidia-ml is looked for when `--nvml-lib` is not given: the loader's path, then the
/// distributions' and the NVIDIA container toolkit's / GPU operator's locations.
const CANDIDATES: &[&str] = &[
    "libnvidia-ml.so.1",
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib64/libnvidia-ml.so.1",
    "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
    "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
];

/// An initialized NVML.
pub struct Nvml {
    lib: Lib,
    /// The file it was loaded from, as given to dlopen.
    pub path: String,
}

/// Loads and initializes NVML; the error says why not, in words for the user.
pub fn open(path: Option<&Path>) -> Result<Nvml, String> {
    let candidates: Vec<PathBuf> = match path {
        Some(p) => vec![p.to_path_buf()],
        None => CANDIDATES.iter().map(PathBuf::from).collect(),
    };
    let mut last = String::new();
    for c in &candidates {
        // A path (not a name for the loader to search) is opened first and loaded through that
        // descriptor: a FIFO or device is refused instead of blocking dlopen, and the file
        // checked is the file loaded.
        let opened = if c.is_absolute() {
            match crate::attach::open::open_host(c) {
                Ok(o) => Some(o),
                Err(e) => {
                    last = match e.reason {
                        crate::attach::stats::Reason::Unreachable => format!("cannot load {e}"),
                        _ => format!("cannot load {}: {e}", c.display()),
                    };
                    continue;
                }
            }
        } else {
            None
        };
        let load = opened.as_ref().map_or_else(
            || c.as_os_str().to_owned(),
            |o| <OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(o.kernel_path().as_bytes()).to_owned(),
        );
        match Lib::builder().lib_path(&load).init() {
            Ok(lib) => {
                return Ok(Nvml {
                    lib,
                    path: c.display().to_string(),
                });
            }
            Err(NvmlError::LibloadingError(e)) => last = format!("cannot load {}: {e}", c.display()),
            Err(NvmlError::DriverNotLoaded) => {
                return Err(format!(
                    "{} loaded, but the NVIDIA kernel driver is not (is there a GPU? `nvidia-smi` tells)",
                    c.display()
                ));
            }
            Err(NvmlError::NoPermission) => {
                return Err(format!("{}: no permission to initialize NVML", c.display()));
            }
            Err(e) => return Err(format!("{}: NVML initialization failed: {e}", c.display())),
        }
    }
    if path.is_some() {
        return Err(last);
    }
    Err(format!(
        "no libnvidia-ml.so.1 (the NVIDIA driver's user-space library) in the loader path or {}; pass --nvml-lib PATH if it lives elsewhere",
        CANDIDATES[1..].join(", ")
    ))
}

/// Name, vendor, memory, compute capability, driver version and PCI bus id of each GPU, plus
/// what a fleet needs to place a device.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeviceInfo {
    pub index: u32,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    pub vendor: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_total_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compute_capability: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_driver_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sm_count: Option<u32>,
    pub max_clocks_mhz: Clocks,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub power_limit_watts: Option<f64>,
    pub pcie_max_link: Link,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Clocks {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graphics: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sm: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<u32>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Link {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
}

impl Link {
    /// The link's theoretical data rate each way, bytes/s: the generation's transfer rate per
    /// lane after its line encoding, times the width. Generations 1–2 send 2.5 and 5 GT/s with
    /// 8b/10b encoding, 3–5 send 8, 16 and 32 GT/s with 128b/130b, 6 sends 64 GT/s in FLITs
    /// of which 242 of 256 bytes are data. `None` when either is unknown (or a later
    /// generation).
    pub fn bytes_per_s(&self) -> Option<f64> {
        let (gt_per_s, efficiency) = match self.generation? {
            1 => (2.5e9, 8.0 / 10.0),
            2 => (5e9, 8.0 / 10.0),
            3 => (8e9, 128.0 / 130.0),
            4 => (16e9, 128.0 / 130.0),
            5 => (32e9, 128.0 / 130.0),
            6 => (64e9, 242.0 / 256.0),
            _ => return None,
        };
        Some(gt_per_s * efficiency / 8.0 * f64::from(self.width?))
    }
}

/// One device at one instant. `None`: the GPU (or driver) does not report it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceSample {
    pub ts_ns: u64,
    pub device: u32,
    /// Percent, as NVML reports them.
    pub util_gpu: Option<u32>,
    pub util_memory: Option<u32>,
    pub util_encoder: Option<u32>,
    pub util_decoder: Option<u32>,
    pub memory_used: Option<u64>,
    pub memory_free: Option<u64>,
    pub memory_reserved: Option<u64>,
    pub memory_total: Option<u64>,
    pub power_mw: Option<u32>,
    pub power_limit_mw: Option<u32>,
    pub temperature_c: Option<u32>,
    pub fan_percent: Option<u32>,
    pub clocks: Clocks,
    /// PCIe bytes per second: the byte counters' rate over the last slow period, or NVML's
    /// 20 ms throughput sample where the counters are missing.
    pub pcie_tx_bps: Option<u64>,
    pub pcie_rx_bps: Option<u64>,
    /// NVML's cumulative PCIe byte counters (OTel `hw.gpu.io`).
    pub io_tx_bytes: Option<u64>,
    pub io_rx_bytes: Option<u64>,
    pub link: Link,
    pub throttle_reasons: Option<u64>,
    pub ecc_corrected: Option<u64>,
    pub ecc_uncorrected: Option<u64>,
    /// Xid errors seen since the observer started; `None` where Xid events are unsupported.
    pub xid_errors: Option<u64>,
    pub last_xid: Option<u64>,
}

/// One process on one device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessSample {
    pub ts_ns: u64,
    pub device: u32,
    pub pid: u32,
    pub memory_bytes: Option<u64>,
    /// Percent over NVML's last sample window for the process; `None` when NVML had no sample.
    pub util_sm: Option<u32>,
    pub util_memory: Option<u32>,
    pub util_encoder: Option<u32>,
    pub util_decoder: Option<u32>,
}

/// Throttle (clock event) reason bits of nvml.h, in the names the JSON uses.
pub const THROTTLE_REASONS: &[(u64, &str)] = &[
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

/// The queries, for timing and for remembering which ones a device does not support.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Q {
    Handle,
    Utilization,
    Encoder,
    Decoder,
    Memory,
    Power,
    PowerLimit,
    Temperature,
    Fans,
    ClockGraphics,
    ClockSm,
    ClockMemory,
    PcieCounters,
    PcieTx,
    PcieRx,
    LinkGen,
    LinkWidth,
    Throttle,
    EccCorrected,
    EccUncorrected,
    Processes,
    ProcessUtilization,
    Events,
}

pub const QUERIES: usize = Q::Events as usize + 1;

/// The NVML function behind each query (the name the summary reports its latency under).
pub const QUERY_NAMES: [&str; QUERIES] = [
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetFanSpeed_v2",
    "nvmlDeviceGetClockInfo(graphics)",
    "nvmlDeviceGetClockInfo(sm)",
    "nvmlDeviceGetClockInfo(memory)",
    "nvmlDeviceGetFieldValues(pcie bytes)",
    "nvmlDeviceGetPcieThroughput(tx)",
    "nvmlDeviceGetPcieThroughput(rx)",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetTotalEccErrors(corrected)",
    "nvmlDeviceGetTotalEccErrors(uncorrected)",
    "nvmlDeviceGetRunningProcessDetailList",
    "nvmlDeviceGetProcessUtilization",
    "nvmlEventSetWait_v2",
];

/// Latency of one query over the run. (Its CPU time is the same: NVML spins while it waits
/// for the driver; measured once with `gpu/gpucheck/bench_nvml_queries.py`, not per query
/// here, where two clock syscalls per query would cost more than the cheap queries themselves.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueryStat {
    pub count: u64,
    pub errors: u64,
    pub total_ns: u64,
    pub max_ns: u64,
}

/// Which of the less frequent queries a round includes. Every round (the interval, 100 ms)
/// reads utilization, power, the SM clock and Xid events; the other tiers are set by what each
/// query costs (docs/BENCHMARKS.md, H100/H200, driver 580): NVML spins while it waits for the
/// driver, so its wall time is CPU time, and any call after an idle interval costs tens of µs
/// (memory info ~70 µs, the PCIe byte counters ~0.8 ms, per-process utilization ~2.7 ms).
#[derive(Clone, Copy, Debug, Default)]
pub struct Tiers {
    /// 500 ms: memory, the processes with their memory, graphics and memory clocks, throttle
    /// reasons, encoder/decoder utilization.
    pub medium: bool,
    /// 2 s: temperature, fan, power limit, ECC.
    pub slow: bool,
    /// 5 s: the PCIe byte counters and link generation/width.
    pub pcie: bool,
    /// 10 s: per-process utilization (NVML returns every sample it took since the last read),
    /// and NVML's 20 ms-blocking PCIe throughput where the byte counters are missing.
    pub rare: bool,
}

/// Is this error "the GPU does not have it" (absent from now on), rather than a transient
/// failure?
fn unsupported(e: &NvmlError) -> bool {
    matches!(
        e,
        NvmlError::NotSupported
            | NvmlError::FunctionNotFound
            | NvmlError::FailedToLoadSymbol(_)
            | NvmlError::NoPermission
            | NvmlError::InvalidArg
    )
}

impl Nvml {
    pub fn device_count(&self) -> Result<u32, String> {
        self.lib
            .device_count()
            .map_err(|e| format!("nvmlDeviceGetCount failed: {e}"))
    }

    /// What every device is. Fields NVML cannot tell are absent.
    pub fn discover(&self) -> Result<Vec<DeviceInfo>, String> {
        let n = self.device_count()?;
        let driver = self.lib.sys_driver_version().ok();
        let cuda = self
            .lib
            .sys_cuda_driver_version()
            .ok()
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10));
        let mut out = Vec::with_capacity(n as usize);
        for index in 0..n {
            let d = self
                .lib
                .device_by_index(index)
                .map_err(|e| format!("device {index}: nvmlDeviceGetHandleByIndex failed: {e}"))?;
            let cc = d.cuda_compute_capability().ok();
            let pci = d.pci_info().ok();
            let sm_count = d
                .attributes()
                .ok()
                .map(|a| a.multiprocessor_count)
                .filter(|&n| n > 0)
                .or_else(|| {
                    let per_sm = cc.as_ref().and_then(|c| cores_per_sm(c.major, c.minor))?;
                    d.num_cores().ok().map(|c| c / per_sm).filter(|&n| n > 0)
                });
            out.push(DeviceInfo {
                index,
                name: d.name().unwrap_or_else(|_| "unknown".into()),
                uuid: d.uuid().ok(),
                vendor: match pci.as_ref().map(|p| p.pci_device_id & 0xffff) {
                    Some(0x10de) | None => "NVIDIA",
                    Some(_) => "unknown",
                },
                memory_total_bytes: d.memory_info().ok().map(|m| m.total),
                compute_capability: cc.map(|c| format!("{}.{}", c.major, c.minor)),
                driver_version: driver.clone(),
                cuda_driver_version: cuda.clone(),
                pci_bus_id: pci.map(|p| p.bus_id),
                sm_count,
                max_clocks_mhz: Clocks {
                    graphics: d.max_clock_info(Clock::Graphics).ok(),
                    sm: d.max_clock_info(Clock::SM).ok(),
                    memory: d.max_clock_info(Clock::Memory).ok(),
                },
                power_limit_watts: d.enforced_power_limit().ok().map(|mw| f64::from(mw) / 1000.0),
                pcie_max_link: Link {
                    generation: d.max_pcie_link_gen().ok(),
                    width: d.max_pcie_link_width().ok(),
                },
            });
        }
        Ok(out)
    }
}

/// CUDA cores per SM by compute capability, for drivers where nvmlDeviceGetAttributes does not
/// answer for a whole (non-MIG) GPU.
fn cores_per_sm(major: i32, minor: i32) -> Option<u32> {
    Some(match (major, minor) {
        (6, 0) => 64,
        (6, _) => 128,
        (7, _) => 64,
        (8, 0) => 64,
        (8, _) => 128,
        (9, _) | (10, _) | (11, _) | (12, _) => 128,
        _ => return None,
    })
}

/// What the sampler keeps between samples of one device.
#[derive(Default)]
struct PerDevice {
    /// Bit per `Q`: the device said it does not support it.
    unsupported: u64,
    /// NVML's own timestamp (µs) of the newest per-process utilization sample seen.
    last_util_us: u64,
    /// The less frequent tiers' latest values, carried on every sample until their next read.
    carried: DeviceSample,
    xid_errors: u64,
    last_xid: Option<u64>,
    /// The previous PCIe counter read: (tx, rx, ts_ns).
    last_io: Option<(u64, u64, u64)>,
    /// Latest per-process utilization (percent: sm, memory, encoder, decoder), carried between
    /// the once-a-second reads.
    util: Vec<(u32, [u32; 4])>,
}

/// Takes samples; owns the per-device state and the query statistics.
pub struct Sampler<'a> {
    handles: Vec<Option<Device<'a>>>,
    devices: Vec<PerDevice>,
    events: Vec<Option<EventSet<'a>>>,
    pub stats: [QueryStat; QUERIES],
}

impl<'a> Sampler<'a> {
    pub fn new(nvml: &'a Nvml, count: u32) -> Self {
        let now_us = crate::clock::realtime_us();
        let mut devices: Vec<PerDevice> = (0..count)
            .map(|_| PerDevice {
                // The last second of NVML's samples, not its whole buffer.
                last_util_us: now_us.saturating_sub(1_000_000),
                ..PerDevice::default()
            })
            .collect();
        // Xid errors arrive as NVML events, one set per device (a failed registration frees
        // the set it was given).
        let events = devices
            .iter_mut()
            .enumerate()
            .map(|(i, pd)| {
                let set = nvml.lib.create_event_set().ok()?;
                let dev = nvml.lib.device_by_index(i as u32).ok()?;
                match dev.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                    Ok(set) => Some(set),
                    Err(_) => {
                        pd.unsupported |= 1 << Q::Events as u64;
                        None
                    }
                }
            })
            .collect();
        let mut s = Self {
            handles: Vec::new(),
            devices,
            events,
            stats: [QueryStat::default(); QUERIES],
        };
        // Handles live as long as NVML: taken once, not every round.
        s.handles = (0..count as usize)
            .map(|i| s.q(i, Q::Handle, || nvml.lib.device_by_index(i as u32)))
            .collect();
        s
    }

    /// Runs one query for device `i`, timed; `None` if it failed or is unsupported.
    fn q<T>(&mut self, i: usize, q: Q, f: impl FnOnce() -> Result<T, NvmlError>) -> Option<T> {
        if self.devices[i].unsupported & (1 << q as u64) != 0 {
            return None;
        }
        let t = Instant::now();
        let r = f();
        let ns = t.elapsed().as_nanos() as u64;
        let s = &mut self.stats[q as usize];
        s.count += 1;
        s.total_ns += ns;
        s.max_ns = s.max_ns.max(ns);
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                s.errors += 1;
                if unsupported(&e) {
                    self.devices[i].unsupported |= 1 << q as u64;
                }
                None
            }
        }
    }

    /// Samples device `i` (and its slow metrics when `slow`), appending the processes on it.
    pub fn sample(
        &mut self,
        i: usize,
        ts_ns: u64,
        tiers: Tiers,
        procs: &mut Vec<ProcessSample>,
    ) -> Option<DeviceSample> {
        let dev = self.handles[i].take()?;
        let s = self.sample_with(i, &dev, ts_ns, tiers, procs);
        self.handles[i] = Some(dev);
        Some(s)
    }

    fn sample_with(
        &mut self,
        i: usize,
        dev: &Device<'a>,
        ts_ns: u64,
        tiers: Tiers,
        procs: &mut Vec<ProcessSample>,
    ) -> DeviceSample {
        // Utilization first: the cheapest call pays for waking NVML's code up.
        let util = self.q(i, Q::Utilization, || dev.utilization_rates());
        if tiers.medium {
            self.medium(i, dev);
        }
        if tiers.slow {
            self.slow(i, dev);
        }
        if tiers.pcie {
            self.pcie(i, dev, ts_ns);
            let link = Link {
                generation: self.q(i, Q::LinkGen, || dev.current_pcie_link_gen()),
                width: self.q(i, Q::LinkWidth, || dev.current_pcie_link_width()),
            };
            self.devices[i].carried.link = link;
        }
        if tiers.rare && self.devices[i].unsupported & (1 << Q::PcieCounters as u64) != 0 {
            let tx = self.q(i, Q::PcieTx, || dev.pcie_throughput(PcieUtilCounter::Send));
            let rx = self.q(i, Q::PcieRx, || dev.pcie_throughput(PcieUtilCounter::Receive));
            let c = &mut self.devices[i].carried;
            c.pcie_tx_bps = tx.map(|k| u64::from(k) * 1024);
            c.pcie_rx_bps = rx.map(|k| u64::from(k) * 1024);
        }
        // What this round read; the rest is the latest of its tier.
        let mut s = DeviceSample {
            ts_ns,
            device: i as u32,
            util_gpu: util.as_ref().map(|u| u.gpu),
            util_memory: util.as_ref().map(|u| u.memory),
            power_mw: self.q(i, Q::Power, || dev.power_usage()),
            ..self.devices[i].carried.clone()
        };
        s.clocks.sm = self.q(i, Q::ClockSm, || dev.clock_info(Clock::SM));
        self.poll_xid(i);
        let pd = &self.devices[i];
        if pd.unsupported & (1 << Q::Events as u64) == 0 {
            s.xid_errors = Some(pd.xid_errors);
            s.last_xid = pd.last_xid;
        }
        if tiers.medium {
            self.processes(i, dev, ts_ns, tiers.rare, procs);
        }
        s
    }

    /// The 500 ms tier.
    fn medium(&mut self, i: usize, dev: &Device<'a>) {
        let memory = self.q(i, Q::Memory, || dev.memory_info());
        let encoder = self
            .q(i, Q::Encoder, || dev.encoder_utilization())
            .map(|u| u.utilization);
        let decoder = self
            .q(i, Q::Decoder, || dev.decoder_utilization())
            .map(|u| u.utilization);
        let graphics = self.q(i, Q::ClockGraphics, || dev.clock_info(Clock::Graphics));
        let mem_clock = self.q(i, Q::ClockMemory, || dev.clock_info(Clock::Memory));
        let throttle = self
            .q(i, Q::Throttle, || dev.current_throttle_reasons())
            .map(|r| r.bits());
        let c = &mut self.devices[i].carried;
        c.memory_used = memory.as_ref().map(|m| m.used);
        c.memory_free = memory.as_ref().map(|m| m.free);
        c.memory_reserved = memory.as_ref().map(|m| m.reserved);
        c.memory_total = memory.as_ref().map(|m| m.total);
        c.util_encoder = encoder;
        c.util_decoder = decoder;
        c.clocks.graphics = graphics;
        c.clocks.memory = mem_clock;
        c.throttle_reasons = throttle;
    }

    /// The 2 s tier.
    fn slow(&mut self, i: usize, dev: &Device<'a>) {
        let power_limit = self.q(i, Q::PowerLimit, || dev.enforced_power_limit());
        let temperature = self.q(i, Q::Temperature, || dev.temperature(TemperatureSensor::Gpu));
        let fan = self.q(i, Q::Fans, || {
            // The first fan stands for the board; a GPU without fans says NotSupported.
            let n = dev.num_fans()?;
            if n == 0 {
                return Err(NvmlError::NotSupported);
            }
            dev.fan_speed(0)
        });
        let ecc_corrected = self.q(i, Q::EccCorrected, || {
            dev.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
        });
        let ecc_uncorrected = self.q(i, Q::EccUncorrected, || {
            dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
        });
        let c = &mut self.devices[i].carried;
        c.power_limit_mw = power_limit;
        c.temperature_c = temperature;
        c.fan_percent = fan;
        c.ecc_corrected = ecc_corrected;
        c.ecc_uncorrected = ecc_uncorrected;
    }

    /// PCIe: NVML's cumulative byte counters (most of a millisecond of CPU a read);
    /// the rate is their change since the last read.
    fn pcie(&mut self, i: usize, dev: &Device<'a>, ts_ns: u64) {
        let ids = [
            FieldId(NVML_FI_DEV_PCIE_COUNT_TX_BYTES),
            FieldId(NVML_FI_DEV_PCIE_COUNT_RX_BYTES),
        ];
        let counters = self.q(i, Q::PcieCounters, || {
            let values = dev.field_values_for(&ids)?;
            let get = |k: usize| match values.get(k).map(|v| v.as_ref().map(|s| &s.value)) {
                Some(Ok(Ok(SampleValue::U64(b)))) => Ok(*b),
                Some(Ok(Ok(SampleValue::U32(b)))) => Ok(u64::from(*b)),
                Some(Ok(Ok(SampleValue::I64(b)))) if *b >= 0 => Ok(*b as u64),
                _ => Err(NvmlError::NotSupported),
            };
            Ok((get(0)?, get(1)?))
        });
        let Some((tx, rx)) = counters else { return };
        let pd = &mut self.devices[i];
        pd.carried.io_tx_bytes = Some(tx);
        pd.carried.io_rx_bytes = Some(rx);
        if let Some((btx, brx)) = pd.last_io.and_then(|prev| pcie_rate(prev, (tx, rx, ts_ns))) {
            pd.carried.pcie_tx_bps = Some(btx);
            pd.carried.pcie_rx_bps = Some(brx);
        }
        pd.last_io = Some((tx, rx, ts_ns));
    }

    /// Drains device `i`'s Xid events without waiting (a timeout is "no event", not an error).
    fn poll_xid(&mut self, i: usize) {
        let Some(set) = self.events[i].as_ref() else { return };
        // Bounded: a storm of events cannot hold the sampler.
        for _ in 0..64 {
            let t = Instant::now();
            let r = set.wait(0);
            let ns = t.elapsed().as_nanos() as u64;
            let s = &mut self.stats[Q::Events as usize];
            s.count += 1;
            s.total_ns += ns;
            s.max_ns = s.max_ns.max(ns);
            match r {
                Ok(ev) => {
                    let pd = &mut self.devices[i];
                    pd.xid_errors += 1;
                    if let Some(XidError::Value(v)) = ev.event_data {
                        pd.last_xid = Some(v);
                    }
                }
                Err(NvmlError::Timeout) => break,
                Err(_) => {
                    s.errors += 1;
                    break;
                }
            }
        }
    }

    /// The compute processes on device `i`, with their memory and (when NVML has a sample for
    /// them since the last call) utilization.
    fn processes(&mut self, i: usize, dev: &Device<'a>, ts_ns: u64, read_util: bool, out: &mut Vec<ProcessSample>) {
        let start = out.len();
        if let Some(list) = self.q(i, Q::Processes, || detail_list(dev)) {
            out.extend(list.into_iter().map(|(pid, memory_bytes)| ProcessSample {
                ts_ns,
                device: i as u32,
                pid,
                memory_bytes,
                ..ProcessSample::default()
            }));
        }
        if read_util {
            let last = self.devices[i].last_util_us;
            let samples = self.q(i, Q::ProcessUtilization, || match dev.process_utilization_stats(last) {
                // No process had a sample since `last`.
                Err(NvmlError::NotFound) => Ok(Vec::new()),
                r => r,
            });
            if let Some(samples) = samples {
                // The mean of each pid's samples since the last read.
                let mut sums: Vec<(u32, [u64; 4], u64)> = Vec::new();
                for u in samples {
                    let pd = &mut self.devices[i];
                    pd.last_util_us = pd.last_util_us.max(u.timestamp);
                    let at = match sums.iter().position(|(pid, ..)| *pid == u.pid) {
                        Some(at) => at,
                        None => {
                            sums.push((u.pid, [0; 4], 0));
                            sums.len() - 1
                        }
                    };
                    let (_, sum, n) = &mut sums[at];
                    for (s, v) in sum.iter_mut().zip([u.sm_util, u.mem_util, u.enc_util, u.dec_util]) {
                        *s += u64::from(v);
                    }
                    *n += 1;
                }
                self.devices[i].util = sums
                    .into_iter()
                    .map(|(pid, sum, n)| (pid, sum.map(|s| ((s + n / 2) / n) as u32)))
                    .collect();
            }
        }
        // Every process on the device, with its latest utilization (processes NVML has a
        // utilization sample for but no memory entry are listed too).
        for &(pid, [sm, mem, enc, dec]) in &self.devices[i].util {
            let row = match out[start..].iter().position(|p| p.pid == pid) {
                Some(at) => &mut out[start + at],
                None if read_util => {
                    out.push(ProcessSample {
                        ts_ns,
                        device: i as u32,
                        pid,
                        ..ProcessSample::default()
                    });
                    let last = out.len() - 1;
                    &mut out[last]
                }
                // Carried over, but the process is gone from the device.
                None => continue,
            };
            row.util_sm = Some(sm);
            row.util_memory = Some(mem);
            row.util_encoder = Some(enc);
            row.util_decoder = Some(dec);
        }
    }
}

/// Bytes per second (tx, rx) between two reads of the PCIe byte counters, (tx, rx, ts_ns) each;
/// a counter that went backwards (driver reload) counts from 0.
fn pcie_rate(prev: (u64, u64, u64), now: (u64, u64, u64)) -> Option<(u64, u64)> {
    let dt = now.2.checked_sub(prev.2).filter(|&d| d > 0)? as f64 / 1e9;
    let per_s = |a: u64, b: u64| (if b >= a { b - a } else { b }) as f64 / dt;
    Some((per_s(prev.0, now.0).round() as u64, per_s(prev.1, now.1).round() as u64))
}

/// (pid, used memory) of the compute processes on a device: the versioned detail list, or the
/// v3 call on drivers without it.
fn detail_list(dev: &Device<'_>) -> Result<Vec<(u32, Option<u64>)>, NvmlError> {
    use nvml_wrapper_sys::bindings::{nvmlProcessDetail_v1_t, nvmlProcessDetailList_v1_t};
    const SUCCESS: u32 = 0;
    const INSUFFICIENT_SIZE: u32 = 7;
    /// NVML_VALUE_NOT_AVAILABLE as an unsigned long long.
    const NOT_AVAILABLE: u64 = u64::MAX;
    let lib = dev.nvml().lib();
    let Ok(f) = lib.nvmlDeviceGetRunningProcessDetailList.as_ref() else {
        return Ok(dev
            .running_compute_processes()?
            .into_iter()
            .map(|p| {
                let mem = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                };
                (p.pid, mem)
            })
            .collect());
    };
    // NVML_STRUCT_VERSION(ProcessDetailList, 1).
    let version = (std::mem::size_of::<nvmlProcessDetailList_v1_t>() | (1 << 24)) as u32;
    let mut entries: Vec<nvmlProcessDetail_v1_t> = Vec::new();
    // The list can grow between the sizing call and the real one: a few tries.
    for _ in 0..4 {
        let mut list = nvmlProcessDetailList_v1_t {
            version,
            mode: 0, // NVML_PROCESS_MODE_COMPUTE
            numProcArrayEntries: entries.len() as u32,
            procArray: if entries.is_empty() {
                std::ptr::null_mut()
            } else {
                entries.as_mut_ptr()
            },
        };
        // SAFETY: FFI; `list` is a valid versioned struct whose array (when not null) has
        // `numProcArrayEntries` writable entries, and the device handle is live.
        let r = unsafe { f(dev.handle(), &mut list) };
        match r {
            SUCCESS => {
                let n = (list.numProcArrayEntries as usize).min(entries.len());
                return Ok(entries[..n]
                    .iter()
                    .map(|p| (p.pid, (p.usedGpuMemory != NOT_AVAILABLE).then_some(p.usedGpuMemory)))
                    .collect());
            }
            INSUFFICIENT_SIZE => {
                let zero = nvmlProcessDetail_v1_t {
                    pid: 0,
                    usedGpuMemory: 0,
                    gpuInstanceId: 0,
                    computeInstanceId: 0,
                    usedGpuCcProtectedMemory: 0,
                };
                entries = vec![zero; list.numProcArrayEntries as usize + 4];
            }
            other => return Err(NvmlError::from(other)),
        }
    }
    Err(NvmlError::InsufficientSize(None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_rate_is_the_generation_lane_rate_after_encoding_times_width() {
        let rate = |generation, width| {
            Link {
                generation: Some(generation),
                width: Some(width),
            }
            .bytes_per_s()
        };
        // PCIe 5.0 ×16 (H100): 32 GT/s × 128/130 / 8 × 16 = 63.02 GB/s.
        assert_eq!(rate(5, 16).map(|r| (r / 1e6).round()), Some(63_015.0));
        assert_eq!(rate(3, 16).map(|r| (r / 1e6).round()), Some(15_754.0));
        assert_eq!(rate(1, 1), Some(250e6));
        assert_eq!(rate(7, 16), None);
        assert_eq!(
            Link {
                generation: Some(4),
                width: None
            }
            .bytes_per_s(),
            None
        );
    }

    #[test]
    fn pcie_rate_is_bytes_per_second_between_reads() {
        // 5 MB out and 10 MB in over 5 s.
        let r = pcie_rate(
            (1_000_000, 2_000_000, 10_000_000_000),
            (6_000_000, 12_000_000, 15_000_000_000),
        );
        assert_eq!(r, Some((1_000_000, 2_000_000)));
        // Counters reset (driver reload): from 0.
        assert_eq!(pcie_rate((900, 900, 0), (100, 50, 1_000_000_000)), Some((100, 50)));
        // No time between the reads: no rate.
        assert_eq!(pcie_rate((1, 1, 5), (2, 2, 5)), None);
    }

    #[test]
    fn throttle_bits_have_the_names_of_nvml_h() {
        let names: Vec<_> = THROTTLE_REASONS
            .iter()
            .filter(|(b, _)| 0x45 & b != 0)
            .map(|(_, n)| *n)
            .collect();
        assert_eq!(names, ["gpu_idle", "sw_power_cap", "hw_thermal_slowdown"]);
    }
}
