//! The process table: one row per live process, the columns that fit the width (by priority:
//! a narrow terminal keeps pid, command, launch rate, GPU busy and the verdict first).

use ratatui::{
    Frame,
    layout::{Constraint, Rect},
    style::Color,
    text::{Line, Span, Text},
    widgets::{Block, Cell, Paragraph, Row as TableRow, Table, TableState},
};

use super::{
    Theme,
    app::{App, Row, Sort},
    compact, short_bytes,
};
use crate::analyze::verdict::Class;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Col {
    Pid,
    Command,
    Gpus,
    Busy,
    Launches,
    H2d,
    D2h,
    Sync,
    Memory,
    Pod,
    Verdict,
    Cupti,
    Anomalies,
}

/// In display order: (column, heading, width, priority — lower is kept first).
const COLS: [(Col, &str, u16, u8); 13] = [
    (Col::Pid, "PID", 7, 0),
    (Col::Command, "COMMAND", 16, 1),
    (Col::Gpus, "GPU", 4, 9),
    (Col::Busy, "BUSY%", 5, 3),
    (Col::Launches, "LAUNCH/s", 8, 2),
    (Col::H2d, "H→D MB/s", 8, 6),
    (Col::D2h, "D→H MB/s", 8, 7),
    (Col::Sync, "SYNC%", 5, 5),
    (Col::Memory, "MEM", 6, 8),
    (Col::Pod, "POD", 24, 12),
    (Col::Verdict, "VERDICT", 14, 4),
    (Col::Cupti, "CUPTI", 8, 11),
    (Col::Anomalies, "ANOM", 4, 10),
];

/// The columns that fit `width` (one space between), in display order.
fn columns(width: u16) -> Vec<usize> {
    let mut by_prio: Vec<usize> = (0..COLS.len()).collect();
    by_prio.sort_by_key(|&i| COLS[i].3);
    let mut used = 0u16;
    let mut keep = Vec::with_capacity(COLS.len());
    for i in by_prio {
        let need = COLS[i].2 + u16::from(used > 0);
        if used + need <= width {
            used += need;
            keep.push(i);
        }
    }
    keep.sort_unstable();
    keep
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".into(), f)
}

fn mbps(v: f64) -> String {
    if v < 999.5 { format!("{v:.1}") } else { compact(v) }
}

pub(super) fn verdict_color(c: Class) -> Color {
    match c {
        Class::GpuBound => Color::Green,
        Class::Idle => Color::DarkGray,
        Class::Mixed => Color::Reset,
        _ => Color::Yellow,
    }
}

fn cell(r: &Row, c: Col, t: Theme) -> Cell<'static> {
    let right = |s: String| Cell::from(Text::from(s).right_aligned());
    match c {
        Col::Pid => right(r.pid.to_string()),
        Col::Command => Cell::from(r.comm.clone()),
        Col::Gpus => Cell::from(r.gpus.clone()),
        Col::Busy => right(opt(r.busy, |v| format!("{v:.0}"))),
        Col::Launches => right(opt(r.launches, compact)),
        Col::H2d => right(opt(r.copies[0], mbps)),
        Col::D2h => right(opt(r.copies[1], mbps)),
        Col::Sync => right(opt(r.sync_pct, |v| format!("{v:.0}"))),
        Col::Memory => right(r.memory.map_or_else(|| "-".into(), short_bytes)),
        Col::Pod => Cell::from(r.pod.clone()),
        Col::Verdict => match r.verdict {
            Some(v) => Cell::from(Span::styled(v.name(), t.fg(verdict_color(v)))),
            None => Cell::from("-"),
        },
        Col::Cupti => Cell::from(r.cupti),
        Col::Anomalies => {
            if r.anomalies == 0 {
                right("0".into())
            } else {
                Cell::from(Text::from(Span::styled(format!("!{}", r.anomalies), t.fg(Color::Red))).right_aligned())
            }
        }
    }
}

fn sorted_col(s: Sort) -> Option<Col> {
    match s {
        Sort::Launches => Some(Col::Launches),
        Sort::Busy => Some(Col::Busy),
        Sort::Copies => Some(Col::H2d),
        Sort::Sync => Some(Col::Sync),
        Sort::Memory => Some(Col::Memory),
        Sort::Pid => Some(Col::Pid),
    }
}

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, app: &mut App) {
    if area.height == 0 {
        return;
    }
    let t = app.theme;
    let mut title = vec![Span::styled(
        format!(" processes {}/{} ", app.visible.len(), app.rows.len()),
        t.bold(),
    )];
    title.push(Span::raw(format!("sort: {} ", app.sort.name())));
    if !app.filter.is_empty() || app.filtering {
        title.push(Span::styled(format!("filter: /{} ", app.filter), t.fg(Color::Cyan)));
    }
    if app.paused {
        title.push(Span::styled("PAUSED ", t.fg(Color::Yellow).patch(t.bold())));
    }
    let block = Block::bordered().title(Line::from(title)).border_style(t.dim());
    let inner = block.inner(area);
    if app.visible.is_empty() {
        let msg = if app.rows.is_empty() {
            "(no CUDA activity yet)".to_string()
        } else {
            format!("(no process matches /{})", app.filter)
        };
        f.render_widget(Paragraph::new(Line::styled(msg, t.dim())).block(block), area);
        return;
    }
    let cols = columns(inner.width);
    let sorted = sorted_col(app.sort);
    let header = TableRow::new(cols.iter().map(|&i| {
        let (c, head, ..) = COLS[i];
        let style = if Some(c) == sorted {
            t.bold().patch(t.fg(Color::Cyan))
        } else {
            t.bold()
        };
        let text = Text::from(Span::styled(head, style));
        Cell::from(
            if matches!(c, Col::Command | Col::Gpus | Col::Pod | Col::Verdict | Col::Cupti) {
                text
            } else {
                text.right_aligned()
            },
        )
    }));
    // Only the rows that can show are built: the window around the selection.
    let h = inner.height.saturating_sub(1) as usize;
    let state = app.table_state();
    let sel = state.selected().unwrap_or(0);
    let mut off = state.offset();
    if sel < off {
        off = sel;
    } else if h > 0 && sel >= off + h {
        off = sel + 1 - h;
    }
    off = off.min(app.visible.len().saturating_sub(h));
    *app.table_state().offset_mut() = off;
    let rows: Vec<TableRow<'static>> = app.visible[off..(off + h).min(app.visible.len())]
        .iter()
        .map(|&i| {
            let r = &app.rows[i];
            TableRow::new(cols.iter().map(|&c| cell(r, COLS[c].0, t)))
        })
        .collect();
    let widths: Vec<Constraint> = cols.iter().map(|&i| Constraint::Length(COLS[i].2)).collect();
    let table = Table::new(rows, widths)
        .header(header)
        .column_spacing(1)
        .block(block)
        .row_highlight_style(t.selected());
    let mut window = TableState::default().with_selected(Some(sel.saturating_sub(off)));
    f.render_stateful_widget(table, area, &mut window);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrow_terminals_keep_the_most_important_columns() {
        let names = |w| columns(w).iter().map(|&i| COLS[i].1).collect::<Vec<_>>();
        assert_eq!(
            names(78),
            [
                "PID",
                "COMMAND",
                "BUSY%",
                "LAUNCH/s",
                "H→D MB/s",
                "D→H MB/s",
                "SYNC%",
                "VERDICT"
            ]
        );
        assert_eq!(names(40), ["PID", "COMMAND", "BUSY%", "LAUNCH/s"]);
        assert_eq!(names(200).len(), COLS.len());
    }
}
