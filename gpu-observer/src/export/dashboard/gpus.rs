//! The GPU panels: per GPU, its utilization, VRAM, power, temperature, fan, clocks, PCIe and
//! the last 60 s of utilization (NVML's history) — a bordered panel each when they fit, one
//! line each when they do not (many GPUs, a small terminal).

use ratatui::{
    Frame,
    layout::{Constraint, Layout, Rect},
    style::Color,
    text::{Line, Span},
    widgets::{Block, Paragraph},
};

use super::{Theme, bar, temperature_band};
use crate::{
    export::{terminal::human_rate, text::printable_cut},
    nvml::{DeviceInfo, DeviceSample, State, View},
};

/// Rows of a full panel: its border and four lines.
const PANEL_ROWS: u16 = 6;
/// Rows left to the process table (its border, header and a few processes) before panels
/// collapse to lines.
const TABLE_MIN_ROWS: u16 = 8;
/// Characters of a GPU's name shown.
const NAME_CHARS: usize = 32;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
/// The history the sparkline spans.
const HISTORY_S: f64 = 60.0;

/// The rows the GPU area takes in a main area `rows` high.
pub(super) fn height(v: Option<&View>, rows: u16) -> u16 {
    let n = v.map_or(0, |v| v.devices.len()) as u16;
    if n == 0 {
        return 1.min(rows);
    }
    let room = rows.saturating_sub(TABLE_MIN_ROWS);
    if n.saturating_mul(PANEL_ROWS) <= room {
        n * PANEL_ROWS
    } else {
        // Compact: a line per GPU in one border, as many as fit.
        (n + 2).min(room.max(3)).min(rows)
    }
}

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, v: Option<&View>, t: Theme) {
    if area.height == 0 {
        return;
    }
    let Some(v) = v.filter(|v| !v.devices.is_empty()) else {
        let msg = match v.map(|v| (v.state, v.message.as_str())) {
            Some((State::Unavailable, why)) => format!("NVML unavailable: {}", printable_cut(why, 200)),
            Some((State::Off, _)) => "NVML off (--no-nvml): no GPU metrics".into(),
            Some((State::Active, _)) => "NVML: no GPU found".into(),
            _ => "NVML starting…".into(),
        };
        f.render_widget(Paragraph::new(Line::styled(msg, t.dim())), area);
        return;
    };
    let n = v.devices.len() as u16;
    if area.height >= n * PANEL_ROWS {
        let areas = Layout::vertical(vec![Constraint::Length(PANEL_ROWS); n as usize]).split(area);
        for ((d, s), a) in v.latest().zip(areas.iter()) {
            panel(f, *a, v, d, s, t);
        }
    } else {
        compact(f, area, v, t);
    }
}

fn title(d: &DeviceInfo, s: Option<&DeviceSample>, t: Theme) -> Line<'static> {
    let mut spans = vec![Span::styled(
        format!(" GPU {} · {} ", d.index, printable_cut(&d.name, NAME_CHARS)),
        t.bold(),
    )];
    if let Some(s) = s {
        // Idle is not a slowdown.
        let slow = s
            .throttle_reasons
            .map(|r| crate::export::jsonl::throttle_names(r & !0x1))
            .unwrap_or_default();
        if !slow.is_empty() {
            spans.push(Span::styled(
                format!(" slowed: {} ", slow.join(",")),
                t.fg(Color::Yellow),
            ));
        }
        if let Some(x) = s.last_xid {
            spans.push(Span::styled(
                format!(" Xid {x} ({} errors) ", s.xid_errors.unwrap_or(0)),
                t.fg(Color::Red),
            ));
        }
    }
    Line::from(spans)
}

fn pct(v: Option<u32>) -> String {
    v.map_or_else(|| "   -".into(), |p| format!("{p:>3}%"))
}

/// `name ███░░ 73%` for a utilization (a bar only when known).
fn util(spans: &mut Vec<Span<'static>>, name: &str, v: Option<u32>, width: usize, t: Theme) {
    spans.push(Span::raw(format!("{name} ")));
    let frac = f64::from(v.unwrap_or(0)) / 100.0;
    if width > 0 {
        spans.push(Span::styled(bar(frac, width), t.fill(frac)));
        spans.push(Span::raw(" "));
    }
    spans.push(Span::raw(pct(v)));
}

