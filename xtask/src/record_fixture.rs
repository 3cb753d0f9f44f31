//! `cargo xtask record-fixture`: records the ring-buffer fixture of the replay test and the
//! pipeline benchmark (tests/data/README.md).
//!
//! The debug observer, in JSON-lines mode with `--record-ring`, watches one scripted fake
//! workload (`--pid`, so nothing else on the machine gets in) from `init` to `exit`; the raw
//! ring-buffer records, the observer's own JSON lines, the workload's ledger of the calls it
//! made and a description of the event ABI they were recorded with go to tests/data/. Run it
//! as root, again whenever the event ABI (gpu-observer-common) changes.

use std::{
    fs,
    io::{BufRead, BufReader},
    os::fd::AsRawFd,
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::workload::Workload;
use gpu_observer_common::{
    api,
    cupti::GpuRecord,
    event::{CallEvent, EventHeader, EventKind, GpuEvent, GpuNameEvent, IoctlEvent, LaunchEvent, NameEvent},
};
use serde_json::{Value, json};

/// What the fixture is called in tests/data/.
pub const NAME: &str = "fake-workload";
/// The lock the integration tests and every session that loads eBPF on this machine share.
const MACHINE_LOCK: &str = "/tmp/gpu-observer-tests.lock";
/// The observer's rescan: it notices the workload's exit within this.
const INTERVAL_MS: u64 = 200;

/// The workload's commands after `load`, in order (tests/fixtures/README.md has what each does;
/// the replay test's expected counts are derived from this list). `{}` is a ledger file. Small
/// on purpose: the recording and the JSON lines stay well under 1 MB each.
pub const SCRIPT: &[&str] = &[
    "init",
    // 2 threads × 2 rounds × 75 calls: every probed entry point.
    "run 2 2 {}",
    "names {}",
    "directions {}",
    "unwind 2 3",
    "ioctl_outside",
    "flood_allocs 300 0",
    "burst 500",
];

pub fn record_fixture() -> Result<()> {
    if !crate::is_root() {
        bail!("record-fixture runs the observer (eBPF programs, uprobes): run it as root");
    }
    crate::setup()?;
    let fixtures = fs::canonicalize(crate::fixtures()?)?;
    let bin = crate::build(false)?;
    let data = crate::root().join("tests/data");
    let work = crate::root().join("target/record-fixture");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    fs::create_dir_all(&data)?;

    let _lock = machine_lock()?;
    let lib = fixtures.join("libcuda.so.1");
    let mut w = Workload::start(
        &fixtures.join("cuda_workload"),
        // The fake libcuda's default sync sleep (2 ms), said explicitly; no injection library.
        &[("FAKE_CUDA_SYNC_US", "2000".into())],
    )?;
    let loaded = w.cmd(&format!("load {}", lib.display()))?;
    let (rec, out) = (work.join(format!("{NAME}.rec")), work.join(format!("{NAME}.jsonl")));
    let args: Vec<String> = vec![
        "--pid".into(),
        w.pid.to_string(),
        "--format".into(),
        "jsonl".into(),
        "--trace-all".into(),
        "--no-nvml".into(),
        "--interval-ms".into(),
        INTERVAL_MS.to_string(),
        "--output".into(),
        out.display().to_string(),
        "--record-ring".into(),
        rec.display().to_string(),
    ];
    let mut agent = Command::new(&bin)
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {}", bin.display()))?;
    let stderr = collect(agent.stderr.take().context("observer stderr")?);
    let said = |needle: &str| {
        stderr
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .any(|l| l.contains(needle))
    };
    let start = Instant::now();
    while !said("gpu-observer: ready") {
        if let Some(st) = agent.try_wait()? {
            bail!(
                "the observer exited before `ready` ({st}):\n{}",
                stderr
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .join("\n")
            );
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = agent.kill();
            bail!("the observer did not say `ready` in 60 s");
        }
        thread::sleep(Duration::from_millis(20));
    }

    let mut ledger = Vec::new();
    let mut replies = Vec::new();
    for (i, step) in SCRIPT.iter().enumerate() {
        let file = work.join(format!("ledger-{i}.jsonl"));
        let line = step.replace("{}", &file.display().to_string());
        replies.push(json!({ "command": step, "reply": w.cmd(&line)? }));
        if step.contains("{}") {
            ledger.extend(fs::read(&file).with_context(|| format!("read {}", file.display()))?);
        }
    }
    w.exit()?;
    let status = wait(&mut agent, Duration::from_secs(60))?;
    let stderr = stderr
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .join("\n");
    if !status.success() {
        bail!("the observer exited with {status}:\n{stderr}");
    }

    // Nothing lost: a fixture with drops would not be the workload's exact account.
    let text = fs::read_to_string(&out)?;
    let total: Value = serde_json::from_str(text.lines().last().context("no JSON lines")?)?;
    if total["type"] != "summary" || total["scope"] != "total" {
        bail!("the last JSON line is not the total summary: {total}");
    }
    if total["dropped"] != 0 || total["decode_errors"] != 0 {
        bail!("the observer dropped records or failed to decode some; record again:\n{total}");
    }
    let records = count_records(&fs::read(&rec)?)?;
    if Some(records) != total["events"].as_u64() {
        bail!("{records} records recorded, {} events counted", total["events"]);
    }

    let commit = crate::output(
        Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(crate::root()),
    )
    .unwrap_or_default();
    let common = crate::output(
        Command::new("git")
            .args(["log", "-1", "--format=%H", "--", "gpu-observer-common"])
            .current_dir(crate::root()),
    )
    .unwrap_or_default();
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let meta = json!({
        "what": "gpu-observer ring-buffer recording of the scripted fake workload (tests/data/README.md)",
        "command": "cargo xtask record-fixture",
        "observer_args": ["--pid", "<workload pid>", "--format", "jsonl", "--trace-all", "--no-nvml",
                          "--interval-ms", INTERVAL_MS.to_string(), "--output", format!("{NAME}.jsonl"),
                          "--record-ring", format!("{NAME}.rec")],
        "workload": { "load": loaded, "script": replies },
        "records": records,
        "commit": commit.trim(),
        "gpu_observer_common_commit": common.trim(),
        "kernel": kernel.trim(),
        "abi": abi(),
    });
    for (name, bytes) in [
        (format!("{NAME}.rec"), fs::read(&rec)?),
        (format!("{NAME}.jsonl"), text.into_bytes()),
        (format!("{NAME}.calls.jsonl"), ledger),
        (
            format!("{NAME}.meta.json"),
            format!("{}\n", serde_json::to_string_pretty(&meta)?).into_bytes(),
        ),
    ] {
        let path = data.join(&name);
        fs::write(&path, &bytes).with_context(|| format!("write {}", path.display()))?;
        eprintln!("xtask: {} ({} bytes)", path.display(), bytes.len());
    }
    eprintln!("xtask: {records} records; the observer said:\n{stderr}");
    Ok(())
}

/// The event ABI the records were written with: record sizes, kinds and the API table (ids are
/// 1-based indexes into it). The replay test refuses a fixture whose ABI is not the current one.
pub fn abi() -> Value {
    use std::mem::size_of;
    json!({
        "sizes": {
            "EventHeader": size_of::<EventHeader>(),
            "LaunchEvent": size_of::<LaunchEvent>(),
            "CallEvent": size_of::<CallEvent>(),
            "NameEvent": size_of::<NameEvent>(),
            "IoctlEvent": size_of::<IoctlEvent>(),
            "GpuEvent": size_of::<GpuEvent>(),
            "GpuNameEvent": size_of::<GpuNameEvent>(),
            "GpuRecord": size_of::<GpuRecord>(),
        },
        "kinds": {
            "Launch": EventKind::Launch as u32,
            "Call": EventKind::Call as u32,
            "Ioctl": EventKind::Ioctl as u32,
            "ProcessExit": EventKind::ProcessExit as u32,
            "Name": EventKind::Name as u32,
            "Gpu": EventKind::Gpu as u32,
            "GpuName": EventKind::GpuName as u32,
        },
        "apis": api::APIS.iter().map(|a| a.name).collect::<Vec<_>>(),
    })
}

/// Records in a `--record-ring` file (magic, then u32 LE length + bytes each).
fn count_records(file: &[u8]) -> Result<u64> {
    let mut rest = file
        .strip_prefix(b"GPUOREC1".as_slice())
        .context("not a ring recording (no GPUOREC1 header)")?;
    let mut n = 0;
    while !rest.is_empty() {
        let len = u32::from_le_bytes(rest.get(..4).context("truncated length")?.try_into()?) as usize;
        rest = rest.get(4 + len..).context("truncated record")?;
        n += 1;
    }
    Ok(n)
}

/// Holds the machine's eBPF lock (released when dropped: the file is closed).
fn machine_lock() -> Result<fs::File> {
    let f = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(MACHINE_LOCK)
        .with_context(|| format!("open {MACHINE_LOCK}"))?;
    eprintln!("xtask: waiting for {MACHINE_LOCK}");
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        bail!("flock {MACHINE_LOCK}: {}", std::io::Error::last_os_error());
    }
    Ok(f)
}

fn collect(pipe: impl std::io::Read + Send + 'static) -> Arc<Mutex<Vec<String>>> {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            sink.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(line);
        }
    });
    lines
}

fn wait(child: &mut Child, timeout: Duration) -> Result<ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait()? {
            // Let the stderr reader take the last lines.
            thread::sleep(Duration::from_millis(100));
            return Ok(st);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            bail!("the observer did not exit within {timeout:?} of the workload's exit");
        }
        thread::sleep(Duration::from_millis(20));
    }
}
