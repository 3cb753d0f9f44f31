//! The dashboard's state: what the latest snapshots said (rates between successive ones), what
//! the person chose (selection, sort, filter, panes), the keys that change it, and one frame.
//!
//! The work is done when a snapshot arrives ([`App::update`], 4 a second) or a key changes the
//! view: rows are computed, names sanitized and rows ordered there, so that [`App::draw`]
//! (run for every redraw) only lays out what is ready.

use std::{collections::HashMap, sync::Arc};

use gpu_observer_common::{api::Direction, cupti::CuptiState};
use ratatui::{
    Frame,
    crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers},
    layout::{Constraint, Layout},
    text::Line,
    widgets::TableState,
};

use super::{Theme, detail, gpus, help, procs, status};
use crate::{
    analyze::{anomaly::Mode, verdict::Verdict, window::ProcessVerdict},
    attach::Drops,
    export::text::printable_cut,
    nvml,
    procinfo::ProcInfo,
    snapshot::{ProcessView, Snapshot},
};

const MIB: f64 = 1024.0 * 1024.0;
/// Rows kept (the most by the sort key are what a person looks at; a snapshot holds at most a
/// few thousand processes).
pub(crate) const MAX_ROWS: usize = 512;
/// Characters of a command and of a pod shown in the table (escapes included).
const COMM_CHARS: usize = 16;
const POD_CHARS: usize = 40;
/// Pods remembered by pid; past this the cache starts over.
const PODS_MAX: usize = 4096;
/// The longest filter typed.
const FILTER_MAX: usize = 64;

/// What a frame shows: one snapshot and what goes with it.
pub struct Input<'a> {
    pub snap: &'a Snapshot,
    pub verdicts: &'a HashMap<u32, ProcessVerdict>,
    pub drops: &'a Drops,
    /// One line on the attach state, e.g. "3 libraries attached".
    pub attach: &'a str,
    pub elapsed_s: f64,
}

/// What the runtime should do after a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    None,
    Quit,
    Redraw,
}

/// The order of the process table (`s` cycles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sort {
    Launches,
    Busy,
    Copies,
    Sync,
    Memory,
    Pid,
}

impl Sort {
    pub fn name(self) -> &'static str {
        match self {
            Sort::Launches => "launches/s",
            Sort::Busy => "GPU busy",
            Sort::Copies => "copies MB/s",
            Sort::Sync => "sync %",
            Sort::Memory => "memory",
            Sort::Pid => "pid",
        }
    }

    fn next(self) -> Self {
        match self {
            Sort::Launches => Sort::Busy,
            Sort::Busy => Sort::Copies,
            Sort::Copies => Sort::Sync,
            Sort::Sync => Sort::Memory,
            Sort::Memory => Sort::Pid,
            Sort::Pid => Sort::Launches,
        }
    }
}

/// One process as the table shows it; rates are over the last interval (`None` until two
/// snapshots were seen, or when not known).
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub pid: u32,
    /// Sanitized and cut.
    pub comm: String,
    /// The GPUs NVML lists it on now (`-`: none).
    pub gpus: String,
    /// GPU busy percent: CUPTI's busy time, else the busy fraction its verdict's window measured,
    /// else NVML's SM utilization of the process.
    pub busy: Option<f64>,
    pub launches: Option<f64>,
    /// MB/s (MiB, as the terminal view) by direction: H→D, D→H, D→D, other.
    pub copies: [Option<f64>; 4],
    pub sync_pct: Option<f64>,
    /// Device memory: NVML's, else what the uprobes saw allocated and not freed.
    pub memory: Option<u64>,
    /// Sanitized, cut; empty when not in a container.
    pub pod: String,
    pub verdict: Option<crate::analyze::verdict::Class>,
    pub cupti: &'static str,
    pub anomalies: u64,
    pub view: Arc<ProcessView>,
}

impl Row {
    fn copy_total(&self) -> Option<f64> {
        match (self.copies[0], self.copies[1]) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        }
    }
}

/// The status line's facts.
#[derive(Clone, Debug, Default)]
pub(crate) struct StatusInfo {
    pub elapsed_s: f64,
    pub events: u64,
    pub drops: u64,
    pub attach: String,
    pub nvml: String,
}

pub struct App {
    pub(crate) theme: Theme,
    pub(crate) paused: bool,
    pub(crate) sort: Sort,
    pub(crate) filter: String,
    /// `/` typed: keys go to the filter until Enter or Esc.
    pub(crate) filtering: bool,
    pub(crate) detail: bool,
    pub(crate) help: bool,
    pub(crate) rows: Vec<Row>,
    /// Indexes into `rows` of those shown, in order.
    pub(crate) visible: Vec<usize>,
    pub(crate) selected: Option<u32>,
    table: TableState,
    prev: HashMap<u32, Arc<ProcessView>>,
    prev_taken_ns: u64,
    seq: u64,
    pub(crate) nvml: Option<Arc<nvml::View>>,
    pub(crate) verdicts: HashMap<u32, Verdict>,
    pub(crate) status: StatusInfo,
    pub(crate) mode: Mode,
    pub(crate) taken_ns: u64,
    procinfo: ProcInfo,
    pods: HashMap<u32, String>,
    /// The detail pane's lines for (pid, snapshot seq): rebuilt when either changes.
    detail_cache: Option<(u32, u64, Vec<Line<'static>>)>,
}

impl App {
    /// `color`: false under `NO_COLOR` (then only bold and reverse mark things).
    pub fn new(color: bool) -> App {
        App {
            theme: Theme { color },
            paused: false,
            sort: Sort::Launches,
            filter: String::new(),
            filtering: false,
            detail: false,
            help: false,
            rows: Vec::new(),
            visible: Vec::new(),
            selected: None,
            table: TableState::default(),
            prev: HashMap::new(),
            prev_taken_ns: 0,
            seq: 0,
            nvml: None,
            verdicts: HashMap::new(),
            status: StatusInfo::default(),
            mode: Mode::Robust,
            taken_ns: 0,
            procinfo: ProcInfo::host(),
            pods: HashMap::new(),
            detail_cache: None,
        }
    }