fn vram(s: &DeviceSample, d: &DeviceInfo) -> Option<(u64, u64)> {
    Some((s.memory_used?, s.memory_total.or(d.memory_total_bytes)?))
}

fn power(s: &DeviceSample) -> String {
    match (s.power_mw, s.power_limit_mw) {
        (Some(p), Some(l)) => format!("{:.0}/{:.0}W", f64::from(p) / 1e3, f64::from(l) / 1e3),
        (Some(p), None) => format!("{:.0}W", f64::from(p) / 1e3),
        _ => "-W".into(),
    }
}

fn temperature(spans: &mut Vec<Span<'static>>, s: &DeviceSample, t: Theme) {
    match s.temperature_c {
        Some(c) => {
            let (band, color) = temperature_band(c);
            spans.push(Span::raw(format!("{c}°C ")));
            spans.push(Span::styled(band, t.fg(color).patch(t.bold())));
        }
        None => spans.push(Span::raw("-°C")),
    }
}

fn mhz(v: Option<u32>) -> String {
    v.map_or_else(|| "-".into(), |m| m.to_string())
}

/// A full panel: four lines in a border.
fn panel(f: &mut Frame<'_>, area: Rect, v: &View, d: &DeviceInfo, s: Option<&DeviceSample>, t: Theme) {
    let block = Block::bordered().title(title(d, s, t)).border_style(t.dim());
    let inner = block.inner(area);
    f.render_widget(block, area);
    let Some(s) = s else {
        f.render_widget(Paragraph::new("no sample yet"), inner);
        return;
    };
    let w = inner.width as usize;
    // Line 1: GPU, memory controller, encoder, decoder.
    let wide = w >= 64;
    let fixed = if wide { 40 } else { 20 };
    let b = (w.saturating_sub(fixed) / 2).clamp(0, 30);
    let mut l1 = Vec::new();
    util(&mut l1, "GPU", s.util_gpu, b, t);
    l1.push(Span::raw("  "));
    util(&mut l1, "MEM", s.util_memory, b, t);
    if wide {
        l1.push(Span::raw(format!(
            "  ENC {}  DEC {}",
            pct(s.util_encoder),
            pct(s.util_decoder)
        )));
    }
    // Line 2: VRAM, power, temperature, fan.
    let mut l2 = vec![Span::raw("VRAM ")];
    let b2 = w.saturating_sub(55).clamp(4, 30);
    match vram(s, d) {
        Some((used, total)) => {
            let frac = used as f64 / total.max(1) as f64;
            l2.push(Span::styled(bar(frac, b2), t.fill(frac)));
            l2.push(Span::raw(format!(
                " {:.1}/{:.1}G",
                used as f64 / GIB,
                total as f64 / GIB
            )));
        }
        None => l2.push(Span::raw("-")),
    }
    l2.push(Span::raw(format!("  PWR {}  ", power(s))));
    temperature(&mut l2, s, t);
    l2.push(Span::raw(format!("  FAN {}", pct(s.fan_percent).trim_start())));
    // Line 3: clocks, PCIe.
    let c = &s.clocks;
    let link = match (s.link.generation, s.link.width) {
        (Some(g), Some(x)) => format!("gen{g}×{x}"),
        _ => "-".into(),
    };
    let io = |b: Option<u64>| b.map_or_else(|| "-".into(), |b| human_rate(b as f64));
    let l3 = format!(
        "CLK gfx {} SM {} mem {} MHz  PCIe {link} TX {} RX {}",
        mhz(c.graphics),
        mhz(c.sm),
        mhz(c.memory),
        io(s.pcie_tx_bps),
        io(s.pcie_rx_bps)
    );
    // Line 4: the utilization history.
    let label = "util 60s ";
    let hist = sparkline(v, d.index as usize, w.saturating_sub(label.len()));
    let lines = vec![
        Line::from(l1),
        Line::from(l2),
        Line::raw(l3),
        Line::from(vec![
            Span::styled(label, t.dim()),
            Span::styled(hist, t.fg(Color::Cyan)),
        ]),
    ];
    f.render_widget(Paragraph::new(lines), inner);
}

