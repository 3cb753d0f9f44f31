//! `--flamegraph FILE`: the stacks of a scripted workload, weighted by the fake CUPTI's
//! documented GPU times (tests/fixtures/README.md: a launch of grid.x G runs 1000·G ns, a copy
//! of B bytes 500 + B/1000 ns) or, without CUPTI, by launch count.

use std::time::Duration;

use gpu_observer_tests::*;

/// The number of passes in a `loop` reply (`ok loop <passes> <µs>`).
fn passes(reply: &str) -> u64 {
    assert!(reply.starts_with("ok loop "), "{reply}");
    reply.split_whitespace().nth(2).unwrap().parse().unwrap()
}

/// `run` with the fake CUPTI and `--flamegraph DIR/NAME`: 3 µs `gemm` and 5 µs `relu` kernels
/// and a 200 000-byte copy (700 ns) a pass. Returns what it wrote, the passes, the pid, stderr
/// and the file's path.
fn run_with_cupti(name: &str) -> (String, u64, u32, Vec<String>, String) {
    let _g = serial();
    require_root();
    let dir = scratch(&format!("flamegraph-{name}"));
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let path = dir.join(name);
    let mut r = RunAgent::with_cupti_args(&dir, &lib, &["--flamegraph", path.to_str().unwrap()], &[]);
    let pid = r.pid;
    r.cmd("init");
    // Paced (0.5 ms a pass) so that the ring buffer drops nothing on a small machine.
    let n = passes(&r.cmd("loop 300 launch:3:gemm launch:5:relu htod:200000 sleep:500"));
    let cap = r.finish();
    assert!(
        cap.stderr.iter().any(|l| l.ends_with(" events, 0 dropped")),
        "{}",
        cap.stderr.join("\n")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    (text, n, pid, cap.stderr, path.display().to_string())
}

#[test]
fn run_with_cupti_weighs_each_stack_by_its_gpu_time() {
    let (text, n, pid, stderr, path) = run_with_cupti("k.folded");
    let p = format!("cuda_workload {pid};cuda_workload tid {pid}");
    assert_eq!(
        text,
        format!(
            "{p};cuLaunchKernel;gemm {}\n\
             {p};cuLaunchKernel;relu {}\n\
             {p};cuMemcpyHtoD_v2;memcpy HtoD {}\n",
            3_000 * n,
            5_000 * n,
            700 * n
        ),
        "{}",
        stderr.join("\n")
    );
    let said = format!(
        "gpu-observer: --flamegraph {}: 3 stacks, {} ns in all of GPU time",
        path,
        8_700 * n
    );
    assert!(stderr.contains(&said), "no `{said}`:\n{}", stderr.join("\n"));
}

fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[test]
fn an_svg_path_gets_an_svg_titled_with_its_unit() {
    let (svg, n, pid, stderr, _) = run_with_cupti("k.svg");
    assert!(svg.starts_with("<?xml"), "{svg}");
    assert!(svg.trim_end().ends_with("</svg>"), "{svg}");
    assert_eq!(svg.matches("<g").count(), svg.matches("</g>").count(), "{svg}");
    assert!(
        svg.contains(">GPU time (ns) of kernels, copies and memsets, from CUPTI</text>"),
        "{svg}"
    );
    // inferno writes counts with thousands separators.
    let gemm = format!("<title>gemm ({} ns,", thousands(3_000 * n));
    let titles: Vec<&str> = svg
        .split("<title>")
        .skip(1)
        .filter_map(|t| t.split("</title>").next())
        .collect();
    assert!(svg.contains(&gemm), "no {gemm} in {titles:?}\n{}", stderr.join("\n"));
    assert!(svg.contains(&format!("<title>cuda_workload {pid} (")), "{svg}");
    assert!(svg.contains("<title>memcpy HtoD ("), "{svg}");
    assert!(
        stderr.iter().any(|l| l.contains("k.svg: 3 stacks")),
        "{}",
        stderr.join("\n")
    );
}

#[test]
fn without_cupti_all_processes_are_weighed_by_launches() {
    let _g = serial();
    require_root();
    let dir = scratch("flamegraph-launches");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let path = dir.join("launches.folded");
    let agent = Agent::start(
        &dir,
        &[
            "--libcuda",
            lib.to_str().unwrap(),
            "--flamegraph",
            path.to_str().unwrap(),
        ],
    );
    agent.wait_stderr("attached", Duration::from_secs(5));
    let mut w = Workload::start();
    w.cmd(&format!("load {}", lib.display()));
    w.cmd("init");
    let n = passes(&w.cmd("loop 200 launch:1:gemm launch:1:gemm launch:1:relu sync"));
    w.cmd("burst 7");
    let pid = w.pid;
    w.exit();
    let cap = agent.stop();
    assert!(cap.status.success(), "{}", cap.stderr.join("\n"));
    let p = format!("cuda_workload {pid};cuda_workload tid {pid}");
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        format!(
            "{p};cuLaunchKernel;[unnamed kernel] 7\n\
             {p};cuLaunchKernel;gemm {}\n\
             {p};cuLaunchKernel;relu {n}\n",
            2 * n
        ),
        "{}",
        cap.stderr.join("\n")
    );
    let err = cap.stderr.join("\n");
    assert!(
        err.contains(&format!("launches.folded: 3 stacks, {} launches in all\n", 3 * n + 7)),
        "{err}"
    );
    assert!(err.contains("--flamegraph: weighted by launch count"), "{err}");
}
