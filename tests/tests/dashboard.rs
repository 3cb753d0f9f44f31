//! Issue 15 end to end: the dashboard as a person sees it. The real agent (root, real eBPF)
//! runs on a pseudo-terminal of a fixed size, against the fake libcuda and the fake NVML; what
//! it writes goes through a terminal emulator (the vt100 crate) to get the screen. Asserted:
//! the GPU panel, the workload's row with its launch rate, a resize to 80×24, and after `q`
//! (or SIGTERM) the terminal given back — the alternate screen left and the cursor shown
//! before the summary, which is on the normal screen, and the pty out of raw mode.

use std::{
    io::Read,
    num::NonZeroU16,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    os::unix::process::CommandExt,
    path::Path,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use gpu_observer_tests::*;

/// Leaves the alternate screen (xterm's private mode 1049; docs/DESIGN.md "Dashboard").
const LEAVE_ALT: &[u8] = b"\x1b[?1049l";
const ENTER_ALT: &[u8] = b"\x1b[?1049h";
const SHOW_CURSOR: &[u8] = b"\x1b[?25h";

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).rposition(|w| w == needle)
}

/// The agent on a pseudo-terminal: everything it writes, as bytes and as a screen.
struct OnPty {
    child: Child,
    master: OwnedFd,
    /// Our copy of the terminal side, to read its modes after the agent has exited.
    slave: OwnedFd,
    bytes: Arc<Mutex<Vec<u8>>>,
}

