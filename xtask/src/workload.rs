//! The scripted fake workload (tests/fixtures/cuda_workload), driven one command and one reply
//! line at a time: what the soak and the fixture recorder run under the observer.

use std::{
    fs,
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
};

use anyhow::{Context, Result, bail};

pub struct Workload {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub pid: u32,
}

impl Workload {
    /// Starts `exe` with `env` added, and waits for its `ready <pid>`. An injection library
    /// comes only from `env`, never from the caller's environment.
    pub fn start(exe: &Path, env: &[(&str, String)]) -> Result<Self> {
        let mut child = Command::new(exe)
            .env_remove("CUDA_INJECTION64_PATH")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("spawn {}", exe.display()))?;
        let stdin = child.stdin.take().context("workload stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("workload stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let pid = line
            .trim()
            .strip_prefix("ready ")
            .and_then(|p| p.parse().ok())
            .with_context(|| format!("workload said {line:?}, not `ready <pid>`"))?;
        Ok(Self {
            child,
            stdin,
            stdout,
            pid,
        })
    }

    /// One command; its `ok …` reply (anything else is an error).
    pub fn cmd(&mut self, line: &str) -> Result<String> {
        writeln!(self.stdin, "{line}")?;
        self.stdin.flush()?;
        let mut reply = String::new();
        self.stdout.read_line(&mut reply)?;
        if !reply.starts_with("ok") {
            bail!("workload {}: `{line}` → {:?}", self.pid, reply.trim());
        }
        Ok(reply.trim().to_string())
    }

    /// `run T N`: the calls made, from the workload's ledger (one record line per call), which
    /// must agree with the number its reply gives.
    pub fn run(&mut self, (threads, rounds): (u64, u64), ledger: &Path) -> Result<u64> {
        let reply = self.cmd(&format!("run {threads} {rounds} {}", ledger.display()))?;
        let said: u64 = reply
            .strip_prefix("ok run ")
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("workload {}: unexpected reply {reply:?}", self.pid))?;
        let lines = fs::read_to_string(ledger)
            .with_context(|| format!("read the ledger {}", ledger.display()))?
            .lines()
            .count() as u64;
        fs::remove_file(ledger)?;
        if lines != said {
            bail!(
                "workload {}: its reply says {said} calls, its ledger holds {lines}",
                self.pid
            );
        }
        Ok(lines)
    }

    pub fn exit(mut self) -> Result<()> {
        self.cmd("exit")?;
        let st = self.child.wait()?;
        if !st.success() {
            bail!("workload {} exited with {st}", self.pid);
        }
        Ok(())
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        // Only a workload left behind by an error is still running here.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
