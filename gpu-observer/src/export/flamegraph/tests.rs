use std::sync::Arc;

use gpu_observer_common::{
    api::{self, ApiSpec},
    cupti::{GpuRecord, GpuRecordKind},
};

use super::*;
use crate::{
    correlate::cupti_join::Origin,
    decode::{Call, KernelName, Launch},
};

fn spec(name: &str) -> &'static ApiSpec {
    api::by_id(api::id_of(name).unwrap()).unwrap()
}

fn comm(s: &[u8]) -> [u8; 16] {
    let mut c = [0; 16];
    let n = s.len().min(16);
    c[..n].copy_from_slice(&s[..n]);
    c
}

fn launch(pid: u32, tid: u32, name: &[u8], api: &str, kernel: Option<&str>) -> Event {
    Event {
        ts_ns: 1,
        pid,
        tid,
        comm: comm(name),
        api: Some(spec(api)),
        body: Body::Launch(Launch {
            kernel: kernel.map(|k| Arc::new(KernelName::new(k))),
            ..Launch::of(0xF000)
        }),
    }
}

fn call(pid: u32, tid: u32, name: &[u8], api: &str) -> Event {
    Event {
        ts_ns: 1,
        pid,
        tid,
        comm: comm(name),
        api: Some(spec(api)),
        body: Body::Call(Call::returned(spec(api), 10)),
    }
}

fn exit(pid: u32) -> Event {
    Event {
        ts_ns: 1,
        pid,
        tid: pid,
        comm: comm(b"gone"),
        api: None,
        body: Body::ProcessExit,
    }
}

fn origin(tid: u32, api: &str) -> Origin {
    Origin {
        function: 0,
        tid,
        api: Some(spec(api)),
        cupti_api: "cudaLaunchKernel",
        launch_ts_ns: Some(1),
        api_start_ns: 1,
        api_end_ns: 2,
        kernel: None,
    }
}

/// A GPU record of `kind` lasting `ns`, of process `pid` ("main"), launched by `origin`.
fn gpu(
    pid: u32,
    kind: GpuRecordKind,
    ns: u64,
    origin: Option<Origin>,
    kernel: Option<&str>,
    nvtx: &[&str],
) -> GpuActivity {
    GpuActivity {
        pid,
        comm: comm(b"main"),
        rec: GpuRecord {
            kind: kind as u32,
            correlation_id: 1,
            start_ns: 1_000,
            end_ns: 1_000 + ns,
            copy_kind: 1,
            ..Default::default()
        },
        origin,
        kernel: kernel.map(|k| Arc::new(KernelName::new(k))),
        occupancy: None,
        sm_count: None,
        anomalous: false,
        nvtx: (!nvtx.is_empty()).then(|| Arc::from(nvtx.iter().map(|l| Arc::from(*l)).collect::<Vec<Arc<str>>>())),
    }
}

fn kernel(pid: u32, tid: u32, ns: u64, name: &str, nvtx: &[&str]) -> GpuActivity {
    gpu(
        pid,
        GpuRecordKind::Kernel,
        ns,
        Some(origin(tid, "cuLaunchKernel")),
        Some(name),
        nvtx,
    )
}

