//! Property tests (proptest) of what observed processes can put in front of the agent:
//! - `decode::decode` never panics, whatever the bytes: arbitrary ones, and records with a
//!   valid header and kind but random, short or truncated payloads;
//! - the pipeline (decode → correlate → JSON lines and a collecting sink → snapshots) never
//!   panics on arbitrary sequences of records of every kind, counts every record exactly once
//!   (decoded events + decode errors = records; every event reaches the sinks), and keeps its
//!   state within the `--memory-limit-mb` budget (exited processes, live allocations, kernel
//!   names).
//!
//! Which fields are arbitrary: what the observed process controls (call arguments, values read
//! through its out-pointers, kernel names, `comm`, ioctl fd/cmd/arg, and every field of a CUPTI
//! record, which its injection library writes). Fields the kernel fills in (the header's
//! timestamp, pid and tid, call durations, ioctl counts) come from realistic ranges, except in
//! the decode properties, where every byte is arbitrary.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a panic is the test failing"
)]

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Result;
use gpu_observer::{
    correlate::{Correlator, cupti_join::GpuActivity},
    decode::{Body, Event, decode},
    export::{
        Sink,
        jsonl::{JsonlSink, JsonlWriter},
    },
    nvml,
    pipeline::Pipeline,
    snapshot::{Publisher, Snapshot},
};
use gpu_observer_common::{
    api::{self, API_COUNT},
    cupti::GpuRecord,
    event::{
        CallEvent, EventHeader, EventKind, GpuEvent, GpuNameEvent, IoctlEvent, LaunchEvent, NAME_LEN, NameEvent,
        call_flags,
    },
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Records as the ring holds them.

fn bytes_of<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: viewing a plain #[repr(C)] record of integers as its bytes, as the ring holds it.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }.to_vec()
}

fn name_field(name: &[u8]) -> [u8; NAME_LEN] {
    let mut f = [0u8; NAME_LEN];
    let n = name.len().min(NAME_LEN);
    f[..n].copy_from_slice(&name[..n]);
    f
}

#[derive(Clone, Debug)]
struct Hdr {
    api: u32,
    pid: u32,
    tid: u32,
    ts_ns: u64,
    comm: [u8; 16],
}

impl Hdr {
    fn header(&self, kind: EventKind) -> EventHeader {
        EventHeader {
            kind: kind as u32,
            api: self.api,
            pid: self.pid,
            tid: self.tid,
            ts_ns: self.ts_ns,
            comm: self.comm,
        }
    }
}

#[derive(Clone, Debug)]
struct CallFields {
    args: [u64; 6],
    out: [u64; 2],
    duration_ns: u64,
    ioctl_ns: u64,
    ioctl_count: u32,
    result: u32,
    nested: u32,
    read_errors: u32,
    abandoned: bool,
}

impl CallFields {
    fn event(&self, hdr: EventHeader) -> CallEvent {
        CallEvent {
            hdr,
            args: self.args,
            out: self.out,
            duration_ns: self.duration_ns,
            ioctl_ns: self.ioctl_ns,
            ioctl_count: self.ioctl_count,
            result: self.result,
            nested: self.nested,
            read_errors: self.read_errors,
            flags: if self.abandoned { call_flags::ABANDONED } else { 0 },
            _pad: 0,
        }
    }
}

/// One ring-buffer record of any kind.
#[derive(Clone, Debug)]
enum Rec {
    Launch {
        hdr: Hdr,
        function: u64,
        stream: u64,
        grid: [u32; 3],
        block: [u32; 3],
        shared_mem_bytes: u32,
        read_errors: u32,
    },
    Call {
        hdr: Hdr,
        call: CallFields,
    },
    Name {
        hdr: Hdr,
        call: CallFields,
        name: Vec<u8>,
    },
    Ioctl {
        hdr: Hdr,
        fd: u32,
        cmd: u32,
        arg: u64,
        duration_ns: u64,
        ret: i64,
        parent_api: u32,
    },
    Exit {
        hdr: Hdr,
    },
    Gpu {
        hdr: Hdr,
        rec: GpuRecord,
    },
    GpuName {
        hdr: Hdr,
        key: u64,
        name: Vec<u8>,
    },
    /// A record of the kinds above cut short, or bytes that are no record at all.
    Raw(Vec<u8>),
}