    /// Reads containers and pods from another proc root (tests).
    #[cfg(test)]
    pub(crate) fn with_procinfo(mut self, info: ProcInfo) -> App {
        self.procinfo = info;
        self
    }

    /// A new snapshot (rates are computed between successive ones; ignored while paused).
    pub fn update(&mut self, input: &Input<'_>) {
        if self.paused {
            return;
        }
        let snap = input.snap;
        self.status = StatusInfo {
            elapsed_s: input.elapsed_s,
            events: snap.events,
            drops: input.drops.total,
            attach: input.attach.to_string(),
            nvml: nvml_state(&snap.nvml),
        };
        if snap.seq == self.seq && self.seq != 0 {
            return;
        }
        let interval_s = (self.prev_taken_ns != 0 && snap.taken_ns > self.prev_taken_ns)
            .then(|| (snap.taken_ns - self.prev_taken_ns) as f64 / 1e9);
        self.seq = snap.seq;
        self.taken_ns = snap.taken_ns;
        self.mode = snap.anomalies.0.mode;
        self.nvml = Some(snap.nvml.clone());
        let gpus = &*snap.nvml;
        let mut rows = Vec::with_capacity(snap.procs.len().min(MAX_ROWS));
        let mut next = HashMap::with_capacity(snap.procs.len());
        for p in snap.procs.iter().filter(|p| !p.exited) {
            let prev = self.prev.get(&p.pid);
            let (now, before) = (&p.stats, prev.map(|v| &v.stats));
            let rate = |f: &dyn Fn(&crate::correlate::Stats) -> u64| {
                let (i, b) = (interval_s?, before?);
                Some(f(now).saturating_sub(f(b)) as f64 / i)
            };
            let dir = |d: Direction| rate(&|s| s.copy(d).bytes).map(|b| b / MIB);
            let nv = gpus.procs.get(&p.pid);
            let cupti_busy = p.gpu.as_ref().and_then(|g| {
                let b = prev?.gpu.as_ref().map_or(0, |g0| g0.stats.busy_ns);
                Some(g.stats.busy_ns.saturating_sub(b) as f64 / (interval_s? * 1e9) * 100.0)
            });
            // Else what its verdict's window measured (the verdict's own order: the GPU's
            // utilization while the process had it to itself, then its SM samples), else
            // NVML's last SM sample. On the H100 a training step with the GPU 83 % busy had
            // SM samples of 1 %: the verdict's number is the one the verdict line explains.
            let busy = cupti_busy
                .or_else(|| {
                    let e = &input.verdicts.get(&p.pid)?.verdict.evidence;
                    e.gpu_busy().map(|b| b * 100.0)
                })
                .or_else(|| nv.and_then(|u| u.sm_util_last).map(f64::from));
            let pod = pod_of(&mut self.pods, &self.procinfo, p.pid);
            rows.push(Row {
                pid: p.pid,
                comm: printable_cut(&p.comm, COMM_CHARS - 1),
                gpus: match nv {
                    Some(u) if !u.devices_now.is_empty() => {
                        u.devices_now.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
                    }
                    _ => "-".into(),
                },
                busy,
                launches: rate(&|s| s.launches),
                copies: [
                    dir(Direction::CpuToGpu),
                    dir(Direction::GpuToCpu),
                    dir(Direction::GpuToGpu),
                    dir(Direction::Unknown),
                ],
                sync_pct: rate(&|s| s.syncs.ns).map(|ns| ns / 1e9 * 100.0),
                memory: nv
                    .map(|u| u.memory_bytes)
                    .or((p.stats.live_device > 0).then_some(p.stats.live_device)),
                pod,
                verdict: input.verdicts.get(&p.pid).map(|v| v.verdict.class),
                cupti: p.gpu.as_ref().map_or("-", |g| CuptiState::name_of(g.status.state)),
                anomalies: p.anomaly_count(),
                view: p.clone(),
            });
            next.insert(p.pid, p.clone());
        }
        self.prev = next;
        self.prev_taken_ns = snap.taken_ns;
        self.verdicts = rows
            .iter()
            .filter_map(|r| Some((r.pid, input.verdicts.get(&r.pid)?.verdict.clone())))
            .collect();
        self.pods.retain(|pid, _| self.prev.contains_key(pid));
        self.rows = rows;
        self.reorder();
    }

