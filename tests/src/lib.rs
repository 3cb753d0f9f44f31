//! Harness for gpu-observer's integration tests: runs the real agent (real eBPF, as root) against
//! the fake libcuda and the scripted workload from `tests/fixtures`, and reads what it wrote.
//!
//! `cargo xtask test` builds everything and sets `GPU_OBSERVER_BIN` / `GPU_OBSERVER_FIXTURES`.

use std::{
    collections::{BTreeMap, HashMap},
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

pub mod otlp;

use serde_json::Value;

/// Tests share the machine's uprobes and processes: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the workspace")
        .to_path_buf()
}

pub fn observer_bin() -> PathBuf {
    let p = std::env::var_os("GPU_OBSERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/debug/gpu-observer"));
    assert!(
        p.is_file(),
        "{} not built: run the tests with `cargo xtask test`",
        p.display()
    );
    p
}

pub fn fixtures() -> PathBuf {
    let p = std::env::var_os("GPU_OBSERVER_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/fixtures"));
    assert!(
        p.join("cuda_workload").is_file(),
        "fixtures not built in {}: run `cargo xtask test`",
        p.display()
    );
    p
}

pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "integration tests load eBPF programs: run them as root (`cargo xtask test`)"
    );
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A fresh scratch directory under target/.
pub fn scratch(name: &str) -> PathBuf {
    let dir = workspace().join("target/test-scratch").join(format!(
        "{name}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

/// A private copy of a fixture library (`libcuda.so.1` or `partial/libcuda.so.1`): a new inode,
/// so no earlier attach covers it.
pub fn fresh_lib(dir: &Path, which: &str) -> PathBuf {
    let dst = dir.join("lib");
    std::fs::create_dir_all(&dst).unwrap();
    let dst = dst.join("libcuda.so.1");
    std::fs::copy(fixtures().join(which), &dst).expect("copy fake libcuda");
    dst
}

/// The lines a pipe carries, collected on a thread as they come (bytes that are not UTF-8 are
/// kept, replaced, so a test can still look for what should not be there).
pub fn collect_lines(pipe: impl std::io::Read + Send + 'static) -> Arc<Mutex<Vec<String>>> {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).split(b'\n').map_while(Result::ok) {
            sink.lock().unwrap().push(String::from_utf8_lossy(&line).into_owned());
        }
    });
    lines
}

