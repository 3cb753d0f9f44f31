//! Hand-built snapshots for the dashboard's tests, and a frame rendered on ratatui's
//! TestBackend read back as text and styles.

use std::{collections::HashMap, sync::Arc, time::Duration};

use ratatui::{Terminal, backend::TestBackend, buffer::Buffer};

use super::app::{App, Input};
use crate::{
    analyze::window::ProcessVerdict,
    attach::Drops,
    correlate::Stats,
    nvml::{self, DeviceInfo, DeviceSample, Hub, State},
    snapshot::{ProcessView, Snapshot},
};

pub const S: u64 = 1_000_000_000;
pub const GIB: u64 = 1 << 30;

/// A process `pid` named `comm` with these counters.
pub fn process(pid: u32, comm: &str, stats: Stats) -> Arc<ProcessView> {
    Arc::new(ProcessView {
        pid,
        comm: comm.into(),
        first_ts: 0,
        last_ts: S,
        exited: false,
        stats,
        top_kernels: Vec::new(),
        leaks: Vec::new(),
        gpu: None,
        anomalies: None,
    })
}

/// Counters: `launches` launches, `h2d` bytes copied host to device, `sync_ns` blocked.
pub fn stats(launches: u64, h2d: u64, sync_ns: u64) -> Stats {
    let mut s = Stats {
        launches,
        ..Stats::default()
    };
    s.copies[gpu_observer_common::api::Direction::CpuToGpu.index()].count = h2d / (1 << 20);
    s.copies[gpu_observer_common::api::Direction::CpuToGpu.index()].bytes = h2d;
    s.syncs.count = sync_ns / 1_000_000;
    s.syncs.ns = sync_ns;
    s
}

/// An H100 at 73 % with 40 of 80 GiB used, 350 of 700 W, 65 °C, and `history` utilization
/// samples (100 ms apart) before the latest.
pub fn device(index: u32, history: &[u32]) -> (DeviceInfo, Vec<Arc<DeviceSample>>) {
    let info = DeviceInfo {
        index,
        name: "NVIDIA H100 80GB HBM3".into(),
        memory_total_bytes: Some(80 * GIB),
        ..DeviceInfo::default()
    };
    let latest = DeviceSample {
        device: index,
        util_gpu: Some(73),
        util_memory: Some(41),
        util_encoder: Some(0),
        util_decoder: Some(0),
        memory_used: Some(40 * GIB),
        memory_total: Some(80 * GIB),
        power_mw: Some(350_000),
        power_limit_mw: Some(700_000),
        temperature_c: Some(65),
        fan_percent: Some(40),
        clocks: nvml::query::Clocks {
            graphics: Some(1980),
            sm: Some(1980),
            memory: Some(2619),
        },
        link: nvml::query::Link {
            generation: Some(5),
            width: Some(16),
        },
        pcie_tx_bps: Some(1_200_000_000),
        pcie_rx_bps: Some(3_400_000_000),
        ..DeviceSample::default()
    };
    let mut h: Vec<Arc<DeviceSample>> = history
        .iter()
        .map(|&u| {
            Arc::new(DeviceSample {
                device: index,
                util_gpu: Some(u),
                ..DeviceSample::default()
            })
        })
        .collect();
    h.push(Arc::new(latest));
    (info, h)
}

/// An active NVML view of these devices.
pub fn nvml_view(devices: Vec<(DeviceInfo, Vec<Arc<DeviceSample>>)>) -> Arc<nvml::View> {
    let mut v = (*Hub::new(State::Active, Duration::from_millis(100), None).view()).clone();
    for (d, h) in devices {
        v.devices.push(d);
        v.history.push(h.into_iter().collect());
        v.totals.push(Default::default());
    }
    Arc::new(v)
}

/// A snapshot at `t_ns` of these processes.
pub fn snapshot(seq: u64, t_ns: u64, procs: Vec<Arc<ProcessView>>, nvml: Arc<nvml::View>) -> Snapshot {
    let mut procs = procs;
    procs.sort_by_key(|p| p.pid);
    Snapshot {
        seq,
        taken_ns: t_ns,
        last: false,
        events: 12_345,
        decode_errors: 0,
        forgotten: 0,
        abandoned: 0,
        threshold_ns: 0,
        budget: Default::default(),
        evicted: Default::default(),
        procs,
        nvml,
        agent: Default::default(),
        anomalies: Default::default(),
    }
}

/// An app (colour as asked) that read no container of any process.
pub fn app(color: bool) -> App {
    App::new(color).with_procinfo(crate::procinfo::ProcInfo::new("/nonexistent-proc", "/nonexistent-logs"))
}

/// Feeds `snap` with these drops and verdicts.
pub fn feed(app: &mut App, snap: &Snapshot, drops: u64, verdicts: &HashMap<u32, ProcessVerdict>) {
    let drops = Drops {
        total: drops,
        ..Drops::default()
    };
    app.update(&Input {
        snap,
        verdicts,
        drops: &drops,
        attach: "3 libraries attached",
        elapsed_s: 12.0,
    });
}

/// One frame at `w`×`h`.
pub fn render(app: &mut App, w: u16, h: u16) -> Buffer {
    let mut term = Terminal::new(TestBackend::new(w, h)).unwrap();
    term.draw(|f| app.draw(f)).unwrap();
    term.backend().buffer().clone()
}

/// The buffer's rows as text.
pub fn rows(b: &Buffer) -> Vec<String> {
    let a = b.area;
    (0..a.height)
        .map(|y| (0..a.width).map(|x| b[(x, y)].symbol()).collect::<String>())
        .collect()
}

/// The row holding `needle`, or a panic showing the screen.
pub fn row_with(b: &Buffer, needle: &str) -> (u16, String) {
    let r = rows(b);
    r.iter()
        .enumerate()
        .find(|(_, l)| l.contains(needle))
        .map(|(y, l)| (y as u16, l.clone()))
        .unwrap_or_else(|| panic!("no {needle:?} on the screen:\n{}", r.join("\n")))
}