    /// Sorts and filters the rows, bounds them, and keeps the selection on its process.
    pub(crate) fn reorder(&mut self) {
        let needle = self.filter.to_lowercase();
        let mut v: Vec<usize> = (0..self.rows.len())
            .filter(|&i| {
                let r = &self.rows[i];
                needle.is_empty()
                    || r.comm.to_lowercase().contains(&needle)
                    || r.pod.to_lowercase().contains(&needle)
                    || r.pid.to_string().contains(&needle)
            })
            .collect();
        let key = |r: &Row| -> Option<f64> {
            match self.sort {
                Sort::Launches => r.launches,
                Sort::Busy => r.busy,
                Sort::Copies => r.copy_total(),
                Sort::Sync => r.sync_pct,
                Sort::Memory => r.memory.map(|m| m as f64),
                Sort::Pid => None,
            }
        };
        let rows = &self.rows;
        v.sort_by(|&a, &b| {
            let (ra, rb) = (&rows[a], &rows[b]);
            // Largest first; unknown last; then by pid.
            let by_key = match (key(ra), key(rb)) {
                (Some(x), Some(y)) => y.total_cmp(&x),
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (None, None) => std::cmp::Ordering::Equal,
            };
            by_key.then(ra.pid.cmp(&rb.pid))
        });
        v.truncate(MAX_ROWS);
        self.visible = v;
        let at = self
            .selected
            .and_then(|pid| self.visible.iter().position(|&i| self.rows[i].pid == pid));
        match at {
            Some(i) => self.table.select(Some(i)),
            None => {
                self.selected = self.visible.first().map(|&i| self.rows[i].pid);
                self.table.select(self.selected.map(|_| 0));
            }
        }
    }

    /// The selected process's row.
    pub(crate) fn selected_row(&self) -> Option<&Row> {
        let pid = self.selected?;
        self.visible.iter().map(|&i| &self.rows[i]).find(|r| r.pid == pid)
    }

    fn step(&mut self, by: isize) {
        if self.visible.is_empty() {
            return;
        }
        let at = self.table.selected().unwrap_or(0) as isize;
        let to = (at + by).clamp(0, self.visible.len() as isize - 1) as usize;
        self.table.select(Some(to));
        self.selected = Some(self.rows[self.visible[to]].pid);
    }

    pub fn key(&mut self, key: KeyEvent) -> Action {
        if key.kind == KeyEventKind::Release {
            return Action::None;
        }
        if key.modifiers.contains(KeyModifiers::CONTROL) && key.code == KeyCode::Char('c') {
            return Action::Quit;
        }
        if self.filtering {
            match key.code {
                KeyCode::Esc => {
                    self.filter.clear();
                    self.filtering = false;
                }
                KeyCode::Enter => self.filtering = false,
                KeyCode::Backspace => {
                    self.filter.pop();
                }
                KeyCode::Char(c) if !c.is_control() && self.filter.chars().count() < FILTER_MAX => {
                    self.filter.push(c);
                }
                KeyCode::Up => self.step(-1),
                KeyCode::Down => self.step(1),
                _ => return Action::None,
            }
            self.reorder();
            return Action::Redraw;
        }
        if self.help {
            // Any key closes the help; q still quits.
            self.help = false;
            return if key.code == KeyCode::Char('q') {
                Action::Quit
            } else {
                Action::Redraw
            };
        }
        match key.code {
            KeyCode::Char('q') => return Action::Quit,
            KeyCode::Up | KeyCode::Char('k') => self.step(-1),
            KeyCode::Down | KeyCode::Char('j') => self.step(1),
            KeyCode::PageUp => self.step(-10),
            KeyCode::PageDown => self.step(10),
            KeyCode::Home => self.step(isize::MIN / 2),
            KeyCode::End => self.step(isize::MAX / 2),
            KeyCode::Enter | KeyCode::Tab => self.detail = !self.detail,
            KeyCode::Char('s') => {
                self.sort = self.sort.next();
                self.reorder();
            }
            KeyCode::Char('p') => self.paused = !self.paused,
            KeyCode::Char('?') | KeyCode::F(1) => self.help = true,
            KeyCode::Char('/') => self.filtering = true,
            KeyCode::Esc => {
                if self.detail {
                    self.detail = false;
                } else {
                    self.filter.clear();
                    self.reorder();
                }
            }
            _ => return Action::None,
        }
        Action::Redraw
    }

    pub fn draw(&mut self, f: &mut Frame<'_>) {
        let area = f.area();
        let [main, status_area] = Layout::vertical([Constraint::Min(0), Constraint::Length(1)]).areas(area);
        let gpu_h = gpus::height(self.nvml.as_deref(), main.height);
        let [gpu_area, rest] = Layout::vertical([Constraint::Length(gpu_h), Constraint::Min(0)]).areas(main);
        gpus::draw(f, gpu_area, self.nvml.as_deref(), self.theme);
        let detail = self.detail && self.selected_row().is_some();
        if detail {
            let (table_area, detail_area) = if rest.height >= 18 {
                let [t, d] = Layout::vertical([Constraint::Length((rest.height * 2 / 5).max(6)), Constraint::Min(0)])
                    .areas(rest);
                (Some(t), d)
            } else {
                (None, rest)
            };
            if let Some(t) = table_area {
                procs::draw(f, t, self);
            }
            let lines = self.detail_lines();
            if let Some(row) = self.selected_row() {
                detail::draw(f, detail_area, row, lines, self.theme);
            }
        } else {
            procs::draw(f, rest, self);
        }
        status::draw(f, status_area, self);
        if self.help {
            help::draw(f, area, self.theme);
        }
    }

    pub(crate) fn table_state(&mut self) -> &mut TableState {
        &mut self.table
    }

    /// The detail pane's lines for the selected process (built once per snapshot).
    fn detail_lines(&mut self) -> Vec<Line<'static>> {
        let Some(pid) = self.selected else {
            return Vec::new();
        };
        if let Some((p, seq, lines)) = &self.detail_cache
            && *p == pid
            && *seq == self.seq
        {
            return lines.clone();
        }
        let lines = match self.selected_row() {
            Some(row) => detail::lines(row, self.verdicts.get(&pid), self.nvml.as_deref(), self),
            None => Vec::new(),
        };
        self.detail_cache = Some((pid, self.seq, lines.clone()));
        lines
    }
}