fn winsize(rows: u16, cols: u16) -> libc::winsize {
    libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

impl OnPty {
    fn start(dir: &Path, lib: &Path, rows: u16, cols: u16) -> OnPty {
        let (mut m, mut s) = (0, 0);
        let ws = winsize(rows, cols);
        // SAFETY: openpty writes two descriptors; the name buffer may be null, the termios
        // null (the line discipline's defaults: canonical, echo), the winsize points at ours.
        let rc = unsafe { libc::openpty(&mut m, &mut s, std::ptr::null_mut(), std::ptr::null(), &ws) };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: both were just opened by openpty and are owned by nothing else.
        let (master, slave) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
        let nvml = fixtures().join("nvml/libnvidia-ml.so.1");
        let mut cmd = Command::new(observer_bin());
        cmd.args(["--interval-ms", "200", "--libcuda"])
            .arg(lib)
            .arg("--nvml-lib")
            .arg(&nvml)
            .env("FAKE_NVML_GPU_UTIL", "37,64")
            .env_remove("NO_COLOR")
            .env("TERM", "xterm-256color")
            .current_dir(dir)
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave.try_clone().unwrap()));
        // SAFETY: between fork and exec only async-signal-safe calls: setsid, ioctl. The pty
        // becomes the agent's controlling terminal (fd 0), so a resize reaches it as SIGWINCH.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawn gpu-observer");
        let bytes: Arc<Mutex<Vec<u8>>> = Arc::default();
        {
            let (bytes, mut r) = (bytes.clone(), std::fs::File::from(master.try_clone().unwrap()));
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                // Ends with EIO once no one has the terminal side open, or when the test ends.
                while let Ok(n) = r.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    bytes.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            });
        }
        OnPty {
            child,
            master,
            slave,
            bytes,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        self.bytes.lock().unwrap().clone()
    }

    /// The screen a person would see, at `rows`×`cols`, after everything written so far.
    fn screen(&self, rows: u16, cols: u16) -> vt100::Parser {
        let mut p = vt100::Parser::new(NonZeroU16::new(rows).unwrap(), NonZeroU16::new(cols).unwrap(), 0);
        p.process(&self.bytes());
        p
    }

    /// Waits until the screen shows something for which `pred` holds; returns its text.
    fn wait_screen(&self, rows: u16, cols: u16, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let text = self.screen(rows, cols).screen().contents();
            if pred(&text) {
                return text;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the screen never showed {what}:\n{text}\n--- raw ---\n{}",
                String::from_utf8_lossy(&self.bytes())
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn type_keys(&self, keys: &[u8]) {
        // SAFETY: writing our buffer to the master descriptor we own.
        let n = unsafe { libc::write(self.master.as_raw_fd(), keys.as_ptr().cast(), keys.len()) };
        assert_eq!(n, keys.len() as isize);
    }

    fn resize(&self, rows: u16, cols: u16) {
        let ws = winsize(rows, cols);
        // SAFETY: TIOCSWINSZ reads a winsize from the pointer; the kernel signals the
        // terminal's foreground process group (the agent) with SIGWINCH.
        let rc = unsafe { libc::ioctl(self.master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        assert_eq!(rc, 0);
    }

    /// Waits for the agent's exit; then the rest of what it wrote (the reader keeps reading
    /// while our copy of the terminal side is open: wait until it settles).
    fn finish(&mut self) -> (std::process::ExitStatus, Vec<u8>) {
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "gpu-observer did not exit:\n{}",
                String::from_utf8_lossy(&self.bytes())
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut len = usize::MAX;
        while len != self.bytes().len() {
            len = self.bytes().len();
            std::thread::sleep(Duration::from_millis(200));
        }
        (status, self.bytes())
    }

    /// The terminal's modes now: (canonical, echo) — both on unless someone left it raw.
    fn cooked(&self) -> (bool, bool) {
        // SAFETY: termios is plain data; tcgetattr fills it from our descriptor.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: as above; the descriptor is ours and open.
        assert_eq!(unsafe { libc::tcgetattr(self.slave.as_raw_fd(), &mut t) }, 0);
        (t.c_lflag & libc::ICANON != 0, t.c_lflag & libc::ECHO != 0)
    }
}

impl Drop for OnPty {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What must hold after the agent left the dashboard by `q` or SIGTERM: exit 0; in the
/// stream, the alternate screen left and the cursor shown after the last frame and before the
/// summary; on the emulated terminal, the normal screen with the summary and a visible cursor;
/// the pty back in canonical mode with echo.
fn assert_restored(pty: &mut OnPty, pid: u32) {
    let (status, raw) = pty.finish();
    let text = String::from_utf8_lossy(&raw).into_owned();
    assert!(status.success(), "{status}:\n{text}");
    let entered = find(&raw, ENTER_ALT).expect("the dashboard entered the alternate screen");
    let left = rfind(&raw, LEAVE_ALT).expect("the alternate screen was left");
    let shown = rfind(&raw, SHOW_CURSOR).expect("the cursor was shown again");
    let summary = rfind(&raw, b"gpu-observer summary:").unwrap_or_else(|| panic!("no summary:\n{text}"));
    assert!(entered < left && left < summary && shown < summary, "order:\n{text}");
    assert!(
        find(&raw[summary..], ENTER_ALT).is_none(),
        "the screen was taken again after the summary"
    );
    let p = pty.screen(30, 100);
    let screen = p.screen();
    assert!(!screen.alternate_screen(), "still on the alternate screen");
    assert!(!screen.hide_cursor(), "the cursor is still hidden");
    // The summary's block for the workload (terminal::final_summary), on a screen tall enough
    // to hold all of it.
    let contents = pty.screen(300, 100).screen().contents();
    assert!(contents.contains("gpu-observer summary:"), "{contents}");
    assert!(contents.contains(&format!("pid {pid} (cuda_workload)")), "{contents}");
    assert_eq!(pty.cooked(), (true, true), "the terminal was left in raw mode");
}

/// A launch rate as the view prints it (`1234`, `1.2k`).
fn rate(token: &str) -> Option<f64> {
    match token.strip_suffix('k') {
        Some(k) => k.parse::<f64>().ok().map(|v| v * 1000.0),
        None => token.parse().ok(),
    }
}

/// The workload's launch rate in the process table.
fn row_rate(screen: &str, pid: u32) -> Option<f64> {
    // The value in the process's row under the table's LAUNCH/s header (numbers are
    // right-aligned in their column: they start at or after the header's first character).
    let lines: Vec<Vec<char>> = screen.lines().map(|l| l.chars().collect()).collect();
    let col = lines.iter().find_map(|l| {
        let s: String = l.iter().collect();
        s.find("LAUNCH/s").map(|b| s[..b].chars().count())
    })?;
    let row = lines.iter().find(|l| {
        let s: String = l.iter().collect();
        // Inside the table's border.
        let s = s.trim_start_matches(['│', ' ']);
        s.split_whitespace().next() == Some(&pid.to_string()) && s.contains("cuda_workload")
    })?;
    let rest: String = row.iter().skip(col).collect();
    rest.split_whitespace().next().and_then(rate)
}

#[test]
fn the_dashboard_shows_the_gpus_and_the_workloads_launch_rate_and_q_restores_the_terminal() {
    let _g = serial();
    require_root();
    let dir = scratch("dashboard");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut pty = OnPty::start(&dir, &lib, 30, 100);
    // The GPU panel: both fake devices with the scripted utilization.
    pty.wait_screen(30, 100, "the GPU panel", |s| {
        s.contains("Fake GPU 0") && s.contains("37%") && s.contains("Fake GPU 1") && s.contains("64%")
    });
    let mut w = Workload::start();
    w.cmd(&format!("load {}", lib.display()));
    w.cmd("init");
    let pid = w.pid;
    // ~2 ms a pass: a few hundred launches a second, for 8 s, on its own thread here.
    let looping = std::thread::spawn(move || {
        let reply = w.cmd("loop 8000 launch:1 sleep:2000");
        (w, reply)
    });
    let seen = pty.wait_screen(30, 100, "the workload's row with a launch rate", |s| {
        row_rate(s, pid).is_some_and(|r| r > 0.0)
    });
    // A second look, a while into the loop: the rate over a full window.
    std::thread::sleep(Duration::from_secs(2));
    let screen = pty.screen(30, 100).screen().contents();
    let shown = row_rate(&screen, pid).unwrap_or_else(|| panic!("no row for {pid}:\n{screen}\n(first: {seen})"));
    let (w, reply) = looping.join().unwrap();
    // `ok loop <passes> <elapsed µs>`: the rate the workload really launched at.
    let parts: Vec<f64> = reply.split_whitespace().skip(2).map(|t| t.parse().unwrap()).collect();
    let actual = parts[0] / (parts[1] / 1e6);
    assert!(
        (0.6 * actual..=1.4 * actual).contains(&shown),
        "shown {shown} launches/s, the workload made {actual:.0}/s:\n{screen}"
    );
    // Smaller, as a laptop's terminal: the view is drawn again at 80×24.
    pty.resize(24, 80);
    std::thread::sleep(Duration::from_millis(1500));
    let small = pty.screen(24, 80).screen().contents();
    assert!(
        small.contains("Fake GPU 0") && small.contains("cuda_workload"),
        "{small}"
    );
    pty.type_keys(b"q");
    assert_restored(&mut pty, pid);
    w.exit();
}

#[test]
fn sigterm_restores_the_terminal_before_the_summary() {
    let _g = serial();
    require_root();
    let dir = scratch("dashboard-term");
    let lib = fresh_lib(&dir, "libcuda.so.1");
    let mut pty = OnPty::start(&dir, &lib, 30, 100);
    let mut w = Workload::start();
    w.cmd(&format!("load {}", lib.display()));
    w.cmd("init");
    w.cmd("loop 1500 launch:1 sleep:2000");
    let pid = w.pid;
    pty.wait_screen(30, 100, "the workload's row", |s| {
        s.contains("Fake GPU 0") && row_rate(s, pid).is_some()
    });
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(pty.child.id() as i32, libc::SIGTERM) };
    assert_restored(&mut pty, pid);
    w.exit();
}
