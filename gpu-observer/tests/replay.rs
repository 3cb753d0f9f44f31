//! Replays the committed ring-buffer recording of the scripted fake workload
//! (tests/data/README.md, `cargo xtask record-fixture`) through the agent's pipeline — decode →
//! correlate → sinks → snapshots — with no root, no BPF and no /proc, and checks:
//! - what the workload did, counted exactly (derived from its script, tests/fixtures/README.md,
//!   and cross-checked against its own ledger of the calls it made);
//! - that the JSON lines the replay writes are the real observer's, line for line;
//! - the final snapshot's per-process state.
//!
//! What a replay cannot know is taken from the live run's own output, so that the comparison is
//! exact: the device file behind each ioctl's fd and the agent's resident set at its first event
//! (its /proc lookups: a [`Lookup`] answers them from the recorded lines), the time of the final
//! tick (its last `memory` line's `ts_ns`, given to `finish`), and the summary's parts that are
//! not the pipeline's (`wall_ns`, `otlp`, `libraries`). One field is left out of the comparison:
//! the `ts_ns` of `leak` lines, the agent's clock when it handled the batch the exit came in.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test: a panic is the test failing"
)]

use std::{
    collections::{BTreeMap, HashMap},
    io::Write,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Result;
use gpu_observer::{
    attach::Drops,
    correlate::{
        Correlator, CuptiChange, DEFAULT_MEMORY_LIMIT_MB, Leak, Lookup, MemorySample, SyncTarget,
        cupti_join::GpuActivity,
    },
    decode::{Body, Event},
    export::{
        LeakReport, Sink, Summary,
        jsonl::{JsonlSink, JsonlWriter},
    },
    nvml,
    pipeline::{Pipeline, recorded},
    snapshot::{Publisher, Snapshot},
};
use gpu_observer_common::{
    api::{self, Direction, MemKind},
    event::EventKind,
    limits::DEFAULT_RING_BYTES,
};
use serde_json::Value;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data");
const FIXTURE: &str = "fake-workload";
/// The observer's default `--threshold-us` (the fixture was recorded with it).
const THRESHOLD_NS: u64 = 100_000;
/// The correlator's allocator slack (`SLACK_BYTES` in correlate/mod.rs): what `Budget::derive`
/// takes off besides the agent's resident set and twice the ring.
const SLACK_BYTES: u64 = 8 << 20;

fn data(ext: &str) -> Vec<u8> {
    let path = format!("{DATA}/{FIXTURE}.{ext}");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e} (see tests/data/README.md)"))
}

/// The live observer's lines, less its `verdict` lines and the summaries' `verdict`: the main
/// task judges those from its ticks and the processes' CPU time in /proc, which a replay of
/// the ring does not have.
fn recorded_lines() -> Vec<String> {
    String::from_utf8(data("jsonl"))
        .unwrap()
        .lines()
        .filter(|l| parse(l)["type"] != "verdict")
        .map(str::to_owned)
        .collect()
}

