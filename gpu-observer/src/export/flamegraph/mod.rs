//! `--flamegraph FILE`: kernel stacks, `process;thread;NVTX ranges…;API;kernel weight`, folded
//! (one stack a line) or, when FILE ends in `.svg`, drawn as a flamegraph (inferno).
//!
//! Weighted by GPU time when CUPTI timed the work (processes started with `gpu-observer run`):
//! each kernel, copy and memset record adds its GPU ns under the launching thread, the NVTX
//! ranges open on it at the launch (outermost first), the driver entry point and the kernel
//! (`memcpy HtoD`, `memset` for copies and memsets). Without any GPU record the weight is the
//! number of launches the uprobes saw (`process;thread;API;kernel`: NVTX ranges come from
//! CUPTI, so there are none). One unit per file: with both kinds of process in a run, GPU time
//! wins and the launches of the processes without it are counted as left out, on stderr.
//!
//! Aggregated in memory while observing (bounded, see `table.rs`), written once at the end
//! (`Sink::summary`). Every name in a frame comes from an observed process: frames hold no
//! `;` (the separator), no control or line-breaking characters (escaped visibly, as
//! `export/text.rs` does for terminals) and at most [`MAX_FRAME_CHARS`] characters.

mod table;

use std::{
    collections::{HashMap, HashSet},
    fmt::Write as _,
    io::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use gpu_observer_common::{api::Family, cupti::GpuRecordKind};

use crate::{
    correlate::cupti_join::GpuActivity,
    decode::{Body, Event},
    export::{Sink, Summary, text},
    say,
};
use table::Table;
pub use table::{MAX_STACKS, OTHER_PROCESSES, OTHER_STACKS};

/// Characters of one frame, escapes included; then `…`. A demangled template kernel name can
/// run to kilobytes; a flamegraph shows a few dozen characters of it.
pub const MAX_FRAME_CHARS: usize = 256;
/// NVTX ranges kept under a thread; deeper ones become one `[deeper NVTX ranges]` frame.
pub const MAX_NVTX_DEPTH: usize = 64;
/// Threads whose names are remembered (each ~40 bytes); a thread beyond is named by its tid.
const MAX_THREADS: usize = 65_536;
/// Processes whose names (and whether CUPTI timed them) are remembered: every process with
/// stacks fits (each has at least one stack or `[other stacks]` frame in one of two tables).
const MAX_PROCESSES: usize = 2 * (MAX_STACKS + table::MAX_OTHER);

/// What the weights are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    GpuNs,
    Launches,
}

impl Unit {
    /// The SVG's title.
    pub const fn title(self) -> &'static str {
        match self {
            Unit::GpuNs => "GPU time (ns) of kernels, copies and memsets, from CUPTI",
            Unit::Launches => "Kernel launches (no GPU timing: no CUPTI)",
        }
    }

    /// The SVG's count name, and the unit in messages.
    pub const fn count_name(self) -> &'static str {
        match self {
            Unit::GpuNs => "ns",
            Unit::Launches => "launches",
        }
    }

    const fn subtitle(self) -> &'static str {
        match self {
            Unit::GpuNs => "process › thread › NVTX ranges › driver API › kernel (or memcpy/memset)",
            Unit::Launches => "process › thread › driver API › kernel (NVTX ranges need CUPTI: gpu-observer run)",
        }
    }
}

/// How sure a process name is: the correlator's name for the process (its main thread's)
/// beats a name seen on one of its other threads.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Rank {
    Thread,
    Process,
}

pub struct FlamegraphSink {
    path: PathBuf,
    /// Taken when the file is written (once).
    file: Option<std::fs::File>,
    gpu: Table,
    launches: Table,
    /// pid → the process frame's name (and the comm it was made from, so that a launch of
    /// an unchanged name allocates nothing).
    processes: HashMap<u32, (Rank, [u8; 16], Box<str>)>,
    /// (pid, tid) → the thread frame (`name tid N`), from the thread's launches and copies.
    threads: HashMap<(u32, u32), ([u8; 16], Box<str>)>,
    /// Processes that exited since the last flush: their threads are forgotten then, not at
    /// once, since a batch's GPU records reach the sinks after its events (export/sink.rs).
    exited: Vec<u32>,
    /// Processes with GPU records.
    timed: HashSet<u32>,
    /// The stack being built (reused: no allocation for a stack already seen).
    key: String,
}

