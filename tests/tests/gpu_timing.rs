//! `--gpu-timing` end to end: the CUPTI injection library loaded into a process that is already
//! launching (ptrace, one thread borrowed, memfd, `dlopen`), switched on, withdrawn, switched on
//! again by a second observer; the injection killed at each of its steps; every refusal; and the
//! program's own output unchanged. Real eBPF, the fake libcuda and fake CUPTI, exact counts.
//!
//! The workload is started without `CUDA_INJECTION64_PATH` (nothing loads the library at
//! `cuInit`) and with `GPU_OBSERVER_CUPTI_PATH` naming the fake CUPTI, so the injected library
//! finds it. `inject_tool` (tests/src/bin) runs the injection alone, without eBPF.

use std::{
    collections::{BTreeMap, HashMap},
    io::{BufRead, BufReader, Write},
    os::unix::process::{CommandExt, ExitStatusExt},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use gpu_observer::attach::inject::{DIE_AT_ENV, STEPS};
use gpu_observer_common::cupti::MEMFD_NAME;
use gpu_observer_tests::*;
use serde_json::Value;

/// The kernels the workload names before anything attaches, and launches from its background
/// thread with those handles only.
const KERNELS: [&str; 2] = ["late_gemm", "late_relu"];
const BACKGROUND: &str = "background launch:late_gemm launch:late_relu sleep:1000";
/// `launch` OPs per pass of [`BACKGROUND`].
const LAUNCHES_PER_PASS: u64 = 2;
/// The issue's bound on how long the borrowed thread may be stopped.
const PAUSE_BOUND_US: u64 = 20_000;
/// The background loop's longest gap between two passes (a pass is ~1.1 ms idle). Loose: a busy
/// 2-core machine, and an observer attaching uprobes meanwhile.
const MAX_GAP_BOUND_US: u64 = 500_000;
/// The unprivileged user (and group) `nobody`.
const NOBODY: u32 = 65534;

fn inject_tool_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_inject_tool"))
}

/// The workload as a late-attach target: no injection library in its environment, the fake
/// CUPTI where an injected library looks for it, records flushed every 50 ms.
fn late_command(extra: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(fixtures().join("cuda_workload"));
    cmd.env_remove("CUDA_INJECTION64_PATH")
        .env_remove("NVTX_INJECTION64_PATH")
        .env_remove("FAKE_CUPTI_BUSY")
        .env("GPU_OBSERVER_CUPTI_PATH", fixtures().join("libcupti.so.13"))
        .env("GPU_OBSERVER_CUPTI_FLUSH_MS", "50")
        .envs(extra.iter().copied());
    cmd
}

fn late_workload(extra: &[(&str, &str)]) -> Workload {
    Workload::spawn(late_command(extra))
}

/// `exit`: the workload answers `ok exit` and exits 0.
fn exits_cleanly(w: Workload) {
    let (bye, status) = w.exit_status();
    assert_eq!((bye.as_str(), status.code()), ("ok exit", Some(0)), "{status}");
}

/// `load LIB`, `init`, `kernels late_gemm late_relu` (handles named before any observer), then
/// the background thread launching them. The replies, in order.
fn start_launching(w: &mut Workload, lib: &Path) -> Vec<String> {
    let mut replies = vec![w.cmd(&format!("load {}", lib.display())), w.cmd("init")];
    let k = w.cmd(&format!("kernels {}", KERNELS.join(" ")));
    assert!(
        k.starts_with("ok kernels late_gemm=0x") && k.contains(" late_relu=0x"),
        "kernels reply: {k:?}"
    );
    replies.push(k);
    let bg = w.cmd(BACKGROUND);
    assert_eq!(bg, "ok", "background reply");
    replies.push(bg);
    // Launching for a while before whatever comes next (a stop_background right away can find
    // no pass done).
    std::thread::sleep(Duration::from_millis(100));
    replies
}

/// `ok iterations=N max_gap_us=G launches=L`, parsed strictly.
#[derive(Debug, Clone, Copy)]
struct Progress {
    iterations: u64,
    max_gap_us: u64,
    launches: u64,
}

fn parse_progress(reply: &str) -> Progress {
    let f: Vec<&str> = reply.split(' ').collect();
    let num = |i: usize, key: &str| -> u64 {
        f.get(i)
            .and_then(|t| t.strip_prefix(key))
            .and_then(|t| t.strip_prefix('='))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("stop_background reply {reply:?}: no {key}=N as word {i}"))
    };
    assert_eq!((f.len(), f[0]), (4, "ok"), "stop_background reply {reply:?}");
    Progress {
        iterations: num(1, "iterations"),
        max_gap_us: num(2, "max_gap_us"),
        launches: num(3, "launches"),
    }
}

/// `stop_background`: progress made, every pass's launches made.
fn stop_background(w: &mut Workload, per_pass: u64, what: &str) -> (String, Progress) {
    let reply = w.cmd("stop_background");
    let p = parse_progress(&reply);
    assert!(p.iterations > 0, "{what}: the background loop made no pass: {reply:?}");
    assert_eq!(
        p.launches,
        p.iterations * per_pass,
        "{what}: launches are not {per_pass} per pass: {reply:?}"
    );
    (reply, p)
}

