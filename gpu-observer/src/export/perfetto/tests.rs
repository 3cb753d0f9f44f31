//! The writer's framing, cap and interning, and the sink's tracks, nesting and flows, read back
//! with the same messages (the Python decoder in tests/perfetto/ checks the files
//! independently, with Perfetto's own protos).

use std::sync::Arc;

use gpu_observer_common::{api, cupti::GpuRecord};
use prost::Message;

use super::{
    proto::{self, TracePacket},
    writer::{Key, Writer},
    *,
};
use crate::{
    correlate::cupti_join::Origin,
    decode::{Call, Ioctl, KernelName, Launch},
};

const COMM: [u8; 16] = *b"train\0\0\0\0\0\0\0\0\0\0\0";

/// The packets of a file, each frame checked; a torn tail is ignored, as readers do.
fn packets(data: &[u8]) -> Vec<TracePacket> {
    let mut out = Vec::new();
    let mut buf = data;
    while !buf.is_empty() {
        assert_eq!(buf[0], 0x0A, "not a Trace.packet field");
        let mut rest = &buf[1..];
        let Ok(len) = prost::encoding::decode_varint(&mut rest) else {
            break;
        };
        let len = len as usize;
        if rest.len() < len {
            break;
        }
        out.push(TracePacket::decode(&rest[..len]).unwrap());
        buf = &rest[len..];
    }
    out
}

fn spec(name: &str) -> &'static api::ApiSpec {
    api::by_id(api::id_of(name).unwrap()).unwrap()
}

fn ev(ts: u64, tid: u32, api: &str, body: Body) -> Event {
    Event {
        ts_ns: ts,
        pid: 100,
        tid,
        comm: COMM,
        api: Some(spec(api)),
        body,
    }
}

fn launch(ts: u64, api: &str) -> Event {
    ev(
        ts,
        101,
        api,
        Body::Launch(Launch {
            held: None,
            function: 0x10,
            grid: [4, 1, 1],
            block: [128, 1, 1],
            shared_mem_bytes: 0,
            stream: 0x77,
            read_errors: 0,
            kernel: Some(Arc::new(KernelName::new("_Z4gemmv"))),
        }),
    )
}

fn kernel(start: u64, end: u64, stream: u32, origin: Option<(&str, u64)>) -> GpuActivity {
    GpuActivity {
        pid: 100,
        comm: COMM,
        rec: GpuRecord {
            kind: GpuRecordKind::Kernel as u32,
            correlation_id: 9,
            start_ns: start,
            end_ns: end,
            stream,
            ..Default::default()
        },
        origin: origin.map(|(api, ts)| Origin {
            function: 0,
            tid: 101,
            api: Some(spec(api)),
            cupti_api: "cuLaunchKernel",
            launch_ts_ns: Some(ts),
            api_start_ns: ts,
            api_end_ns: ts + 10,
            kernel: None,
        }),
        kernel: Some(Arc::new(KernelName::new("_Z4gemmv"))),
        occupancy: None,
        sm_count: None,
        anomalous: false,
        nvtx: Some(Arc::from(vec![Arc::<str>::from("step"), Arc::<str>::from("fwd")])),
    }
}

fn sink() -> PerfettoSink<Vec<u8>> {
    PerfettoSink::to_writer(Vec::new(), u64::MAX, "t.pftrace")
}

fn cupti_on(s: &mut PerfettoSink<Vec<u8>>) {
    s.cupti_state(&CuptiChange {
        pid: 100,
        ts_ns: 1,
        comm: "train".into(),
        status: crate::correlate::cupti_join::Status {
            state: Some(CuptiState::Active),
            ..Default::default()
        },
    })
    .unwrap();
}