impl FlamegraphSink {
    pub fn create(path: &Path) -> Result<Self> {
        Ok(Self::with_file(
            path,
            crate::export::output::create("--flamegraph", path)?,
        ))
    }

    fn with_file(path: &Path, file: std::fs::File) -> Self {
        Self {
            path: path.to_path_buf(),
            file: Some(file),
            gpu: Table::default(),
            launches: Table::default(),
            processes: HashMap::new(),
            threads: HashMap::new(),
            exited: Vec::new(),
            timed: HashSet::new(),
            key: String::new(),
        }
    }

    fn svg(&self) -> bool {
        self.path.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg"))
    }

    fn name_process(&mut self, pid: u32, comm: &[u8; 16], rank: Rank) {
        match self.processes.get(&pid) {
            Some((r, c, _)) if *r > rank || (*r == rank && c == comm) => return,
            None if self.processes.len() >= MAX_PROCESSES => return,
            _ => {}
        }
        let mut name = String::new();
        push_sanitized(&mut name, &crate::rules::comm(comm));
        self.processes.insert(pid, (rank, *comm, name.into()));
    }

    /// Remembers the thread's name from one of its calls, and the process's.
    fn name_thread(&mut self, ev: &Event) {
        let rank = if ev.tid == ev.pid { Rank::Process } else { Rank::Thread };
        self.name_process(ev.pid, &ev.comm, rank);
        let k = (ev.pid, ev.tid);
        match self.threads.get(&k) {
            Some((c, _)) if *c == ev.comm => return,
            None if self.threads.len() >= MAX_THREADS => return,
            _ => {}
        }
        let mut name = String::new();
        push_sanitized(&mut name, &ev.comm());
        let _ = write!(name, " tid {}", ev.tid);
        self.threads.insert(k, (ev.comm, name.into()));
    }

    fn push_thread(&mut self, pid: u32, tid: u32) {
        match self.threads.get(&(pid, tid)) {
            Some((_, n)) => push_frame_raw(&mut self.key, n),
            None => {
                sep(&mut self.key);
                let _ = write!(self.key, "tid {tid}");
            }
        }
    }

    fn launch(&mut self, ev: &Event, l: &crate::decode::Launch) {
        self.name_thread(ev);
        self.key.clear();
        self.push_thread(ev.pid, ev.tid);
        push_frame(&mut self.key, ev.api.map_or("[launch]", |a| a.name));
        match (&l.kernel, ev.api.map(|a| a.family)) {
            (Some(k), _) => push_frame(&mut self.key, &k.demangled),
            (None, Some(Family::GraphLaunch)) => push_frame_raw(&mut self.key, "[graph]"),
            (None, _) => push_frame_raw(&mut self.key, "[unnamed kernel]"),
        }
        self.launches.add(ev.pid, &self.key, 1);
    }

    /// The folded lines and their unit; what stderr should add about what is not in them.
    fn render(&self) -> (Unit, Vec<String>, Vec<String>) {
        let process = |pid: u32| match self.processes.get(&pid) {
            Some((_, _, n)) => format!("{n} {pid}"),
            None => format!("pid {pid}"),
        };
        let mut notes = Vec::new();
        let (unit, table) = if self.gpu.is_empty() {
            if !self.launches.is_empty() {
                notes.push(
                    "weighted by launch count: no process had GPU timing (CUPTI comes with \
                     `gpu-observer run`), and without it there are no NVTX ranges"
                        .to_string(),
                );
            }
            (Unit::Launches, &self.launches)
        } else {
            let mut left = 0u64;
            let mut procs = 0usize;
            for pid in self.launches.pids().filter(|p| !self.timed.contains(p)) {
                left = left.saturating_add(self.launches.of_pid(pid));
                procs += 1;
            }
            if left > 0 {
                notes.push(format!(
                    "{left} launches of {procs} processes without GPU timing (no CUPTI) are not in it"
                ));
            }
            if self.launches.other_processes() > 0 {
                notes.push(format!(
                    "{} launches of processes past the stack bounds could not be told apart and are not in it",
                    self.launches.other_processes()
                ));
            }
            (Unit::GpuNs, &self.gpu)
        };
        if table.folded > 0 {
            notes.push(format!(
                "{} of {} {} went to `{OTHER_STACKS}` frames (more than {MAX_STACKS} distinct stacks or {} MiB of them)",
                table.folded,
                table.added,
                match unit {
                    Unit::GpuNs => "GPU records",
                    Unit::Launches => "launches",
                },
                table::MAX_STACK_BYTES >> 20
            ));
        }
        (unit, table.lines(process), notes)
    }

