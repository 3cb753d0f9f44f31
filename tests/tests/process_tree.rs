//! Real jobs are process trees: `run` and `--pid` follow the descendants of the process —
//! forked, forked and exec'd, started through a shell, before or after the observer attached —
//! and `--no-children` sees none of them. Every call of every worker exact.

use std::{path::Path, time::Duration};

use gpu_observer_tests::*;

const CALLS_PER_RUN: usize = 75;
const WORKERS: [&str; 3] = ["fork", "exec", "shell"];

/// Each worker's pid (from the pid file it wrote) and its ledger.
fn workers(dir: &Path) -> Vec<(u32, Vec<serde_json::Value>)> {
    WORKERS
        .iter()
        .map(|w| {
            let pid = std::fs::read_to_string(dir.join(format!("{w}.cmd.pid")))
                .unwrap_or_else(|e| panic!("worker {w} wrote no pid: {e}"))
                .trim()
                .parse()
                .unwrap();
            let calls = expected_calls(&dir.join(format!("{w}.jsonl")));
            assert_eq!(calls.len(), 3 * CALLS_PER_RUN, "worker {w}'s ledger");
            (pid, calls)
        })
        .collect()
}

fn assert_every_worker_exact(dir: &Path, cap: &Captured) {
    for (pid, calls) in workers(dir) {
        assert_exact(&calls, cap, pid);
        assert_eq!(cap.process_summary(pid)["exited"], true, "pid {pid} in the summary");
    }
}

/// The launcher (cuda_workload) starts three workers that each load the fake libcuda and run
/// 3 rounds; it waits for them.
fn launch(cmd: &mut dyn FnMut(&str) -> String, dir: &Path, lib: &Path, delay_ms: u64) {
    let reply = cmd(&format!("workers {} 3 {} {delay_ms}", lib.display(), dir.display()));
    assert!(reply.starts_with("ok workers"), "{reply}");
}

#[test]
fn run_follows_forked_execd_and_shell_started_workers() {
    let _g = serial();
    require_root();
    let dir = scratch("tree-run");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut r = RunAgent::start(
        &dir,
        &[
            "--trace-all",
            "--interval-ms",
            "100",
            "--no-nvml",
            "--libcuda",
            lib.to_str().unwrap(),
        ],
        &[],
    );
    launch(&mut |c| r.cmd(c), &dir, &lib, 0);
    assert_eq!(r.cmd("wait_workers"), "ok wait_workers");
    let cap = r.finish();
    assert_every_worker_exact(&dir, &cap);
}

#[test]
fn pid_follows_workers_started_after_it_attached() {
    let _g = serial();
    require_root();
    let dir = scratch("tree-pid-before");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = Workload::start();
    let agent = Agent::start(&dir, &["--pid", &w.pid.to_string(), "--libcuda", lib.to_str().unwrap()]);
    launch(&mut |c| w.cmd(c), &dir, &lib, 0);
    assert_eq!(w.cmd("wait_workers"), "ok wait_workers");
    let cap = agent.stop();
    assert_every_worker_exact(&dir, &cap);
    w.exit();
}

#[test]
fn pid_follows_workers_that_run_before_it_attached() {
    let _g = serial();
    require_root();
    let dir = scratch("tree-pid-after");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = Workload::start();
    // The workers load libcuda and wait 2.5 s before their calls: the agent attaches meanwhile,
    // finds them below the launcher in /proc, and their library in their maps.
    launch(&mut |c| w.cmd(c), &dir, &lib, 2500);
    std::thread::sleep(Duration::from_millis(300));
    let agent = Agent::start(&dir, &["--pid", &w.pid.to_string()]);
    agent.wait_stderr("following pid", Duration::from_secs(5));
    agent.wait_stderr(&format!("attached {}", lib.display()), Duration::from_secs(5));
    assert_eq!(w.cmd("wait_workers"), "ok wait_workers");
    let cap = agent.stop();
    assert_every_worker_exact(&dir, &cap);
    w.exit();
}

#[test]
fn no_children_sees_none_of_the_workers() {
    let _g = serial();
    require_root();
    let dir = scratch("tree-no-children");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut w = Workload::start();
    let agent = Agent::start(
        &dir,
        &[
            "--pid",
            &w.pid.to_string(),
            "--no-children",
            "--libcuda",
            lib.to_str().unwrap(),
        ],
    );
    launch(&mut |c| w.cmd(c), &dir, &lib, 0);
    assert_eq!(w.cmd("wait_workers"), "ok wait_workers");
    let cap = agent.stop();
    let pids: Vec<u32> = workers(&dir).into_iter().map(|(p, _)| p).collect();
    let theirs = cap.count(|e| e["pid"].as_u64().is_some_and(|p| pids.contains(&(p as u32))));
    assert_eq!(theirs, 0, "--no-children: no line of a worker");
    w.exit();
}