/// The pod (or container) of a process, read from /proc once per pid.
fn pod_of(pods: &mut HashMap<u32, String>, info: &ProcInfo, pid: u32) -> String {
    if let Some(p) = pods.get(&pid) {
        return p.clone();
    }
    if pods.len() >= PODS_MAX {
        pods.clear();
    }
    let shown = match info.container(pid) {
        Some(c) => match c.pod {
            Some((pod, ns, container)) => printable_cut(&format!("{ns}/{pod}/{container}"), POD_CHARS),
            None => printable_cut(&c.id.chars().take(12).collect::<String>(), POD_CHARS),
        },
        None => String::new(),
    };
    pods.insert(pid, shown.clone());
    shown
}

/// NVML's state for the status line.
fn nvml_state(v: &nvml::View) -> String {
    match v.state {
        nvml::State::Active => format!(
            "NVML {} GPU{}",
            v.devices.len(),
            if v.devices.len() == 1 { "" } else { "s" }
        ),
        s => format!("NVML {}", s.name()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use ratatui::{
        buffer::Buffer,
        crossterm::event::{KeyCode, KeyEvent, KeyModifiers},
        style::{Color, Modifier},
    };

    use super::*;
    use crate::{
        analyze::{
            findings::Findings,
            verdict::{Class, Evidence},
        },
        correlate::{Amount, Leak, SyncTarget, cupti_join::GpuStats},
        decode::KernelName,
        export::dashboard::testing::*,
        snapshot::GpuView,
    };

    const HOSTILE: &str = "\x1b]0;pwn\x07";

    fn press(app: &mut App, code: KeyCode) -> Action {
        app.key(KeyEvent::new(code, KeyModifiers::NONE))
    }

    fn typed(app: &mut App, s: &str) {
        for c in s.chars() {
            press(app, KeyCode::Char(c));
        }
    }

    /// Process 10 (train: 4 000 launches/s, 50 % in syncs, kernels, CUPTI, leaks, anomalies),
    /// 20 (infer: 2 000 launches/s, 100 MB/s host to device) and 30 (a hostile name, on GPU 0
    /// at 90 % SM by NVML), one second apart.
    fn two_snapshots() -> (Snapshot, Snapshot, HashMap<u32, ProcessVerdict>) {
        let nv = |hist: &[u32]| {
            let mut v = (*nvml_view(vec![device(0, hist)])).clone();
            v.procs.insert(
                30,
                nvml::ProcUse {
                    devices_now: vec![0],
                    memory_bytes: 3 * GIB,
                    sm_util_last: Some(90),
                    ..Default::default()
                },
            );
            Arc::new(v)
        };
        let hist: Vec<u32> = [0; 300].into_iter().chain([100; 300]).collect();
        let train = |launches, sync_ns, busy_ns| {
            let mut s = stats(launches, 0, sync_ns);
            s.sync_by_target = BTreeMap::from([
                (
                    SyncTarget::Stream(0x7f00),
                    Amount {
                        count: 300,
                        bytes: 0,
                        ns: sync_ns * 3 / 5,
                    },
                ),
                (
                    SyncTarget::Context,
                    Amount {
                        count: 200,
                        bytes: 0,
                        ns: sync_ns * 2 / 5,
                    },
                ),
            ]);
            s.live_device = 2 * GIB;
            s.live_allocs = 3;
            let mut p = (*process(10, "train", s)).clone();
            p.top_kernels = vec![
                (Arc::new(KernelName::new("gemm_kernel")), launches * 3 / 4),
                (Arc::new(KernelName::new("gemm\u{202e}txt.exe")), launches / 4),
            ];
            let mut g = GpuStats {
                busy_ns,
                ..GpuStats::default()
            };
            g.by_kernel.insert(Arc::from("gemm_kernel"), (1000, 27_000_000));
            p.gpu = Some(GpuView {
                status: Default::default(),
                stats: g,
                nvtx: Default::default(),
            });
            p.leaks = vec![Leak {
                api: "cuMemAlloc_v2",
                mem: gpu_observer_common::api::MemKind::Device,
                count: 3,
                bytes: 2 * GIB,
            }];
            let mut f = Findings::default();
            f.note(
                S / 2,
                &crate::snapshot::testing::kernel_finding("gemm_x", 412_000.0, 41_000.0, 115.4),
            );
            p.anomalies = Some(Arc::new(f));
            Arc::new(p)
        };
        let s1 = snapshot(
            1,
            S,
            vec![
                train(1_000, 0, 0),
                process(20, "infer", stats(100, 0, 0)),
                process(30, HOSTILE, stats(0, 0, 0)),
            ],
            nv(&hist),
        );
        let s2 = snapshot(
            2,
            2 * S,
            vec![
                train(5_000, S / 2, S * 93 / 100),
                process(20, "infer", stats(2_100, 100 << 20, 0)),
                process(30, HOSTILE, stats(0, 0, 0)),
            ],
            nv(&hist),
        );
        let verdicts = HashMap::from([(
            10,
            ProcessVerdict {
                pid: 10,
                comm: "train".into(),
                verdict: Verdict {
                    class: Class::GpuBound,
                    secondary: None,
                    evidence: Evidence {
                        window_ns: 10 * S,
                        gpu_busy: Some(0.93),
                        busy_source: crate::analyze::verdict::BusySource::Cupti,
                        ..Evidence::default()
                    },
                },
            },
        )]);
        (s1, s2, verdicts)
    }

    #[test]
    fn gpu_busy_is_cuptis_else_the_verdicts_else_nvmls_sm_sample() {
        let (s1, s2, mut v) = two_snapshots();
        let busy = |v: &HashMap<u32, ProcessVerdict>| {
            let mut a = app(false);
            feed(&mut a, &s1, 0, v);
            feed(&mut a, &s2, 0, v);
            let of = |pid| a.rows.iter().find(|r| r.pid == pid).and_then(|r| r.busy);
            (of(10).map(f64::round), of(30))
        };
        // pid 10 has CUPTI busy time (93 % between the two snapshots); pid 30 only NVML's SM
        // sample (90 %).
        assert_eq!(busy(&v), (Some(93.0), Some(90.0)));
        // CUPTI's own number, whatever the verdict's window says.
        v.get_mut(&10).unwrap().verdict.evidence.gpu_busy = Some(0.5);
        assert_eq!(busy(&v).0, Some(93.0));
        // With a verdict measured from the GPU's utilization (nvml_device), pid 30 shows that.
        v.insert(
            30,
            ProcessVerdict {
                pid: 30,
                comm: "x".into(),
                verdict: Verdict {
                    class: Class::GpuBound,
                    secondary: None,
                    evidence: Evidence {
                        window_ns: 10 * S,
                        gpu_busy: Some(0.40),
                        busy_source: crate::analyze::verdict::BusySource::NvmlDevice,
                        ..Evidence::default()
                    },
                },
            },
        );
        assert_eq!(busy(&v).1, Some(40.0));
    }

    fn running(color: bool) -> App {
        let (s1, s2, v) = two_snapshots();
        let mut a = app(color);
        feed(&mut a, &s1, 0, &v);
        feed(&mut a, &s2, 0, &v);
        a
    }

    /// The pids of the table's rows, top to bottom.
    fn order(b: &Buffer) -> Vec<u32> {
        rows(b)
            .iter()
            .skip_while(|l| !l.contains(" PID "))
            .filter(|l| l.starts_with('│'))
            .filter_map(|l| l.trim_start_matches('│').split_whitespace().next()?.parse().ok())
            .collect()
    }

    #[test]
    fn the_gpu_panel_shows_its_numbers_bars_band_and_history() {
        let mut a = running(true);
        let b = render(&mut a, 100, 30);
        assert!(
            row_with(&b, "GPU 0 · NVIDIA H100 80GB HBM3")
                .1
                .starts_with("┌ GPU 0 · NVIDIA H100 80GB HBM3 ─")
        );
        let (_, l1) = row_with(&b, "│GPU ");
        assert_eq!(
            l1.trim_end_matches(['│', ' ']),
            "│GPU █████████████████████░░░░░░░░  73%  MEM ████████████░░░░░░░░░░░░░░░░░  41%  ENC   0%  DEC   0%"
        );
        let (y, l2) = row_with(&b, "│VRAM ");
        assert_eq!(
            l2.trim_end_matches(['│', ' ']),
            "│VRAM ███████████████░░░░░░░░░░░░░░░ 40.0/80.0G  PWR 350/700W  65°C WARM  FAN 40%"
        );
        // The VRAM bar half full, green; WARM in green, bold.
        assert_eq!(b[(6, y)].fg, Color::Green);
        let warm = l2
            .chars()
            .collect::<Vec<_>>()
            .windows(4)
            .position(|w| w == ['W', 'A', 'R', 'M'])
            .unwrap() as u16;
        assert_eq!(b[(warm, y)].fg, Color::Green);
        assert!(b[(warm, y)].modifier.contains(Modifier::BOLD));
        let (_, l3) = row_with(&b, "│CLK ");
        assert_eq!(
            l3.trim_end_matches(['│', ' ']),
            "│CLK gfx 1980 SM 1980 mem 2619 MHz  PCIe gen5×16 TX 1.20 GB/s RX 3.40 GB/s"
        );
        // 60 s in 89 columns: the older half idle, the newer busy, the column between them
        // half of each.
        let (_, l4) = row_with(&b, "│util 60s ");
        let spark: String = l4.trim_start_matches("│util 60s ").trim_end_matches('│').into();
        assert_eq!(spark.chars().count(), 89);
        assert_eq!(spark, format!("{}▅{}", "▁".repeat(44), "█".repeat(44)), "{spark}");
    }

    #[test]
    fn temperatures_fall_in_bands_and_history_columns_average_their_samples() {
        let bands: Vec<&str> = [40, 50, 51, 70, 71, 85, 86, 99]
            .into_iter()
            .map(|c| super::super::temperature_band(c).0)
            .collect();
        assert_eq!(
            bands,
            ["COOL", "COOL", "WARM", "WARM", "HOT", "HOT", "CRITICAL", "CRITICAL"]
        );
        let hist: Vec<u32> = [0; 300].into_iter().chain([100; 300]).collect();
        let v = nvml_view(vec![device(0, &hist)]);
        assert_eq!(super::gpus::sparkline(&v, 0, 10), "▁▁▁▁▁█████");
        // Six seconds seen: the rest of the minute blank; (73 + 59 × 50) / 60 rounds to ▅.
        let v = nvml_view(vec![device(0, &[50; 60])]);
        assert_eq!(super::gpus::sparkline(&v, 0, 10), "        ▅▅");
        let mut hot = (*nvml_view(vec![device(0, &[])])).clone();
        let mut s = (*hot.history[0][0]).clone();
        s.temperature_c = Some(91);
        hot.history[0][0] = Arc::new(s);
        let mut a = app(true);
        feed(&mut a, &snapshot(1, S, vec![], Arc::new(hot)), 0, &HashMap::new());
        let b = render(&mut a, 100, 30);
        let (y, l) = row_with(&b, "91°C CRITICAL");
        let col = l
            .chars()
            .collect::<Vec<_>>()
            .windows(8)
            .position(|w| w.iter().collect::<String>() == "CRITICAL")
            .unwrap();
        assert_eq!(b[(col as u16, y)].fg, Color::Red);
    }

    #[test]
    fn rows_show_rates_between_snapshots() {
        let mut a = running(true);
        let b = render(&mut a, 200, 30);
        let (_, h) = row_with(&b, "PID");
        assert_eq!(
            h.split_whitespace().collect::<Vec<_>>(),
            [
                "│", "PID", "COMMAND", "GPU", "BUSY%", "LAUNCH/s", "H→D", "MB/s", "D→H", "MB/s", "SYNC%", "MEM", "POD",
                "VERDICT", "CUPTI", "ANOM", "│"
            ]
        );
        let cells = |pid: &str| {
            let (_, l) = row_with(&b, &format!("│{pid:>7} "));
            l.split_whitespace().map(str::to_string).collect::<Vec<_>>()
        };
        assert_eq!(
            cells("10"),
            [
                "│",
                "10",
                "train",
                "-",
                "93",
                "4.0k",
                "0.0",
                "0.0",
                "50",
                "2.0G",
                "gpu_bound",
                "unknown",
                "!1",
                "│"
            ]
        );
        assert_eq!(
            cells("20"),
            [
                "│", "20", "infer", "-", "-", "2.0k", "100.0", "0.0", "0", "-", "-", "-", "0", "│"
            ]
        );
        assert_eq!(
            cells("30"),
            [
                "│",
                "30",
                "\\x1b]0;pwn\\x07",
                "0",
                "90",
                "0",
                "0.0",
                "0.0",
                "0",
                "3.0G",
                "-",
                "-",
                "0",
                "│"
            ]
        );
        // The first snapshot alone has no rates.
        let (s1, _, v) = two_snapshots();
        let mut first = app(true);
        feed(&mut first, &s1, 0, &v);
        let b = render(&mut first, 200, 30);
        assert!(
            row_with(&b, "│     20 infer")
                .1
                .contains("-        -        -        -     - ")
        );
    }

    #[test]
    fn s_cycles_the_sort_and_arrows_move_the_highlight() {
        let mut a = running(true);
        assert_eq!(order(&render(&mut a, 120, 30)), [10, 20, 30]);
        assert!(
            row_with(&render(&mut a, 120, 30), "sort: launches/s")
                .1
                .contains("processes 3/3")
        );
        press(&mut a, KeyCode::Char('s'));
        assert_eq!(a.sort, Sort::Busy);
        // 30 at NVML's 90 %, 10 at CUPTI's 93 %: 10, 30, then 20 (unknown) last.
        assert_eq!(order(&render(&mut a, 120, 30)), [10, 30, 20]);
        press(&mut a, KeyCode::Char('s'));
        assert_eq!(order(&render(&mut a, 120, 30)), [20, 10, 30]);
        assert!(row_with(&render(&mut a, 120, 30), "sort: copies MB/s").0 > 0);
        // The selection stays on its process (10, the first at the start) across sorts.
        let b = render(&mut a, 120, 30);
        let (y10, _) = row_with(&b, "│     10 ");
        let (y20, _) = row_with(&b, "│     20 ");
        assert!(b[(3, y10)].modifier.contains(Modifier::REVERSED));
        assert!(!b[(3, y20)].modifier.contains(Modifier::REVERSED));
        assert_eq!(press(&mut a, KeyCode::Down), Action::Redraw);
        let b = render(&mut a, 120, 30);
        assert_eq!(a.selected, Some(30));
        assert!(
            b[(3, row_with(&b, "│     30 ").0)]
                .modifier
                .contains(Modifier::REVERSED)
        );
        assert!(
            !b[(3, row_with(&b, "│     10 ").0)]
                .modifier
                .contains(Modifier::REVERSED)
        );
        press(&mut a, KeyCode::Down);
        assert_eq!(a.selected, Some(30), "the last row stays selected");
        press(&mut a, KeyCode::Up);
        press(&mut a, KeyCode::Up);
        assert_eq!(a.selected, Some(20));
    }

    #[test]
    fn slash_filters_rows_and_esc_clears() {
        let mut a = running(true);
        press(&mut a, KeyCode::Char('/'));
        typed(&mut a, "inf");
        let b = render(&mut a, 120, 30);
        assert_eq!(order(&b), [20]);
        assert!(row_with(&b, "processes 1/3").1.contains("filter: /inf"));
        assert!(rows(&b)[29].starts_with("/inf▏  Enter keeps, Esc clears"));
        // While typing, q is text, not quit.
        assert_eq!(press(&mut a, KeyCode::Char('q')), Action::Redraw);
        assert_eq!(order(&render(&mut a, 120, 30)), Vec::<u32>::new());
        assert!(row_with(&render(&mut a, 120, 30), "(no process matches /infq)").0 > 0);
        press(&mut a, KeyCode::Backspace);
        press(&mut a, KeyCode::Enter);
        assert_eq!(order(&render(&mut a, 120, 30)), [20]);
        // Enter kept the filter; the pid matches too; Esc clears it.
        press(&mut a, KeyCode::Esc);
        assert_eq!(order(&render(&mut a, 120, 30)), [10, 20, 30]);
        press(&mut a, KeyCode::Char('/'));
        typed(&mut a, "30");
        assert_eq!(order(&render(&mut a, 120, 30)), [30]);
        press(&mut a, KeyCode::Esc);
        assert_eq!(order(&render(&mut a, 120, 30)), [10, 20, 30]);
        assert!(!a.filtering);
    }

    #[test]
    fn enter_opens_the_detail_of_the_selected_process() {
        let mut a = running(true);
        press(&mut a, KeyCode::Enter);
        let b = render(&mut a, 120, 40);
        let text = rows(&b).join("\n");
        assert!(row_with(&b, "┌ pid 10 · train ").0 > 0, "{text}");
        let line = |needle: &str| row_with(&b, needle).1.trim_end_matches(['│', ' ']).to_string();
        assert_eq!(line("verdict   "), "│verdict   gpu_bound");
        // The evidence and the hint, wrapped in the pane.
        assert!(
            line("GPU busy 93.0%")
                .starts_with("│          gpu_bound over 10.0 s: GPU busy 93.0% (cupti) — the kernels are")
        );
        assert!(text.contains("optimize the top kernels by GPU"), "{text}");
        assert_eq!(line("      3750×"), "│        3750×  gemm_kernel");
        assert_eq!(line("      1250×"), "│        1250×  gemm\\u{202e}txt.exe");
        assert_eq!(line("mean"), "│     27.0 ms     1000×  mean   27.0 µs  gemm_kernel");
        assert_eq!(
            line("syncs"),
            "│syncs     500 × 500 ms blocked; stream 0x7f00 300× 300 ms, context 200× 200 ms"
        );
        assert_eq!(
            line("memory"),
            "│memory    2.0 GiB outstanding in 3 allocations (2.0 GiB device, 0 B managed, 0 B pinned host)"
        );
        assert_eq!(
            line("not freed"),
            "│          3 × 2.0 GiB of device memory from cuMemAlloc_v2 not freed"
        );
        assert_eq!(line("anomalies "), "│anomalies 1 flagged");
        assert_eq!(
            line("412 µs"),
            "│          kernel \"gemm_x\" 412 µs, typically 41.0 µs (115 dev), 1.5 s ago"
        );
        // Another process's copies, now and in total.
        press(&mut a, KeyCode::Down);
        let b20 = render(&mut a, 120, 40);
        assert_eq!(
            row_with(&b20, "copies").1.trim_end_matches(['│', ' ']),
            "│copies    H→D   100.0 MB/s now; 100 copies, 100.0 MiB, - while copying"
        );
        assert_eq!(
            row_with(&b20, "verdict").1.trim_end_matches(['│', ' ']),
            "│verdict   - (not enough samples yet)"
        );
        press(&mut a, KeyCode::Up);
        // The table stays above, smaller; Esc closes.
        assert!(row_with(&b, "│     20 infer").0 < row_with(&b, "┌ pid 10").0);
        press(&mut a, KeyCode::Esc);
        assert!(!rows(&render(&mut a, 120, 40)).join("\n").contains("┌ pid 10"));
        // Tab toggles as well; on a short screen the detail takes the table's place.
        press(&mut a, KeyCode::Tab);
        let b = render(&mut a, 80, 24);
        assert!(row_with(&b, "┌ pid 10 · train").0 > 0);
        assert!(!rows(&b).join("\n").contains("LAUNCH/s"));
    }

    #[test]
    fn drops_are_red_with_the_remedy() {
        let (_, s2, v) = two_snapshots();
        let mut a = app(true);
        feed(&mut a, &s2, 7, &v);
        let b = render(&mut a, 120, 30);
        let status = &rows(&b)[29];
        assert!(
            status.starts_with(
                "12 s │ 12345 events │ 7 dropped: raise --ring-buffer-size │ 3 libraries attached │ NVML 1 GPU │ ? help"
            ),
            "{status}"
        );
        let x = status.chars().position(|c| c == '7').unwrap() as u16;
        assert_eq!(b[(x, 29)].fg, Color::Red);
        feed(
            &mut a,
            &{
                let mut s = s2.clone();
                s.seq = 3;
                s
            },
            0,
            &v,
        );
        let status = rows(&render(&mut a, 120, 30))[29].clone();
        assert!(status.starts_with("12 s │ 12345 events │ 0 dropped │ "), "{status}");
    }

    #[test]
    fn question_mark_shows_the_keys_and_any_key_closes_them() {
        let mut a = running(true);
        press(&mut a, KeyCode::Char('?'));
        let b = render(&mut a, 80, 24);
        assert!(row_with(&b, "┌ keys ").0 > 0);
        assert!(row_with(&b, "│ s            cycle the sort column").0 > 0);
        assert!(row_with(&b, "│ /            filter by command, pid, pod").0 > 0);
        assert_eq!(press(&mut a, KeyCode::Char('x')), Action::Redraw);
        assert!(!rows(&render(&mut a, 80, 24)).join("\n").contains("┌ keys "));
        assert_eq!(press(&mut a, KeyCode::Char('q')), Action::Quit);
        assert_eq!(
            a.key(KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL)),
            Action::Quit
        );
    }

    #[test]
    fn p_pauses_updates() {
        let (s1, s2, v) = two_snapshots();
        let mut a = app(true);
        feed(&mut a, &s1, 0, &v);
        press(&mut a, KeyCode::Char('p'));
        feed(&mut a, &s2, 0, &v);
        let b = render(&mut a, 120, 30);
        assert!(rows(&b)[29].contains("PAUSED (p resumes)"));
        // Still the first snapshot: no rates.
        assert!(row_with(&b, "│     10 train").1.contains("     -        -"));
    }

    #[test]
    fn fits_80_by_24_and_collapses_many_gpus_to_lines() {
        let mut a = running(true);
        let b = render(&mut a, 80, 24);
        let r = rows(&b);
        assert!(r[0].starts_with("┌ GPU 0 · NVIDIA H100 80GB HBM3 "), "{}", r.join("\n"));
        assert_eq!(
            r[7].split_whitespace().collect::<Vec<_>>(),
            [
                "│", "PID", "COMMAND", "BUSY%", "LAUNCH/s", "H→D", "MB/s", "D→H", "MB/s", "SYNC%", "VERDICT", "│"
            ]
        );
        assert_eq!(order(&b), [10, 20, 30]);
        assert!(r[23].starts_with("12 s │ 12345 events │ 0 dropped │ 3 libraries attached │ NVML 1 GPU"));
        // Four GPUs do not fit as panels at 24 rows: a line each.
        let (_, s2, v) = two_snapshots();
        let four = nvml_view((0..4).map(|i| device(i, &[50; 10])).collect());
        let mut a = app(true);
        feed(&mut a, &snapshot(1, S, s2.procs.clone(), four), 0, &v);
        let r = rows(&render(&mut a, 80, 24));
        assert!(r[0].starts_with("┌ GPUs "), "{}", r.join("\n"));
        assert_eq!(
            r[1].trim_end_matches(['│', ' ']),
            "│ 0 NVIDIA H100… GPU ██████░░  73%  VRAM ███░░░ 40.0/80.0G  350/700W  65°C WARM"
        );
        assert!(r[4].starts_with("│ 3 NVIDIA H100…"));
        assert_eq!(order(&render(&mut a, 80, 24)), [10, 20, 30]);
        // Forty: as many as leave the table its rows, then how many more.
        let forty = nvml_view((0..40).map(|i| device(i, &[])).collect());
        let mut a = app(false);
        feed(&mut a, &snapshot(1, S, s2.procs.clone(), forty), 0, &v);
        let r = rows(&render(&mut a, 80, 24));
        assert_eq!(r[13].trim_end_matches(['│', ' ']), "│+28 more GPUs", "{}", r.join("\n"));
        assert!(r[16].contains("PID"), "{}", r.join("\n"));
    }

    #[test]
    fn no_color_draws_no_colour() {
        for color in [false, true] {
            let (s1, s2, v) = two_snapshots();
            let mut a = app(color);
            feed(&mut a, &s1, 3, &v);
            feed(&mut a, &s2, 3, &v);
            press(&mut a, KeyCode::Enter);
            let b = render(&mut a, 120, 40);
            let coloured = b
                .content()
                .iter()
                .filter(|c| c.fg != Color::Reset || c.bg != Color::Reset)
                .count();
            if color {
                assert!(coloured > 0);
            } else {
                assert_eq!(coloured, 0);
                // Still marked: the selection reversed.
                assert!(
                    b[(3, row_with(&b, "│     10 ").0)]
                        .modifier
                        .contains(Modifier::REVERSED)
                );
            }
        }
    }

    #[test]
    fn hostile_names_are_inert() {
        // A container whose pod name holds an OSC title change.
        let root = std::env::temp_dir().join(format!("gpu-observer-dashboard-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let id = "0123456789abcdef".repeat(4);
        std::fs::create_dir_all(root.join("proc/30")).unwrap();
        std::fs::create_dir_all(root.join("logs")).unwrap();
        std::fs::write(
            root.join("proc/30/cgroup"),
            format!("0::/system.slice/docker-{id}.scope\n"),
        )
        .unwrap();
        std::fs::write(root.join(format!("logs/evil{HOSTILE}\u{202e}pod_ns_main-{id}.log")), "").unwrap();
        let (s1, s2, v) = two_snapshots();
        let mut a = App::new(true).with_procinfo(ProcInfo::new(root.join("proc"), root.join("logs")));
        feed(&mut a, &s1, 0, &v);
        feed(&mut a, &s2, 0, &v);
        let b = render(&mut a, 200, 40);
        let (_, l) = row_with(&b, "│     30 ");
        assert!(l.contains("\\x1b]0;pwn\\x07"), "{l}");
        // The pod column cut at its width; the detail's title has it whole.
        assert!(l.contains(" ns/evil\\x1b]0;pwn\\x07\\u{ "), "{l}");
        // The kernel name in the detail pane of 10.
        press(&mut a, KeyCode::Enter);
        let b2 = render(&mut a, 200, 40);
        // Then 30's detail, title with the pod.
        press(&mut a, KeyCode::Down);
        press(&mut a, KeyCode::Down);
        let b3 = render(&mut a, 200, 40);
        assert!(
            row_with(
                &b3,
                "┌ pid 30 · \\x1b]0;pwn\\x07 · ns/evil\\x1b]0;pwn\\x07\\u{202e}pod/main "
            )
            .0 > 0
        );
        for b in [&b, &b2, &b3] {
            for c in b.content() {
                assert!(
                    !c.symbol().chars().any(|ch| ch.is_control() || ch == '\u{202e}'),
                    "raw {:?}",
                    c.symbol()
                );
            }
        }
        assert!(rows(&b2).join("\n").contains("gemm\\u{202e}txt.exe"));
        let _ = std::fs::remove_dir_all(&root);
    }
}