    fn write(&mut self) -> Result<()> {
        let Some(file) = self.file.take() else {
            return Ok(());
        };
        let (unit, lines, notes) = self.render();
        let total = lines
            .iter()
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<u64>().ok())
            .fold(0u64, u64::saturating_add);
        let bytes = if self.svg() {
            svg(unit, &lines)?
        } else {
            let mut b = Vec::with_capacity(lines.iter().map(|l| l.len() + 1).sum());
            for l in &lines {
                b.extend_from_slice(l.as_bytes());
                b.push(b'\n');
            }
            b
        };
        let mut out = std::io::BufWriter::new(file);
        out.write_all(&bytes)
            .and_then(|()| out.flush())
            .with_context(|| format!("writing --flamegraph {}", self.path.display()))?;
        if lines.is_empty() {
            say(format_args!(
                "--flamegraph {}: no kernel launch or GPU record was seen; {}",
                self.path.display(),
                if self.svg() {
                    "the SVG says so"
                } else {
                    "the file is empty"
                }
            ));
        } else {
            say(format_args!(
                "--flamegraph {}: {} stacks, {total} {} in all{}",
                self.path.display(),
                lines.len(),
                unit.count_name(),
                match unit {
                    Unit::GpuNs => " of GPU time",
                    Unit::Launches => "",
                }
            ));
        }
        for n in notes {
            say(format_args!("--flamegraph: {n}"));
        }
        Ok(())
    }
}

impl Sink for FlamegraphSink {
    fn describe(&self) -> String {
        format!("the flamegraph {}", self.path.display())
    }

    fn event(&mut self, ev: &Event) -> Result<()> {
        match &ev.body {
            Body::Launch(l) => self.launch(ev, l),
            // A copy or memset: its GPU record names this thread too.
            Body::Call(_)
                if ev
                    .api
                    .is_some_and(|a| matches!(a.family, Family::Memcpy | Family::Memset)) =>
            {
                self.name_thread(ev)
            }
            Body::ProcessExit => self.exited.push(ev.pid),
            _ => {}
        }
        Ok(())
    }

    fn gpu(&mut self, a: &GpuActivity) -> Result<()> {
        let kind = a.kind();
        if !matches!(
            kind,
            Some(GpuRecordKind::Kernel | GpuRecordKind::Memcpy | GpuRecordKind::Memset)
        ) {
            return Ok(());
        }
        self.name_process(a.pid, &a.comm, Rank::Process);
        if self.timed.len() < MAX_PROCESSES {
            self.timed.insert(a.pid);
        }
        self.key.clear();
        match &a.origin {
            Some(o) => {
                self.push_thread(a.pid, o.tid);
                if let Some(stack) = &a.nvtx {
                    for label in stack.iter().take(MAX_NVTX_DEPTH) {
                        push_frame(&mut self.key, label);
                    }
                    if stack.len() > MAX_NVTX_DEPTH {
                        push_frame_raw(&mut self.key, "[deeper NVTX ranges]");
                    }
                }
                push_frame(&mut self.key, o.api.map_or(o.cupti_api, |s| s.name));
            }
            // CUPTI's record never met its launching call: no thread, no API to put it under.
            None => push_frame_raw(&mut self.key, "[launch not joined]"),
        }
        match kind {
            Some(GpuRecordKind::Kernel) => {
                match a.kernel.as_ref().or(a.origin.as_ref().and_then(|o| o.kernel.as_ref())) {
                    Some(k) => push_frame(&mut self.key, &k.demangled),
                    None => push_frame_raw(&mut self.key, "[unnamed kernel]"),
                }
            }
            Some(GpuRecordKind::Memcpy) => {
                let label = crate::correlate::cupti_join::copy_label(a.rec.copy_kind);
                push_frame_raw(&mut self.key, label.unwrap_or("memcpy (kind unknown)"));
            }
            _ => push_frame_raw(&mut self.key, "memset"),
        }
        self.gpu.add(a.pid, &self.key, a.duration_ns());
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if !self.exited.is_empty() {
            let gone: HashSet<u32> = self.exited.drain(..).collect();
            self.threads.retain(|(pid, _), _| !gone.contains(pid));
        }
        Ok(())
    }

