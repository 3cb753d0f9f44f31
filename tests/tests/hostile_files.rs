//! Issue 10, items 1–3: library files that an unprivileged user's process maps must not crash,
//! hang or steer the root agent, nor make it hold unbounded probes. The hostile processes run
//! as uid 65534 (or, for the mount tricks, as root in a mount namespace of their own: `unshare
//! -m`, as a user with user + mount namespaces could) and use tests/fixtures/hostile_maps.c.

use std::{
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use gpu_observer_tests::*;

const NOBODY: u32 = 65534;

/// The agent's uprobe-multi links on files under `dir`: its `anon_inode:bpf_link` fds whose
/// fdinfo names such a file (the kernel shows the path of the inode the link holds). Counted by
/// path because other processes on the machine may map libcuda too.
fn links_under(pid: u32, dir: &Path) -> usize {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    let prefix = format!("path:\t{}/", dir.display());
    fds.flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:bpf_link"))
        .filter(|e| {
            std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", e.file_name().to_string_lossy()))
                .is_ok_and(|info| info.lines().any(|l| l.starts_with(&prefix)))
        })
        .count()
}

/// Whether a process still runs (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().map(|r| !r.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

/// Lines of the agent's stderr containing every one of `needles`.
fn lines_with(agent: &Agent, needles: &[&str]) -> Vec<String> {
    agent
        .stderr()
        .into_iter()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .collect()
}

/// Waits until `n` stderr lines contain every needle (or the agent dies, or `timeout`).
fn wait_lines(agent: &Agent, needles: &[&str], n: usize, timeout: Duration) -> usize {
    let start = Instant::now();
    loop {
        let got = lines_with(agent, needles).len();
        if got >= n || start.elapsed() > timeout || !alive(agent.pid()) {
            return got;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stops the agent and fails the test with how it died, if it did.
fn assert_alive(agent: Agent, what: &str) -> Agent {
    if alive(agent.pid()) {
        return agent;
    }
    let cap = agent.finish();
    panic!(
        "gpu-observer died {what}: {}; stderr:\n{}",
        cap.status,
        cap.stderr.join("\n")
    );
}

/// A directory the unprivileged user owns.
fn user_dir(dir: &Path, name: &str) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    std::os::unix::fs::chown(&d, Some(NOBODY), Some(NOBODY)).unwrap();
    d
}

/// hostile_maps as the unprivileged user.
fn hostile(args: &[&str]) -> Workload {
    let mut cmd = Command::new(fixtures().join("hostile_maps"));
    cmd.args(args).uid(NOBODY).gid(NOBODY);
    Workload::spawn(cmd)
}

/// cuda_workload in a mount namespace of its own, with `lib` loaded; None (and why, on
/// stderr) if this kernel refuses mount namespaces.
fn workload_in_own_namespace(lib: &Path) -> Option<Workload> {
    let probe = Command::new("unshare")
        .args(["-m", "--propagation", "private", "true"])
        .output()
        .expect("run unshare (util-linux)");
    if !probe.status.success() {
        eprintln!(
            "SKIPPED: the kernel refuses a mount namespace: {}",
            String::from_utf8_lossy(&probe.stderr)
        );
        return None;
    }
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "--propagation", "private"])
        .arg(fixtures().join("cuda_workload"));
    let mut w = Workload::spawn(cmd);
    w.cmd(&format!("load {}", lib.display()));
    Some(w)
}

/// Runs `script` in the mount namespace of `pid`.
fn in_namespace_of(pid: u32, script: &str) {
    let out = Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-m", "--", "sh", "-ec", script])
        .output()
        .expect("run nsenter (util-linux)");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The refusals of the agent's last stderr line about library files (said at exit): other
/// processes on the machine may add attachments, not refusals.
fn refusals(cap: &Captured) -> &str {
    let line = cap
        .stderr
        .iter()
        .rev()
        .find(|l| l.starts_with("gpu-observer: libraries: "))
        .unwrap_or_else(|| panic!("no `libraries:` line: {:?}", cap.stderr));
    let at = line.find(" released, ").expect("released count") + " released, ".len();
    &line[at..]
}

/// Item 1: a user truncates and re-extends the libcuda.so.N files it maps, over and over, while
/// the agent parses them (a mapping of the file would fault with SIGBUS). The agent survives,
/// refuses each file once (it claims 2 097 152 symbols), and observes a normal workload exactly.
#[test]
fn a_library_truncated_while_parsed_cannot_crash_the_agent() {
    let _g = serial();
    require_root();
    let dir = scratch("truncate");
    let agent = Agent::start(&dir, &[]);
    let mut w = Workload::loaded(&dir);
    let wlib = dir.join("lib/libcuda.so.1");
    assert_eq!(
        wait_lines(
            &agent,
            &["gpu-observer: attached ", wlib.to_str().unwrap()],
            1,
            Duration::from_secs(5)
        ),
        1
    );
    let files = user_dir(&dir, "hostile");
    let h = hostile(&["truncate", files.to_str().unwrap(), "8"]);
    let hpid = format!("mapped by pid {} ", h.pid);
    let refused = wait_lines(
        &agent,
        &["refused", &hpid, "[too_many_symbols]"],
        8,
        Duration::from_secs(10),
    );
    // Several more rescans while the files keep changing.
    std::thread::sleep(Duration::from_millis(1000));
    let agent = assert_alive(agent, "while a user truncated the libraries it maps");
    assert_eq!(refused, 8, "{:?}", agent.stderr());
    // Said once per file, not once per rescan.
    assert_eq!(lines_with(&agent, &["refused", &hpid]).len(), 8);
    let exp = dir.join("expected.jsonl");
    w.cmd(&format!("run 2 3 {}", exp.display()));
    h.exit();
    let pid = w.pid;
    w.exit();
    assert_eq!(
        wait_lines(
            &agent,
            &["released", dir.join("lib").to_str().unwrap()],
            1,
            Duration::from_secs(5)
        ),
        1
    );
    let cap = agent.stop();
    assert!(cap.status.success(), "{}", cap.status);
    let expected = expected_calls(&exp).len();
    assert_eq!(
        cap.count(|e| is_event(e) && e["pid"] == pid && e["api"].is_string()),
        expected
    );
    assert_eq!(refusals(&cap), "8 refused (too_many_symbols 8)");
}

/// Item 2a: a process maps ~/x/libcuda.so.1, then a FIFO is bind-mounted over that path in its
/// mount namespace. Opening it for reading would block the agent for good; the agent refuses it
/// at once (said once, counted), observes another process exactly, and stops on SIGINT.
#[test]
fn a_fifo_bind_mounted_over_a_mapped_library_is_refused_without_blocking() {
    let _g = serial();
    require_root();
    let dir = scratch("fifo");
    let lib = fresh_lib(&dir.join("hostile"), "libcuda.so.1");
    let Some(h) = workload_in_own_namespace(&lib) else {
        return;
    };
    let fifo = dir.join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    in_namespace_of(h.pid, &format!("mount --bind {} {}", fifo.display(), lib.display()));
    let mut w = Workload::loaded(&dir);
    let agent = Agent::start(&dir, &[]);
    let hpid = format!("mapped by pid {} ", h.pid);
    assert_eq!(wait_lines(&agent, &["refused", &hpid], 1, Duration::from_secs(5)), 1);
    let line = &lines_with(&agent, &["refused", &hpid])[0];
    assert!(
        line.contains(&format!(
            "{} (in pid {}) is a FIFO (named pipe), not a library file",
            lib.display(),
            h.pid
        )) && line.ends_with("[not_regular_file]"),
        "{line}"
    );
    agent.wait_stderr(&format!("mapped by pid {} ", w.pid), Duration::from_secs(5));
    let exp = dir.join("expected.jsonl");
    w.cmd(&format!("run 1 4 {}", exp.display()));
    std::thread::sleep(Duration::from_millis(600));
    let pid = w.pid;
    let start = Instant::now();
    let cap = agent.stop();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "SIGINT took {:?}",
        start.elapsed()
    );
    assert!(cap.status.success(), "{}", cap.status);
    assert_eq!(
        cap.count(|e| is_event(e) && e["pid"] == pid && e["api"].is_string()),
        expected_calls(&exp).len()
    );
    assert_eq!(
        lines_with_cap(&cap, &["refused", &hpid]).len(),
        1,
        "said once: {:?}",
        cap.stderr
    );
    assert_eq!(refusals(&cap), "1 refused (not_regular_file 1)");
    w.exit();
    h.exit();
}

fn lines_with_cap<'a>(cap: &'a Captured, needles: &[&str]) -> Vec<&'a String> {
    cap.stderr
        .iter()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .collect()
}

