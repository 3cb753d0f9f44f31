//! PLACEHOLDER: replaced by the widgets branch.
//!
//! A minimal view that keeps the runtime's contract: a title, one line per GPU with its
//! utilization from the latest NVML sample, and a process table with launches per second.

use std::collections::{HashMap, VecDeque};

use ratatui::{
    Frame,
    crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers},
    layout::{Constraint, Layout},
    style::{Modifier, Style},
    text::Line,
    widgets::{Block, Paragraph, Row, Table},
};

use crate::{analyze::window::ProcessVerdict, attach::Drops, export::text::printable, snapshot::Snapshot};

/// What the runtime hands the view with each new snapshot.
pub struct Input<'a> {
    pub snap: &'a Snapshot,
    pub verdicts: &'a HashMap<u32, ProcessVerdict>,
    pub drops: &'a Drops,
    /// One line on the attach state.
    pub attach: &'a str,
    pub elapsed_s: f64,
}

/// What a key asks of the runtime.
pub enum Action {
    None,
    Quit,
    Redraw,
}

/// Launch counts older than this are the base of the rate (a snapshot comes every 250 ms).
const RATE_WINDOW_NS: u64 = 1_000_000_000;

pub struct App {
    color: bool,
    title: String,
    gpus: Vec<String>,
    rows: Vec<[String; 4]>,
    /// (taken_ns, launches per pid), oldest first, spanning about [`RATE_WINDOW_NS`].
    history: VecDeque<(u64, HashMap<u32, u64>)>,
    paused: bool,
}

impl App {
    pub fn new(color: bool) -> App {
        App {
            color,
            title: "gpu-observer".into(),
            gpus: Vec::new(),
            rows: Vec::new(),
            history: VecDeque::new(),
            paused: false,
        }
    }

    pub fn update(&mut self, input: &Input<'_>) {
        if self.paused {
            return;
        }
        let snap = input.snap;
        self.title = format!(
            "gpu-observer — {:.0} s, {} events, {} dropped — {}",
            input.elapsed_s, snap.events, input.drops.total, input.attach
        );
        let nvml = &*snap.nvml;
        self.gpus = nvml
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let util = nvml
                    .history
                    .get(i)
                    .and_then(|h| h.back())
                    .and_then(|s| s.util_gpu)
                    .map_or_else(|| "–".to_string(), |u| format!("{u}%"));
                format!("GPU {} {}  util {util}", d.index, printable(&d.name))
            })
            .collect();
        if self.gpus.is_empty() {
            self.gpus.push(format!("NVML: {}", printable(&nvml.message)));
        }
        let now: HashMap<u32, u64> = snap.procs.iter().map(|p| (p.pid, p.stats.launches)).collect();
        self.history.push_back((snap.taken_ns, now));
        while self.history.len() > 2 && snap.taken_ns.saturating_sub(self.history[1].0) >= RATE_WINDOW_NS {
            self.history.pop_front();
        }
        let (base_ns, base) = &self.history[0];
        let span_s = snap.taken_ns.saturating_sub(*base_ns) as f64 / 1e9;
        self.rows = snap
            .procs
            .iter()
            .filter(|p| !p.exited)
            .map(|p| {
                let rate = match base.get(&p.pid) {
                    Some(b) if span_s > 0.0 => format!("{:.0}", p.stats.launches.saturating_sub(*b) as f64 / span_s),
                    _ => "–".into(),
                };
                let verdict = input
                    .verdicts
                    .get(&p.pid)
                    .map_or_else(String::new, |v| format!("{:?}", v.verdict.class));
                [p.pid.to_string(), printable(&p.comm), rate, verdict]
            })
            .collect();
    }

    pub fn draw(&mut self, f: &mut Frame<'_>) {
        let [title, gpus, procs] = Layout::vertical([
            Constraint::Length(1),
            Constraint::Length(self.gpus.len() as u16 + 2),
            Constraint::Min(3),
        ])
        .areas(f.area());
        let bold = if self.color {
            Style::default().add_modifier(Modifier::BOLD)
        } else {
            Style::default()
        };
        f.render_widget(Paragraph::new(Line::styled(self.title.as_str(), bold)), title);
        let lines: Vec<Line> = self.gpus.iter().map(|g| Line::raw(g.as_str())).collect();
        f.render_widget(Paragraph::new(lines).block(Block::bordered().title("GPUs")), gpus);
        let rows = self.rows.iter().map(|r| Row::new(r.iter().map(String::as_str)));
        let table = Table::new(
            rows,
            [
                Constraint::Length(8),
                Constraint::Length(16),
                Constraint::Length(10),
                Constraint::Min(10),
            ],
        )
        .header(Row::new(["PID", "COMMAND", "LAUNCH/s", "VERDICT"]).style(bold))
        .block(Block::bordered().title(if self.paused { "Processes (paused)" } else { "Processes" }));
        f.render_widget(table, procs);
    }

    pub fn key(&mut self, key: KeyEvent) -> Action {
        if key.kind != KeyEventKind::Press {
            return Action::None;
        }
        match key.code {
            KeyCode::Char('q') => Action::Quit,
            KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => Action::Quit,
            KeyCode::Char('p') => {
                self.paused = !self.paused;
                Action::Redraw
            }
            _ => Action::None,
        }
    }
}