impl Rec {
    fn encode(&self) -> Vec<u8> {
        match self {
            Rec::Launch {
                hdr,
                function,
                stream,
                grid,
                block,
                shared_mem_bytes,
                read_errors,
            } => bytes_of(&LaunchEvent {
                hdr: hdr.header(EventKind::Launch),
                function: *function,
                stream: *stream,
                grid: *grid,
                block: *block,
                shared_mem_bytes: *shared_mem_bytes,
                read_errors: *read_errors,
            }),
            Rec::Call { hdr, call } => bytes_of(&call.event(hdr.header(EventKind::Call))),
            Rec::Name { hdr, call, name } => bytes_of(&NameEvent {
                call: call.event(hdr.header(EventKind::Name)),
                name: name_field(name),
            }),
            Rec::Ioctl {
                hdr,
                fd,
                cmd,
                arg,
                duration_ns,
                ret,
                parent_api,
            } => bytes_of(&IoctlEvent {
                hdr: hdr.header(EventKind::Ioctl),
                arg: *arg,
                duration_ns: *duration_ns,
                ret: *ret,
                fd: *fd,
                cmd: *cmd,
                parent_api: *parent_api,
                _pad: 0,
            }),
            Rec::Exit { hdr } => bytes_of(&hdr.header(EventKind::ProcessExit)),
            Rec::Gpu { hdr, rec } => bytes_of(&GpuEvent {
                hdr: hdr.header(EventKind::Gpu),
                rec: *rec,
            }),
            Rec::GpuName { hdr, key, name } => bytes_of(&GpuNameEvent {
                hdr: hdr.header(EventKind::GpuName),
                key: *key,
                name: name_field(name),
            }),
            Rec::Raw(b) => b.clone(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Strategies.

/// Values that make records meet: the same few addresses, sizes and handles come up again
/// (allocations are freed, copies land in them, handles are named and launched), with extremes
/// and now and then anything.
fn pooled() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => prop::sample::select(vec![
            0u64,
            1,
            16,
            4096,
            0x1000,
            0x1800,
            0x2000,
            0x7f10_0000_0000,
            0x7f10_0000_1000,
            1 << 20,
            1 << 40,
            u64::MAX - 1,
            u64::MAX,
        ]),
        1 => any::<u64>(),
    ]
}

/// A comm as a process may set it: any bytes, often a plain name.
fn comm() -> impl Strategy<Value = [u8; 16]> {
    prop_oneof![
        3 => Just(*b"train\0\0\0\0\0\0\0\0\0\0\0"),
        1 => any::<[u8; 16]>(),
    ]
}

/// A header as the kernel writes it: a few processes (so their records meet), their threads,
/// CLOCK_MONOTONIC timestamps; the API id any valid one, 0, or out of the table.
fn hdr(pids: u32) -> impl Strategy<Value = Hdr> {
    (
        prop_oneof![8 => 1..=API_COUNT as u32, 1 => Just(0u32), 1 => (API_COUNT as u32 + 1)..u32::MAX],
        1..=pids,
        0u32..3,
        0u64..(1 << 50),
        comm(),
    )
        .prop_map(|(api, pid, thread, ts_ns, comm)| Hdr {
            api,
            pid,
            tid: pid * 100 + thread,
            ts_ns,
            comm,
        })
}

fn call_fields() -> impl Strategy<Value = CallFields> {
    (
        prop::array::uniform6(pooled()),
        prop::array::uniform2(pooled()),
        0u64..(1 << 40),
        0u64..(1 << 40),
        0u32..1000,
        prop_oneof![4 => Just(0u32), 1 => any::<u32>()],
        0u32..8,
        0u32..16,
        prop::bool::weighted(0.1),
    )
        .prop_map(
            |(args, out, duration_ns, ioctl_ns, ioctl_count, result, nested, read_errors, abandoned)| CallFields {
                args,
                out,
                duration_ns,
                ioctl_ns,
                ioctl_count,
                result,
                nested,
                read_errors,
                abandoned,
            },
        )
}

/// Kernel names: mangled C++ (valid or not), plain, long, not UTF-8, without a NUL.
fn kernel_name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(b"_Z9scale_vecPffj".to_vec()),
        Just(b"_ZN3foo6kernelIfEEvPT_i".to_vec()),
        "_Z[0-9A-Za-z_]{0,40}".prop_map(String::into_bytes),
        "[a-z_]{1,20}".prop_map(String::into_bytes),
        prop::collection::vec(any::<u8>(), 0..1100),
    ]
}