fn sink(name: &str) -> FlamegraphSink {
    let dir = std::env::temp_dir().join(format!("gpu-observer-flamegraph-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    FlamegraphSink::create(&dir.join(name)).unwrap()
}

/// Writes the file as at the end of a run and reads it back.
fn written(mut s: FlamegraphSink) -> String {
    s.write().unwrap();
    let text = std::fs::read_to_string(&s.path).unwrap();
    let _ = std::fs::remove_file(&s.path);
    text
}

fn feed(s: &mut FlamegraphSink, events: &[Event], gpus: &[GpuActivity]) {
    for e in events {
        s.event(e).unwrap();
    }
    for a in gpus {
        s.gpu(a).unwrap();
    }
}

#[test]
fn gpu_time_under_nvtx_ranges_gives_the_specs_shape() {
    let mut s = sink("gpu.folded");
    let model = ["model_inference", "gpu.forward_pass"];
    feed(
        &mut s,
        &[
            launch(1, 1, b"main", "cuLaunchKernel", Some("gpu.matmul")),
            call(1, 1, b"main", "cuMemcpyHtoD_v2"),
            launch(1, 2, b"worker", "cuLaunchKernel", Some("relu")),
        ],
        &[
            // Two launches of one kernel under the same ranges: one stack, 1000 + 1300 ns.
            kernel(1, 1, 1_000, "gpu.matmul", &model),
            kernel(1, 1, 1_300, "gpu.matmul", &model),
            kernel(1, 1, 500, "relu", &model[..1]),
            gpu(
                1,
                GpuRecordKind::Memcpy,
                700,
                Some(origin(1, "cuMemcpyHtoD_v2")),
                None,
                &model[..1],
            ),
            gpu(
                1,
                GpuRecordKind::Memset,
                40,
                Some(origin(1, "cuMemsetD8_v2")),
                None,
                &[],
            ),
            kernel(1, 2, 10, "relu", &[]),
            // Never joined to its launch: no thread, no API.
            gpu(1, GpuRecordKind::Kernel, 5, None, Some("relu"), &[]),
            // Not work on the GPU: not in the flamegraph.
            gpu(1, GpuRecordKind::Api, 99, Some(origin(1, "cuLaunchKernel")), None, &[]),
        ],
    );
    let (unit, _, notes) = s.render();
    assert_eq!(unit, Unit::GpuNs);
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(
        written(s),
        "main 1;[launch not joined];relu 5\n\
         main 1;main tid 1;cuMemsetD8_v2;memset 40\n\
         main 1;main tid 1;model_inference;cuLaunchKernel;relu 500\n\
         main 1;main tid 1;model_inference;cuMemcpyHtoD_v2;memcpy HtoD 700\n\
         main 1;main tid 1;model_inference;gpu.forward_pass;cuLaunchKernel;gpu.matmul 2300\n\
         main 1;worker tid 2;cuLaunchKernel;relu 10\n"
    );
}

#[test]
fn without_gpu_records_launches_are_counted() {
    let mut s = sink("launches.folded");
    let mut events = vec![
        // A worker launches first: the process is still named after its main thread.
        launch(7, 8, b"loader", "cuLaunchKernel", Some("_Z4gemmPfS_")),
        launch(7, 8, b"loader", "cuLaunchKernel", Some("_Z4gemmPfS_")),
    ];
    events.extend((0..3).map(|_| launch(7, 7, b"train", "cuLaunchKernel", Some("_Z4gemmPfS_"))));
    events.push(launch(7, 7, b"train", "cuLaunchKernel_ptsz", None));
    events.push(launch(7, 7, b"train", "cuGraphLaunch", None));
    // Calls that are not launches add nothing.
    events.push(call(7, 7, b"train", "cuMemcpyHtoD_v2"));
    events.push(call(7, 7, b"train", "cuCtxSynchronize"));
    feed(&mut s, &events, &[]);
    let (unit, _, notes) = s.render();
    assert_eq!(unit, Unit::Launches);
    assert_eq!(notes.len(), 1);
    assert!(notes[0].starts_with("weighted by launch count"), "{notes:?}");
    assert_eq!(
        written(s),
        "train 7;loader tid 8;cuLaunchKernel;gemm(float*, float*) 2\n\
         train 7;train tid 7;cuGraphLaunch;[graph] 1\n\
         train 7;train tid 7;cuLaunchKernel;gemm(float*, float*) 3\n\
         train 7;train tid 7;cuLaunchKernel_ptsz;[unnamed kernel] 1\n"
    );
}

#[test]
fn with_both_gpu_time_wins_and_the_untimed_launches_are_counted_as_left_out() {
    let mut s = sink("mixed.folded");
    let mut events = vec![launch(1, 1, b"main", "cuLaunchKernel", Some("k"))];
    events.extend((0..3).map(|_| launch(2, 2, b"untimed", "cuLaunchKernel", Some("k"))));
    events.extend((0..2).map(|_| launch(3, 3, b"untimed", "cuLaunchKernel", Some("k"))));
    feed(&mut s, &events, &[kernel(1, 1, 2_000, "k", &[])]);
    let (unit, _, notes) = s.render();
    assert_eq!(unit, Unit::GpuNs);
    assert_eq!(
        notes,
        ["5 launches of 2 processes without GPU timing (no CUPTI) are not in it"]
    );
    assert_eq!(written(s), "main 1;main tid 1;cuLaunchKernel;k 2000\n");
}

#[test]
fn hostile_names_stay_one_frame_each_escaped_and_bounded() {
    let mut s = sink("hostile.folded");
    let long = "x".repeat(10 * 1024);
    let names = ["a;b\nc", "\x1b]0;pwn\x07", long.as_str(), "  ", "gemm\u{202e}"];
    for n in names {
        s.event(&launch(5, 5, b"ev;il\x1b\nx", "cuLaunchKernel", Some(n)))
            .unwrap();
    }
    let mut k = kernel(5, 5, 1, "k", &["range;with\nbreak", long.as_str()]);
    k.comm = comm(b"ev;il\x1b\nx");
    s.gpu(&k).unwrap();
    let mut out = s.render().1;
    let lines = out.clone();
    for l in &lines {
        assert!(!l.chars().any(|c| c.is_control()), "{l:?}");
        let (frames, count) = l.rsplit_once(' ').unwrap();
        count.parse::<u64>().unwrap();
        let frames: Vec<&str> = frames.split(';').collect();
        assert!(frames.iter().all(|f| f.chars().count() <= MAX_FRAME_CHARS + 1), "{l:?}");
        assert_eq!(frames[0], "ev,il\\x1b\\x0ax 5");
        assert_eq!(frames[1], "ev,il\\x1b\\x0ax tid 5");
    }
    let cut = format!("{}…", "x".repeat(MAX_FRAME_CHARS));
    out.sort();
    assert_eq!(
        out,
        [format!(
            "ev,il\\x1b\\x0ax 5;ev,il\\x1b\\x0ax tid 5;range,with\\x0abreak;{cut};cuLaunchKernel;k 1"
        ),]
    );
    // In GPU mode the launches are not drawn; the same names counted as launches:
    let mut s = sink("hostile2.folded");
    for n in names {
        s.event(&launch(5, 5, b"ev;il\x1b\nx", "cuLaunchKernel", Some(n)))
            .unwrap();
    }
    assert_eq!(
        written(s),
        format!(
            "ev,il\\x1b\\x0ax 5;ev,il\\x1b\\x0ax tid 5;cuLaunchKernel;[no name] 1\n\
             ev,il\\x1b\\x0ax 5;ev,il\\x1b\\x0ax tid 5;cuLaunchKernel;\\x1b]0,pwn\\x07 1\n\
             ev,il\\x1b\\x0ax 5;ev,il\\x1b\\x0ax tid 5;cuLaunchKernel;a,b\\x0ac 1\n\
             ev,il\\x1b\\x0ax 5;ev,il\\x1b\\x0ax tid 5;cuLaunchKernel;gemm\\u{{202e}} 1\n\
             ev,il\\x1b\\x0ax 5;ev,il\\x1b\\x0ax tid 5;cuLaunchKernel;{cut} 1\n"
        )
    );
}

#[test]
fn stacks_past_the_bound_go_to_one_other_frame_per_process_and_nothing_is_lost() {
    let mut s = sink("bound.folded");
    for i in 0..MAX_STACKS + 10 {
        s.gpu(&kernel(1, 1, 3, &format!("k{i}"), &[])).unwrap();
    }
    // Kept stacks still add up after the bound; new ones of another process get its own frame.
    s.gpu(&kernel(1, 1, 4, "k0", &[])).unwrap();
    s.gpu(&kernel(2, 2, 100, "new", &[])).unwrap();
    let (_, lines, notes) = s.render();
    assert_eq!(lines.len(), MAX_STACKS + 2);
    assert!(lines.contains(&"main 1;[other stacks] 30".to_string()));
    assert!(lines.contains(&"main 2;[other stacks] 100".to_string()));
    assert!(lines.contains(&"main 1;tid 1;cuLaunchKernel;k0 7".to_string()));
    assert_eq!(
        notes,
        [format!(
            "11 of {} GPU records went to `[other stacks]` frames (more than {MAX_STACKS} distinct stacks or 32 MiB of them)",
            MAX_STACKS + 12
        )]
    );
    let total: u64 = lines
        .iter()
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap())
        .sum();
    assert_eq!(total, 3 * (MAX_STACKS as u64 + 10) + 4 + 100);
}

#[test]
fn past_the_other_frames_bound_processes_share_one_frame() {
    let mut t = Table::default();
    for i in 0..MAX_STACKS {
        t.add(0, &format!("s{i}"), 1);
    }
    for pid in 1..=table::MAX_OTHER as u32 + 3 {
        t.add(pid, "s", 2);
    }
    let lines = t.lines(|pid| format!("p{pid}"));
    assert_eq!(lines.len(), MAX_STACKS + table::MAX_OTHER + 1);
    assert_eq!(lines.first().unwrap(), "[other processes] 6");
    assert_eq!(t.folded, table::MAX_OTHER as u64 + 3);
}

#[test]
fn a_thread_is_forgotten_at_the_flush_after_its_process_exited() {
    let mut s = sink("exit.folded");
    s.event(&launch(4, 9, b"worker", "cuLaunchKernel", Some("k"))).unwrap();
    s.event(&exit(4)).unwrap();
    // The batch's GPU records come after its events: still named.
    s.gpu(&kernel(4, 9, 10, "k", &[])).unwrap();
    s.flush().unwrap();
    s.gpu(&kernel(4, 9, 20, "k", &[])).unwrap();
    assert_eq!(
        written(s),
        "main 4;tid 9;cuLaunchKernel;k 20\n\
         main 4;worker tid 9;cuLaunchKernel;k 10\n"
    );
}

#[test]
fn nothing_seen_writes_an_empty_folded_file() {
    let mut s = sink("empty.folded");
    s.event(&call(1, 1, b"main", "cuCtxSynchronize")).unwrap();
    assert_eq!(written(s), "");
}

/// Parses an SVG with quick-xml (every tag balanced, names matching) and returns the text of
/// its `<title>` and `<text>` elements (frames' tooltips, the title), entities resolved.
fn svg_titles(svg: &str) -> Vec<String> {
    use quick_xml::events::Event as X;
    let mut r = quick_xml::Reader::from_str(svg);
    r.config_mut().check_end_names = true;
    let (mut depth, mut in_title, mut titles) = (0i32, false, Vec::new());
    let mut cur = String::new();
    loop {
        match r
            .read_event()
            .unwrap_or_else(|e| panic!("not well-formed XML: {e}\n{svg}"))
        {
            X::Start(t) => {
                depth += 1;
                in_title = matches!(t.name().as_ref(), b"title" | b"text");
                cur.clear();
            }
            X::End(t) => {
                depth -= 1;
                if matches!(t.name().as_ref(), b"title" | b"text") {
                    titles.push(cur.clone());
                    in_title = false;
                }
            }
            X::Text(t) if in_title => cur.push_str(&t.decode().unwrap()),
            X::GeneralRef(g) if in_title => match &*g.decode().unwrap() {
                "lt" => cur.push('<'),
                "gt" => cur.push('>'),
                "amp" => cur.push('&'),
                "quot" => cur.push('"'),
                "apos" => cur.push('\''),
                other => cur.push(
                    g.resolve_char_ref()
                        .unwrap()
                        .unwrap_or_else(|| panic!("entity {other}")),
                ),
            },
            X::Eof => break,
            _ => {}
        }
    }
    assert_eq!(depth, 0, "unbalanced tags");
    titles
}

#[test]
fn the_svg_is_well_formed_and_names_its_unit_and_frames() {
    let mut s = sink("gpu.svg");
    s.event(&launch(1, 1, b"main", "cuLaunchKernel", Some("void k<float>(int&)")))
        .unwrap();
    s.gpu(&kernel(1, 1, 2_300, "void k<float>(int&)", &["model_inference"]))
        .unwrap();
    s.gpu(&kernel(1, 1, 700, "relu", &[])).unwrap();
    let svg = written(s);
    let titles = svg_titles(&svg);
    assert!(titles.iter().any(|t| t == Unit::GpuNs.title()), "{titles:?}");
    for frame in [
        "main 1",
        "main tid 1",
        "model_inference",
        "cuLaunchKernel",
        "void k<float>(int&)",
        "relu",
    ] {
        assert!(
            titles.iter().any(|t| t.starts_with(&format!("{frame} ("))),
            "no frame {frame}: {titles:?}"
        );
    }
    assert!(titles.iter().any(|t| t == "relu (700 ns, 23.33%)"), "{titles:?}");
    assert!(titles.iter().any(|t| t == "all (3,000 ns, 100%)"), "{titles:?}");

    let mut s = sink("launches.svg");
    s.event(&launch(1, 1, b"main", "cuLaunchKernel", Some("relu"))).unwrap();
    let titles = svg_titles(&written(s));
    assert!(titles.iter().any(|t| t == Unit::Launches.title()), "{titles:?}");
    assert!(titles.iter().any(|t| t.starts_with("relu (1 launches")), "{titles:?}");
}

#[test]
fn an_empty_svg_is_still_one_and_says_there_is_no_data() {
    let svg = written(sink("empty.svg"));
    assert_eq!(
        svg_titles(&svg),
        [
            Unit::Launches.title(),
            Unit::Launches.title(),
            "No data: gpu-observer saw no kernel launch or GPU record."
        ]
    );
}
