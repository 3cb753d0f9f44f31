//! The live dashboard (issue 15): GPU panels, the process table, a detail pane for the selected
//! process and a status line, drawn with ratatui from the snapshots the reader publishes.
//!
//! [`app::App`] holds the state (rates between successive snapshots, selection, sort, filter)
//! and draws one frame; the runtime (raw mode, the event loop) lives elsewhere and drives it.
//! Everything an observed process named (command, kernel, pod) is made inert by
//! `export/text.rs` once, when a snapshot arrives, never per frame.

pub mod app;
mod detail;
mod gpus;
mod help;
mod procs;
mod status;

use ratatui::style::{Color, Modifier, Style};

/// Colours, or none (`NO_COLOR`): every style the widgets use comes from here, so that without
/// colour only modifiers (bold, reverse) remain.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Theme {
    pub color: bool,
}

impl Theme {
    pub fn fg(self, c: Color) -> Style {
        if self.color { Style::new().fg(c) } else { Style::new() }
    }

    pub fn bold(self) -> Style {
        Style::new().add_modifier(Modifier::BOLD)
    }

    /// Green, yellow, red as a fill fraction (0–1) rises: bars, VRAM.
    pub fn fill(self, frac: f64) -> Style {
        self.fg(if frac >= 0.9 {
            Color::Red
        } else if frac >= 0.7 {
            Color::Yellow
        } else {
            Color::Green
        })
    }

    pub fn dim(self) -> Style {
        self.fg(Color::DarkGray)
    }

    /// The selected row: reversed, so it shows without colour too.
    pub fn selected(self) -> Style {
        Style::new().add_modifier(Modifier::REVERSED)
    }
}

/// A horizontal bar of `width` cells filled to `frac` (0–1): `█` filled, `░` empty, so the
/// fill reads without colour.
pub(crate) fn bar(frac: f64, width: usize) -> String {
    let filled = ((frac.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    let mut s = String::with_capacity(width * 3);
    s.extend(std::iter::repeat_n('█', filled));
    s.extend(std::iter::repeat_n('░', width - filled));
    s
}

/// A rate in 5 characters or fewer: `950`, `12.3k`, `4.5M`.
pub(crate) fn compact(v: f64) -> String {
    if v < 999.5 {
        format!("{v:.0}")
    } else if v < 999_500.0 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{:.1}M", v / 1e6)
    }
}

/// Bytes in a short form: `512K`, `40.0G`.
pub(crate) fn short_bytes(b: u64) -> String {
    const K: f64 = 1024.0;
    let b = b as f64;
    if b >= K * K * K {
        format!("{:.1}G", b / (K * K * K))
    } else if b >= K * K {
        format!("{:.0}M", b / (K * K))
    } else if b >= K {
        format!("{:.0}K", b / K)
    } else {
        format!("{b:.0}B")
    }
}

/// Temperature bands, as the design documents' GPU monitoring spec draws them: COOL to 50 °C,
/// WARM to 70, HOT to 85, CRITICAL above (datacenter GPUs begin to slow down in the mid-80s).
pub(crate) fn temperature_band(c: u32) -> (&'static str, Color) {
    match c {
        0..=50 => ("COOL", Color::Cyan),
        51..=70 => ("WARM", Color::Green),
        71..=85 => ("HOT", Color::Yellow),
        _ => ("CRITICAL", Color::Red),
    }
}

#[cfg(test)]
pub(crate) mod testing;
