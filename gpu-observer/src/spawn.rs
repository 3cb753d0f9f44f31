//! `gpu-observer run -- CMD`: start a program with the CUPTI injection library and observe it
//! from its first instruction.
//!
//! The child is started first and held at a gate while the probes are loaded and attached with
//! its pid as the filter, so nothing it does is missed: `/bin/sh` waits for a line on fd 3 and
//! then `exec`s CMD, which keeps the pid (waiting inside `pre_exec` instead would deadlock:
//! `spawn` returns only once the exec happened). Under sudo CMD runs as the invoking user
//! (SUDO_UID/SUDO_GID), which is what the user means by `sudo gpu-observer run -- CMD`.

use std::{
    ffi::{CString, OsString},
    io::Write,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Child, Command},
};

use anyhow::{Context, Result, bail};
use gpu_observer_common::cupti::LIBRARY_FILE;

use crate::cli::Cli;

/// A started program, still waiting at the gate until [`Spawned::release`].
pub struct Spawned {
    pub child: Child,
    gate: Option<std::fs::File>,
    pub injection: Option<PathBuf>,
}

/// The injection library `run` gives the program: `--cupti-lib`, else the one beside the
/// gpu-observer binary; none with `--no-cupti`.
pub fn injection_library(cli: &Cli) -> Result<Option<PathBuf>> {
    if cli.no_cupti {
        return Ok(None);
    }
    let path = match &cli.cupti_lib {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .context("where is gpu-observer?")?
            .with_file_name(LIBRARY_FILE),
    };
    if !path.is_file() {
        bail!(
            "the CUPTI injection library {} does not exist: pass --cupti-lib PATH (it is built as target/*/{LIBRARY_FILE}), or --no-cupti to observe with uprobes only",
            path.display()
        );
    }
    Ok(Some(std::fs::canonicalize(&path)?))
}

/// The user to run as when started through sudo: (uid, gid, name, home).
fn sudo_user() -> Option<(u32, u32, CString, Option<OsString>)> {
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        return None;
    }
    let uid: u32 = std::env::var("SUDO_UID").ok()?.parse().ok()?;
    let gid: u32 = std::env::var("SUDO_GID").ok()?.parse().ok()?;
    let name = CString::new(std::env::var("SUDO_USER").ok()?).ok()?;
    if uid == 0 {
        return None;
    }
    Some((uid, gid, name, home_of(uid)))
}

fn home_of(uid: u32) -> Option<OsString> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 6 && f[2].parse() == Ok(uid)).then(|| OsString::from(f[5]))
    })
}

/// Forks CMD with the injection library in its environment, held before exec.
pub fn start(cmd: &[OsString], cli: &Cli) -> Result<Spawned> {
    let injection = injection_library(cli)?;
    let mut fds = [0; 2];
    // SAFETY: valid out-array for two fds.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("pipe for the start gate");
    }
    // SAFETY: pipe2 just returned these two fds, owned by nobody else.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1])) };
    let gate_fd = read_end.as_raw_fd();
    let mut c = Command::new("/bin/sh");
    c.args(["-c", "read -r _ <&3; exec 3<&-; exec \"$@\"", "gpu-observer-run"])
        .args(cmd);
    if let Some(lib) = &injection {
        if let Some(old) = std::env::var_os("CUDA_INJECTION64_PATH") {
            eprintln!(
                "gpu-observer: note: replacing CUDA_INJECTION64_PATH={} with {}",
                old.to_string_lossy(),
                lib.display()
            );
        }
        c.env("CUDA_INJECTION64_PATH", lib)
            .env("GPU_OBSERVER_CUDA_BUFFER_SIZE", cli.cuda_buffer_size.to_string())
            .env("GPU_OBSERVER_CUPTI_RATE_LIMIT", cli.cupti_rate_limit.to_string());
        // The same library is the NVTX tool: it hands NVTX's calls to the CUPTI it loaded, so
        // NVTX ranges come as CUPTI markers. Another tool named by the user keeps its place
        // (NVTX has one tool per process); the program's ranges are then not seen.
        match std::env::var_os("NVTX_INJECTION64_PATH").filter(|v| !v.is_empty()) {
            Some(other) if other != lib.as_os_str() => eprintln!(
                "gpu-observer: note: NVTX_INJECTION64_PATH={} is kept: NVTX ranges go to that tool, not to gpu-observer",
                other.to_string_lossy()
            ),
            _ => {
                c.env("NVTX_INJECTION64_PATH", lib);
            }
        }
    }
    let user = sudo_user();
    if let Some((_, _, name, home)) = &user {
        c.env("USER", name.to_string_lossy().as_ref())
            .env("LOGNAME", name.to_string_lossy().as_ref());
        if let Some(h) = home {
            c.env("HOME", h);
        }
    }
    let drop_to = user.map(|(uid, gid, name, _)| (uid, gid, name));
    // SAFETY: the closure runs in the forked child before exec and only makes async-signal-safe
    // calls (dup2, initgroups/setgid/setuid) on data prepared before the fork.
    unsafe {
        c.pre_exec(move || {
            // The gate on fd 3 for the shell (dup2 clears close-on-exec on the copy).
            if libc::dup2(gate_fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some((uid, gid, name)) = &drop_to
                && (libc::initgroups(name.as_ptr(), *gid) != 0 || libc::setgid(*gid) != 0 || libc::setuid(*uid) != 0)
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = c
        .spawn()
        .with_context(|| format!("cannot start {}", Path::new(&cmd[0]).display()))?;
    // The shell reports a CMD it cannot run (exit 127) once released.
    drop(read_end);
    Ok(Spawned {
        child,
        gate: Some(write_end),
        injection,
    })
}

impl Spawned {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lets the program run (the probes are attached).
    pub fn release(&mut self) -> Result<()> {
        if let Some(mut g) = self.gate.take() {
            g.write_all(b"\n").context("release the started program")?;
        }
        Ok(())
    }

    /// The exit code to leave with: the program's, or 128 + the signal that ended it.
    pub fn exit_code(status: std::process::ExitStatus) -> i32 {
        use std::os::unix::process::ExitStatusExt;
        status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
    }
}
