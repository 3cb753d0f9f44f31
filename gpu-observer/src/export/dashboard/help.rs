//! The help overlay (`?`): the keys, over the middle of the screen.

use ratatui::{
    Frame,
    layout::{Constraint, Flex, Layout, Rect},
    text::Line,
    widgets::{Block, Clear, Paragraph},
};

use super::Theme;

const KEYS: [(&str, &str); 10] = [
    ("q, Ctrl-C", "quit"),
    ("↑/↓, j/k", "select a process"),
    ("PgUp/PgDn", "move by 10"),
    ("Enter, Tab", "open/close the detail pane"),
    ("s", "cycle the sort column"),
    ("p", "pause/resume updates"),
    ("/", "filter by command, pid, pod"),
    ("Esc", "close the pane, clear the filter"),
    ("?", "this help (any key closes)"),
    ("", "drops: raise --ring-buffer-size"),
];

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, t: Theme) {
    let h = (KEYS.len() as u16 + 2).min(area.height);
    let w = 50.min(area.width);
    let [row] = Layout::vertical([Constraint::Length(h)]).flex(Flex::Center).areas(area);
    let [pop] = Layout::horizontal([Constraint::Length(w)])
        .flex(Flex::Center)
        .areas(row);
    let lines: Vec<Line<'static>> = KEYS
        .iter()
        .map(|(k, what)| Line::from(format!(" {k:<12} {what}")))
        .collect();
    f.render_widget(Clear, pop);
    f.render_widget(
        Paragraph::new(lines).block(Block::bordered().title(Line::styled(" keys ", t.bold()))),
        pop,
    );
}
