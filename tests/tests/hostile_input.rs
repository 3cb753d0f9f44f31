//! Issue 10, items 4 and 6–9: what an ordinary local user (or a careless command line) hands
//! the root observer — hostile names, planted links and files, bad numbers and URLs, a closed
//! pipe, a full disk, a hung NVML call, missing capabilities, a pid that can never load CUDA.
//! Each must give a clear error or an escaped line, never a panic, a hang or a write where the
//! user steered it (docs/SECURITY.md).

use std::{
    io::{BufRead, BufReader, Read, Write},
    os::unix::{fs::PermissionsExt, process::ExitStatusExt},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use gpu_observer_tests::{
    Workload, collect_lines, fixtures, fresh_lib, observer_bin, observer_on_script_pty, require_root, scratch, serial,
};

/// An observer started with the caller's stdout, its stderr collected line by line.
struct Observer {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Observer {
    fn start(args: &[&str], env: &[(&str, &str)], stdout: Stdio) -> Observer {
        Self::start_cmd(Command::new(observer_bin()), args, env, stdout)
    }

    fn start_cmd(mut cmd: Command, args: &[&str], env: &[(&str, &str)], stdout: Stdio) -> Observer {
        let mut child = cmd
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn gpu-observer");
        let stderr = collect_lines(child.stderr.take().unwrap());
        Observer { child, stderr }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    fn wait_stderr(&self, needle: &str, timeout: Duration) {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if self.stderr().contains(needle) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("no `{needle}` on stderr within {timeout:?}:\n{}", self.stderr());
    }

    /// The exit status within `timeout`, or None (the observer is then killed).
    fn exit_within(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Some(s) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(100)); // the stderr thread catches up
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }

    fn sigint(&self) {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn status_text(s: Option<ExitStatus>) -> String {
    match s {
        None => "still running (killed by the test)".into(),
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exit code {c}"),
            (_, Some(sig)) => format!("signal {sig}"),
            _ => format!("{s:?}"),
        },
    }
}

/// Item 7: bad numbers and URLs — flags and the standard OTLP variables — are clear errors at
/// start-up: no panic (exit code 101, "panicked"), nothing attached, no wait.
#[test]
fn bad_inputs_are_clear_errors_before_anything_attaches() {
    let _g = serial();
    require_root();
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: &[Case] = &[
        (
            &["--otlp-endpoint", "localhost:4317"],
            &[],
            "is not a collector URL: it has no scheme",
        ),
        (&["--otlp-endpoint", "not a url"], &[], "is not a collector URL"),
        (&["--otlp-endpoint", "http://[::1"], &[], "is not a collector URL"),
        (
            &["--otlp-endpoint", "ftp://collector:4317"],
            &[],
            "scheme must be http or https",
        ),
        (
            &[],
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4317")],
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ),
        (
            &[],
            &[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://[::1")],
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ),
        (&["--duration", "inf"], &[], "out of range"),
        (&["--duration", "1e300"], &[], "out of range"),
        (&["--duration=-1"], &[], "out of range"),
        (&["--duration", "0"], &[], "out of range"),
        (&["--threshold-us", "18446744073709551615"], &[], "--threshold-us"),
        (&["--ring-buffer-size", "8589934592"], &[], "too large"),
        (&["--ring-buffer-size", "2147483648"], &[], "too large"),
        (&["--otlp-queue", "18446744073709551615"], &[], "--otlp-queue"),
    ];
    let mut failures = Vec::new();
    for (args, env, expect) in cases {
        let mut o = Observer::start(args, env, Stdio::null());
        let status = o.exit_within(Duration::from_secs(10));
        let err = o.stderr();
        let ok = status.is_some_and(|s| matches!(s.code(), Some(1 | 2)))
            && !err.contains("panicked")
            && err.contains(expect)
            && !err.contains("ready")
            && !err.contains("attached");
        if !ok {
            failures.push(format!(
                "{args:?} {env:?}: {}, stderr:\n{err}\n(expected a message with `{expect}`)",
                status_text(status)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n---\n"));
}

/// Item 9: a `--pid` that can never load CUDA is said at once, not waited for forever.
#[test]
fn a_zombie_or_kernel_thread_pid_is_refused_at_once() {
    let _g = serial();
    require_root();
    // A child that exited and is not reaped (until `zombie` is dropped) is a zombie.
    let mut zombie = Command::new("true").spawn().unwrap();
    let zpid = zombie.id();
    let start = Instant::now();
    while !std::fs::read_to_string(format!("/proc/{zpid}/stat")).is_ok_and(|s| s.contains(") Z ")) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "`true` did not become a zombie"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    for (pid, expect) in [(zpid, "is a zombie"), (2, "is a kernel thread")] {
        let mut o = Observer::start(&["--pid", &pid.to_string()], &[], Stdio::null());
        let status = o.exit_within(Duration::from_secs(10));
        let err = o.stderr();
        assert!(
            status.is_some_and(|s| s.code() == Some(1)) && err.contains(expect) && err.contains("never load CUDA"),
            "--pid {pid}: {}, stderr:\n{err}",
            status_text(status)
        );
    }
    zombie.wait().unwrap();
}

/// Item 9: with CAP_BPF + CAP_PERFMON only (a non-root uid), the observer names the capability
/// it lacks to read tracefs, instead of saying tracefs is not mounted.
#[test]
fn a_missing_capability_is_named() {
    let _g = serial();
    require_root();
    if Command::new("setpriv").arg("--version").output().is_err() {
        panic!("setpriv (util-linux) is needed for this test");
    }
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .contains(" - tracefs ");
    if !mounted {
        let st = Command::new("mount")
            .args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"])
            .status()
            .unwrap();
        assert!(st.success(), "mount tracefs for the test");
    }
    // The binary where uid 65534 can run it (the workspace may be under a private home).
    let dir = std::env::temp_dir().join(format!("gpu-observer-caps-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.join("gpu-observer");
    std::fs::copy(observer_bin(), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cmd = Command::new("setpriv");
    cmd.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all,+bpf,+perfmon",
        "--ambient-caps=-all,+bpf,+perfmon",
        "--",
    ])
    .arg(&bin)
    .current_dir(&dir);
    let mut o = Observer::start_cmd(cmd, &["--no-nvml", "--duration", "2"], &[], Stdio::null());
    let status = o.exit_within(Duration::from_secs(20));
    let err = o.stderr();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        status.is_some_and(|s| s.code() == Some(1))
            && err.contains("CAP_DAC_READ_SEARCH")
            && !err.contains("not mounted"),
        "{}, stderr:\n{err}",
        status_text(status)
    );
}

/// Item 6: `--output` in a sticky world-writable directory (like /tmp) refuses a symlink or a
/// file that another user planted there (as the kernel's protected_symlinks/protected_regular
/// would), fails at once on a FIFO with no reader, and creates new files mode 0600.
#[test]
fn output_refuses_what_another_user_planted_in_a_sticky_directory() {
    let _g = serial();
    require_root();
    let dir = scratch("output");
    let tmp = dir.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let victim = dir.join("victim.conf");
    std::fs::write(&victim, "root's precious configuration\n").unwrap();
    let nobody = 65534;
    let link = tmp.join("trace.jsonl");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    lchown(&link, nobody);
    let foreign = tmp.join("theirs.jsonl");
    std::fs::write(&foreign, "another user's file\n").unwrap();
    lchown(&foreign, nobody);
    let fifo = tmp.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);

    let mut failures = Vec::new();
    for (path, expect) in [
        (&link, "refusing to follow a symlink owned by uid 65534"),
        (&foreign, "refusing to write to a file owned by uid 65534"),
        (&fifo, "a FIFO with no reader"),
    ] {
        let mut o = Observer::start(
            &[
                "--format",
                "jsonl",
                "--output",
                path.to_str().unwrap(),
                "--duration",
                "1",
                "--no-nvml",
            ],
            &[],
            Stdio::null(),
        );
        let status = o.exit_within(Duration::from_secs(10));
        let err = o.stderr();
        if !(status.is_some_and(|s| s.code() == Some(1)) && err.contains(expect) && !err.contains("ready")) {
            failures.push(format!(
                "--output {}: {}, stderr:\n{err}",
                path.display(),
                status_text(status)
            ));
        }
    }
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "root's precious configuration\n",
        "the symlink's target was written through; {}",
        failures.join("\n")
    );
    assert_eq!(std::fs::read_to_string(&foreign).unwrap(), "another user's file\n");
    assert!(failures.is_empty(), "{}", failures.join("\n---\n"));

    // A new file of ours: created, private.
    let mine = tmp.join("mine.jsonl");
    let mut o = Observer::start(
        &[
            "--format",
            "jsonl",
            "--output",
            mine.to_str().unwrap(),
            "--duration",
            "0.5",
            "--no-nvml",
        ],
        &[],
        Stdio::null(),
    );
    let status = o.exit_within(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "{}: {}",
        status_text(status),
        o.stderr()
    );
    let mode = std::fs::metadata(&mine).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "new output files are root's alone");
    assert!(std::fs::read_to_string(&mine).unwrap().contains("\"scope\":\"total\""));
}

fn lchown(path: &Path, uid: u32) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: valid NUL-terminated path.
    let r = unsafe { libc::lchown(c.as_ptr(), uid, uid) };
    assert_eq!(r, 0, "lchown {}", path.display());
}

/// Item 8: when stdout's reader goes away (`| head`), the observer stops at once, says which
/// output failed, and still gives the summary (on stderr).
#[test]
fn a_closed_pipe_stops_the_observer_with_the_summary_on_stderr() {
    let _g = serial();
    require_root();
    let dir = scratch("pipe");
    let mut w = Workload::loaded(&dir);
    let mut o = Observer::start(
        &[
            "--format",
            "jsonl",
            "--trace-all",
            "--pid",
            &w.pid.to_string(),
            "--no-nvml",
            "--interval-ms",
            "200",
        ],
        &[],
        Stdio::piped(),
    );
    o.wait_stderr("gpu-observer: ready", Duration::from_secs(60));
    w.cmd("burst 2000");
    let mut out = BufReader::new(o.child.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    assert!(first.contains("\"type\":\"launch\""), "{first}");
    drop(out); // `| head -1` exits
    let closed = Instant::now();
    w.cmd("burst 200000");
    let status = o.exit_within(Duration::from_secs(10));
    let err = o.stderr();
    assert!(
        status.is_some_and(|s| s.code() == Some(1))
            && err.contains("writing JSON lines to stdout failed")
            && err.contains("gpu-observer summary:"),
        "{} ({:?} after the pipe closed), stderr:\n{err}",
        status_text(status),
        closed.elapsed()
    );
    w.exit();
}

/// Item 8: a full disk stops the observer, names the file, and the summary goes to stderr.
#[test]
fn a_full_disk_stops_the_observer_and_names_the_file() {
    let _g = serial();
    require_root();
    let dir = scratch("disk");
    let disk = dir.join("disk");
    std::fs::create_dir(&disk).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(&disk)
        .status()
        .unwrap();
    assert!(st.success(), "mount a 64 KiB tmpfs");
    struct Umount(PathBuf);
    impl Drop for Umount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _u = Umount(disk.clone());
    let out = disk.join("out.jsonl");
    let mut w = Workload::loaded(&dir);
    let mut o = Observer::start(
        &[
            "--format",
            "jsonl",
            "--trace-all",
            "--output",
            out.to_str().unwrap(),
            "--pid",
            &w.pid.to_string(),
            "--no-nvml",
        ],
        &[],
        Stdio::null(),
    );
    o.wait_stderr("gpu-observer: ready", Duration::from_secs(60));
    w.cmd("burst 100000");
    let status = o.exit_within(Duration::from_secs(10));
    let err = o.stderr();
    assert!(
        status.is_some_and(|s| s.code() == Some(1))
            && err.contains(&format!("writing JSON lines to {} failed", out.display()))
            && err.contains("No space left on device")
            && err.contains("gpu-observer summary:"),
        "{}, stderr:\n{err}",
        status_text(status)
    );
    w.exit();
}

/// Item 8: an NVML call that never returns does not hold the observer's exit.
#[test]
fn a_hung_nvml_call_does_not_hold_the_exit() {
    let _g = serial();
    require_root();
    let dir = scratch("nvml-hang");
    let w = Workload::loaded(&dir);
    let nvml = fixtures().join("nvml/libnvidia-ml.so.1");
    let out = dir.join("out.jsonl");
    let mut o = Observer::start(
        &[
            "--format",
            "jsonl",
            "--output",
            out.to_str().unwrap(),
            "--pid",
            &w.pid.to_string(),
            "--nvml-lib",
            nvml.to_str().unwrap(),
            "--nvml-interval-ms",
            "50",
        ],
        &[("FAKE_NVML_HANG", "3")],
        Stdio::null(),
    );
    o.wait_stderr("gpu-observer: ready", Duration::from_secs(60));
    // The sampler's fourth utilization call of device 0 never returns.
    std::thread::sleep(Duration::from_millis(600));
    o.sigint();
    let status = o.exit_within(Duration::from_secs(8));
    let err = o.stderr();
    assert!(
        status.is_some_and(|s| s.success()) && err.contains("an NVML call has not returned"),
        "{}, stderr:\n{err}",
        status_text(status)
    );
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        text.lines().last().is_some_and(|l| l.contains("\"scope\":\"total\"")),
        "no summary"
    );
    drop(w);
}

/// Item 4: a process names itself and a kernel with terminal control sequences; nothing of them
/// reaches the terminal raw — not the live view, not the final summary, not stderr — and the
/// names are shown escaped.
#[test]
fn control_characters_from_observed_processes_never_reach_the_terminal() {
    let _g = serial();
    require_root();
    let dir = scratch("escape");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hostile_names.py");
    let mut py = Command::new("python3")
        .arg(&script)
        .arg(&lib)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut py_in = py.stdin.take().unwrap();
    let mut py_out = BufReader::new(py.stdout.take().unwrap());
    let mut line = String::new();
    py_out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    let pid = py.id().to_string();

    // The live view, on a terminal (script(1) gives the observer a pty); the plain one (on a
    // terminal the default is the dashboard).
    let summary = dir.join("summary.txt");
    let mut live = observer_on_script_pty(&format!(
        "--format terminal --pid {pid} --no-nvml --interval-ms 100 --duration 3"
    ));
    std::thread::sleep(Duration::from_millis(1500));
    writeln!(py_in, "go").unwrap();
    line.clear();
    py_out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "done");
    let mut screen = Vec::new();
    live.stdout.take().unwrap().read_to_end(&mut screen).unwrap();
    live.wait().unwrap();
    let screen = String::from_utf8_lossy(&screen).into_owned();
    assert!(
        screen.contains("\\x1b]0;pwn\\x07"),
        "the live view shows the name escaped:\n{screen}"
    );

    // The final summary (to a file, exactly as it is printed on a terminal), and stderr.
    let mut o = Observer::start(
        &["--pid", &pid, "--no-nvml", "--output", summary.to_str().unwrap()],
        &[],
        Stdio::null(),
    );
    o.wait_stderr("gpu-observer: ready", Duration::from_secs(60));
    writeln!(py_in, "go").unwrap();
    line.clear();
    py_out.read_line(&mut line).unwrap();
    writeln!(py_in, "exit").unwrap();
    py.wait().unwrap();
    let status = o.exit_within(Duration::from_secs(20));
    assert!(
        status.is_some_and(|s| s.success()),
        "{}: {}",
        status_text(status),
        o.stderr()
    );
    let text = std::fs::read_to_string(&summary).unwrap();
    let err = o.stderr();

    for (what, out) in [("live view", &screen), ("final summary", &text), ("stderr", &err)] {
        // The view's own escapes (cursor home, clear) are the only ones allowed.
        let stripped = out.replace("\x1b[H\x1b[2J", "");
        let bad: Vec<char> = stripped
            .chars()
            .filter(|&c| (c.is_control() && c != '\n' && c != '\r' && c != '\t') || c == '\u{202e}')
            .collect();
        assert!(bad.is_empty(), "{what} carries raw control characters {bad:?}:\n{out}");
        assert!(
            !out.contains("FORGED\n") && !out.contains("\n    666 root"),
            "{what} has a forged row"
        );
    }
    assert!(
        text.contains("\\x1b]0;pwn\\x07\\x1b[2J"),
        "comm escaped in the summary:\n{text}"
    );
    assert!(
        text.contains("\\x1b[31mEVIL\\x1b[0m\\x0a    666 root FORGED\\u{202e}gnp.exe\\u{9b}2J"),
        "kernel name escaped in the summary:\n{text}"
    );
}