    fn summary(&mut self, _s: &Summary<'_>) -> Result<()> {
        self.write()
    }
}

fn sep(key: &mut String) {
    if !key.is_empty() {
        key.push(';');
    }
}

/// A frame the sink spelled itself (or already sanitized).
fn push_frame_raw(key: &mut String, frame: &str) {
    sep(key);
    key.push_str(frame);
}

/// A frame from a name an observed process chose.
fn push_frame(key: &mut String, name: &str) {
    sep(key);
    push_sanitized(key, name);
}

/// `name` made safe for a frame: trimmed (inferno trims lines, and a blank frame shows
/// nothing), `;` → `,`, unsafe characters escaped as `export/text.rs` shows them, at most
/// [`MAX_FRAME_CHARS`] characters as written, then `…`.
fn push_sanitized(out: &mut String, name: &str) {
    let name = name.trim();
    if name.is_empty() {
        out.push_str("[no name]");
        return;
    }
    let plain = |c: char| c != ';' && !text::unsafe_char(c);
    if name.len() <= MAX_FRAME_CHARS && name.chars().all(plain) {
        // The common case: nothing to change, and at most MAX_FRAME_CHARS bytes.
        out.push_str(name);
        return;
    }
    let mut shown = 0;
    let mut one = String::new();
    for c in name.chars() {
        one.clear();
        if c == ';' {
            one.push(',');
        } else if plain(c) {
            one.push(c);
        } else {
            let _ = write!(one, "{}", text::Printable(c.encode_utf8(&mut [0; 4])));
        }
        let n = one.chars().count();
        if shown + n > MAX_FRAME_CHARS {
            out.push('…');
            return;
        }
        out.push_str(&one);
        shown += n;
    }
}

/// The flamegraph of `lines` (folded, sorted) as SVG; a page saying there was nothing to
/// draw when there are none (inferno refuses empty input).
fn svg(unit: Unit, lines: &[String]) -> Result<Vec<u8>> {
    if lines.is_empty() {
        return Ok(format!(
            "<?xml version=\"1.0\" standalone=\"no\"?>\n\
             <svg version=\"1.1\" width=\"1200\" height=\"80\" xmlns=\"http://www.w3.org/2000/svg\">\
             <title>{0}</title>\
             <text x=\"600\" y=\"30\" text-anchor=\"middle\" font-family=\"Verdana\" font-size=\"17\">{0}</text>\
             <text x=\"600\" y=\"60\" text-anchor=\"middle\" font-family=\"Verdana\" font-size=\"12\">\
             No data: gpu-observer saw no kernel launch or GPU record.</text></svg>\n",
            unit.title()
        )
        .into_bytes());
    }
    let mut opt = inferno::flamegraph::Options::default();
    opt.title = unit.title().to_string();
    opt.subtitle = Some(unit.subtitle().to_string());
    opt.count_name = unit.count_name().to_string();
    opt.name_type = "Frame:".to_string();
    // Colours from the frame names, not a random generator: the same stacks draw the same SVG.
    opt.hash = true;
    opt.deterministic = true;
    let mut out = Vec::new();
    inferno::flamegraph::from_lines(&mut opt, lines.iter().map(String::as_str), &mut out)
        .context("drawing the --flamegraph SVG")?;
    Ok(out)
}

#[cfg(test)]
mod tests;
