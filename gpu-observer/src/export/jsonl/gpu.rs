//! `gpu_kernel`, `gpu_memcpy`, `gpu_memset` and `cupti` lines, and the `cupti` block of a
//! process summary.

use std::io::{self, Write};

use gpu_observer_common::cupti::GpuRecordKind;

use gpu_observer_common::cupti::{CuptiState, NvtxState};

use super::{JsonlWriter, OptNum, opt_str};
use crate::{
    correlate::{
        CuptiChange,
        cupti_join::{GpuActivity, copy_kind_name, memory_kind_name},
        nvtx::NvtxRange,
    },
    export::{
        attributes::{Value, span_attributes},
        sink::{GpuTimingEvent, GpuTimingNote},
    },
    rules::bandwidth_mbps,
    snapshot::GpuView,
};

/// Slot of each GPU line type in `sampled_out`.
const SAMPLED_SLOT: [usize; 3] = [3, 4, 5];

impl<W: Write> JsonlWriter<W> {
    /// One joined GPU record, subject to adaptive sampling by its GPU duration.
    pub fn gpu(&mut self, a: &GpuActivity) -> io::Result<()> {
        let (ty, slot) = match a.kind() {
            Some(GpuRecordKind::Kernel) => ("gpu_kernel", SAMPLED_SLOT[0]),
            Some(GpuRecordKind::Memcpy) => ("gpu_memcpy", SAMPLED_SLOT[1]),
            Some(GpuRecordKind::Memset) => ("gpu_memset", SAMPLED_SLOT[2]),
            _ => return Ok(()),
        };
        let dur = a.duration_ns();
        if !crate::rules::kept(dur, self.threshold_ns, self.trace_all, a.anomalous) {
            self.sampled_out[slot] += 1;
            return Ok(());
        }
        let r = &a.rec;
        let o = a.origin.as_ref();
        let comm = crate::rules::comm(&a.comm);
        self.head(ty, r.start_ns, a.pid, o.map_or(0, |o| o.tid), &comm)?;
        let out = &mut self.out;
        opt_str(out, "api", o.and_then(|o| o.api).map(|a| a.name))?;
        opt_str(out, "cupti_api", o.map(|o| o.cupti_api))?;
        write!(
            out,
            ",\"correlation_id\":{},\"gpu_start_ns\":{},\"gpu_end_ns\":{},\"gpu_duration_ns\":{dur},\"launch_ts_ns\":{},\"queue_delay_ns\":{},\"cupti_api_start_ns\":{},\"cupti_api_end_ns\":{},\"device\":{},\"context\":{},\"stream\":{},\"graph_id\":{}",
            r.correlation_id,
            r.start_ns,
            r.end_ns,
            OptNum(o.and_then(|o| o.launch_ts_ns)),
            OptNum(a.queue_delay_ns()),
            OptNum(o.map(|o| o.api_start_ns)),
            OptNum(o.map(|o| o.api_end_ns)),
            r.device,
            r.context,
            r.stream,
            OptNum((r.graph_id != 0).then_some(u64::from(r.graph_id)))
        )?;
        match a.kind() {
            Some(GpuRecordKind::Kernel) => {
                opt_str(out, "kernel", a.kernel.as_ref().map(|k| &*k.demangled))?;
                opt_str(out, "kernel_mangled", a.kernel.as_ref().map(|k| &*k.mangled))?;
                write!(
                    out,
                    ",\"grid\":[{},{},{}],\"block\":[{},{},{}],\"registers_per_thread\":{},\"static_shared_mem_bytes\":{},\"dynamic_shared_mem_bytes\":{},\"occupancy\":",
                    r.grid[0],
                    r.grid[1],
                    r.grid[2],
                    r.block[0],
                    r.block[1],
                    r.block[2],
                    r.registers_per_thread,
                    r.static_shared_mem,
                    r.dynamic_shared_mem
                )?;
                match a.occupancy {
                    Some(v) => write!(out, "{v:.4}")?,
                    None => out.write_all(b"null")?,
                }
            }
            Some(GpuRecordKind::Memcpy) => write!(
                out,
                ",\"bytes\":{},\"copy_kind\":\"{}\",\"src_kind\":\"{}\",\"dst_kind\":\"{}\",\"bandwidth_mbps\":{:.3}",
                r.bytes,
                copy_kind_name(r.copy_kind),
                memory_kind_name(r.src_kind),
                memory_kind_name(r.dst_kind),
                bandwidth_mbps(r.bytes, dur)
            )?,
            _ => write!(
                out,
                ",\"bytes\":{},\"value\":{},\"memory_kind\":\"{}\"",
                r.bytes,
                r.copy_kind,
                memory_kind_name(r.dst_kind)
            )?,
        }
        if let Some(stack) = &a.nvtx {
            out.write_all(b",\"nvtx\":[")?;
            for (i, label) in stack.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                serde_json::to_writer(&mut *out, &**label).map_err(io::Error::other)?;
            }
            out.write_all(b"]")?;
        }
        let slow = crate::rules::is_slow(dur, self.threshold_ns);
        write!(out, ",\"is_slow\":{slow},\"attributes\":{{")?;
        for (i, (k, v)) in span_attributes(a, self.threshold_ns / 1000, slow)
            .into_iter()
            .enumerate()
        {
            write!(out, "{}\"{k}\":", if i == 0 { "" } else { "," })?;
            match v {
                Value::Str(s) => serde_json::to_writer(&mut *out, &s).map_err(io::Error::other)?,
                Value::Int(n) => write!(out, "{n}")?,
                Value::Float(f) => write!(out, "{f:.4}")?,
                Value::Bool(b) => write!(out, "{b}")?,
            }
        }
        out.write_all(b"}}\n")
    }

    /// An NVTX range that ended (or was still open at the end: `end_ns` null), or a mark. All
    /// are written: they are the program's own structure, not sampled.
    pub fn nvtx(&mut self, r: &NvtxRange) -> io::Result<()> {
        let comm = crate::rules::comm(&r.comm);
        self.head("nvtx_range", r.start_ns, r.pid, r.tid, &comm)?;
        let out = &mut self.out;
        write!(out, ",\"id\":{},\"kind\":\"{}\",\"name\":", r.id, r.kind.name())?;
        serde_json::to_writer(&mut *out, &*r.name).map_err(io::Error::other)?;
        out.write_all(b",\"domain\":")?;
        serde_json::to_writer(&mut *out, &r.domain.as_deref()).map_err(io::Error::other)?;
        writeln!(
            out,
            ",\"start_ns\":{},\"end_ns\":{},\"duration_ns\":{},\"depth\":{}}}",
            r.start_ns,
            OptNum(r.end_ns),
            OptNum(r.end_ns.map(|e| e.saturating_sub(r.start_ns))),
            r.depth
        )
    }

    /// A process's CUPTI state changed (active, busy next to another profiler, ...).
    pub fn cupti(&mut self, c: &CuptiChange) -> io::Result<()> {
        let s = &c.status;
        self.head("cupti", c.ts_ns, c.pid, c.pid, &c.comm)?;
        write!(
            self.out,
            ",\"state\":\"{}\",\"cupti_result\":{}",
            CuptiState::name_of(s.state),
            s.cupti_result
        )?;
        opt_str(&mut self.out, "message", Some(CuptiState::message_of(s.state)))?;
        self.out.write_all(b"}\n")
    }

    /// What `--gpu-timing` did to a process.
    pub fn gpu_timing(&mut self, n: &GpuTimingNote) -> io::Result<()> {
        self.head("gpu_timing", n.ts_ns, n.pid, n.tid, &n.comm)?;
        write!(self.out, ",\"event\":\"{}\"", n.event.name())?;
        match &n.event {
            GpuTimingEvent::Injected { pause_us, diverted_us } => write!(
                self.out,
                ",\"pause_us\":{pause_us},\"diverted_us\":{diverted_us},\"library\":\"memfd:{}\"",
                gpu_observer_common::cupti::MEMFD_NAME
            )?,
            GpuTimingEvent::AlreadyLoaded { late } => write!(self.out, ",\"late\":{late}")?,
            GpuTimingEvent::Refused { reason, message } => {
                write!(self.out, ",\"reason\":\"{reason}\"")?;
                opt_str(&mut self.out, "message", Some(message))?;
            }
            GpuTimingEvent::Withdrawn { records } => write!(self.out, ",\"records\":{records}")?,
        }
        self.out.write_all(b"}\n")
    }

    /// A capture window's edge (fleet mode): `{"type":"capture","state":"open"|"closed",…}`.
    pub fn capture(&mut self, e: &crate::observe::capture::Edge) -> io::Result<()> {
        writeln!(
            self.out,
            "{{\"type\":\"capture\",\"ts_ns\":{},\"state\":\"{}\",\"links\":{},\"failed\":{},\"took_us\":{},\"window_ns\":{},\"period_ns\":{},\"capture_fraction\":{:.4},\"cupti\":{}}}",
            e.ts_ns,
            if e.open { "open" } else { "closed" },
            e.links,
            e.failed,
            e.took_us,
            e.window_ns,
            e.period_ns,
            e.fraction,
            e.cupti
        )
    }

    /// The `"cupti":{...}` block of a process summary (`null` without the injection library).
    pub(super) fn gpu_summary(&mut self, g: Option<&GpuView>) -> io::Result<()> {
        let o = &mut self.out;
        let Some(g) = g else {
            return o.write_all(b",\"cupti\":null");
        };
        let (s, st) = (&g.stats, &g.status);
        write!(
            o,
            ",\"cupti\":{{\"state\":\"{}\",\"cupti_result\":{},\"kernels\":{},\"memcpys\":{},\"memsets\":{},\"joined\":{},\"unjoined\":{},\"api_records\":{},\"api_unmatched\":{},\"calls_evicted\":{},\"gpu_kernel_ns\":{},\"gpu_memcpy_ns\":{},\"gpu_memset_ns\":{},\"gpu_span_ns\":{},\"queue_delay_avg_ns\":{},\"queue_delay_max_ns\":{},\"cupti_dropped\":{},\"rate_limited\":{},\"forwarded\":{},\"buffers\":{},\"buffer_bytes\":{},\"rate_limit\":{},\"top_kernels\":[",
            CuptiState::name_of(st.state),
            st.cupti_result,
            s.kernels,
            s.memcpys,
            s.memsets,
            s.joined,
            s.unjoined,
            s.api_records,
            s.api_unmatched,
            s.recent_evicted,
            s.kernel_ns,
            s.memcpy_ns,
            s.memset_ns,
            s.last_gpu_ns.saturating_sub(s.first_gpu_ns),
            crate::rules::mean_ns(s.queue_delay_ns, s.queue_delays),
            s.max_queue_delay_ns,
            st.cupti_dropped,
            st.rate_limited,
            st.forwarded,
            st.buffers,
            st.buffer_bytes,
            st.rate_limit
        )?;
        for (i, (name, count, ns)) in s.top_kernels(10).into_iter().enumerate() {
            o.write_all(if i == 0 { b"{\"kernel\":" } else { b",{\"kernel\":" })?;
            serde_json::to_writer(&mut *o, &**name).map_err(io::Error::other)?;
            write!(o, ",\"count\":{count},\"gpu_ns\":{ns}}}")?;
        }
        o.write_all(b"]")?;
        let n = &g.nvtx;
        write!(
            o,
            ",\"nvtx\":{{\"state\":\"{}\",\"thread_ranges\":{},\"process_ranges\":{},\"marks\":{},\"open_at_end\":{},\"unmatched_ends\":{},\"unnamed\":{},\"evicted\":{},\"gpu_records_with_stack\":{}}}}}",
            NvtxState::name_of(st.nvtx),
            n.thread_ranges,
            n.process_ranges,
            n.marks,
            n.open_at_end,
            n.unmatched_ends,
            n.unnamed,
            n.evicted,
            n.stacks
        )
    }
}