fn parse(line: &str) -> Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("bad JSON line {line:?}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// The workload's script (xtask/src/record_fixture.rs SCRIPT) and what it makes, from
// tests/fixtures/README.md and cuda_workload.c.

/// `run 2 2`: threads × rounds.
const THREADS: u64 = 2;
const ROUNDS: u64 = 2;
const RUN_ROUNDS: u64 = THREADS * ROUNDS;
/// `unwind 2 3`: N copies left by longjmp (+ 2 more), 3M calls that return.
const UNWIND_N: u64 = 2;
const UNWIND_M: u64 = 3;
/// `flood_allocs 300 0`: cuMemAllocManaged(4096) never freed.
const FLOOD: u64 = 300;
/// `burst 500`: cuLaunchKernel of a handle never named.
const BURST: u64 = 500;
/// `names`: 3 + 2 + 4 + 1 launches of named handles, 1 of an unnamed one.
const NAMES_NAMED: u64 = 10;
const NAMES_LAUNCHES: u64 = NAMES_NAMED + 1;

/// Per (thread, round) of `run`, by the order of cuda_workload.c's `round_`.
const ROUND_LAUNCHES: u64 = 6;
const ROUND_GRAPH: u64 = 2;
const ROUND_COPIES: u64 = 20;
const ROUND_MEMSETS: u64 = 24;
const ROUND_ALLOCS: u64 = 9;
const ROUND_SYNCS: u64 = 5;
/// cuMemAlloc_v2 issues 2 ioctls, each sync 1.
const ROUND_IOCTLS: u64 = 2 + ROUND_SYNCS;

/// Bytes of copy variant `k` (0..20) in round `i`: 4096·(k+1) + i.
fn copy_bytes(k: u64, i: u64) -> u64 {
    4096 * (k + 1) + i
}

/// Bytes of memset variant `m` (0..24) in round `i` (N elements, or Width × Height, × size).
fn memset_bytes(m: u64, i: u64) -> u64 {
    let n = 1000 * (m + 1) + i;
    let area = (100 + m) * (10 + i);
    let elem = [1, 2, 4, 1, 2, 4][(m as usize % 12) / 2];
    if m < 12 { n * elem } else { area * elem }
}

/// Bytes of the 9 allocations of thread `t`'s round `i`, all freed in the same round.
fn round_alloc_bytes(t: u64, i: u64) -> u64 {
    let pitch = (1000 + i).div_ceil(512) * 512;
    (65536 * (t + 1) + i) // cuMemAlloc_v2
        + 2 * 4096 * (i + 1) // cuMemAllocAsync{,_ptsz}
        + 2 * 8192 * (i + 1) // cuMemAllocFromPoolAsync{,_ptsz}
        + pitch * 4 // cuMemAllocPitch_v2
        + (1 << 20) // cuMemAllocManaged
        + (3000 + i) // cuMemAllocHost_v2
        + (5000 + i) // cuMemHostAlloc
}

/// Sum over every (thread, round) of `run`.
fn over_run(f: impl Fn(u64, u64) -> u64) -> u64 {
    (0..THREADS)
        .flat_map(|t| (0..ROUNDS).map(move |i| (t, i)))
        .map(|(t, i)| f(t, i))
        .sum()
}

/// `directions`: its 12 copies (bytes, direction, inferred from allocations, host side pinned).
const DIRECTIONS: [(u64, Direction, bool, Option<bool>); 12] = [
    (4096, Direction::CpuToGpu, true, Some(true)),
    (4097, Direction::GpuToCpu, true, Some(true)),
    (100, Direction::CpuToGpu, true, Some(false)),
    (200, Direction::GpuToCpu, true, Some(false)),
    (300, Direction::GpuToGpu, true, None),
    (400, Direction::GpuToGpu, true, None),
    (500, Direction::GpuToCpu, true, Some(true)),
    (600, Direction::CpuToGpu, true, Some(false)),
    (700, Direction::CpuToGpu, false, Some(true)),
    (800, Direction::CpuToGpu, false, Some(false)),
    (900, Direction::GpuToCpu, false, Some(true)),
    (64, Direction::Unknown, false, None),
];
/// `directions` allocates 1 MiB device, 1 MiB pinned, registers 64 KiB, 64 KiB managed, then
/// 12345 bytes device it keeps; frees the first two and unregisters.
const DIRECTIONS_ALLOCS: [u64; 5] = [1 << 20, 1 << 20, 1 << 16, 1 << 16, 12345];
const DIRECTIONS_FREED: u64 = (1 << 20) + (1 << 20) + (1 << 16);
/// Its syncs: stream 0x51 ×3, 0x52 ×1, event 0xe1 ×2, the context ×1.
const DIRECTIONS_SYNCS: u64 = 7;
/// Its ioctls: 2 per cuMemAlloc_v2 (2 calls) and 1 per sync.
const DIRECTIONS_IOCTLS: u64 = 2 * 2 + DIRECTIONS_SYNCS;
/// `init`: cuInit (3 ioctls) and cuDevicePrimaryCtxRetain (2).
const INIT_IOCTLS: u64 = 3 + 2;
/// ioctls outside any call: one in `unwind`, two nvidia ones in `ioctl_outside` (its TCGETS is
/// not an nvidia ioctl and not inside a call: not recorded).
const OUTSIDE_IOCTLS: u64 = 1 + 2;

// ---------------------------------------------------------------------------------------------
// The replay.

/// What the pipeline handed a sink.
#[derive(Default)]
struct Collected {
    events: Vec<Event>,
    gpu: usize,
    cupti: usize,
    memory: Vec<(u64, MemorySample, String)>,
    leaks: Vec<(u32, String, bool, Vec<Leak>)>,
    flushes: usize,
    closed: bool,
    summaries: usize,
}

struct TestSink(Arc<Mutex<Collected>>);

impl Sink for TestSink {
    fn describe(&self) -> String {
        "the test's collector".into()
    }

    fn event(&mut self, ev: &Event) -> Result<()> {
        self.0.lock().unwrap().events.push(ev.clone());
        Ok(())
    }

    fn gpu(&mut self, _a: &GpuActivity) -> Result<()> {
        self.0.lock().unwrap().gpu += 1;
        Ok(())
    }

    fn cupti_state(&mut self, _change: &CuptiChange) -> Result<()> {
        self.0.lock().unwrap().cupti += 1;
        Ok(())
    }

    fn memory(&mut self, ts_ns: u64, m: &MemorySample, comm: &str) -> Result<()> {
        self.0.lock().unwrap().memory.push((ts_ns, m.clone(), comm.into()));
        Ok(())
    }

    fn leaks(&mut self, r: &LeakReport<'_>) -> Result<()> {
        self.0
            .lock()
            .unwrap()
            .leaks
            .push((r.pid, r.comm.into(), r.exited, r.leaks.to_vec()));
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        self.0.lock().unwrap().flushes += 1;
        Ok(())
    }

    fn close(&mut self) {
        self.0.lock().unwrap().closed = true;
    }

    fn summary(&mut self, _s: &Summary<'_>) -> Result<()> {
        self.0.lock().unwrap().summaries += 1;
        Ok(())
    }
}

/// Where the replay's JSON lines go.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the live agent looked up in /proc, taken from what it wrote: the device file behind
/// each (pid, fd) of its ioctl lines, and its resident set when the first event came (backed
/// out of the total summary's `memory_budget.tables_bytes`, see `Budget::derive`). Replayed
/// events then get the same ioctl `device` and the same budgets as on the live run.
struct Recorded {
    fds: HashMap<(u32, u32), Arc<str>>,
    resident: u64,
}

impl Recorded {
    fn from(lines: &[String]) -> Self {
        let mut fds = HashMap::new();
        let mut resident = 0;
        for v in lines.iter().map(|l| parse(l)) {
            if v["type"] == "ioctl"
                && let Some(dev) = v["device"].as_str()
            {
                let key = (v["pid"].as_u64().unwrap() as u32, v["fd"].as_u64().unwrap() as u32);
                fds.insert(key, dev.into());
            }
            if v["type"] == "summary" && v["scope"] == "total" {
                let tables = v["memory_budget"]["tables_bytes"].as_u64().unwrap();
                let limit = v["memory_limit_mb"].as_u64().unwrap() << 20;
                resident = limit - tables - 2 * u64::from(DEFAULT_RING_BYTES) - SLACK_BYTES;
            }
        }
        Self { fds, resident }
    }
}

impl Lookup for Recorded {
    fn comm(&self, _pid: u32) -> Option<String> {
        None
    }

    fn fd_target(&self, pid: u32, fd: u32) -> Option<Arc<str>> {
        self.fds.get(&(pid, fd)).cloned()
    }

    fn own_resident_bytes(&self) -> u64 {
        self.resident
    }
}

struct Replay {
    collected: Collected,
    /// The JSON lines written, the summaries included.
    lines: Vec<String>,
    snapshot: Arc<Snapshot>,
}

/// Replays the fixture through a pipeline configured as the recording observer was
/// (`--format jsonl --no-nvml`, default threshold and memory limit; `trace_all` as given),
/// finishing at `end_ns`; the summaries are written with the live run's wall time and the
/// agent's own parts (`otlp`, `libraries`: not the pipeline's) taken from its total line.
fn replay(trace_all: bool, end_ns: u64) -> Replay {
    let lines = recorded_lines();
    let total = parse(lines.last().unwrap());
    let collected = Arc::new(Mutex::new(Collected::default()));
    let out = Shared::default();
    let sinks: Vec<Box<dyn Sink>> = vec![
        Box::new(TestSink(collected.clone())),
        Box::new(JsonlSink {
            writer: JsonlWriter::new(out.clone(), THRESHOLD_NS, trace_all),
            dest: "the test's buffer".into(),
        }),
    ];
    let corr = Correlator::new(THRESHOLD_NS)
        .with_memory_limit_mb(DEFAULT_MEMORY_LIMIT_MB, DEFAULT_RING_BYTES)
        .with_lookup(Box::new(Recorded::from(&lines)));
    let hub = nvml::Hub::new(nvml::State::Off, Duration::from_millis(100), None);
    let (publisher, snapshots) = Publisher::new(hub.view());
    let mut pipe = Pipeline::new(corr, sinks, hub, None, publisher, Default::default(), 0);
    let file = data("rec");
    for rec in recorded(&file).expect("a ring recording") {
        pipe.record(rec).unwrap();
    }
    let (mut sinks, snapshot) = pipe.finish(end_ns).unwrap();
    assert!(
        Arc::ptr_eq(&snapshot, &snapshots.load()),
        "the last snapshot is published"
    );
    let drops = Drops {
        total: 0,
        by_kind: (1..EventKind::COUNT)
            .map(|k| (EventKind::from_u32(k).unwrap(), 0))
            .collect(),
        by_pid_kind: HashMap::new(),
    };
    let agent = [
        ("otlp", total["otlp"].clone()),
        ("libraries", total["libraries"].clone()),
    ];
    let summary = Summary {
        snapshot: &snapshot,
        drops: &drops,
        wall_ns: total["wall_ns"].as_u64().unwrap(),
        unattributed_drops: 0,
        agent: &agent,
        verdicts: &HashMap::new(),
    };
    for s in &mut sinks {
        s.summary(&summary).unwrap();
    }
    drop(sinks);
    let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let collected = std::mem::take(&mut *collected.lock().unwrap());
    Replay {
        collected,
        lines: text.lines().map(str::to_owned).collect(),
        snapshot,
    }
}

/// The live run's last `memory` line's time: its final tick, which the replay's finish is given.
fn final_tick_ns(lines: &[String]) -> u64 {
    lines
        .iter()
        .rev()
        .map(|l| parse(l))
        .find(|v| v["type"] == "memory")
        .expect("a memory line")["ts_ns"]
        .as_u64()
        .unwrap()
}

/// A `leak` line without its `ts_ns`: the live agent's clock when it handled the batch the exit
/// came in (`monotonic_ns()` in the pipeline), which no replay can reproduce.
/// Likewise a process summary's `verdict` (see [`recorded_lines`]).
fn without_leak_time(line: &str) -> String {
    let mut v = parse(line);
    if v["type"] == "leak" {
        v.as_object_mut().unwrap().remove("ts_ns");
        return v.to_string();
    }
    if v["type"] == "summary" && v["scope"] == "process" {
        v.as_object_mut().unwrap().remove("verdict");
        return v.to_string();
    }
    line.to_owned()
}

// ---------------------------------------------------------------------------------------------

#[test]
fn the_fixture_was_recorded_with_the_current_event_abi() {
    use gpu_observer_common::{cupti::GpuRecord, event::*};
    use std::mem::size_of;
    let meta: Value = serde_json::from_slice(&data("meta.json")).unwrap();
    let abi = &meta["abi"];
    let sizes = [
        ("EventHeader", size_of::<EventHeader>()),
        ("LaunchEvent", size_of::<LaunchEvent>()),
        ("CallEvent", size_of::<CallEvent>()),
        ("NameEvent", size_of::<NameEvent>()),
        ("IoctlEvent", size_of::<IoctlEvent>()),
        ("GpuEvent", size_of::<GpuEvent>()),
        ("GpuNameEvent", size_of::<GpuNameEvent>()),
        ("GpuRecord", size_of::<GpuRecord>()),
    ];
    let rerecord = "the event ABI changed since tests/data was recorded: run `cargo xtask record-fixture` as root (tests/data/README.md)";
    for (name, size) in sizes {
        assert_eq!(abi["sizes"][name], size, "{name}: {rerecord}");
    }
    for k in 1..EventKind::COUNT {
        let kind = EventKind::from_u32(k).unwrap();
        assert_eq!(abi["kinds"][format!("{kind:?}")], k, "{kind:?}: {rerecord}");
    }
    let apis: Vec<&str> = api::APIS.iter().map(|a| a.name).collect();
    assert_eq!(abi["apis"], serde_json::json!(apis), "API table: {rerecord}");
    let records = recorded(&data("rec")).unwrap().count() as u64;
    assert_eq!(meta["records"], records);
}

#[test]
fn replay_counts_exactly_what_the_workload_did() {
    let lines = recorded_lines();
    let r = replay(true, final_tick_ns(&lines));
    let c = &r.collected;

    // Events by kind (each record is one event: no decode errors).
    let launches = ROUND_LAUNCHES * RUN_ROUNDS + ROUND_GRAPH * RUN_ROUNDS + NAMES_LAUNCHES + BURST;
    let copies = ROUND_COPIES * RUN_ROUNDS + DIRECTIONS.len() as u64 + (UNWIND_N + 2) + 2 * UNWIND_M;
    let memsets = ROUND_MEMSETS * RUN_ROUNDS;
    let allocs = ROUND_ALLOCS * RUN_ROUNDS + DIRECTIONS_ALLOCS.len() as u64 + FLOOD;
    let frees = ROUND_ALLOCS * RUN_ROUNDS + 3;
    let syncs = ROUND_SYNCS * RUN_ROUNDS + DIRECTIONS_SYNCS + UNWIND_M;
    let ioctls = INIT_IOCTLS + ROUND_IOCTLS * RUN_ROUNDS + DIRECTIONS_IOCTLS + UNWIND_M + OUTSIDE_IOCTLS;
    // names: cuModuleLoadData, cuLibraryLoadData, cuModuleUnload, cuLibraryUnload; and
    // cuModuleGetFunction ×2, cuLibraryGetKernel, cuKernelGetFunction, cuFuncGetName.
    let (modules, symbols, inits, exits) = (4, 5, 2, 1);
    let events = launches + copies + memsets + allocs + frees + syncs + ioctls + modules + symbols + inits + exits;
    assert_eq!(
        (launches, copies, memsets, allocs, frees, syncs, ioctls, events),
        (543, 102, 96, 341, 39, 30, 50, 1213)
    );
    let mut by_kind: BTreeMap<&str, u64> = BTreeMap::new();
    for ev in &c.events {
        let kind = match (&ev.body, ev.api.map(|a| a.family)) {
            (Body::Launch(_), _) => "launch",
            (Body::Ioctl(_), _) => "ioctl",
            (Body::ProcessExit, _) => "process_exit",
            (Body::Call(_), Some(f)) => match f {
                api::Family::Memcpy => "memcpy",
                api::Family::Memset => "memset",
                api::Family::Alloc => "alloc",
                api::Family::Free => "free",
                api::Family::Sync => "sync",
                api::Family::Module => "module",
                api::Family::Symbol => "symbol",
                api::Family::Init => "init",
                other => panic!("a call of family {other:?}"),
            },
            (body, _) => panic!("unexpected event {body:?}"),
        };
        *by_kind.entry(kind).or_default() += 1;
    }
    let expected: BTreeMap<&str, u64> = [
        ("launch", launches),
        ("memcpy", copies),
        ("memset", memsets),
        ("alloc", allocs),
        ("free", frees),
        ("sync", syncs),
        ("ioctl", ioctls),
        ("module", modules),
        ("symbol", symbols),
        ("init", inits),
        ("process_exit", exits),
    ]
    .into();
    assert_eq!(by_kind, expected);
    assert_eq!((c.gpu, c.cupti), (0, 0), "no CUPTI in this fixture");
    assert!(c.closed);
    assert!(c.flushes >= 1, "flushed at the end");
    assert_eq!(c.summaries, 1);

    // One process, every event of it, exited.
    let snap = &r.snapshot;
    assert!(snap.last);
    assert_eq!((snap.events, snap.decode_errors, snap.procs.len()), (events, 0, 1));
    assert_eq!((snap.abandoned, snap.forgotten), (UNWIND_N + 2, 0));
    assert_eq!(snap.evicted, Default::default());
    let p = &snap.procs[0];
    assert_eq!((p.comm.as_str(), p.exited), ("cuda_workload", true));
    assert!(c.events.iter().all(|e| e.pid == p.pid));
    let s = &p.stats;
    assert_eq!(s.events, events);

    // Launches: by entry point, named through modules/libraries/kernels, graph launches neither.
    assert_eq!(s.launches, launches);
    let mut launch_apis: BTreeMap<&str, u64> = [
        "cuLaunchKernel_ptsz",
        "cuLaunchKernelEx",
        "cuLaunchKernelEx_ptsz",
        "cuLaunchCooperativeKernel",
        "cuLaunchCooperativeKernel_ptsz",
        "cuGraphLaunch",
        "cuGraphLaunch_ptsz",
    ]
    .into_iter()
    .map(|a| (a, RUN_ROUNDS))
    .collect();
    launch_apis.insert("cuLaunchKernel", RUN_ROUNDS + NAMES_LAUNCHES + BURST);
    assert_eq!(s.launch_apis, launch_apis);
    assert_eq!(s.named_launches, NAMES_NAMED);
    assert_eq!(
        s.unresolved_launches,
        ROUND_LAUNCHES * RUN_ROUNDS + (NAMES_LAUNCHES - NAMES_NAMED) + BURST
    );
    let top: Vec<(&str, u64)> = p.top_kernels.iter().map(|(k, n)| (&*k.demangled, *n)).collect();
    assert_eq!(
        top,
        [
            ("void foo::kernel<float>(float*, int)", 5),
            ("scale_vec(float*, float, unsigned int)", 3),
            ("write_value", 2)
        ]
    );
    let named: Vec<&str> = c
        .events
        .iter()
        .filter_map(|e| match &e.body {
            Body::Launch(l) => l.kernel.as_ref().map(|k| &*k.mangled),
            _ => None,
        })
        .collect();
    let mut plan = vec!["_Z9scale_vecPffj"; 3];
    plan.extend(["write_value"; 2]);
    plan.extend(["_ZN3foo6kernelIfEEvPT_i"; 5]);
    assert_eq!(named, plan, "named launches in the order `names` made them");

    // Copies by direction, with bytes: run's explicit copies by their API, its generic and
    // peer ones between untracked pointers unknown; directions' by its table; unwind's HtoD.
    let run_bytes = |ks: &[u64]| over_run(|_, i| ks.iter().map(|&k| copy_bytes(k, i)).sum());
    let dir_bytes = |d: Direction| DIRECTIONS.iter().filter(|c| c.1 == d).map(|c| c.0).sum::<u64>();
    let dir_count = |d: Direction| DIRECTIONS.iter().filter(|c| c.1 == d).count() as u64;
    let unwind = (UNWIND_N + 2 + 2 * UNWIND_M, (UNWIND_N + 2 + 2 * UNWIND_M) * 64);
    let amount = |count, bytes| (count, bytes);
    let got = |d: Direction| {
        let a = s.copy(d);
        (a.count, a.bytes)
    };
    assert_eq!(
        got(Direction::CpuToGpu),
        amount(
            4 * RUN_ROUNDS + dir_count(Direction::CpuToGpu) + unwind.0,
            run_bytes(&[0, 1, 6, 7]) + dir_bytes(Direction::CpuToGpu) + unwind.1
        )
    );
    assert_eq!(
        got(Direction::GpuToCpu),
        amount(
            4 * RUN_ROUNDS + dir_count(Direction::GpuToCpu),
            run_bytes(&[2, 3, 8, 9]) + dir_bytes(Direction::GpuToCpu)
        )
    );
    assert_eq!(
        got(Direction::GpuToGpu),
        amount(
            4 * RUN_ROUNDS + dir_count(Direction::GpuToGpu),
            run_bytes(&[4, 5, 10, 11]) + dir_bytes(Direction::GpuToGpu)
        )
    );
    assert_eq!(
        got(Direction::Unknown),
        amount(
            8 * RUN_ROUNDS + dir_count(Direction::Unknown),
            run_bytes(&[12, 13, 14, 15, 16, 17, 18, 19]) + dir_bytes(Direction::Unknown)
        )
    );
    assert_eq!(
        [
            got(Direction::CpuToGpu),
            got(Direction::GpuToCpu),
            got(Direction::GpuToGpu),
            got(Direction::Unknown)
        ],
        [(31, 301_856), (20, 431_689), (18, 557_764), (33, 2_162_768)]
    );
    assert_eq!(s.inferred_copies, DIRECTIONS.iter().filter(|c| c.2).count() as u64);
    assert_eq!(
        s.pinned_copies,
        DIRECTIONS.iter().filter(|c| c.3 == Some(true)).count() as u64
    );
    // Explicit HtoD/DtoH of run (sync and async) and unwind's copies are from pageable memory.
    assert_eq!(
        s.pageable_copies,
        8 * RUN_ROUNDS + DIRECTIONS.iter().filter(|c| c.3 == Some(false)).count() as u64 + unwind.0
    );

    // Memsets, allocations, frees, what was never freed.
    let memset_total = over_run(|_, i| (0..ROUND_MEMSETS).map(|m| memset_bytes(m, i)).sum());
    assert_eq!((s.memsets.count, s.memsets.bytes), (memsets, memset_total));
    let alloc_total = over_run(round_alloc_bytes) + DIRECTIONS_ALLOCS.iter().sum::<u64>() + FLOOD * 4096;
    assert_eq!((s.allocs.count, s.allocs.bytes), (allocs, alloc_total));
    assert_eq!(
        (s.frees.count, s.frees.bytes, s.unknown_frees),
        (frees, over_run(round_alloc_bytes) + DIRECTIONS_FREED, 0)
    );
    let managed = Leak {
        api: "cuMemAllocManaged",
        mem: MemKind::Managed,
        count: FLOOD + 1,
        bytes: FLOOD * 4096 + (1 << 16),
    };
    let device = Leak {
        api: "cuMemAlloc_v2",
        mem: MemKind::Device,
        count: 1,
        bytes: 12345,
    };
    assert_eq!(p.leaks, [managed.clone(), device.clone()]);
    assert_eq!(
        (s.live_device, s.live_managed, s.live_host, s.live_allocs),
        (12345, managed.bytes, 0, FLOOD + 2)
    );
    assert_eq!(c.leaks.len(), 1, "one report, at the exit");
    assert_eq!(c.leaks[0], (p.pid, "cuda_workload".into(), true, vec![managed, device]));
    assert_eq!(c.memory.len(), 1, "one memory sample, at the end");
    assert_eq!(
        c.memory[0].1,
        MemorySample {
            pid: p.pid,
            device: 12345,
            managed: FLOOD * 4096 + (1 << 16),
            host: 0,
            allocations: FLOOD + 2,
        }
    );

    // Syncs by target: every one sleeps 2 ms in the fake libcuda, so every one is slow.
    assert_eq!(s.syncs.count, syncs);
    let by: BTreeMap<SyncTarget, u64> = s.sync_by_target.iter().map(|(t, a)| (*t, a.count)).collect();
    let mut want: BTreeMap<SyncTarget, u64> = [
        (SyncTarget::Context, 2 * RUN_ROUNDS + 1),
        (SyncTarget::Stream(0x51), 3 + UNWIND_M),
        (SyncTarget::Stream(0x52), 1),
        (SyncTarget::Event(0xe1), 2),
    ]
    .into();
    for t in 0..THREADS {
        want.insert(SyncTarget::Stream(0x5000 + t), ROUNDS);
        want.insert(SyncTarget::Stream(0x5100 + t), ROUNDS);
        want.insert(SyncTarget::Event(0xE000 + t), ROUNDS);
    }
    assert_eq!(by, want);
    assert!(s.syncs.ns >= syncs * 2_000_000, "{} ns", s.syncs.ns);
    assert_eq!(s.slow_calls, syncs);

    // ioctls: in which calls, and outside any.
    assert_eq!((s.ioctls.count, s.ioctls_in_calls), (ioctls, ioctls - OUTSIDE_IOCTLS));
    let by_api: BTreeMap<&str, u64> = s.ioctl_by_api.iter().map(|(a, n)| (*a, n.count)).collect();
    let want: BTreeMap<&str, u64> = [
        ("cuInit", 3),
        ("cuDevicePrimaryCtxRetain", 2),
        ("cuMemAlloc_v2", 2 * (RUN_ROUNDS + 2)),
        ("cuCtxSynchronize", RUN_ROUNDS + 1),
        ("cuCtxSynchronize_v2", RUN_ROUNDS),
        ("cuStreamSynchronize", RUN_ROUNDS + 4 + UNWIND_M),
        ("cuStreamSynchronize_ptsz", RUN_ROUNDS),
        ("cuEventSynchronize", RUN_ROUNDS + 2),
    ]
    .into();
    assert_eq!(by_api, want);
    let cmds: BTreeMap<u32, u64> = s.ioctl_by_cmd.iter().map(|(c, (_, a))| (*c, a.count)).collect();
    // RM_CONTROL: cuInit's 3, every sync's 1, unwind's and ioctl_outside's outside calls.
    let control = 3 + syncs + OUTSIDE_IOCTLS;
    // RM_ALLOC: retain's 2 and the first of each cuMemAlloc_v2's; 0x25 its second.
    let alloc_v2 = RUN_ROUNDS + 2;
    assert_eq!(
        cmds,
        [(0xc020462a, control), (0xc030462b, 2 + alloc_v2), (0x25, alloc_v2)].into()
    );
    // The fake library's ioctls go to its /dev/null fd, which the live agent resolved (and the
    // replay's lookup repeats); the workload's own fds outside calls were closed by then.
    let devices: Vec<(bool, Option<&str>)> = c
        .events
        .iter()
        .filter_map(|e| match &e.body {
            Body::Ioctl(i) => Some((i.parent.is_some(), i.device.as_deref())),
            _ => None,
        })
        .collect();
    assert!(
        devices.iter().all(|(in_call, d)| !in_call || *d == Some("/dev/null")),
        "{devices:?}"
    );

    // The rest of the calls.
    assert_eq!((s.inits.count, s.modules.count), (inits, modules));
    assert_eq!((s.abandoned_calls, s.failed_calls), (UNWIND_N + 2, 0));
    assert_eq!(s.call_apis.values().sum::<u64>(), events - launches - ioctls - exits);
    assert_eq!(
        (s.call_apis["cuMemAllocManaged"], s.call_apis["cuMemcpyHtoD_v2"]),
        (RUN_ROUNDS + 1 + FLOOD, RUN_ROUNDS + 2 + unwind.0)
    );
}

#[test]
fn replay_matches_the_workloads_own_ledger() {
    // Every call `run`, `names` and `directions` wrote down is in the replay's JSON lines with
    // the same fields (api, tid, sizes, handles, direction, …), as many times as written.
    let lines = recorded_lines();
    let r = replay(true, final_tick_ns(&lines));
    let events: Vec<Value> = r.lines.iter().map(|l| parse(l)).collect();
    let ledger: Vec<Value> = String::from_utf8(data("calls.jsonl"))
        .unwrap()
        .lines()
        .map(parse)
        .collect();
    assert_eq!(
        ledger.len() as u64,
        75 * RUN_ROUNDS + NAMES_LAUNCHES + DIRECTIONS.len() as u64
    );
    let shape = |v: &Value| -> Vec<String> { v.as_object().unwrap().keys().cloned().collect() };
    let project = |shape: &[String], v: &Value| -> String {
        shape
            .iter()
            .map(|k| format!("{k}={}", v.get(k).unwrap_or(&Value::Null)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut wanted: BTreeMap<Vec<String>, HashMap<String, usize>> = BTreeMap::new();
    for line in &ledger {
        let sh = shape(line);
        let key = project(&sh, line);
        *wanted.entry(sh).or_default().entry(key).or_default() += 1;
    }
    for (sh, keys) in &wanted {
        let mut got: HashMap<String, usize> = HashMap::new();
        for ev in &events {
            *got.entry(project(sh, ev)).or_default() += 1;
        }
        for (key, n) in keys {
            let have = got.get(key).copied().unwrap_or(0);
            assert!(have >= *n, "{key}: the workload made {n}, the replay wrote {have}");
        }
    }
}

#[test]
fn replayed_json_lines_are_the_live_observers_line_for_line() {
    let recorded = recorded_lines();
    let r = replay(true, final_tick_ns(&recorded));
    assert_eq!(r.lines.len(), recorded.len());
    for (i, (got, want)) in r.lines.iter().zip(&recorded).enumerate() {
        assert_eq!(
            without_leak_time(got),
            without_leak_time(want),
            "line {} differs (replayed, then recorded)",
            i + 1
        );
    }
    // Only the leak lines' time was left out, and they come right after the exit.
    let leak_lines: Vec<usize> = recorded
        .iter()
        .enumerate()
        .filter(|(_, l)| parse(l)["type"] == "leak")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(leak_lines.len(), 2);
    assert_eq!(parse(&recorded[leak_lines[0] - 1])["type"], "process_exit");
}

#[test]
fn adaptive_sampling_leaves_out_exactly_the_fast_copies_memsets_and_syncs() {
    // The same recording without --trace-all: the lines written are the live (trace-all) run's
    // minus copies, memsets and syncs under the threshold (abandoned ones are always written),
    // and the total summary counts what was left out.
    let recorded = recorded_lines();
    let r = replay(false, final_tick_ns(&recorded));
    let fast = |v: &Value| {
        matches!(v["type"].as_str(), Some("memcpy" | "memset" | "sync"))
            && v["duration_ns"].as_u64().is_some_and(|d| d < THRESHOLD_NS)
    };
    let mut left_out: BTreeMap<String, u64> = BTreeMap::new();
    let mut kept = Vec::new();
    for line in &recorded {
        let v = parse(line);
        if fast(&v) {
            *left_out.entry(v["type"].as_str().unwrap().into()).or_default() += 1;
        } else if v["type"] != "summary" {
            kept.push(without_leak_time(line));
        }
    }
    let events: Vec<String> = r
        .lines
        .iter()
        .filter(|l| parse(l)["type"] != "summary")
        .map(|l| without_leak_time(l))
        .collect();
    assert_eq!(events, kept);
    // Every copy and memset of the fake library is fast; every sync sleeps 2 ms.
    let abandoned = UNWIND_N + 2;
    assert_eq!(
        left_out,
        [("memcpy".to_string(), 102 - abandoned), ("memset".to_string(), 96)].into()
    );
    let total = parse(r.lines.last().unwrap());
    assert_eq!(total["trace_all"], false);
    assert_eq!(
        total["sampled_out"],
        serde_json::json!({"memcpy": 102 - abandoned, "memset": 96, "sync": 0, "gpu_kernel": 0, "gpu_memcpy": 0, "gpu_memset": 0})
    );
    // The counters do not depend on sampling.
    let p = &r.snapshot.procs[0];
    assert_eq!(
        (
            p.stats.copies.iter().map(|a| a.count).sum::<u64>(),
            p.stats.memsets.count
        ),
        (102, 96)
    );
}