/// Another background round: the process still launches from a thread of its own.
fn another_round(w: &mut Workload, what: &str) -> Progress {
    assert_eq!(w.cmd("background launch:late_gemm sleep:1000"), "ok", "{what}");
    std::thread::sleep(Duration::from_millis(150));
    stop_background(w, 1, what).1
}

/// Mappings of the injected library's memfd at offset 0 (one per load).
fn memfd_mappings(pid: u32) -> usize {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let want = format!("/memfd:{MEMFD_NAME} (deleted)");
    maps.lines()
        .filter(|l| {
            let f: Vec<&str> = l.splitn(6, ' ').collect();
            f.len() == 6 && u64::from_str_radix(f[2], 16) == Ok(0) && f[5].trim_start() == want
        })
        .count()
}

/// The process's descriptors that are the injection's memfd.
fn memfd_fds(pid: u32) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|l| l.to_string_lossy().into_owned())
        .filter(|l| l.starts_with(&format!("/memfd:{MEMFD_NAME}")))
        .collect()
}

fn tasks(pid: u32) -> Vec<u32> {
    let mut t: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
                .collect()
        })
        .unwrap_or_default();
    t.sort_unstable();
    t
}

/// (tid, TracerPid) of every thread that is traced.
fn traced_threads(pid: u32) -> Vec<(u32, u32)> {
    tasks(pid)
        .into_iter()
        .filter_map(|tid| {
            let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).ok()?;
            let t: u32 = s
                .lines()
                .find_map(|l| l.strip_prefix("TracerPid:"))?
                .trim()
                .parse()
                .ok()?;
            (t != 0).then_some((tid, t))
        })
        .collect()
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    start.elapsed()
}

/// Nothing of an injection in the process: no mapping, no memfd, no tracer.
fn assert_untouched(pid: u32, what: &str) {
    assert_eq!(memfd_mappings(pid), 0, "{what}: a memfd mapping appeared in pid {pid}");
    assert_eq!(
        memfd_fds(pid),
        Vec::<String>::new(),
        "{what}: memfd descriptors in pid {pid}"
    );
    assert_eq!(traced_threads(pid), vec![], "{what}: threads of pid {pid} still traced");
}

/// What `inject_tool` did.
struct Tool {
    status: ExitStatus,
    line: Option<Value>,
    stdout: String,
    stderr: String,
}