/// Waits until the agent has written (and flushed: every 200 ms) a JSON line to `out` for which
/// `pred` holds, and returns it; panics with what was written on timeout.
pub fn wait_output_line(out: &Path, pred: impl Fn(&Value) -> bool, timeout: Duration) -> Value {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(out).unwrap_or_default();
        // Only complete lines: the agent may be in the middle of one.
        let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        if let Some(v) = complete
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| pred(v))
        {
            return v;
        }
        if start.elapsed() > timeout {
            panic!("no such line in {} within {timeout:?}:\n{complete}", out.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The observer with `args` (one shell line) on a terminal of its own: script(1) gives it a
/// pseudo-terminal and copies what it draws to the child's stdout (piped).
pub fn observer_on_script_pty(args: &str) -> Child {
    let cmdline = format!("{} {args}", observer_bin().display());
    Command::new("script")
        .args(["-qfec", &cmdline, "/dev/null"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("script(1)")
}

/// The agent, writing JSON lines to a file.
pub struct Agent {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
    out: PathBuf,
}

/// What the agent wrote.
pub struct Captured {
    pub events: Vec<Value>,
    pub stderr: Vec<String>,
    pub status: std::process::ExitStatus,
}

impl Agent {
    /// Starts `gpu-observer --format jsonl --output DIR/out.jsonl --trace-all ARGS` (every
    /// event written: the tests count them) and waits for `ready`.
    pub fn start(dir: &Path, args: &[&str]) -> Agent {
        Self::spawn(dir, args, true, &[])
    }

    /// As [`Agent::start`], with the default adaptive sampling (no `--trace-all`).
    pub fn start_sampled(dir: &Path, args: &[&str]) -> Agent {
        Self::spawn(dir, args, false, &[])
    }

    /// As [`Agent::start`], with extra environment for the agent (the fake NVML's script).
    pub fn start_with_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Agent {
        Self::spawn(dir, args, true, env)
    }

    fn spawn(dir: &Path, args: &[&str], trace_all: bool, env: &[(&str, &str)]) -> Agent {
        let out = dir.join("out.jsonl");
        let mut child = Command::new(observer_bin())
            .args(["--format", "jsonl", "--output"])
            .arg(&out)
            .args(["--interval-ms", "200"])
            .args(trace_all.then_some("--trace-all"))
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn gpu-observer");
        let stderr = collect_lines(child.stderr.take().unwrap());
        let agent = Agent { child, stderr, out };
        agent.wait_stderr("gpu-observer: ready", Duration::from_secs(60));
        agent
    }

    pub fn stderr(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    /// The agent's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a stderr line containing `needle`; panics with the whole stderr on timeout.
    pub fn wait_stderr(&self, needle: &str, timeout: Duration) -> Duration {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if self.stderr().iter().any(|l| l.contains(needle)) {
                return start.elapsed();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "gpu-observer did not print `{needle}` within {timeout:?}; stderr:\n{}",
            self.stderr().join("\n")
        );
    }

    /// Waits for a written JSON line for which `pred` holds ([`wait_output_line`]).
    pub fn wait_line(&self, pred: impl Fn(&Value) -> bool, timeout: Duration) -> Value {
        wait_output_line(&self.out, pred, timeout)
    }

    /// SIGINT, wait for exit, read the output.
    pub fn stop(self) -> Captured {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        self.finish()
    }

    /// Waits for the agent to exit by itself (e.g. `--pid` process exited).
    pub fn finish(mut self) -> Captured {
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > Duration::from_secs(30) {
                let _ = self.child.kill();
                panic!("gpu-observer did not exit; stderr:\n{}", self.stderr().join("\n"));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        std::thread::sleep(Duration::from_millis(50));
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let events = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
            .collect();
        Captured {
            events,
            stderr: self.stderr(),
            status,
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Captured {
    /// The last line: the total summary.
    pub fn total(&self) -> &Value {
        let last = self.events.last().expect("no output at all");
        assert_eq!(last["type"], "summary", "last line is not the summary: {last}");
        assert_eq!(last["scope"], "total");
        last
    }

    pub fn of_type<'a>(&'a self, ty: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
        self.events.iter().filter(move |e| e["type"] == ty)
    }

    pub fn process_summary(&self, pid: u32) -> &Value {
        self.events
            .iter()
            .find(|e| e["type"] == "summary" && e["scope"] == "process" && e["pid"] == pid)
            .unwrap_or_else(|| panic!("no summary for pid {pid}"))
    }

    pub fn count(&self, pred: impl Fn(&Value) -> bool) -> usize {
        self.events.iter().filter(|e| pred(e)).count()
    }
}

/// The scripted workload (`tests/fixtures/cuda_workload`), driven line by line.
pub struct Workload {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub pid: u32,
}

impl Workload {
    pub fn start() -> Workload {
        Self::start_with_env(&[])
    }

    /// A workload that has loaded a private copy of the fake libcuda (in `dir`).
    pub fn loaded(dir: &Path) -> Workload {
        let lib = fresh_lib(dir, "libcuda.so.1");
        let mut w = Self::start();
        w.cmd(&format!("load {}", lib.display()));
        w
    }

    pub fn start_with_env(env: &[(&str, &str)]) -> Workload {
        let mut cmd = Command::new(fixtures().join("cuda_workload"));
        cmd.envs(env.iter().copied());
        Self::spawn(cmd)
    }

    /// Any program that speaks the workload's protocol (`ready <pid>` first, then one reply
    /// line per command): cuda_workload under `unshare`, the hostile_maps fixture, ….
    pub fn spawn(cmd: Command) -> Workload {
        Self::spawn_with_stderr(cmd, Stdio::inherit())
    }

    fn spawn_with_stderr(mut cmd: Command, stderr: Stdio) -> Workload {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let pid = line
            .trim()
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("{cmd:?} did not say `ready <pid>`: {line:?}"))
            .parse()
            .unwrap();
        Workload {
            child,
            stdin,
            stdout,
            pid,
        }
    }

    /// Sends one command, returns its `ok ...` reply (panics on `err`).
    pub fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
        let mut reply = String::new();
        self.stdout.read_line(&mut reply).unwrap();
        assert!(reply.starts_with("ok"), "workload `{line}` → {reply:?}");
        reply.trim().to_string()
    }

    pub fn exit(mut self) {
        let _ = writeln!(self.stdin, "exit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lines that are events from the probes, not lines the agent adds (summaries, memory samples,
/// leak reports).
/// Whether an entry point launches work (the API table's launch families: entry-only probes).
pub fn is_launch(api: &str) -> bool {
    gpu_observer_common::api::id_of(api)
        .and_then(gpu_observer_common::api::by_id)
        .is_some_and(|s| !s.family.has_return_probe())
}

pub fn is_event(e: &Value) -> bool {
    // The rest are derived lines: summaries, memory samples, leak reports, verdicts, anomalies.
    !matches!(
        e["type"].as_str(),
        Some("summary" | "memory" | "leak" | "verdict" | "anomaly")
    )
}

/// Reads the workload's record of the calls it made.
pub fn expected_calls(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("workload wrote its records")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A call as a comparable key: its api, tid, and the fields the expected record names.
pub fn key_of(expected: &Value, actual: &Value) -> String {
    let mut parts = Vec::new();
    for (k, _) in expected.as_object().expect("record is an object") {
        parts.push(format!("{k}={}", actual.get(k).unwrap_or(&Value::Null)));
    }
    parts.join(" ")
}

/// Multiset of calls per api, keyed by the fields the expected records carry.
fn by_api(records: &[&Value], template: &HashMap<String, Value>) -> BTreeMap<String, BTreeMap<String, usize>> {
    let mut out: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for r in records {
        let api = r["api"].as_str().unwrap_or("?").to_string();
        let Some(t) = template.get(&api) else {
            continue;
        };
        *out.entry(api).or_default().entry(key_of(t, r)).or_default() += 1;
    }
    out
}

/// Every expected call was captured once with the same argument values, and nothing else.
pub fn assert_exact(expected: &[Value], captured: &Captured, pid: u32) {
    let template: HashMap<String, Value> = expected
        .iter()
        .map(|e| (e["api"].as_str().unwrap().to_string(), e.clone()))
        .collect();
    let exp: Vec<&Value> = expected.iter().collect();
    let got: Vec<&Value> = captured
        .events
        .iter()
        .filter(|e| e["pid"] == pid && e["api"].is_string() && is_event(e))
        .filter(|e| template.contains_key(e["api"].as_str().unwrap()))
        .collect();
    let (want, have) = (by_api(&exp, &template), by_api(&got, &template));
    for (api, calls) in &want {
        assert_eq!(
            Some(calls),
            have.get(api),
            "calls of {api} differ (expected vs captured)"
        );
    }
    assert_eq!(want.len(), have.len());
    assert_eq!(exp.len(), got.len());
}

/// `gpu-observer --format jsonl --output DIR/out.jsonl ARGS run -- cuda_workload`: the
/// scripted workload started by the observer, spoken to through the observer's stdin and
/// stdout (the program inherits them): a [`Workload`] whose process is the observer.
pub struct RunAgent {
    w: Workload,
    stderr: Arc<Mutex<Vec<String>>>,
    out: PathBuf,
    /// The started program's pid (its `ready` line).
    pub pid: u32,
}

impl RunAgent {
    pub fn start(dir: &Path, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> RunAgent {
        let out = dir.join("out.jsonl");
        let mut cmd = Command::new(observer_bin());
        cmd.args(["--format", "jsonl", "--output"])
            .arg(&out)
            .args(args)
            .arg("run")
            .arg("--")
            .arg(fixtures().join("cuda_workload"))
            .envs(env.iter().copied());
        let mut w = Workload::spawn_with_stderr(cmd, Stdio::piped());
        let stderr = collect_lines(w.child.stderr.take().unwrap());
        let pid = w.pid;
        RunAgent { w, stderr, out, pid }
    }

    /// `run` of the workload with the fake CUPTI (records flushed every 50 ms) and `lib`, a
    /// fresh fake libcuda, attached up front and loaded; no NVML; ticks every 100 ms.
    pub fn with_cupti(dir: &Path, lib: &Path, env: &[(&str, &str)]) -> RunAgent {
        Self::with_cupti_args(dir, lib, &[], env)
    }

    /// [`with_cupti`](Self::with_cupti), with more options for the observer (`--otlp-*`).
    pub fn with_cupti_args(dir: &Path, lib: &Path, args: &[&str], env: &[(&str, &str)]) -> RunAgent {
        let cupti = fixtures().join("libcupti.so.13");
        let mut all: Vec<(&str, &std::ffi::OsStr)> = vec![
            ("GPU_OBSERVER_CUPTI_PATH", cupti.as_os_str()),
            ("GPU_OBSERVER_CUPTI_FLUSH_MS", "50".as_ref()),
        ];
        all.extend(env.iter().map(|(k, v)| (*k, v.as_ref())));
        let mut opts = vec!["--interval-ms", "100", "--no-nvml", "--libcuda", lib.to_str().unwrap()];
        opts.extend_from_slice(args);
        let mut r = RunAgent::start(dir, &opts, &all);
        r.cmd(&format!("load {}", lib.display()));
        r
    }

    /// Sends one command to the started workload, returns its `ok ...` reply (panics on `err`).
    pub fn cmd(&mut self, line: &str) -> String {
        self.w.cmd(line)
    }

    /// Waits for a written JSON line for which `pred` holds ([`wait_output_line`]).
    pub fn wait_line(&self, pred: impl Fn(&Value) -> bool, timeout: Duration) -> Value {
        wait_output_line(&self.out, pred, timeout)
    }

    /// `exit` to the workload; waits for the observer, which ends with it; its output.
    pub fn finish(mut self) -> Captured {
        let _ = writeln!(self.w.stdin, "exit");
        let _ = self.w.stdin.flush();
        let status = self.w.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let stderr = self.stderr.lock().unwrap().clone();
        assert!(status.success(), "{status}: {}", stderr.join("\n"));
        Captured {
            events: std::fs::read_to_string(&self.out)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect(),
            stderr,
            status,
        }
    }
}

impl Workload {
    /// `exit`: its reply (`ok exit`) and the process's exit status.
    pub fn exit_status(mut self) -> (String, std::process::ExitStatus) {
        writeln!(self.stdin, "exit").unwrap();
        self.stdin.flush().unwrap();
        let mut reply = String::new();
        let _ = self.stdout.read_line(&mut reply);
        let status = self.child.wait().unwrap();
        (reply.trim().to_string(), status)
    }
}

/// The CUPTI injection library built beside the agent.
pub fn injection_lib() -> PathBuf {
    observer_bin().with_file_name("libgpu_observer_cupti.so")
}

/// The fake CUPTI the injection library loads in the tests.
pub fn fake_cupti() -> PathBuf {
    fixtures().join("libcupti.so.13")
}

/// The environment that makes the fake driver load our injection library and it the fake
/// CUPTI (records flushed every 50 ms, syncs not delayed), with `extra` added.
pub fn cupti_env(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("CUDA_INJECTION64_PATH", injection_lib().display().to_string()),
        ("GPU_OBSERVER_CUPTI_PATH", fake_cupti().display().to_string()),
        ("GPU_OBSERVER_CUPTI_FLUSH_MS", "50".to_string()),
        ("FAKE_CUDA_SYNC_US", "0".to_string()),
    ];
    env.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    env
}

/// `cupti_stats` of the fake CUPTI a workload loaded: its own account (enabled kinds, enable
/// and disable calls, records delivered).
pub fn cupti_stats(w: &mut Workload) -> Value {
    let reply = w.cmd("cupti_stats");
    let json = reply
        .strip_prefix("ok cupti_stats ")
        .unwrap_or_else(|| panic!("cupti_stats reply {reply:?}"));
    serde_json::from_str(json).unwrap_or_else(|e| panic!("cupti_stats reply {reply:?}: {e}"))
}

impl Workload {
    /// The workload with the injection library and the fake CUPTI ([`cupti_env`] with
    /// `extra`), a fresh fake libcuda in `dir` loaded.
    pub fn with_cupti(dir: &Path, extra: &[(&'static str, &'static str)]) -> Workload {
        let env = cupti_env(extra);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let lib = fresh_lib(dir, "libcuda.so.1");
        let mut w = Workload::start_with_env(&env);
        w.cmd(&format!("load {}", lib.display()));
        w
    }
}