/// Item 2b: in its namespace, a tmpfs over the library's directory holds an absolute symlink
/// libcuda.so.1 → a root-only host file that the namespace does not have. Resolved against the
/// host's root, root would open (and attach) the host file; resolved inside the process's root
/// it leads nowhere, and the agent refuses the mapping.
#[test]
fn an_absolute_symlink_planted_in_a_mount_namespace_resolves_inside_it() {
    let _g = serial();
    require_root();
    let dir = scratch("symlink");
    let lib = fresh_lib(&dir.join("hostile"), "libcuda.so.1");
    let host_only = fresh_lib(&dir.join("host-only"), "libcuda.so.1");
    std::fs::set_permissions(
        host_only.parent().unwrap(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let Some(h) = workload_in_own_namespace(&lib) else {
        return;
    };
    let lib_dir = lib.parent().unwrap();
    in_namespace_of(
        h.pid,
        &format!(
            "mount -t tmpfs none {d}; ln -s {host} {d}/libcuda.so.1; mount -t tmpfs none {hidden}",
            d = lib_dir.display(),
            host = host_only.display(),
            hidden = host_only.parent().unwrap().display()
        ),
    );
    let agent = Agent::start(&dir, &["--pid", &h.pid.to_string()]);
    // Attached or refused, the line names the process.
    let hpid = format!("mapped by pid {}", h.pid);
    assert_eq!(wait_lines(&agent, &[&hpid], 1, Duration::from_secs(5)), 1);
    std::thread::sleep(Duration::from_millis(600));
    let cap = agent.stop();
    assert_eq!(
        lines_with_cap(&cap, &["gpu-observer: attached "]),
        Vec::<&String>::new(),
        "a file outside the process's root was attached"
    );
    let refused = lines_with_cap(&cap, &["refused", &hpid]);
    assert_eq!(refused.len(), 1, "{:?}", cap.stderr);
    assert!(
        refused[0].contains(&format!(
            "{} (in pid {}): No such file or directory",
            lib.display(),
            h.pid
        )) && refused[0].ends_with("[unreachable]"),
        "{}",
        refused[0]
    );
    assert_eq!(
        cap.stderr.last().map(String::as_str),
        Some("gpu-observer: libraries: 0 attached (0 now), 0 released, 1 refused (unreachable 1)")
    );
    h.exit();
}

/// Runs the agent with `args` and `cwd`, killed after `limit`: (exit code, stderr).
fn run_briefly(args: &[&str], cwd: &Path, limit: Duration) -> (Option<i32>, String) {
    let mut child = Command::new(observer_bin())
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "gpu-observer {args:?} did not exit within {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Item 2c: --libcuda and --nvml-lib given a FIFO fail at once with a message (dlopen and
/// open of a FIFO block); a relative --nvml-lib without a `/` names the file in the current
/// directory, not a name for the loader to search.
#[test]
fn library_flags_given_a_fifo_fail_fast_and_a_relative_nvml_lib_loads() {
    let _g = serial();
    require_root();
    let dir = scratch("flags");
    let fifo = dir.join("libcuda.so.1");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let f = fifo.to_str().unwrap();
    for flag in ["--libcuda", "--nvml-lib"] {
        let (code, err) = run_briefly(&[flag, f, "--duration", "2"], &dir, Duration::from_secs(5));
        assert_eq!(code, Some(2), "{flag}: {err}");
        assert!(
            err.contains(&format!("{f} is a FIFO (named pipe), not a library file")),
            "{flag}: {err}"
        );
    }
    let (code, err) = run_briefly(
        &["devices", "--nvml-lib", "libnvidia-ml.so.1"],
        &fixtures().join("nvml"),
        Duration::from_secs(10),
    );
    assert_eq!(code, Some(0), "{err}");
}

/// Item 3: one user maps 300 distinct libcuda copies. The agent attaches the first
/// --max-libraries-per-user (default 8), refuses the other 292 (each said once, counted), still
/// attaches another user's library, releases the 8 files' links when the process exits (within
/// two rescans), and exits promptly.
#[test]
fn one_user_mapping_300_copies_gets_the_per_user_limit_and_links_are_released() {
    let _g = serial();
    require_root();
    let dir = scratch("copies");
    let agent = Agent::start(&dir, &[]);
    let apid = agent.pid();
    let mut w = Workload::loaded(&dir);
    let wline = dir.join("lib/libcuda.so.1");
    assert_eq!(
        wait_lines(
            &agent,
            &["gpu-observer: attached ", wline.to_str().unwrap()],
            1,
            Duration::from_secs(5)
        ),
        1
    );
    let wlib = dir.join("lib");
    assert_eq!(links_under(apid, &wlib), 5, "links for one libcuda (one per program)");

    let files = user_dir(&dir, "copies");
    let h = hostile(&[
        "copies",
        files.to_str().unwrap(),
        "300",
        fixtures().join("libcuda.so.1").to_str().unwrap(),
    ]);
    let hline = format!("mapped by pid {} of uid {NOBODY}", h.pid);
    let refused = wait_lines(
        &agent,
        &["refused", &hline, "[user_limit]"],
        292,
        Duration::from_secs(10),
    );
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(links_under(apid, &files), 8 * 5, "links while 300 copies are mapped");
    assert_eq!(refused, 292);
    assert_eq!(lines_with(&agent, &["gpu-observer: attached ", &hline]).len(), 8);
    assert_eq!(lines_with(&agent, &["refused", &hline]).len(), 292, "said once each");
    // The other user's library is still attached, and works.
    assert_eq!(links_under(apid, &wlib), 5);
    let exp = dir.join("expected.jsonl");
    w.cmd(&format!("run 1 3 {}", exp.display()));

    let gone = Instant::now();
    h.exit();
    let released = wait_lines(
        &agent,
        &["released", files.to_str().unwrap()],
        8,
        Duration::from_secs(5),
    );
    let took = gone.elapsed();
    assert_eq!(released, 8);
    assert_eq!(links_under(apid, &files), 0);
    assert_eq!(links_under(apid, &wlib), 5);
    // Two rescans (200 ms each), then one grace period for all 40 links closed at once.
    assert!(took < Duration::from_millis(1000), "released after {took:?}");
    let pid = w.pid;
    w.exit();
    assert_eq!(
        wait_lines(&agent, &["released", wlib.to_str().unwrap()], 1, Duration::from_secs(3)),
        1
    );
    assert_eq!(links_under(apid, &wlib), 0);

    let start = Instant::now();
    let cap = agent.stop();
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "exit took {:?}",
        start.elapsed()
    );
    assert!(cap.status.success(), "{}", cap.status);
    assert_eq!(
        cap.count(|e| is_event(e) && e["pid"] == pid && e["api"].is_string()),
        expected_calls(&exp).len()
    );
    assert_eq!(refusals(&cap), "292 refused (user_limit 292)");
}
