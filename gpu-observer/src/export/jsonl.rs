//! JSON lines (`--format jsonl`): the schema of ARCHITECTURE.md, one object per event, written
//! straight into a buffered writer (no allocation per event).

use std::io::{self, Write};

use gpu_observer_common::api::Family;

use crate::{
    attach::Drops,
    correlate::{Correlator, DIRECTIONS, Process, direction_name, mem_name},
    decode::{Body, Call, Event},
    export::bandwidth_mbps,
};

pub struct JsonlWriter<W: Write> {
    out: W,
}

fn hex(v: u64) -> Hex {
    Hex(v)
}

/// A pointer or handle written as a JSON string `"0x…"`.
struct Hex(u64);

impl std::fmt::Display for Hex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "\"{:#x}\"", self.0)
    }
}

/// An optional handle: `"0x…"` or `null`.
struct OptHex(Option<u64>);

impl std::fmt::Display for OptHex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(v) => write!(f, "\"{v:#x}\""),
            None => f.write_str("null"),
        }
    }
}

/// An optional number: the value or `null`.
struct OptNum(Option<u64>);

impl std::fmt::Display for OptNum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(v) => write!(f, "{v}"),
            None => f.write_str("null"),
        }
    }
}

impl<W: Write> JsonlWriter<W> {
    pub fn new(out: W) -> Self {
        Self { out }
    }

