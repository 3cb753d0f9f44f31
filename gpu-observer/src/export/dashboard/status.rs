//! The status line: elapsed, events, drops (red, with the remedy, once any), the attach and
//! NVML states; while `/` is typed, the filter being typed.

use ratatui::{
    Frame,
    layout::Rect,
    style::Color,
    text::{Line, Span},
    widgets::Paragraph,
};

use super::app::App;
use crate::export::text::printable_cut;

/// Characters of the attach line shown (the runtime writes it, but it may name paths).
const ATTACH_CHARS: usize = 60;

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, app: &App) {
    let t = app.theme;
    let s = &app.status;
    let sep = || Span::styled(" │ ", t.dim());
    let mut spans = Vec::with_capacity(16);
    if app.filtering {
        spans.push(Span::styled(
            format!("/{}▏", app.filter),
            t.fg(Color::Cyan).patch(t.bold()),
        ));
        spans.push(Span::styled("  Enter keeps, Esc clears", t.dim()));
        f.render_widget(Paragraph::new(Line::from(spans)), area);
        return;
    }
    spans.push(Span::styled(format!("{:.0} s", s.elapsed_s), t.bold()));
    spans.push(sep());
    spans.push(Span::raw(format!("{} events", s.events)));
    spans.push(sep());
    if s.drops > 0 {
        spans.push(Span::styled(
            format!("{} dropped: raise --ring-buffer-size", s.drops),
            t.fg(Color::Red).patch(t.bold()),
        ));
    } else {
        spans.push(Span::styled("0 dropped", t.fg(Color::Green)));
    }
    spans.push(sep());
    spans.push(Span::raw(printable_cut(&s.attach, ATTACH_CHARS)));
    spans.push(sep());
    spans.push(Span::raw(s.nvml.clone()));
    if app.paused {
        spans.push(sep());
        spans.push(Span::styled("PAUSED (p resumes)", t.fg(Color::Yellow).patch(t.bold())));
    }
    spans.push(sep());
    spans.push(Span::styled("? help", t.dim()));
    f.render_widget(Paragraph::new(Line::from(spans)), area);
}