impl Tool {
    fn run(pid: u32, lib: &Path, word: Option<&str>, die_at: Option<&str>, uid: Option<u32>) -> Tool {
        let mut cmd = Command::new(inject_tool_bin());
        cmd.arg(pid.to_string()).arg(lib).args(word).env_remove(DIE_AT_ENV);
        if let Some(step) = die_at {
            cmd.env(DIE_AT_ENV, step);
        }
        if let Some(u) = uid {
            cmd.uid(u).gid(u);
        }
        let out = cmd.output().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        Tool {
            status: out.status,
            line: stdout.lines().next().and_then(|l| serde_json::from_str(l).ok()),
            stdout,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    fn seen(&self) -> String {
        format!("{} stdout {:?} stderr {:?}", self.status, self.stdout, self.stderr)
    }

    /// The refusal's message, after checking its reason and what it says.
    fn refused(&self, reason: &str, says: &[&str]) -> String {
        assert!(self.status.success(), "inject_tool: {}", self.seen());
        let line = self
            .line
            .as_ref()
            .unwrap_or_else(|| panic!("no JSON line: {}", self.seen()));
        assert_eq!(
            (line["outcome"].as_str(), line["reason"].as_str()),
            (Some("refused"), Some(reason)),
            "inject_tool: {}",
            self.seen()
        );
        let msg = line["message"].as_str().unwrap_or_default().to_string();
        for s in says {
            assert!(msg.contains(s), "refusal message does not say {s:?}: {msg:?}");
        }
        msg
    }
}

fn of_pid<'a>(cap: &'a Captured, ty: &'a str, pid: u32) -> Vec<&'a Value> {
    cap.of_type(ty).filter(|e| e["pid"] == pid).collect()
}

fn gpu_timing_events(cap: &Captured, pid: u32) -> Vec<String> {
    of_pid(cap, "gpu_timing", pid)
        .iter()
        .map(|e| e["event"].as_str().unwrap_or("?").to_string())
        .collect()
}

fn cupti_states(cap: &Captured, pid: u32) -> Vec<String> {
    of_pid(cap, "cupti", pid)
        .iter()
        .map(|e| e["state"].as_str().unwrap_or("?").to_string())
        .collect()
}

/// What one observer run with GPU timing saw of the workload.
struct Window {
    kernels: usize,
    launches: usize,
    named: usize,
}

/// Every GPU kernel record joined to a launch of the background thread, named as that launch,
/// and every launch between the first and the last joined one got its kernel record; the
/// summary counts the same; launches from the first joined one on are all named.
fn assert_window(cap: &Captured, pid: u32, what: &str) -> Window {
    let launches = of_pid(cap, "launch", pid);
    let kernels = of_pid(cap, "gpu_kernel", pid);
    assert!(!kernels.is_empty(), "{what}: no gpu_kernel line for pid {pid}");
    let by_key: HashMap<(u64, u64), &Value> = launches
        .iter()
        .map(|l| ((l["tid"].as_u64().unwrap(), l["ts_ns"].as_u64().unwrap()), *l))
        .collect();
    assert_eq!(
        by_key.len(),
        launches.len(),
        "{what}: two launch lines with one tid and ts"
    );
    let mut claimed: BTreeMap<(u64, u64), usize> = BTreeMap::new();
    for g in &kernels {
        let ts = g["launch_ts_ns"]
            .as_u64()
            .unwrap_or_else(|| panic!("{what}: gpu_kernel not joined: {g}"));
        let name = g["kernel"].as_str().unwrap_or_default();
        assert!(
            KERNELS.contains(&name),
            "{what}: kernel {name:?} not one of {KERNELS:?}: {g}"
        );
        assert_eq!(g["api"], "cuLaunchKernel", "{what}: {g}");
        let key = (g["tid"].as_u64().unwrap(), ts);
        let launch = by_key
            .get(&key)
            .unwrap_or_else(|| panic!("{what}: gpu_kernel joined to no launch line: {g}"));
        assert_eq!(
            launch["kernel"], g["kernel"],
            "{what}: launch {launch} vs its record {g}"
        );
        *claimed.entry(key).or_default() += 1;
    }
    assert!(
        claimed.values().all(|&n| n == 1),
        "{what}: a launch got two kernel records"
    );
    let first = claimed.keys().map(|k| k.1).min().unwrap();
    let last = claimed.keys().map(|k| k.1).max().unwrap();
    let in_window = launches
        .iter()
        .filter(|l| (first..=last).contains(&l["ts_ns"].as_u64().unwrap()))
        .count();
    assert_eq!(
        in_window,
        kernels.len(),
        "{what}: {in_window} launches between the first and the last joined one ({first}..={last}), {} kernel records",
        kernels.len()
    );
    let unnamed_after: Vec<&&Value> = launches
        .iter()
        .filter(|l| l["ts_ns"].as_u64().unwrap() >= first && l["kernel"].is_null())
        .collect();
    assert!(
        unnamed_after.is_empty(),
        "{what}: {} launches from the first joined one on are unnamed, e.g. {}",
        unnamed_after.len(),
        unnamed_after[0]
    );
    let named = launches.iter().filter(|l| !l["kernel"].is_null()).count();
    let s = cap.process_summary(pid);
    let c = &s["cupti"];
    assert_eq!(
        (c["kernels"].as_u64(), c["joined"].as_u64(), c["unjoined"].as_u64()),
        (Some(kernels.len() as u64), Some(kernels.len() as u64), Some(0)),
        "{what}: summary cupti block vs {} gpu_kernel lines: {c}",
        kernels.len()
    );
    assert_eq!(
        (s["launches"].as_u64(), s["named_launches"].as_u64()),
        (Some(launches.len() as u64), Some(named as u64)),
        "{what}: summary launches vs {} launch lines ({named} named): {s}",
        launches.len()
    );
    assert_eq!(
        s["named_launches"].as_u64().unwrap() + s["unresolved_launches"].as_u64().unwrap(),
        s["launches"].as_u64().unwrap(),
        "{what}: named + unresolved != launches: {s}"
    );
    Window {
        kernels: kernels.len(),
        launches: launches.len(),
        named,
    }
}

fn observer_args(pid: u32, more: &[&str]) -> Vec<String> {
    let mut a = vec!["--pid".to_string(), pid.to_string(), "--no-nvml".into()];
    a.extend(more.iter().map(|s| s.to_string()));
    a
}

fn start_agent(dir: &Path, args: &[String]) -> Agent {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Agent::start(dir, &args)
}

#[test]
fn attach_inject_observe_withdraw_reattach() {
    let _g = serial();
    require_root();
    let dir = scratch("gpu-timing");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = late_workload(&[]);
    let pid = w.pid;
    start_launching(&mut w, &lib);
    std::thread::sleep(Duration::from_millis(200));
    assert_untouched(pid, "before any observer");

    // 1: inject, time the GPU for 2 s, withdraw, then uprobes only for a second.
    let d1 = dir.join("first");
    std::fs::create_dir_all(&d1).unwrap();
    let agent = start_agent(&d1, &observer_args(pid, &["--gpu-timing", "--gpu-timing-for", "2"]));
    agent.wait_stderr(
        &format!("GPU timing: loaded the CUPTI library into pid {pid}"),
        Duration::from_secs(15),
    );
    let threads = tasks(pid);
    assert_eq!(memfd_mappings(pid), 1, "after the injection");
    agent.wait_stderr(&format!("GPU timing withdrawn from pid {pid}"), Duration::from_secs(15));
    std::thread::sleep(Duration::from_secs(1));
    let cap = agent.stop();
    assert!(
        cap.status.success(),
        "observer: {}; stderr:\n{}",
        cap.status,
        cap.stderr.join("\n")
    );

    assert_eq!(gpu_timing_events(&cap, pid), ["injected", "withdrawn"], "first run");
    let inj = of_pid(&cap, "gpu_timing", pid)[0].clone();
    let pause = inj["pause_us"].as_u64().unwrap_or(u64::MAX);
    println!(
        "first injection: pause_us={pause} diverted_us={} tid={} (threads {threads:?})",
        inj["diverted_us"], inj["tid"]
    );
    assert!(pause <= PAUSE_BOUND_US, "pause_us {pause} > {PAUSE_BOUND_US}: {inj}");
    assert!(inj["diverted_us"].as_u64().is_some(), "{inj}");
    assert_eq!(inj["library"], format!("memfd:{MEMFD_NAME}"), "{inj}");
    let tid = inj["tid"].as_u64().unwrap() as u32;
    assert!(
        threads.contains(&tid),
        "borrowed tid {tid} is not a thread of {pid}: {threads:?}"
    );
    assert_eq!(cupti_states(&cap, pid), ["active", "idle"], "first run's cupti lines");
    let withdrawn = of_pid(&cap, "gpu_timing", pid)[1].clone();
    let first = assert_window(&cap, pid, "first run");
    let records = withdrawn["records"].as_u64().unwrap_or(0);
    assert!(
        records >= first.kernels as u64,
        "withdrawn records {records} < {} kernel records: {withdrawn}",
        first.kernels
    );
    let injected_at = inj["ts_ns"].as_u64().unwrap();
    let before: Vec<&Value> = of_pid(&cap, "launch", pid)
        .into_iter()
        .filter(|l| l["ts_ns"].as_u64().unwrap() < injected_at)
        .collect();
    assert!(
        before.iter().all(|l| l["kernel"].is_null()),
        "a launch before the injection was named: {:?}",
        before.iter().find(|l| !l["kernel"].is_null())
    );
    let summary = cap.process_summary(pid);
    assert_eq!(summary["cupti"]["state"], "idle", "{summary}");
    println!(
        "first run: {} launches ({} before the injection, {} named), {} kernel records, {records} records forwarded",
        first.launches,
        before.len(),
        first.named,
        first.kernels
    );
    let idle = cupti_stats(&mut w);
    assert_eq!(
        (
            idle["enabled_kinds"].clone(),
            idle["enable_calls"].as_u64(),
            idle["disable_calls"].as_u64(),
            idle["driver_apis"].as_u64()
        ),
        // Kernel, memcpy, memset, marker, and the whole DRIVER and RUNTIME kinds (a late
        // library does not use the per-API switches: none set, driver_apis 0).
        (serde_json::json!([]), Some(6), Some(6), Some(0)),
        "CUPTI after the withdraw: {idle}"
    );

    // 2: a second observer finds the library there, switches it on again, and off at its end.
    let d2 = dir.join("second");
    std::fs::create_dir_all(&d2).unwrap();
    let agent = start_agent(&d2, &observer_args(pid, &["--gpu-timing"]));
    agent.wait_stderr(
        &format!(
            "GPU timing: pid {pid} has the CUPTI library already (loaded by an earlier --gpu-timing: switched on again)"
        ),
        Duration::from_secs(15),
    );
    agent.wait_line(
        |v| v["type"] == "gpu_kernel" && v["pid"] == pid && v["launch_ts_ns"].is_u64(),
        Duration::from_secs(15),
    );
    std::thread::sleep(Duration::from_millis(500));
    let cap2 = agent.stop();
    assert!(
        cap2.status.success(),
        "second observer: {}; stderr:\n{}",
        cap2.status,
        cap2.stderr.join("\n")
    );
    assert_eq!(
        gpu_timing_events(&cap2, pid),
        ["already_loaded", "withdrawn"],
        "second run"
    );
    let again = of_pid(&cap2, "gpu_timing", pid)[0].clone();
    assert_eq!(again["late"], true, "{again}");
    assert_eq!(
        memfd_mappings(pid),
        1,
        "a second memfd mapping after the second observer"
    );
    assert_eq!(
        memfd_fds(pid),
        Vec::<String>::new(),
        "the memfd is closed after the load"
    );
    assert_eq!(cupti_states(&cap2, pid), ["active", "idle"], "second run's cupti lines");
    let second = assert_window(&cap2, pid, "second run");
    let records2 = of_pid(&cap2, "gpu_timing", pid)[1]["records"].as_u64().unwrap_or(0);
    assert!(records2 >= second.kernels as u64, "second withdraw: {records2} records");
    println!(
        "second run: {} launches ({} named), {} kernel records, {records2} records",
        second.launches, second.named, second.kernels
    );
    let idle = cupti_stats(&mut w);
    assert_eq!(
        (
            idle["enabled_kinds"].clone(),
            idle["enable_calls"].as_u64(),
            idle["disable_calls"].as_u64()
        ),
        (serde_json::json!([]), Some(12), Some(12)),
        "CUPTI after the second withdraw: {idle}"
    );

    // The program went on all along, untouched in what it says.
    let (reply, p) = stop_background(&mut w, LAUNCHES_PER_PASS, "after both observers");
    println!("workload: {reply}");
    assert!(
        p.max_gap_us < MAX_GAP_BOUND_US,
        "the background loop was held up {} µs (bound {MAX_GAP_BOUND_US}): {reply}",
        p.max_gap_us
    );
    assert_eq!(traced_threads(pid), vec![], "threads still traced");
    let (bye, status) = w.exit_status();
    assert_eq!(
        (bye.as_str(), status.code()),
        ("ok exit", Some(0)),
        "workload exit: {status}"
    );
}

/// The injection killed (SIGKILL) at each of its steps: the target never notices more than a
/// pause; a thread sent into the loader code waits ~2 s for the observer, gives up (closing its
/// memfd) and goes back to its system call; after `go` the library is loaded, idle.
#[test]
fn sigkill_at_every_step_leaves_the_target_running() {
    let _g = serial();
    require_root();
    let start = Instant::now();
    let lib = fixtures().join("libcuda.so.1");
    let mut cases: Vec<Option<&str>> = STEPS.iter().copied().map(Some).collect();
    cases.push(None);
    let mut seen = Vec::new();
    for die_at in cases {
        let label = die_at.unwrap_or("(nowhere)");
        let what = format!("killed at {label}");
        let mut w = late_workload(&[]);
        let pid = w.pid;
        w.cmd(&format!("load {}", lib.display()));
        w.cmd("init");
        w.cmd("kernels late_gemm");
        assert_eq!(w.cmd("background launch:late_gemm sleep:1000"), "ok");
        std::thread::sleep(Duration::from_millis(100));
        let t = Tool::run(pid, &injection_lib(), Some("on"), die_at, None);
        match die_at {
            Some(_) => {
                assert_eq!(
                    t.status.signal(),
                    Some(libc::SIGKILL),
                    "{what}: inject_tool {}",
                    t.seen()
                );
                assert_eq!(t.stdout, "", "{what}: it printed before dying");
            }
            None => {
                assert!(t.status.success(), "{what}: {}", t.seen());
                let line = t.line.clone().unwrap_or_default();
                assert_eq!(line["outcome"], "injected", "{what}: {}", t.seen());
                let pause = line["pause_us"].as_u64().unwrap_or(u64::MAX);
                assert!(pause <= PAUSE_BOUND_US, "{what}: pause_us {pause}: {line}");
                seen.push(format!("(nowhere): pause_us={pause}"));
            }
        }
        // A thread that runs the loader code on its own: its memfd appears, stays ~2 s (the
        // wait for `go`), and is closed when it gives up.
        let waits = matches!(die_at, Some("regs_set" | "released" | "memfd" | "half_written"));
        let loads = matches!(die_at, None | Some("go"));
        if waits {
            wait_until(&format!("{what}: the memfd"), Duration::from_secs(2), || {
                !memfd_fds(pid).is_empty()
            });
            let held = wait_until(&format!("{what}: the memfd closed"), Duration::from_secs(8), || {
                memfd_fds(pid).is_empty()
            });
            seen.push(format!("{label}: memfd open {} ms more", held.as_millis()));
        } else if loads {
            wait_until(&format!("{what}: the library mapped"), Duration::from_secs(5), || {
                memfd_mappings(pid) == 1 && memfd_fds(pid).is_empty()
            });
        }
        assert_eq!(
            memfd_mappings(pid),
            usize::from(loads),
            "{what}: memfd mappings in pid {pid}"
        );
        assert_eq!(memfd_fds(pid), Vec::<String>::new(), "{what}: memfd left open");
        assert_eq!(traced_threads(pid), vec![], "{what}: still traced");
        let (reply, p) = stop_background(&mut w, 1, &what);
        let again = another_round(&mut w, &what);
        seen.push(format!("{label}: {reply}; then {} passes", again.iterations));
        assert!(p.iterations > 0 && again.iterations > 0, "{what}");
        assert_eq!(memfd_mappings(pid), usize::from(loads), "{what}: at the end");
        let (bye, status) = w.exit_status();
        assert_eq!(
            (bye.as_str(), status.code()),
            ("ok exit", Some(0)),
            "{what}: exit {status}"
        );
    }
    println!("{}", seen.join("\n"));
    println!("sigkill_at_every_step: {:.1} s", start.elapsed().as_secs_f64());
    assert!(start.elapsed() < Duration::from_secs(90), "took {:?}", start.elapsed());
}

/// A process that has not loaded libcuda: the workload before `load`, and a static program.
#[test]
fn refusal_no_libcuda() {
    let _g = serial();
    require_root();
    let mut w = late_workload(&[]);
    let pid = w.pid;
    let t = Tool::run(pid, &injection_lib(), Some("on"), None, None);
    t.refused("no_libcuda", &[&format!("pid {pid} has not loaded libcuda")]);
    assert_untouched(pid, "no_libcuda");
    // It loads and launches as ever.
    start_launching(&mut w, &fixtures().join("libcuda.so.1"));
    stop_background(&mut w, LAUNCHES_PER_PASS, "no_libcuda");
    exits_cleanly(w);

    let (mut child, spid) = spawn_ready(Command::new(fixtures().join("static_sleeper")), "ready");
    let t = Tool::run(spid, &injection_lib(), None, None, None);
    t.refused("no_libcuda", &[&format!("pid {spid} has not loaded libcuda")]);
    assert_untouched(spid, "static_sleeper");
    assert_eq!(finish(&mut child).code(), Some(0), "static_sleeper's exit");
}

/// A program with no glibc dynamic loader that maps a file named libcuda.so.1 (compiled here,
/// statically): the loader check's refusal. (static_sleeper maps no libcuda, so it is refused
/// before that check.)
#[test]
fn refusal_no_loader() {
    let _g = serial();
    require_root();
    let dir = scratch("gpu-timing-noloader");
    let src = dir.join("static_mapper.c");
    std::fs::write(
        &src,
        r#"#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    char b[64];
    int fd = argc == 2 ? open(argv[1], O_RDONLY) : -1;
    if (fd < 0 || mmap(0, 4096, PROT_READ, MAP_PRIVATE, fd, 0) == MAP_FAILED)
        return 1;
    close(fd);
    if (write(1, "ready\n", 6) != 6)
        return 1;
    while (read(0, b, sizeof b) > 0)
        ;
    return 0;
}
"#,
    )
    .unwrap();
    let bin = dir.join("static_mapper");
    let cc = Command::new("gcc")
        .args(["-static", "-O2", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .expect("gcc");
    assert!(
        cc.status.success(),
        "gcc -static: {}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let cuda = fresh_lib(&dir, "libcuda.so.1");
    let mut cmd = Command::new(&bin);
    cmd.arg(&cuda);
    let (mut child, pid) = spawn_ready(cmd, "ready");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(
        maps.contains(cuda.to_str().unwrap()) && !maps.contains("libc.so.6") && !maps.contains("ld-linux"),
        "the static mapper's maps:\n{maps}"
    );
    let t = Tool::run(pid, &injection_lib(), None, None, None);
    t.refused("no_loader", &[&format!("pid {pid} has no glibc dynamic loader")]);
    assert_untouched(pid, "no_loader");
    assert_eq!(finish(&mut child).code(), Some(0), "static mapper's exit");
}

/// Another tracer holds the process (ptrace_hold): refused by inject_tool and by the observer,
/// which observes the process with uprobes all the same.
#[test]
fn refusal_traced() {
    let _g = serial();
    require_root();
    let dir = scratch("gpu-timing-traced");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = late_workload(&[]);
    let pid = w.pid;
    start_launching(&mut w, &lib);
    let mut hold_cmd = Command::new(fixtures().join("ptrace_hold"));
    hold_cmd.arg(pid.to_string());
    let (mut holder, _) = spawn_ready(hold_cmd, "held");
    let hpid = holder.id();
    assert_eq!(
        traced_threads(pid),
        vec![(pid, hpid)],
        "ptrace_hold holds the main thread"
    );
    let says = format!("pid {pid} is already traced by pid {hpid} (ptrace_hold)");
    let t = Tool::run(pid, &injection_lib(), Some("on"), None, None);
    let msg = t.refused("traced", &[&says]);

    let agent = start_agent(&dir, &observer_args(pid, &["--gpu-timing"]));
    agent.wait_stderr(&format!("GPU timing refused for pid {pid}"), Duration::from_secs(15));
    agent.wait_line(|v| v["type"] == "launch" && v["pid"] == pid, Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(300));
    let cap = agent.stop();
    assert!(cap.status.success(), "observer: {}", cap.status);
    assert_eq!(gpu_timing_events(&cap, pid), ["refused"], "traced");
    let refused = of_pid(&cap, "gpu_timing", pid)[0].clone();
    assert_eq!(
        (refused["reason"].as_str(), refused["message"].as_str()),
        (Some("traced"), Some(msg.as_str())),
        "{refused}"
    );
    let line = format!("GPU timing refused for pid {pid}: {msg}; observing it with uprobes only");
    assert!(
        cap.stderr.iter().any(|l| l.ends_with(&line)),
        "no {line:?} in stderr:\n{}",
        cap.stderr.join("\n")
    );
    let launches = of_pid(&cap, "launch", pid).len();
    assert!(launches > 0, "no launch lines for the refused process");
    assert_eq!(
        (of_pid(&cap, "gpu_kernel", pid).len(), of_pid(&cap, "cupti", pid).len()),
        (0, 0),
        "GPU lines for a refused process"
    );
    println!("traced: {launches} launches observed with uprobes; refusal: {msg}");

    drop(holder.stdin.take());
    assert_eq!(holder.wait().unwrap().code(), Some(0), "ptrace_hold's exit");
    assert_untouched(pid, "traced");
    stop_background(&mut w, LAUNCHES_PER_PASS, "traced");
    exits_cleanly(w);
}

/// inject_tool as nobody (no CAP_SYS_PTRACE) against a workload run as `owner`: refused as
/// ptrace_denied with `says` in the message, the workload untouched.
fn ptrace_denied_case(owner: Option<u32>, says: &str, label: &str) {
    let _g = serial();
    require_root();
    let dir = scratch(&format!(
        "gpu-timing-denied-{}",
        owner.map_or("root".into(), |u| u.to_string())
    ));
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut cmd = late_command(&[]);
    if let Some(u) = owner {
        cmd.uid(u).gid(u);
    }
    let mut w = Workload::spawn(cmd);
    let pid = w.pid;
    start_launching(&mut w, &lib);
    let t = Tool::run(pid, &injection_lib(), Some("on"), None, Some(NOBODY));
    let msg = t.refused("ptrace_denied", &[says]);
    println!("{label}: {msg}");
    assert_untouched(pid, label);
    stop_background(&mut w, LAUNCHES_PER_PASS, label);
    exits_cleanly(w);
}

/// No permission to trace, against a process of nobody's own: the capability check's refusal.
#[test]
fn refusal_ptrace_denied() {
    ptrace_denied_case(
        Some(NOBODY),
        "gpu-observer lacks CAP_SYS_PTRACE",
        "nobody → nobody's process",
    );
}

/// The same against a process of root's: the kernel already refuses to show nobody its maps.
#[test]
fn refusal_ptrace_denied_for_another_users_process() {
    ptrace_denied_case(None, "CAP_SYS_PTRACE", "nobody → root's process");
}

/// `--gpu-timing-for` shorter than the injection takes: the library must still be switched off
/// once it is in, not left collecting until the observer ends.
#[test]
fn a_window_shorter_than_the_injection_is_still_withdrawn() {
    let _g = serial();
    require_root();
    let dir = scratch("gpu-timing-short");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = late_workload(&[]);
    let pid = w.pid;
    start_launching(&mut w, &lib);
    let agent = start_agent(
        &dir,
        &observer_args(pid, &["--gpu-timing", "--gpu-timing-for", "0.001"]),
    );
    agent.wait_stderr(
        &format!("GPU timing: loaded the CUPTI library into pid {pid}"),
        Duration::from_secs(15),
    );
    agent.wait_stderr(&format!("GPU timing withdrawn from pid {pid}"), Duration::from_secs(4));
    std::thread::sleep(Duration::from_secs(1));
    let cap = agent.stop();
    assert_eq!(gpu_timing_events(&cap, pid), ["injected", "withdrawn"]);
    let states = cupti_states(&cap, pid);
    assert_ne!(states.last().map(String::as_str), Some("active"), "{states:?}");
    stop_background(&mut w, LAUNCHES_PER_PASS, "short window");
}

/// Another profiler holds CUPTI (the fake's FAKE_CUPTI_BUSY): the library is loaded, says busy,
/// and the observer reports the refusal, switches it off, and observes with uprobes.
#[test]
fn refusal_cupti_busy() {
    let _g = serial();
    require_root();
    let dir = scratch("gpu-timing-busy");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = late_workload(&[("FAKE_CUPTI_BUSY", "1")]);
    let pid = w.pid;
    start_launching(&mut w, &lib);
    let agent = start_agent(&dir, &observer_args(pid, &["--gpu-timing"]));
    agent.wait_stderr(&format!("GPU timing refused for pid {pid}"), Duration::from_secs(15));
    std::thread::sleep(Duration::from_millis(300));
    let cap = agent.stop();
    assert!(cap.status.success(), "observer: {}", cap.status);
    assert_eq!(gpu_timing_events(&cap, pid), ["injected", "refused"], "busy");
    let refused = of_pid(&cap, "gpu_timing", pid)[1].clone();
    assert_eq!(refused["reason"], "cupti_busy", "{refused}");
    let msg = refused["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(&format!("CUPTI in pid {pid} is held by another profiler")),
        "{refused}"
    );
    let line = format!("GPU timing refused for pid {pid}: {msg}; observing it with uprobes only");
    assert!(
        cap.stderr.iter().any(|l| l.ends_with(&line)),
        "no {line:?} in stderr:\n{}",
        cap.stderr.join("\n")
    );
    assert_eq!(cupti_states(&cap, pid), ["busy"], "busy: cupti lines");
    assert_eq!(of_pid(&cap, "gpu_kernel", pid).len(), 0, "GPU records while busy");
    let launches = of_pid(&cap, "launch", pid).len();
    assert!(launches > 0, "no launch lines for the busy process");
    assert_eq!(cap.process_summary(pid)["cupti"]["state"], "busy");
    // The library is in (it was what found CUPTI busy), once; it enabled nothing.
    assert_eq!(memfd_mappings(pid), 1, "busy: the injected library");
    let stats = cupti_stats(&mut w);
    assert_eq!(stats["enabled_kinds"], serde_json::json!([]), "{stats}");
    assert_eq!(traced_threads(pid), vec![]);
    println!("busy: {launches} launches observed with uprobes; {msg}");
    stop_background(&mut w, LAUNCHES_PER_PASS, "busy");
    exits_cleanly(w);
}

/// The library needs a newer glibc than the process has: a copy whose needed versions say
/// GLIBC_9.x instead of GLIBC_2.x (`GLIBC_2.3` → `GLIBC_9.3` in .dynstr only).
#[test]
fn refusal_glibc_too_old() {
    let _g = serial();
    require_root();
    let dir = scratch("gpu-timing-glibc");
    let mut bytes = std::fs::read(injection_lib()).unwrap();
    let (off, len) = section(&bytes, ".dynstr").expect("the library's .dynstr");
    let mut patched = 0;
    let mut i = off;
    while i + 9 <= off + len {
        if &bytes[i..i + 9] == b"GLIBC_2.3" {
            bytes[i + 6] = b'9';
            patched += 1;
        }
        i += 1;
    }
    assert!(patched > 0, "no GLIBC_2.3 in the library's .dynstr");
    let need = newest_glibc(&bytes[off..off + len]).expect("GLIBC versions");
    let old = dir.join("libgpu_observer_cupti.so");
    std::fs::write(&old, &bytes).unwrap();

    let cuda = fresh_lib(&dir, "libcuda.so.1");
    let mut w = late_workload(&[]);
    let pid = w.pid;
    start_launching(&mut w, &cuda);
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let libc_path = maps
        .lines()
        .filter_map(|l| l.splitn(6, ' ').nth(5).map(str::trim_start))
        .find(|p| p.ends_with("/libc.so.6"))
        .expect("the workload maps libc.so.6")
        .to_string();
    let libc_bytes = std::fs::read(&libc_path).unwrap();
    let (loff, llen) = section(&libc_bytes, ".dynstr").expect("libc's .dynstr");
    let have = newest_glibc(&libc_bytes[loff..loff + llen]).expect("libc's versions");
    let t = Tool::run(pid, &old, Some("on"), None, None);
    let msg = t.refused(
        "glibc",
        &[&format!(
            "pid {pid}'s glibc is {} but {} needs glibc {}",
            show(have),
            old.display(),
            show(need)
        )],
    );
    println!("glibc ({patched} names patched): {msg}");
    assert_untouched(pid, "glibc");
    stop_background(&mut w, LAUNCHES_PER_PASS, "glibc");
    exits_cleanly(w);
}

/// The workload's replies for one command sequence, with GPU timing given to it and withdrawn
/// half way, and without: the same, apart from the numbers that count passes and time.
#[test]
fn the_programs_output_is_unchanged_by_gpu_timing() {
    let _g = serial();
    require_root();
    let dir = scratch("gpu-timing-output");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let plain = transcript(&dir, &lib, false);
    let timed = transcript(&dir, &lib, true);
    println!("transcript:\n{}", timed.join("\n"));
    assert_eq!(plain, timed, "the workload's replies differ with GPU timing");
}

fn transcript(dir: &Path, lib: &Path, gpu_timing: bool) -> Vec<String> {
    let mut w = late_workload(&[]);
    let pid = w.pid;
    let mut t = start_launching(&mut w, lib);
    std::thread::sleep(Duration::from_millis(200));
    if gpu_timing {
        let d = dir.join("observer");
        std::fs::create_dir_all(&d).unwrap();
        let agent = start_agent(&d, &observer_args(pid, &["--gpu-timing", "--gpu-timing-for", "1"]));
        agent.wait_stderr(&format!("GPU timing withdrawn from pid {pid}"), Duration::from_secs(15));
        let cap = agent.stop();
        assert_eq!(gpu_timing_events(&cap, pid), ["injected", "withdrawn"]);
        assert!(!of_pid(&cap, "gpu_kernel", pid).is_empty(), "no GPU records");
        assert_eq!(memfd_mappings(pid), 1);
    } else {
        std::thread::sleep(Duration::from_millis(1500));
        assert_untouched(pid, "no GPU timing");
    }
    // Each run of digits → N.
    let numbers = |s: &str| -> String {
        let mut out = String::new();
        for c in s.chars() {
            if !c.is_ascii_digit() {
                out.push(c);
            } else if !out.ends_with('N') {
                out.push('N');
            }
        }
        out
    };
    let (reply, _) = stop_background(&mut w, LAUNCHES_PER_PASS, "transcript");
    t.push(numbers(&reply));
    let run = dir.join(format!("run-{gpu_timing}.jsonl"));
    t.push(w.cmd(&format!("run 1 1 {}", run.display())));
    let l = w.cmd("loop 100 launch:late_gemm sleep:1000");
    assert!(l.starts_with("ok loop "), "{l}");
    t.push(numbers(&l));
    t.push(w.cmd("background launch:late_relu sleep:500"));
    std::thread::sleep(Duration::from_millis(100));
    let (reply, _) = stop_background(&mut w, 1, "transcript");
    t.push(numbers(&reply));
    let (bye, status) = w.exit_status();
    assert_eq!(status.code(), Some(0), "workload exit: {status}");
    t.push(bye);
    t
}

/// A child that says `word` first (static_sleeper, ptrace_hold, the static mapper): it and its
/// pid.
fn spawn_ready(mut cmd: Command, word: &str) -> (Child, u32) {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, format!("{word}\n"), "{cmd:?} said {line:?}");
    let pid = child.id();
    (child, pid)
}

/// EOF on its stdin; its exit status.
fn finish(child: &mut Child) -> ExitStatus {
    if let Some(mut s) = child.stdin.take() {
        let _ = s.flush();
    }
    child.wait().unwrap()
}

/// (file offset, size) of an ELF64 section.
fn section(elf: &[u8], name: &str) -> Option<(usize, usize)> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?) as usize);
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?) as usize);
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?) as usize);
    let (shoff, size, count, names) = (u64_at(0x28)?, u16_at(0x3a)?, u16_at(0x3c)?, u16_at(0x3e)?);
    let names_at = u64_at(shoff + names * size + 0x18)?;
    (0..count).find_map(|i| {
        let h = shoff + i * size;
        let n = names_at + u32_at(h)?;
        let end = n + elf.get(n..)?.iter().position(|&b| b == 0)?;
        (&elf[n..end] == name.as_bytes()).then(|| Some((u64_at(h + 0x18)?, u64_at(h + 0x20)?)))?
    })
}

/// The newest `GLIBC_x.y[.z]` among a string table's strings.
fn newest_glibc(strtab: &[u8]) -> Option<(u32, u32, u32)> {
    strtab
        .split(|&b| b == 0)
        .filter_map(|s| std::str::from_utf8(s).ok()?.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut p = v.split('.').map(|n| n.parse::<u32>().ok());
            Some((p.next()??, p.next()??, p.next().flatten().unwrap_or(0)))
        })
        .max()
}

fn show(v: (u32, u32, u32)) -> String {
    if v.2 == 0 {
        format!("{}.{}", v.0, v.1)
    } else {
        format!("{}.{}.{}", v.0, v.1, v.2)
    }
}