/// GPU records as an injection library (untrusted: it runs in the observed process) writes
/// them: every field arbitrary, the ones the join keys on from small sets so joins happen.
fn gpu_record(wild: bool) -> impl Strategy<Value = GpuRecord> {
    let times = if wild {
        (any::<u64>(), any::<u64>()).boxed()
    } else {
        (0u64..(1 << 50), 0u64..(1 << 40)).prop_map(|(s, d)| (s, s + d)).boxed()
    };
    let bytes = if wild {
        pooled().boxed()
    } else {
        (0u64..(1 << 40)).boxed()
    };
    // Launch geometry as CUDA allows it (blocks of at most 1024 threads, 255 registers, shared
    // memory under 1 MiB), or anything.
    let shape = if wild {
        (any::<[i32; 3]>(), any::<[i32; 3]>(), any::<[u32; 4]>()).boxed()
    } else {
        (
            prop::array::uniform3(0i32..(1 << 20)),
            prop::array::uniform3(0i32..1025),
            (0u32..256, 0u32..(1 << 20), 0u32..(1 << 20), any::<u32>()).prop_map(|(a, b, c, d)| [a, b, c, d]),
        )
            .boxed()
    };
    (
        (0u32..9, 0u32..6, times, 0u32..4, 0u32..100),
        (
            prop_oneof![Just(307u32), Just(276), Just(305), Just(211), any::<u32>()],
            any::<u32>(),
            shape,
        ),
        (
            bytes,
            prop::sample::select(vec![0u64, 1, 2, 0xdead]),
            any::<u32>(),
            any::<[u16; 2]>(),
        ),
        prop::array::uniform8(prop_oneof![3 => 0u64..8, 1 => any::<u64>()]),
    )
        .prop_map(
            |(
                (kind, correlation_id, (start_ns, end_ns), device, thread),
                (cbid, result, (grid, block, more)),
                (bytes, name_key, copy_kind, kinds),
                aux,
            )| GpuRecord {
                kind,
                correlation_id,
                start_ns,
                end_ns,
                device,
                context: 1,
                stream: 7,
                tid: thread,
                cbid,
                result,
                grid,
                block,
                registers_per_thread: more[0],
                static_shared_mem: more[1],
                dynamic_shared_mem: more[2],
                graph_id: more[3],
                bytes,
                name_key,
                copy_kind,
                src_kind: kinds[0],
                dst_kind: kinds[1],
                aux,
            },
        )
}

/// Sizes as a program could pass them and the driver accept: byte and element counts,
/// widths, heights and pitches under 2^24 (a 2D memset's product stays under 2^50 bytes; see
/// `wild`).
fn bound_sizes(api: u32, call: &mut CallFields) {
    let Some(spec) = api::by_id(api) else { return };
    for n in [spec.bytes_arg, spec.height_arg] {
        if let Some(a) = call.args.get_mut(usize::from(n)) {
            *a &= 0xff_ffff;
        }
    }
    call.out[1] &= 0xff_ffff;
}

/// A record of any kind from `pids` processes. `wild`: sizes and GPU times as anything a
/// process could write (byte counts near 2^64, GPU intervals of centuries), which the agent's
/// counters overflow on (see `overflow_*` below); otherwise sizes under 2^24 and GPU
/// intervals under 2^40 ns (~18 minutes).
fn rec(pids: u32, wild: bool) -> impl Strategy<Value = Rec> {
    let launch = (
        hdr(pids),
        pooled(),
        pooled(),
        any::<[u32; 3]>(),
        any::<[u32; 3]>(),
        any::<u32>(),
        0u32..16,
    )
        .prop_map(
            |(hdr, function, stream, grid, block, shared_mem_bytes, read_errors)| Rec::Launch {
                hdr,
                function,
                stream,
                grid,
                block,
                shared_mem_bytes,
                read_errors,
            },
        );
    let ioctl = (
        hdr(pids),
        0u32..8,
        prop_oneof![Just(0xc020_462au32), Just(0xc030_462b), Just(0x25), any::<u32>()],
        any::<u64>(),
        0u64..(1 << 40),
        any::<i64>(),
        prop_oneof![3 => Just(0u32), 1 => 1..=API_COUNT as u32, 1 => any::<u32>()],
    )
        .prop_map(|(hdr, fd, cmd, arg, duration_ns, ret, parent_api)| Rec::Ioctl {
            hdr,
            fd,
            cmd,
            arg,
            duration_ns,
            ret,
            parent_api,
        });
    prop_oneof![
        3 => launch,
        6 => (hdr(pids), call_fields()).prop_map(move |(hdr, mut call)| {
            if !wild {
                bound_sizes(hdr.api, &mut call);
            }
            Rec::Call { hdr, call }
        }),
        2 => (hdr(pids), call_fields(), kernel_name()).prop_map(move |(hdr, mut call, name)| {
            if !wild {
                bound_sizes(hdr.api, &mut call);
            }
            Rec::Name { hdr, call, name }
        }),
        2 => ioctl,
        1 => hdr(pids).prop_map(|hdr| Rec::Exit { hdr }),
        3 => (hdr(pids), gpu_record(wild)).prop_map(|(hdr, rec)| Rec::Gpu { hdr, rec }),
        1 => (hdr(pids), prop::sample::select(vec![0u64, 1, 2, 0xdead]), kernel_name())
            .prop_map(|(hdr, key, name)| Rec::GpuName { hdr, key, name }),
        1 => prop::collection::vec(any::<u8>(), 0..256).prop_map(Rec::Raw),
    ]
}

