//! The detail pane of the selected process: its verdict with evidence and hint, top kernels by
//! launches and (CUPTI) by GPU time, copy bandwidth per direction against the link, syncs by
//! target, ioctls, outstanding memory and leaks, and its recent anomalies. Built once per
//! snapshot (app.rs caches it), bounded: a few entries per section.

use gpu_observer_common::api::Direction;
use ratatui::{
    Frame,
    layout::Rect,
    style::Color,
    text::{Line, Span},
    widgets::{Block, Paragraph, Wrap},
};

use super::{
    Theme,
    app::{App, Row},
    procs::verdict_color,
};
use crate::{
    analyze::verdict::Verdict,
    export::{
        terminal::{arrow, describe_finding, human_bytes, human_ns, human_rate},
        text::printable_cut,
    },
    nvml::View,
};

/// Entries shown per section.
const TOP: usize = 5;
/// Characters of a kernel name shown.
const KERNEL_CHARS: usize = 60;

fn head(t: Theme, s: &'static str) -> Span<'static> {
    Span::styled(format!("{s:<10}"), t.bold())
}

/// The PCIe link's rate of the process's GPU (each way, bytes/s): the verdict's, else the
/// first GPU NVML lists it on.
fn link(row: &Row, v: Option<&Verdict>, nvml: Option<&View>) -> Option<f64> {
    v.and_then(|v| v.evidence.link_bytes_per_s).or_else(|| {
        let n = nvml?;
        let dev = n.procs.get(&row.pid)?.devices_now.first().copied()?;
        n.devices.iter().find(|d| d.index == dev)?.pcie_max_link.bytes_per_s()
    })
}

pub(super) fn lines(row: &Row, v: Option<&Verdict>, nvml: Option<&View>, app: &App) -> Vec<Line<'static>> {
    let t = app.theme;
    let p = &row.view;
    let s = &p.stats;
    let mut out = Vec::with_capacity(32);
    // The verdict first: what a person opens the pane for.
    match v {
        Some(v) => {
            let mut l = vec![
                head(t, "verdict"),
                Span::styled(v.class.name(), t.fg(verdict_color(v.class)).patch(t.bold())),
            ];
            if let Some(s2) = v.secondary {
                l.push(Span::raw(format!(" (then {})", s2.name())));
            }
            out.push(Line::from(l));
            // describe(): the class, the numbers that decided it, and the hint.
            out.push(Line::raw(format!("          {}", printable_cut(&v.describe(), 400))));
        }
        None => out.push(Line::from(vec![
            head(t, "verdict"),
            Span::raw("- (not enough samples yet)"),
        ])),
    }
    // Kernels by launches (uprobes: every process).
    if !p.top_kernels.is_empty() {
        out.push(Line::from(vec![head(t, "kernels"), Span::raw("by launches")]));
        for (k, n) in p.top_kernels.iter().take(TOP) {
            out.push(Line::raw(format!(
                "  {n:>10}×  {}",
                printable_cut(&k.demangled, KERNEL_CHARS)
            )));
        }
    }
    // By GPU time (CUPTI only).
    if let Some(g) = &p.gpu {
        let top = g.stats.top_kernels(TOP);
        if !top.is_empty() {
            out.push(Line::from(vec![head(t, "GPU time"), Span::raw("by GPU time (CUPTI)")]));
            for (name, count, ns) in top {
                out.push(Line::raw(format!(
                    "  {:>10} {:>8}×  mean {:>9}  {}",
                    human_ns(ns as f64),
                    count,
                    human_ns(ns as f64 / count.max(1) as f64),
                    printable_cut(name, KERNEL_CHARS)
                )));
            }
        }
    }
    // Copies: now, while copying, against the link.
    let link = link(row, v, nvml);
    let mut any_copy = false;
    for (i, d) in [
        Direction::CpuToGpu,
        Direction::GpuToCpu,
        Direction::GpuToGpu,
        Direction::Unknown,
    ]
    .into_iter()
    .enumerate()
    {
        let a = s.copy(d);
        if a.count == 0 {
            continue;
        }
        let now = row.copies[i].map_or_else(|| "-".into(), |m| format!("{m:.1} MB/s"));
        let during = (a.ns > 0).then(|| a.bytes as f64 * 1e9 / a.ns as f64);
        let vs_link = match (during, link, d) {
            (Some(b), Some(l), Direction::CpuToGpu | Direction::GpuToCpu) if l > 0.0 => {
                format!(", {:.0}% of the link's {}", b / l * 100.0, human_rate(l))
            }
            _ => String::new(),
        };
        out.push(Line::from(vec![
            head(t, if any_copy { "" } else { "copies" }),
            Span::raw(format!(
                "{:<5} {now} now; {} copies, {}, {} while copying{vs_link}",
                arrow(d),
                a.count,
                human_bytes(a.bytes),
                during.map_or_else(|| "-".into(), human_rate)
            )),
        ]));
        any_copy = true;
    }
    // Syncs by target, most blocked first.
    if s.syncs.count > 0 {
        let mut targets: Vec<_> = s.sync_by_target.iter().collect();
        targets.sort_by(|a, b| b.1.ns.cmp(&a.1.ns).then(a.0.cmp(b.0)));
        let shown: Vec<String> = targets
            .iter()
            .take(3)
            .map(|(target, a)| {
                let what = match target.kind_and_handle() {
                    (kind, Some(h)) => format!("{kind} {h:#x}"),
                    (kind, None) => kind.to_string(),
                };
                format!("{what} {}× {}", a.count, human_ns(a.ns as f64))
            })
            .collect();
        out.push(Line::from(vec![
            head(t, "syncs"),
            Span::raw(format!(
                "{} × {} blocked; {}",
                s.syncs.count,
                human_ns(s.syncs.ns as f64),
                shown.join(", ")
            )),
        ]));
    }
    // ioctls, the commands with the most time.
    if s.ioctls.count > 0 {
        let mut cmds: Vec<_> = s.ioctl_by_cmd.iter().collect();
        cmds.sort_by(|a, b| b.1.1.ns.cmp(&a.1.1.ns).then(a.0.cmp(b.0)));
        let shown: Vec<String> = cmds
            .iter()
            .take(3)
            .map(|(cmd, (name, a))| {
                format!(
                    "{} {}×",
                    name.map_or_else(|| format!("{cmd:#x}"), str::to_string),
                    a.count
                )
            })
            .collect();
        out.push(Line::from(vec![
            head(t, "ioctls"),
            Span::raw(format!(
                "{} in {} ({} inside CUDA calls); {}",
                s.ioctls.count,
                human_ns(s.ioctls.ns as f64),
                s.ioctls_in_calls,
                shown.join(", ")
            )),
        ]));
    }
    // Memory: outstanding, and what was never freed.
    out.push(Line::from(vec![
        head(t, "memory"),
        Span::raw(format!(
            "{} outstanding in {} allocations ({} device, {} managed, {} pinned host)",
            human_bytes(s.outstanding_bytes()),
            s.live_allocs,
            human_bytes(s.live_device),
            human_bytes(s.live_managed),
            human_bytes(s.live_host)
        )),
    ]));
    for l in p.leaks.iter().take(3) {
        out.push(Line::raw(format!(
            "          {} × {} of {} memory from {} not freed",
            l.count,
            human_bytes(l.bytes),
            l.mem.name(),
            l.api
        )));
    }
    // Recent anomalies, newest first.
    if let Some(f) = p.anomalies.as_deref() {
        out.push(Line::from(vec![
            head(t, "anomalies"),
            Span::styled(format!("{} flagged", f.count), t.fg(Color::Red)),
        ]));
        for n in f.latest() {
            out.push(Line::raw(format!(
                "          {}, {:.1} s ago",
                describe_finding(&n.finding, app.mode),
                app.taken_ns.saturating_sub(n.ts_ns) as f64 / 1e9
            )));
        }
    }
    out
}

pub(super) fn draw(f: &mut Frame<'_>, area: Rect, row: &Row, lines: Vec<Line<'static>>, t: Theme) {
    let mut title = format!(" pid {} · {} ", row.pid, row.comm);
    if !row.pod.is_empty() {
        title.push_str(&format!("· {} ", row.pod));
    }
    let block = Block::bordered()
        .title(Line::styled(title, t.bold()))
        .title_bottom(Line::styled(" Esc/Enter closes ", t.dim()));
    f.render_widget(Paragraph::new(lines).block(block).wrap(Wrap { trim: false }), area);
}