/// One line per GPU, as many as fit, the last saying how many more there are.
fn compact(f: &mut Frame<'_>, area: Rect, v: &View, t: Theme) {
    let bordered = area.height >= 3;
    let inner = if bordered {
        let block = Block::bordered().title(" GPUs ").border_style(t.dim());
        let inner = block.inner(area);
        f.render_widget(block, area);
        inner
    } else {
        area
    };
    let rows = inner.height as usize;
    let n = v.devices.len();
    let shown = if n > rows { rows.saturating_sub(1) } else { n };
    let w = inner.width as usize;
    let mut lines = Vec::with_capacity(rows);
    for (d, s) in v.latest().take(shown) {
        lines.push(compact_line(v, d, s, w, t));
    }
    if shown < n {
        lines.push(Line::styled(format!("+{} more GPUs", n - shown), t.dim()));
    }
    f.render_widget(Paragraph::new(lines), inner);
}

/// `0 H100  GPU ███░ 73%  VRAM ██░░ 40.0/80.0G  350/700W  65°C WARM  ▁▂▃`: pieces added while
/// they fit.
fn compact_line(v: &View, d: &DeviceInfo, s: Option<&DeviceSample>, w: usize, t: Theme) -> Line<'static> {
    let mut spans: Vec<Span<'static>> = vec![Span::styled(
        format!("{:>2} {:<12}", d.index, printable_cut(&d.name, 11)),
        t.bold(),
    )];
    let Some(s) = s else {
        spans.push(Span::raw(" no sample yet"));
        return Line::from(spans);
    };
    let mut used = 15;
    let piece = |spans: &mut Vec<Span<'static>>, used: &mut usize, parts: Vec<Span<'static>>| {
        let n: usize = parts.iter().map(|p| p.content.chars().count()).sum();
        if *used + n <= w {
            *used += n;
            spans.extend(parts);
        }
    };
    let mut u = vec![Span::raw(" ")];
    util(&mut u, "GPU", s.util_gpu, 8, t);
    piece(&mut spans, &mut used, u);
    if let Some((m, total)) = vram(s, d) {
        let frac = m as f64 / total.max(1) as f64;
        piece(
            &mut spans,
            &mut used,
            vec![
                Span::raw("  VRAM "),
                Span::styled(bar(frac, 6), t.fill(frac)),
                Span::raw(format!(" {:.1}/{:.1}G", m as f64 / GIB, total as f64 / GIB)),
            ],
        );
    }
    piece(&mut spans, &mut used, vec![Span::raw(format!("  {}", power(s)))]);
    let mut temp = vec![Span::raw("  ")];
    temperature(&mut temp, s, t);
    piece(&mut spans, &mut used, temp);
    let left = w.saturating_sub(used + 2);
    if left >= 8 {
        let hist = sparkline(v, d.index as usize, left.min(60));
        piece(
            &mut spans,
            &mut used,
            vec![Span::raw("  "), Span::styled(hist, t.fg(Color::Cyan))],
        );
    }
    Line::from(spans)
}

/// The last 60 s of a GPU's utilization in `width` columns, oldest left: each column the mean
/// of the samples that fall in it, `▁` (0 %) to `█` (100 %), blank where no sample was taken
/// (before the observer started, or a GPU that does not report utilization).
pub(super) fn sparkline(v: &View, device: usize, width: usize) -> String {
    const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let Some(h) = v.history.get(device) else {
        return " ".repeat(width);
    };
    if width == 0 {
        return String::new();
    }
    let slots = (HISTORY_S / v.interval.as_secs_f64().max(1e-3)).round().max(1.0) as usize;
    // (sum, count) per column.
    let mut cols = vec![(0u64, 0u64); width];
    for (age, s) in h.iter().rev().enumerate().take(slots) {
        let Some(u) = s.util_gpu else { continue };
        let col = width - 1 - (age * width / slots).min(width - 1);
        cols[col].0 += u64::from(u.min(100));
        cols[col].1 += 1;
    }
    cols.iter()
        .map(|&(sum, n)| {
            if n == 0 {
                ' '
            } else {
                let mean = sum as f64 / n as f64;
                LEVELS[((mean / 100.0) * 7.0).round() as usize]
            }
        })
        .collect()
}