// ---------------------------------------------------------------------------------------------
// A pipeline to feed.

#[derive(Default)]
struct Seen {
    events: u64,
    gpu: u64,
    leak_reports: u64,
}

struct Counting(Arc<Mutex<Seen>>);

impl Sink for Counting {
    fn describe(&self) -> String {
        "the test's counter".into()
    }

    fn event(&mut self, _ev: &Event) -> Result<()> {
        self.0.lock().unwrap().events += 1;
        Ok(())
    }

    fn gpu(&mut self, _a: &GpuActivity) -> Result<()> {
        self.0.lock().unwrap().gpu += 1;
        Ok(())
    }

    fn leaks(&mut self, _r: &gpu_observer::export::LeakReport<'_>) -> Result<()> {
        self.0.lock().unwrap().leak_reports += 1;
        Ok(())
    }
}

/// The smallest budget there is (`--memory-limit-mb 1`: the tables get their 4 MiB minimum).
const LIMIT_MB: u64 = 1;

/// Feeds `records` through a pipeline with the JSON-lines sink (to nowhere) and a counter,
/// ticking its timers now and then, and finishes it.
fn run(records: &[Vec<u8>], trace_all: bool) -> (Arc<Snapshot>, Seen) {
    let corr = Correlator::new(100_000).with_memory_limit_mb(LIMIT_MB, 4096);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let sinks: Vec<Box<dyn Sink>> = vec![
        Box::new(JsonlSink {
            writer: JsonlWriter::new(std::io::sink(), 100_000, trace_all),
            dest: "nowhere".into(),
        }),
        Box::new(Counting(seen.clone())),
    ];
    let hub = nvml::Hub::new(nvml::State::Off, Duration::from_millis(100), None);
    let (publisher, _snapshots) = Publisher::new(hub.view());
    let mut pipe = Pipeline::new(corr, sinks, hub, None, publisher, Default::default(), 0);
    let mut now = 0u64;
    for (i, r) in records.iter().enumerate() {
        pipe.record(r).unwrap();
        if i % 37 == 36 {
            pipe.end_batch().unwrap();
            now += 700_000_000;
            pipe.tick(now, false).unwrap();
        }
    }
    let (_sinks, snap) = pipe.finish(now + 1).unwrap();
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    (snap, seen)
}