/// Each track event as (ts, type, track, name), names resolved through the interned data.
fn events(ps: &[TracePacket]) -> Vec<(u64, i32, u64, Option<String>)> {
    let mut names = HashMap::new();
    let mut out = Vec::new();
    for p in ps {
        if p.sequence_flags.unwrap_or(0) & proto::SEQ_INCREMENTAL_STATE_CLEARED != 0 {
            names.clear();
        }
        if let Some(d) = &p.interned_data {
            for n in &d.event_names {
                names.insert(n.iid.unwrap(), n.name.clone().unwrap());
            }
        }
        if let Some(te) = &p.track_event {
            let name = te
                .name_iid
                .map(|i| names.get(&i).cloned().expect("iid used before defined"));
            out.push((p.timestamp.unwrap(), te.r#type.unwrap(), te.track_uuid.unwrap(), name));
        }
    }
    out
}

#[test]
fn frames_are_trace_packet_fields_with_varint_lengths() {
    let mut w = Writer::new(Vec::new(), u64::MAX);
    w.event(5, proto::TYPE_INSTANT, 7, Some(&"x".repeat(200))).unwrap();
    assert!(w.emit().unwrap());
    let data = w.get_ref().clone();
    let ps = packets(&data);
    assert_eq!(ps.len(), 2);
    // The first packet clears the state and sets it up: clock snapshot, defaults, annotation names.
    let first = &ps[0];
    assert_eq!(first.sequence_flags, Some(3));
    assert_eq!(first.trusted_packet_sequence_id, Some(1));
    let clocks = first.clock_snapshot.as_ref().unwrap();
    assert_eq!(clocks.primary_trace_clock, Some(3));
    assert_eq!(
        clocks.clocks.iter().map(|c| c.clock_id.unwrap()).collect::<Vec<_>>(),
        [3, 6, 1]
    );
    assert_eq!(
        first.trace_packet_defaults.as_ref().unwrap().timestamp_clock_id,
        Some(3)
    );
    let names = &first.interned_data.as_ref().unwrap().debug_annotation_names;
    assert_eq!(names.len(), Key::ALL.len());
    assert_eq!((names[0].iid, names[0].name.as_deref()), (Some(1), Some("bytes")));
    // The second: flag 2, its name interned in it; > 127 bytes, so a two-byte length.
    let second = &ps[1];
    assert_eq!(second.sequence_flags, Some(2));
    let body = second.encode_to_vec();
    let first_len = ps[0].encoded_len();
    let off = 1 + prost::length_delimiter_len(first_len) + first_len;
    assert_eq!(data[off], 0x0A);
    let n = body.len();
    assert!(n > 127);
    assert_eq!(&data[off + 1..off + 3], &[(n & 0x7f) as u8 | 0x80, (n >> 7) as u8]);
    assert_eq!(&data[off + 3..], &body[..]);
    assert_eq!(data.len(), off + 3 + n);
    assert_eq!(w.counts.packets, 2);
    assert_eq!(w.counts.bytes, data.len() as u64);
}

#[test]
fn flow_ids_are_unpacked_fixed64() {
    let mut w = Writer::new(Vec::new(), u64::MAX);
    w.event(5, proto::TYPE_INSTANT, 7, None).unwrap();
    w.flow(0x0102_0304_0506_0708);
    w.flow(2);
    assert!(w.emit().unwrap());
    let te = &packets(w.get_ref())[1];
    let bytes = te.track_event.as_ref().unwrap().encode_to_vec();
    // Field 47, wire type 1 (64-bit): varint key (47 << 3 | 1) = 377 = [0xF9, 0x02], twice.
    let key = [0xF9, 0x02];
    let hits = bytes.windows(2).filter(|w| *w == key).count();
    assert_eq!(hits, 2);
    let at = bytes.windows(2).position(|w| w == key).unwrap();
    assert_eq!(&bytes[at + 2..at + 10], &0x0102_0304_0506_0708u64.to_le_bytes());
}

#[test]
fn a_full_intern_table_clears_the_state_and_starts_the_iids_over() {
    let mut w = Writer::with_intern_limit(Vec::new(), u64::MAX, 10);
    for i in 0..5 {
        w.event(i, proto::TYPE_INSTANT, 7, Some(&format!("n{i}"))).unwrap();
        w.emit().unwrap();
    }
    let ps = packets(w.get_ref());
    // An event starts over when fewer than 8 (the most one event interns) of the 10 are
    // left: 3 names per state. clear, n0, n1, n2, clear, n3, n4.
    let flags: Vec<_> = ps.iter().map(|p| p.sequence_flags.unwrap()).collect();
    assert_eq!(flags, [3, 2, 2, 2, 3, 2, 2]);
    let iids: Vec<_> = ps
        .iter()
        .filter_map(|p| p.track_event.as_ref().and_then(|t| t.name_iid))
        .collect();
    assert_eq!(iids, [1, 2, 3, 1, 2]);
    // The resets re-emit the defaults; only the first has the clock snapshot.
    assert!(ps[4].trace_packet_defaults.is_some() && ps[4].clock_snapshot.is_none());
    assert_eq!(w.counts.intern_resets, 1);
    let names: Vec<_> = events(&ps).into_iter().map(|e| e.3.unwrap()).collect();
    assert_eq!(names, ["n0", "n1", "n2", "n3", "n4"]);
    // A name seen again after a reset is interned again, in that packet.
    w.event(9, proto::TYPE_INSTANT, 7, Some("n0")).unwrap();
    w.emit().unwrap();
    let last = packets(w.get_ref()).pop().unwrap();
    assert_eq!(last.interned_data.unwrap().event_names[0].name.as_deref(), Some("n0"));
}

#[test]
fn the_cap_allows_exactly_the_packets_that_fit_then_nothing() {
    // The sizes of the first packets, measured without a cap.
    let mut s = sink();
    for i in 0..4 {
        s.event(&launch(1000 + i, "cuLaunchKernel")).unwrap();
    }
    let sizes: Vec<u64> = {
        let data = s.get_ref();
        let mut v = Vec::new();
        let mut buf = &data[..];
        while !buf.is_empty() {
            let mut rest = &buf[1..];
            let len = prost::encoding::decode_varint(&mut rest).unwrap() as usize;
            let frame = buf.len() - rest.len() + len;
            v.push(frame as u64);
            buf = &buf[frame..];
        }
        v
    };
    // clear-state, process, thread, then 4 launches.
    assert_eq!(sizes.len(), 7);
    let cap = sizes[..5].iter().sum::<u64>();
    let mut s = PerfettoSink::to_writer(Vec::new(), cap + sizes[5] - 1, "t");
    for i in 0..4 {
        s.event(&launch(1000 + i, "cuLaunchKernel")).unwrap();
    }
    // A tiny packet would still fit, but nothing more is written once one did not.
    s.nvml(
        &Line::Process(crate::nvml::ProcessSample {
            pid: 100,
            util_sm: Some(5),
            ..Default::default()
        }),
        Some("train"),
        &[],
    )
    .unwrap();
    assert_eq!(s.get_ref().len() as u64, cap);
    assert_eq!(packets(s.get_ref()).len(), 5);
    assert_eq!(
        s.stats,
        Stats {
            events: 2,
            left_out: 3,
            unplaced: 0
        }
    );
    assert_eq!(s.written().packets, 5);
    assert!(
        s.report().ends_with("; 3 left out by --perfetto-max-mb"),
        "{}",
        s.report()
    );
}

#[test]
fn a_torn_tail_leaves_every_whole_packet_readable() {
    let mut s = sink();
    for i in 0..3 {
        s.event(&launch(1000 + i, "cuLaunchKernel")).unwrap();
    }
    let data = s.get_ref().clone();
    let whole = packets(&data).len();
    assert_eq!(whole, 6);
    assert_eq!(packets(&data[..data.len() - 3]).len(), whole - 1);
    assert_eq!(packets(&data[..data.len() - 1]).len(), whole - 1);
}

#[test]
fn lanes_take_the_first_one_the_slice_does_not_meet_and_give_up_past_four() {
    let mut l = Lanes::default();
    assert_eq!(l.place(0, 10), Some(0));
    assert_eq!(l.place(10, 20), Some(0));
    assert_eq!(l.place(15, 30), Some(1));
    // Meets lane 0's [0, 10), not lane 1's [15, 30).
    assert_eq!(l.place(5, 8), Some(1));
    assert_eq!(l.place(16, 17), Some(2));
    assert_eq!(l.place(16, 17), Some(3));
    assert_eq!(l.place(16, 17), None);
    assert_eq!(l.place(30, 31), Some(0));
    // Out of order but meeting nothing: back on lane 0, between what it holds.
    assert_eq!(l.place(40, 50), Some(0));
    assert_eq!(l.place(31, 40), Some(0));
    // A zero-length slice inside another is not beside it.
    assert_eq!(l.place(45, 45), Some(1));
    let starts: Vec<Vec<u64>> = l.lanes.iter().map(|m| m.keys().copied().collect()).collect();
    assert_eq!(starts, [vec![0, 10, 30, 31, 40], vec![5, 15, 45], vec![16], vec![16]]);
}

#[test]
fn flow_ids_are_derived_from_process_thread_and_entry_time() {
    assert_eq!(flow_id(1, 2, 3), flow_id(1, 2, 3));
    assert_ne!(flow_id(1, 2, 3), flow_id(1, 2, 4));
    assert_ne!(flow_id(1, 2, 3), flow_id(2, 1, 3));
    assert_ne!(flow_id(1, 2, 3), thread_track(1, 2));
    assert_ne!(writer::uuid("x", &[]), 0);
}

#[test]
fn launches_flow_to_their_kernels_and_graph_kernels_chain() {
    let mut s = sink();
    // Before CUPTI is active: no flow.
    s.event(&launch(500, "cuLaunchKernel")).unwrap();
    cupti_on(&mut s);
    s.event(&launch(1000, "cuLaunchKernel")).unwrap();
    s.event(&launch(2000, "cuGraphLaunch")).unwrap();
    s.gpu(&kernel(1500, 1600, 7, Some(("cuLaunchKernel", 1000)))).unwrap();
    s.gpu(&kernel(2500, 2600, 7, Some(("cuGraphLaunch", 2000)))).unwrap();
    s.gpu(&kernel(2600, 2700, 7, Some(("cuGraphLaunch", 2000)))).unwrap();
    let ps = packets(s.get_ref());
    let tes: Vec<_> = ps.iter().filter_map(|p| p.track_event.clone()).collect();
    let f1 = flow_id(100, 101, 1000);
    let f2 = flow_id(100, 101, 2000);
    let flows: Vec<_> = tes
        .iter()
        .map(|t| (t.flow_ids.clone(), t.terminating_flow_ids.clone()))
        .collect();
    let none = (vec![], vec![]);
    assert_eq!(
        flows,
        [
            none.clone(),
            (vec![f1], vec![]),
            (vec![f2], vec![]),
            (vec![], vec![f1]),
            none.clone(),
            (vec![f2], vec![]),
            none.clone(),
            (vec![f2], vec![]),
            none,
        ]
    );
    // The GPU track: a child of the process track, named by device and stream.
    let gpu = stream_track(100, 0, 0, 7, 0);
    let d = ps
        .iter()
        .filter_map(|p| p.track_descriptor.as_ref())
        .find(|d| d.uuid == Some(gpu))
        .unwrap();
    assert_eq!(d.name.as_deref(), Some("GPU 0 stream 7"));
    assert_eq!(d.parent_uuid, Some(process_track(100)));
    // The kernel slice: its demangled name, its NVTX stack.
    let k = &tes[3];
    assert_eq!(k.track_uuid, Some(gpu));
    let nvtx = k
        .debug_annotations
        .iter()
        .find(|a| a.name_iid == Some(Key::Nvtx as u64 + 1));
    assert_eq!(nvtx.unwrap().string_value.as_deref(), Some("step / fwd"));
    assert_eq!(events(&ps)[3].3.as_deref(), Some("gemm()"));
    assert_eq!(s.stats.events, 6);
}

#[test]
fn overlapping_gpu_records_go_to_overlap_lanes() {
    let mut s = sink();
    s.gpu(&kernel(100, 200, 3, None)).unwrap();
    s.gpu(&kernel(150, 250, 3, None)).unwrap();
    s.gpu(&kernel(250, 300, 3, None)).unwrap();
    for i in 0..3 {
        s.gpu(&kernel(160 + i, 170, 3, None)).unwrap();
    }
    let ps = packets(s.get_ref());
    let lane = |l| stream_track(100, 0, 0, 3, l);
    let begins: Vec<_> = events(&ps)
        .into_iter()
        .filter(|e| e.1 == proto::TYPE_SLICE_BEGIN)
        .map(|e| (e.0, e.2))
        .collect();
    assert_eq!(
        begins,
        [
            (100, lane(0)),
            (150, lane(1)),
            (250, lane(0)),
            (160, lane(2)),
            (161, lane(3))
        ]
    );
    assert_eq!(s.stats.unplaced, 1);
    let d = ps
        .iter()
        .filter_map(|p| p.track_descriptor.as_ref())
        .find(|d| d.uuid == Some(lane(2)))
        .unwrap();
    assert_eq!(d.name.as_deref(), Some("GPU 0 stream 3 (overlap 2)"));
    assert_eq!(d.parent_uuid, Some(lane(0)));
}

/// An RM control ioctl of thread 101 inside its cuMemcpyHtoD_v2, 50 ns from `ts`.
fn rm_control(ts: u64, device: Option<Arc<str>>) -> Event {
    ev(
        ts,
        101,
        "cuMemcpyHtoD_v2",
        Body::Ioctl(Ioctl {
            fd: 3,
            cmd: 0xc020_462a,
            arg: 0,
            duration_ns: 50,
            ret: 0,
            parent: Some(spec("cuMemcpyHtoD_v2")),
            name: Some("NV_ESC_RM_CONTROL"),
            device,
        }),
    )
}

#[test]
fn calls_are_slices_with_their_ioctls_inside_and_abandoned_calls_instants() {
    let mut s = sink();
    let ioctl = rm_control(1100, None);
    let mut ioctl2 = ioctl.clone();
    ioctl2.ts_ns = 1200;
    if let Body::Ioctl(i) = &mut ioctl2.body {
        i.name = None;
    }
    let mut call = Call::returned(spec("cuMemcpyHtoD_v2"), 500);
    call.bytes = Some(4096);
    s.event(&ioctl).unwrap();
    s.event(&ioctl2).unwrap();
    s.event(&ev(1000, 101, "cuMemcpyHtoD_v2", Body::Call(call.clone())))
        .unwrap();
    call.abandoned = true;
    s.event(&ev(2000, 101, "cuMemcpyHtoD_v2", Body::Call(call))).unwrap();
    let t = thread_track(100, 101);
    let got: Vec<_> = events(&packets(s.get_ref()))
        .into_iter()
        .map(|(ts, ty, track, name)| {
            assert_eq!(track, t);
            (ts, ty, name)
        })
        .collect();
    let n = |s: &str| Some(s.to_string());
    assert_eq!(
        got,
        [
            (1100, 1, n("NV_ESC_RM_CONTROL")),
            (1150, 2, None),
            (1200, 1, n("ioctl 0xc020462a")),
            (1250, 2, None),
            (1000, 1, n("cuMemcpyHtoD_v2")),
            (1500, 2, None),
            (2000, 3, n("cuMemcpyHtoD_v2")),
        ]
    );
    let ps = packets(s.get_ref());
    let th = ps
        .iter()
        .filter_map(|p| p.track_descriptor.as_ref())
        .find(|d| d.uuid == Some(t))
        .unwrap();
    let td = th.thread.as_ref().unwrap();
    assert_eq!(
        (td.pid, td.tid, td.thread_name.as_deref()),
        (Some(100), Some(101), Some("train"))
    );
    assert_eq!(th.parent_uuid, Some(process_track(100)));
    assert_eq!(s.stats.events, 4);
}

#[test]
fn process_exit_forgets_its_tracks_so_a_reused_pid_is_described_again() {
    let mut s = sink();
    s.event(&launch(1, "cuLaunchKernel")).unwrap();
    s.event(&ev(2, 100, "cuLaunchKernel", Body::ProcessExit)).unwrap();
    assert!(s.procs.is_empty());
    s.event(&launch(3, "cuLaunchKernel")).unwrap();
    let descs = packets(s.get_ref())
        .iter()
        .filter(|p| p.track_descriptor.is_some())
        .count();
    assert_eq!(descs, 4);
}

#[test]
fn verdicts_are_written_when_the_class_changes() {
    use crate::analyze::verdict::{Evidence, Verdict};
    let mut s = sink();
    let pv = |class| ProcessVerdict {
        pid: 100,
        comm: "train".into(),
        verdict: Verdict {
            class,
            secondary: None,
            evidence: Evidence::default(),
        },
    };
    s.verdict(10, &pv(Class::LaunchBound)).unwrap();
    s.verdict(20, &pv(Class::LaunchBound)).unwrap();
    s.verdict(30, &pv(Class::GpuBound)).unwrap();
    let got: Vec<_> = events(&packets(s.get_ref()))
        .into_iter()
        .map(|e| (e.0, e.1, e.2, e.3.unwrap()))
        .collect();
    let p = process_track(100);
    assert_eq!(
        got,
        [
            (10, 3, p, "verdict: launch_bound".to_string()),
            (30, 3, p, "verdict: gpu_bound".to_string())
        ]
    );
}

#[test]
fn nvml_samples_are_counters_under_their_gpu() {
    let mut s = sink();
    let sample = crate::nvml::DeviceSample {
        ts_ns: 77,
        device: 0,
        util_gpu: Some(87),
        power_mw: Some(123_500),
        memory_used: Some(1 << 30),
        ..Default::default()
    };
    s.nvml(&Line::Device(sample), None, &[]).unwrap();
    let ps = packets(s.get_ref());
    let tracks: Vec<_> = ps
        .iter()
        .filter_map(|p| p.track_descriptor.as_ref())
        .map(|d| (d.name.clone().unwrap(), d.counter.clone()))
        .collect();
    assert_eq!(tracks[0], ("GPU 0".to_string(), None));
    assert_eq!(tracks[1].0, "GPU utilization");
    assert_eq!(tracks[2].0, "Memory used");
    assert_eq!(tracks[2].1.as_ref().unwrap().unit, Some(UNIT_SIZE_BYTES));
    assert_eq!(tracks[3].0, "Power");
    assert_eq!(tracks[3].1.as_ref().unwrap().unit_name.as_deref(), Some("W"));
    let values: Vec<_> = ps
        .iter()
        .filter_map(|p| p.track_event.as_ref())
        .map(|t| (t.r#type, t.double_counter_value))
        .collect();
    assert_eq!(
        values,
        [
            (Some(4), Some(87.0)),
            (Some(4), Some(1073741824.0)),
            (Some(4), Some(123.5))
        ]
    );
}

/// A trace with every kind of track for the Python decoder's own check
/// (`GPU_OBSERVER_PERFETTO_SAMPLE=FILE cargo test perfetto::tests::sample`).
#[test]
fn sample() {
    let Some(path) = std::env::var_os("GPU_OBSERVER_PERFETTO_SAMPLE") else {
        return;
    };
    let mut s = sink();
    cupti_on(&mut s);
    s.event(&launch(1000, "cuLaunchKernel")).unwrap();
    s.gpu(&kernel(1500, 1600, 7, Some(("cuLaunchKernel", 1000)))).unwrap();
    s.gpu(&kernel(1550, 1650, 7, None)).unwrap();
    let ioctl = rm_control(2100, Some("/dev/nvidiactl".into()));
    s.event(&ioctl).unwrap();
    s.event(&ev(
        2000,
        101,
        "cuMemcpyHtoD_v2",
        Body::Call(Call::returned(spec("cuMemcpyHtoD_v2"), 500)),
    ))
    .unwrap();
    let sample = crate::nvml::DeviceSample {
        ts_ns: 77,
        device: 0,
        util_gpu: Some(87),
        ..Default::default()
    };
    s.nvml(&Line::Device(sample), None, &[]).unwrap();
    std::fs::write(path, s.get_ref()).unwrap();
}
