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
    /// GPU busy percent: CUPTI's busy time, else NVML's SM utilization of the process.
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
            let busy = cupti_busy.or_else(|| nv.and_then(|u| u.sm_util_last).map(f64::from));
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