/// What every run must keep: each record counted once, each event handed to the sinks, the
/// tables within the budget.
fn check_invariants(records: &[Vec<u8>], snap: &Snapshot, seen: &Seen) -> Result<(), TestCaseError> {
    let decoded = records.iter().filter(|r| decode(r).is_ok()).count() as u64;
    prop_assert_eq!(snap.events, decoded);
    prop_assert_eq!(snap.decode_errors, records.len() as u64 - decoded);
    prop_assert_eq!(seen.events, decoded, "every event reaches the sinks");
    let b = &snap.budget;
    prop_assert_eq!(b.limit_mb, LIMIT_MB);
    let exited = snap.procs.iter().filter(|p| p.exited).count();
    prop_assert!(
        exited <= b.exited,
        "{} exited processes kept, budget {}",
        exited,
        b.exited
    );
    let live: u64 = snap
        .procs
        .iter()
        .filter(|p| !p.exited)
        .map(|p| p.stats.live_allocs)
        .sum();
    prop_assert!(live <= b.allocs, "{} live allocations, budget {}", live, b.allocs);
    prop_assert_eq!(snap.forgotten, snap.evicted.processes);
    let per_process: u64 = snap.procs.iter().map(|p| p.stats.events).sum();
    if snap.forgotten == 0 {
        prop_assert_eq!(per_process, decoded, "each event is one process's");
    } else {
        prop_assert!(per_process < decoded);
    }
    for p in &snap.procs {
        let s = &p.stats;
        let calls: u64 = s.call_apis.values().sum();
        prop_assert!(s.launches + calls + s.ioctls.count <= s.events);
        prop_assert_eq!(s.launch_apis.values().sum::<u64>(), s.launches);
        prop_assert!(
            s.named_launches + s.unresolved_launches <= s.launches,
            "pid {}: {} launches, {} named, {} unresolved",
            p.pid,
            s.launches,
            s.named_launches,
            s.unresolved_launches
        );
        prop_assert!(s.failed_calls + s.abandoned_calls <= calls);
        if !p.exited {
            prop_assert_eq!(p.leaks.iter().map(|l| l.count).sum::<u64>(), s.live_allocs);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// decode

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decode_never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn decode_never_panics_on_valid_headers_with_random_payloads(
        kind in 1..EventKind::COUNT,
        api in prop_oneof![1..=API_COUNT as u32, Just(0u32), any::<u32>()],
        head in any::<[u8; 32]>(),
        payload in prop::collection::vec(any::<u8>(), 0..1300),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = Vec::with_capacity(40 + payload.len());
        bytes.extend_from_slice(&kind.to_le_bytes());
        bytes.extend_from_slice(&api.to_le_bytes());
        bytes.extend_from_slice(&head);
        bytes.extend_from_slice(&payload);
        let whole = decode(&bytes);
        // Cut anywhere: never a panic, and a record shorter than its kind's struct is an error.
        let len = cut.index(bytes.len() + 1);
        let _ = decode(&bytes[..len]);
        if len < std::mem::size_of::<EventHeader>() {
            prop_assert!(decode(&bytes[..len]).is_err());
        }
        if let Ok(ev) = whole {
            prop_assert_eq!(ev.api.map(|a| a.name), api::by_id(api).map(|a| a.name));
        }
    }

    #[test]
    fn decode_never_panics_on_records_of_every_kind_cut_short(r in rec(4, true), cut in any::<prop::sample::Index>()) {
        let bytes = r.encode();
        let _ = decode(&bytes);
        let len = cut.index(bytes.len() + 1);
        let short = decode(&bytes[..len]);
        if len < bytes.len() && !matches!(r, Rec::Raw(_)) {
            prop_assert!(short.is_err(), "a truncated record decoded: {:?}", short);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// correlate, through the pipeline

/// `default` cases, or `GPU_OBSERVER_PROPTEST_CASES` of them: a longer search than CI's, run by
/// hand after a failure CI found (proptest's own `PROPTEST_CASES` does not override a
/// `with_cases`).
fn cases(default: u32) -> u32 {
    std::env::var("GPU_OBSERVER_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(300)))]

    #[test]
    fn the_pipeline_never_panics_and_counts_every_record_once(
        records in prop::collection::vec(rec(6, false), 0..400),
        trace_all in any::<bool>(),
    ) {
        let bytes: Vec<Vec<u8>> = records.iter().map(Rec::encode).collect();
        let (snap, seen) = run(&bytes, trace_all);
        check_invariants(&bytes, &snap, &seen)?;
    }

    #[test]
    fn many_processes_coming_and_going_stay_within_the_exited_budget(
        records in prop::collection::vec(
            prop_oneof![3 => rec(60, false), 1 => hdr(60).prop_map(|hdr| Rec::Exit { hdr })],
            0..600,
        ),
    ) {
        // 60 processes, one record in 4 an exit: more exited processes than the budget keeps.
        let bytes: Vec<Vec<u8>> = records.iter().map(Rec::encode).collect();
        let (snap, seen) = run(&bytes, true);
        check_invariants(&bytes, &snap, &seen)?;
        let mut exited: Vec<u32> = records
            .iter()
            .zip(&bytes)
            .filter(|(r, b)| matches!(r, Rec::Exit { .. }) && decode(b).is_ok())
            .map(|(r, _)| match r { Rec::Exit { hdr } => hdr.pid, _ => unreachable!() })
            .collect();
        exited.sort_unstable();
        exited.dedup();
        if exited.len() > snap.budget.exited {
            prop_assert!(snap.forgotten > 0, "{} processes exited, none forgotten", exited.len());
        }
    }
}

fn call(name: &str, pid: u32, ts_ns: u64, args: [u64; 6], out: [u64; 2]) -> Vec<u8> {
    timed_call(name, pid, ts_ns, args, out, 1000, *b"flood\0\0\0\0\0\0\0\0\0\0\0")
}

/// A call of `name` by pid (its main thread) that returned success after `duration_ns`.
fn timed_call(
    name: &str,
    pid: u32,
    ts_ns: u64,
    args: [u64; 6],
    out: [u64; 2],
    duration_ns: u64,
    comm: [u8; 16],
) -> Vec<u8> {
    let hdr = Hdr {
        api: api::id_of(name).unwrap(),
        pid,
        tid: pid,
        ts_ns,
        comm,
    };
    let fields = CallFields {
        args,
        out,
        duration_ns,
        ioctl_ns: 0,
        ioctl_count: 0,
        result: 0,
        nested: 0,
        read_errors: 0,
        abandoned: false,
    };
    Rec::Call { hdr, call: fields }.encode()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    #[test]
    fn allocation_floods_stay_within_the_allocation_budget(
        pids in 1u32..5,
        per_pid in 3500u64..5000,
        size in 1u64..(1 << 30),
    ) {
        // cuMemAlloc_v2 (address from the out-pointer) never freed, from a few processes.
        let mut records = Vec::new();
        for pid in 1..=pids {
            for i in 0..per_pid {
                let addr = 0x7f00_0000_0000 + i * 0x1_0000_0000 / 4096 * 4096 + u64::from(pid);
                records.push(call("cuMemAlloc_v2", pid, i, [0x7ffd_0000, size, 0, 0, 0, 0], [addr, 0]));
            }
        }
        let (snap, seen) = run(&records, false);
        check_invariants(&records, &snap, &seen)?;
        let live: u64 = snap.procs.iter().map(|p| p.stats.live_allocs).sum();
        let made = u64::from(pids) * per_pid;
        prop_assert_eq!(live, made.min(snap.budget.allocs));
        prop_assert_eq!(snap.evicted.allocations, made.saturating_sub(snap.budget.allocs));
        let allocs: u64 = snap.procs.iter().map(|p| p.stats.allocs.count).sum();
        prop_assert_eq!(allocs, made, "every allocation counted, remembered or not");
    }

    #[test]
    fn kernel_name_floods_stay_within_the_name_budget(
        count in 700u64..1600,
        len in 500usize..1000,
    ) {
        // cuModuleGetFunction naming `count` handles with distinct `len`-byte names (not C++:
        // the demangled name is the name), then a launch of each handle: those that launch
        // named are the names remembered.
        let mut records = Vec::new();
        let spec = api::id_of("cuModuleGetFunction").unwrap();
        for i in 0..count {
            let mut name = format!("k{i:09}").into_bytes();
            name.resize(len, b'x');
            let hdr = Hdr { api: spec, pid: 1, tid: 1, ts_ns: i, comm: *b"names\0\0\0\0\0\0\0\0\0\0\0" };
            let call = CallFields {
                args: [0x7ffd_0000, 0x40d, 0x7ffd_1000, 0, 0, 0],
                out: [0x1_0000 + i, 0],
                duration_ns: 100,
                ioctl_ns: 0,
                ioctl_count: 0,
                result: 0,
                nested: 0,
                read_errors: 0,
                abandoned: false,
            };
            records.push(Rec::Name { hdr, call, name }.encode());
        }
        let launch = api::id_of("cuLaunchKernel").unwrap();
        for i in 0..count {
            let hdr = Hdr { api: launch, pid: 1, tid: 1, ts_ns: count + i, comm: *b"names\0\0\0\0\0\0\0\0\0\0\0" };
            records.push(Rec::Launch { hdr, function: 0x1_0000 + i, stream: 0, grid: [1; 3], block: [1; 3], shared_mem_bytes: 0, read_errors: 0 }.encode());
        }
        let (snap, seen) = run(&records, false);
        check_invariants(&records, &snap, &seen)?;
        let s = &snap.procs[0].stats;
        // What a remembered name costs (correlate's NAME_OVERHEAD + both strings).
        let cost = 96 + 2 * len as u64;
        prop_assert!(s.named_launches * cost <= snap.budget.name_bytes,
            "{} names of {} bytes remembered, budget {} bytes", s.named_launches, cost, snap.budget.name_bytes);
        prop_assert_eq!(s.named_launches, (snap.budget.name_bytes / cost).min(count));
        prop_assert_eq!(s.named_launches + snap.evicted.kernel_names, count);
        prop_assert_eq!(s.named_launches + s.unresolved_launches, count);
    }
}

/// An anomaly line as a sink sees it: what was slow, the start of the call it points at, and
/// whether it is that call's last finding.
type FlagLine = (&'static str, u64, bool);

struct Flags(Arc<Mutex<Vec<FlagLine>>>);

impl Sink for Flags {
    fn describe(&self) -> String {
        "the test's anomaly lines".into()
    }

    fn event(&mut self, _ev: &Event) -> Result<()> {
        Ok(())
    }

    fn gpu(&mut self, _a: &GpuActivity) -> Result<()> {
        Ok(())
    }

    fn anomaly(&mut self, a: &gpu_observer::export::AnomalyLine<'_>) -> Result<()> {
        let at = match a.flagged {
            gpu_observer::export::Flagged::Event(e) => e.ts_ns,
            gpu_observer::export::Flagged::Gpu(g) => g.rec.start_ns,
        };
        assert_eq!(at, a.ts_ns, "the line's time is its call's");
        self.0.lock().unwrap().push((a.finding.what.kind(), at, a.last));
        Ok(())
    }
}

/// A pipeline with only the [`Flags`] sink, fed `records` and one end of batch; the lines it
/// will have.
fn flagging(records: &[Vec<u8>]) -> (Pipeline, Arc<Mutex<Vec<FlagLine>>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let corr = Correlator::new(100_000).with_memory_limit_mb(LIMIT_MB, 4096);
    let hub = nvml::Hub::new(nvml::State::Off, Duration::from_millis(100), None);
    let (publisher, _snapshots) = Publisher::new(hub.view());
    let sinks: Vec<Box<dyn Sink>> = vec![Box::new(Flags(lines.clone()))];
    let mut pipe = Pipeline::new(corr, sinks, hub, None, publisher, Default::default(), 0);
    for r in records {
        pipe.record(r).unwrap();
    }
    pipe.end_batch().unwrap();
    (pipe, lines)
}

#[test]
fn anomaly_lines_point_at_the_flagged_call_and_mark_its_last_finding() {
    let timed = |name: &str, ts_ns: u64, args: [u64; 6], duration_ns: u64| {
        timed_call(
            name,
            1,
            ts_ns,
            args,
            [0; 2],
            duration_ns,
            *b"steady\0\0\0\0\0\0\0\0\0\0",
        )
    };
    let copy = |ts_ns, duration_ns| {
        timed(
            "cuMemcpyHtoD_v2",
            ts_ns,
            [0x7f20_0000_0000, 0x7ffd_0000, 1 << 20, 0, 0, 0],
            duration_ns,
        )
    };
    let sync = |ts_ns, duration_ns| timed("cuStreamSynchronize", ts_ns, [0x51, 0, 0, 0, 0, 0], duration_ns);
    // 40 steady copies and syncs (past the 32-value warm-up), then a copy 100× slower — slower
    // in the call and in bandwidth: two findings — and a sync 100× slower: one.
    let mut records = Vec::new();
    for i in 0..40 {
        records.push(copy(10 * i, 1_000));
        records.push(sync(10 * i + 5, 1_000));
    }
    records.push(copy(1_000, 100_000));
    records.push(sync(2_000, 100_000));
    let (_pipe, lines) = flagging(&records);
    assert_eq!(
        *lines.lock().unwrap(),
        [
            ("call", 1_000, false),
            ("bandwidth", 1_000, true),
            ("call", 2_000, true)
        ]
    );
}

#[test]
fn launches_read_their_names_not_the_events_they_came_with() {
    // A sanity check of the encoder the properties use: a named handle launches named.
    let spec = api::id_of("cuModuleGetFunction").unwrap();
    let hdr = Hdr {
        api: spec,
        pid: 3,
        tid: 3,
        ts_ns: 1,
        comm: *b"enc\0\0\0\0\0\0\0\0\0\0\0\0\0",
    };
    let call = CallFields {
        args: [0x7ffd_0000, 0x40d, 0x7ffd_1000, 0, 0, 0],
        out: [0xf1, 0],
        duration_ns: 100,
        ioctl_ns: 0,
        ioctl_count: 0,
        result: 0,
        nested: 0,
        read_errors: 0,
        abandoned: false,
    };
    let named = Rec::Name {
        hdr: hdr.clone(),
        call,
        name: b"_Z9scale_vecPffj".to_vec(),
    }
    .encode();
    let launch = Rec::Launch {
        hdr: Hdr {
            api: api::id_of("cuLaunchKernel").unwrap(),
            ts_ns: 2,
            ..hdr
        },
        function: 0xf1,
        stream: 0,
        grid: [1; 3],
        block: [1; 3],
        shared_mem_bytes: 0,
        read_errors: 0,
    }
    .encode();
    let Body::Call(c) = decode(&named).unwrap().body else {
        panic!("not a call")
    };
    assert_eq!((c.handle, c.name.as_deref()), (Some(0xf1), Some("_Z9scale_vecPffj")));
    let (snap, _) = run(&[named, launch], true);
    assert_eq!(snap.procs[0].stats.named_launches, 1);
}

// ---------------------------------------------------------------------------------------------
// What the properties found (fixed; these keep them fixed): sizes and GPU times an observed
// process controls overflowed the agent's counters. A panic on the reader thread stops the
// agent ("ring reader thread panicked"); with overflow checks off (release builds) the additions
// wrapped and the totals were wrong, and the occupancy division by zero panicked in release
// builds too. Totals now saturate, and occupancy's arithmetic does.

/// GPU records as a process's injection library (or the process itself, calling the hook)
/// hands them over.
fn gpu(pid: u32, ts_ns: u64, rec: GpuRecord) -> Vec<u8> {
    let hdr = Hdr {
        api: 0,
        pid,
        tid: pid,
        ts_ns,
        comm: *b"cupti\0\0\0\0\0\0\0\0\0\0\0",
    };
    Rec::Gpu { hdr, rec }.encode()
}

/// An H100's attributes (tests/fixtures/README.md, "Devices").
fn h100() -> GpuRecord {
    GpuRecord {
        kind: 5,
        device: 0,
        aux: [132, 2048, 32, 65536, 233_472, 1024, 32, 90],
        ..GpuRecord::default()
    }
}

fn kernel(correlation_id: u32, start_ns: u64, end_ns: u64, block: [i32; 3], registers: u32) -> GpuRecord {
    GpuRecord {
        kind: 2,
        correlation_id,
        start_ns,
        end_ns,
        device: 0,
        grid: [1; 3],
        block,
        registers_per_thread: registers,
        name_key: 1,
        ..GpuRecord::default()
    }
}

#[test]
fn overflow_copy_bytes_from_the_call_arguments() {
    // Minimal case proptest found: two copies whose ByteCount adds up past 2^64 (the driver
    // refuses such a copy; the agent counts it anyway). Debug: "attempt to add with overflow"
    // at correlate/mod.rs (Amount::add); release: the bytes wrap.
    let copy = |bytes| call("cuMemcpyDtoHAsync_v2", 1, 0, [0, 0, bytes, 0, 0, 0], [0, 0]);
    let records = [copy(1), copy(u64::MAX)];
    let (snap, _) = run(&records, true);
    assert_eq!(snap.procs[0].stats.copy(api::Direction::GpuToCpu).bytes, u64::MAX);
}

#[test]
fn overflow_gpu_time_from_cupti_records() {
    // Two kernel records whose GPU intervals add up past 2^64 ns. Debug: "attempt to add with
    // overflow" at cupti_join.rs (`s.kernel_ns += dur`; likewise memcpy_ns, memset_ns).
    let records = [
        gpu(1, 1, kernel(1, 0, u64::MAX, [1; 3], 0)),
        gpu(1, 2, kernel(2, 0, 1, [1; 3], 0)),
    ];
    let (snap, _) = run(&records, true);
    let g = snap.procs[0].gpu.as_ref().unwrap();
    assert_eq!((g.stats.kernels, g.stats.kernel_ns), (2, u64::MAX));
}

#[test]
fn overflow_kernel_block_size_from_cupti_records() {
    // A kernel record of block 2^31-1 × 2^31-1 × 2^31-1 after a device record. Debug:
    // "attempt to multiply with overflow" in the product of the block's dimensions.
    let records = [gpu(1, 1, h100()), gpu(1, 2, kernel(1, 10, 20, [i32::MAX; 3], 32))];
    let (snap, _) = run(&records, true);
    assert_eq!(snap.procs[0].gpu.as_ref().unwrap().stats.kernels, 1);
}

#[test]
fn occupancy_of_a_forged_block_size_divides_by_zero() {
    // Block 2^30 × 2^30 × 2 (2^61 threads: 2^56 warps), 8 registers a thread (256 a warp):
    // 256 × 2^56 = 2^64. Debug: "attempt to multiply with overflow" in Device::occupancy;
    // release: the product wraps to 0 and `registers_per_sm / 0` panics ("attempt to divide by
    // zero"), on the reader thread: the agent stops.
    let records = [
        gpu(1, 1, h100()),
        gpu(1, 2, kernel(1, 10, 20, [1 << 30, 1 << 30, 2], 8)),
    ];
    let (snap, _) = run(&records, true);
    assert_eq!(snap.procs[0].gpu.as_ref().unwrap().stats.kernels, 1);
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::with_cases(300) })]

    #[test]
        fn the_pipeline_never_panics_on_any_sizes_and_gpu_records(
        records in prop::collection::vec(rec(6, true), 0..400),
    ) {
        let bytes: Vec<Vec<u8>> = records.iter().map(Rec::encode).collect();
        let (snap, seen) = run(&bytes, true);
        check_invariants(&bytes, &snap, &seen)?;
    }
}

#[test]
fn kernels_that_go_out_unjoined_on_the_timer_are_judged_too() {
    // CUPTI kernel records whose launches the probes never saw (a process attached late):
    // they wait for their API records, then the timer sends them out unjoined. 40 of 1 µs and
    // one of 100 µs, all of one name and shape: the slow one is an anomaly all the same.
    let hdr = Hdr {
        api: 0,
        pid: 1,
        tid: 1,
        ts_ns: 0,
        comm: *b"cupti\0\0\0\0\0\0\0\0\0\0\0",
    };
    let mut records = vec![
        Rec::GpuName {
            hdr,
            key: 1,
            name: b"_Z6steadyv".to_vec(),
        }
        .encode(),
    ];
    for i in 0..40u64 {
        records.push(gpu(
            1,
            i,
            kernel(i as u32 + 1, 10_000 * i, 10_000 * i + 1_000, [32, 1, 1], 16),
        ));
    }
    records.push(gpu(1, 40, kernel(41, 500_000, 600_000, [32, 1, 1], 16)));
    let (mut pipe, lines) = flagging(&records);
    assert!(lines.lock().unwrap().is_empty(), "nothing judged before they go out");
    pipe.tick(u64::MAX / 2, true).unwrap();
    assert_eq!(*lines.lock().unwrap(), [("kernel", 500_000, true)]);
}