    pub fn into_inner(self) -> W {
        self.out
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    fn head(&mut self, ty: &str, ev: &Event) -> io::Result<()> {
        write!(
            self.out,
            "{{\"type\":\"{ty}\",\"ts_ns\":{},\"pid\":{},\"tid\":{},\"comm\":",
            ev.ts_ns, ev.pid, ev.tid
        )?;
        serde_json::to_writer(&mut self.out, ev.comm())?;
        if let Some(api) = ev.api {
            write!(self.out, ",\"api\":\"{}\"", api.name)?;
        }
        Ok(())
    }

    pub fn event(&mut self, ev: &Event) -> io::Result<()> {
        match &ev.body {
            Body::Launch(l) => {
                self.head("launch", ev)?;
                write!(
                    self.out,
                    ",\"kernel\":null,\"function\":{},\"grid\":[{},{},{}],\"block\":[{},{},{}],\"shared_mem_bytes\":{},\"stream\":{}",
                    hex(l.function),
                    l.grid[0],
                    l.grid[1],
                    l.grid[2],
                    l.block[0],
                    l.block[1],
                    l.block[2],
                    l.shared_mem_bytes,
                    hex(l.stream)
                )?;
                if l.read_errors != 0 {
                    write!(self.out, ",\"read_errors\":{}", l.read_errors)?;
                }
            }
            Body::Call(c) => {
                let family = ev.api.map(|a| a.family);
                let ty = match family {
                    Some(Family::Memcpy) => "memcpy",
                    Some(Family::Memset) => "memset",
                    Some(Family::Alloc) => "alloc",
                    Some(Family::Free) => "free",
                    Some(Family::Sync) => "sync",
                    _ => "init",
                };
                self.head(ty, ev)?;
                self.call_fields(family, c)?;
            }
            Body::Ioctl(i) => {
                self.head("ioctl", ev)?;
                write!(
                    self.out,
                    ",\"fd\":{},\"cmd\":{},\"arg\":{},\"duration_ns\":{},\"ret\":{},\"parent_api\":",
                    i.fd,
                    hex(u64::from(i.cmd)),
                    hex(i.arg),
                    i.duration_ns,
                    i.ret
                )?;
                match i.parent {
                    Some(p) => write!(self.out, "\"{}\"", p.name)?,
                    None => self.out.write_all(b"null")?,
                }
            }
            Body::ProcessExit => self.head("process_exit", ev)?,
        }
        self.out.write_all(b"}\n")
    }

    fn call_fields(&mut self, family: Option<Family>, c: &Call) -> io::Result<()> {
        let o = &mut self.out;
        match family {
            Some(Family::Memcpy) => {
                let bytes = c.bytes.unwrap_or(0);
                write!(
                    o,
                    ",\"direction\":\"{}\",\"bytes\":{bytes},\"duration_ns\":{},\"bandwidth_mbps\":{:.3},\"async\":{},\"stream\":{},\"dst\":{},\"src\":{}",
                    direction_name(c.direction),
                    c.duration_ns,
                    bandwidth_mbps(bytes, c.duration_ns),
                    c.stream.is_some(),
                    OptHex(c.stream),
                    OptHex(c.dst),
                    OptHex(c.src)
                )?;
            }
            Some(Family::Memset) => {
                write!(
                    o,
                    ",\"bytes\":{},\"duration_ns\":{},\"stream\":{},\"address\":{}",
                    OptNum(c.bytes),
                    c.duration_ns,
                    OptHex(c.stream),
                    OptHex(c.address)
                )?;
            }
            Some(Family::Alloc | Family::Free) => {
                write!(
                    o,
                    ",\"bytes\":{},\"address\":{},\"memory\":\"{}\",\"duration_ns\":{},\"stream\":{}",
                    OptNum(c.bytes),
                    OptHex(c.address),
                    mem_name(c.mem).unwrap_or("device"),
                    c.duration_ns,
                    OptHex(c.stream)
                )?;
            }
            _ => {
                write!(
                    o,
                    ",\"duration_ns\":{},\"handle\":{}",
                    c.duration_ns,
                    OptHex(c.stream)
                )?;
            }
        }
        write!(
            o,
            ",\"result\":{},\"ioctl_count\":{},\"ioctl_ns\":{}",
            c.result, c.ioctl_count, c.ioctl_ns
        )?;
        if c.nested != 0 {
            write!(o, ",\"nested_calls\":{}", c.nested)?;
        }
        if c.read_errors != 0 {
            write!(o, ",\"read_errors\":{}", c.read_errors)?;
        }
        Ok(())
    }

    /// One `summary` line per process, then the total line (always last; `events` and
    /// `dropped` always present).
    pub fn summary(
        &mut self,
        corr: &Correlator,
        drops: &Drops,
        wall_ns: u64,
        unattributed: u64,
    ) -> io::Result<()> {
        for p in corr.sorted() {
            self.process_summary(p, drops.by_pid.get(&p.pid).copied().unwrap_or(0), wall_ns)?;
        }
        // Drops of processes the agent never saw an event from still count.
        write!(
            self.out,
            "{{\"type\":\"summary\",\"scope\":\"total\",\"pid\":null,\"events\":{},\"dropped\":{},\"dropped_by_kind\":{{",
            corr.events, drops.total
        )?;
        for (i, (kind, n)) in drops.by_kind.iter().enumerate() {
            let name = match kind {
                1 => "launch",
                2 => "call",
                3 => "ioctl",
                _ => "process_exit",
            };
            write!(self.out, "{}\"{name}\":{n}", if i == 0 { "" } else { "," })?;
        }
        write!(
            self.out,
            "}},\"decode_errors\":{},\"processes\":{},\"forgotten_processes\":{},\"unattributed_drops\":{unattributed},\"wall_ns\":{wall_ns}}}",
            corr.decode_errors,
            corr.procs.len(),
            corr.forgotten
        )?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }

    fn process_summary(&mut self, p: &Process, dropped: u64, wall_ns: u64) -> io::Result<()> {
        let s = &p.stats;
        write!(
            self.out,
            "{{\"type\":\"summary\",\"scope\":\"process\",\"pid\":{},\"comm\":",
            p.pid
        )?;
        serde_json::to_writer(&mut self.out, &p.comm)?;
        write!(
            self.out,
            ",\"events\":{},\"dropped\":{dropped},\"exited\":{},\"launches\":{},\"launch_apis\":{{",
            s.events, p.exited, s.launches
        )?;
        for (i, (api, n)) in s.launch_apis.iter().enumerate() {
            write!(self.out, "{}\"{api}\":{n}", if i == 0 { "" } else { "," })?;
        }
        self.out.write_all(b"},\"memcpy\":{")?;
        for (i, d) in DIRECTIONS.iter().enumerate() {
            let a = s.copies[i];
            write!(
                self.out,
                "{}\"{}\":{{\"count\":{},\"bytes\":{},\"duration_ns\":{},\"bandwidth_mbps\":{:.3}}}",
                if i == 0 { "" } else { "," },
                direction_name(*d),
                a.count,
                a.bytes,
                a.ns,
                bandwidth_mbps(a.bytes, a.ns)
            )?;
        }
        let sync_fraction = if wall_ns > 0 {
            s.syncs.ns as f64 / wall_ns as f64
        } else {
            0.0
        };
        write!(
            self.out,
            "}},\"memset\":{{\"count\":{},\"bytes\":{}}},\"alloc\":{{\"count\":{},\"bytes\":{}}},\"free\":{{\"count\":{},\"bytes\":{},\"unknown\":{}}},\"outstanding_bytes\":{},\"sync\":{{\"count\":{},\"duration_ns\":{},\"wall_fraction\":{:.4}}},\"init\":{{\"count\":{},\"duration_ns\":{}}},\"ioctl\":{{\"count\":{},\"duration_ns\":{},\"in_calls\":{}}},\"failed_calls\":{},\"calls\":{{",
            s.memsets.count,
            s.memsets.bytes,
            s.allocs.count,
            s.allocs.bytes,
            s.frees.count,
            s.frees.bytes,
            s.unknown_frees,
            s.outstanding_bytes,
            s.syncs.count,
            s.syncs.ns,
            sync_fraction,
            s.inits.count,
            s.inits.ns,
            s.ioctls.count,
            s.ioctls.ns,
            s.ioctls_in_calls,
            s.failed_calls
        )?;
        for (i, (api, n)) in s.call_apis.iter().enumerate() {
            write!(self.out, "{}\"{api}\":{n}", if i == 0 { "" } else { "," })?;
        }
        self.out.write_all(b"}}\n")
    }
}
