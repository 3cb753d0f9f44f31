//! The few ptrace requests an injection makes, on one thread of the target.
//!
//! `PTRACE_SEIZE` never stops the thread by itself and sets no options: in particular not
//! `PTRACE_O_EXITKILL`, so if the observer dies at any point the kernel detaches the thread and
//! lets it run on. A tracer is a *thread*: every request here must come from the thread that
//! seized, and that thread ending detaches too (see `super::inject`).

use std::{
    io,
    time::{Duration, Instant},
};

/// A thread this thread has seized.
pub struct Tracee {
    pub tid: i32,
    stopped: bool,
    /// The signal of a signal-delivery stop, handed back when the thread is let go: a signal
    /// is never swallowed.
    pending: i32,
}

/// How a wait for the stop ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Stop {
    /// The `PTRACE_INTERRUPT` stop (`PTRACE_EVENT_STOP`).
    Interrupted,
    /// A signal arrived first (signal-delivery stop): it must be passed on.
    Signal(i32),
    /// The thread exited.
    Gone,
}

fn check(r: libc::c_long) -> io::Result<libc::c_long> {
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r) }
}

impl Tracee {
    /// `PTRACE_SEIZE`: becomes the thread's tracer without stopping it.
    pub fn seize(tid: i32) -> io::Result<Self> {
        // SAFETY: a ptrace request on a thread id; no pointers are passed.
        check(unsafe { libc::ptrace(libc::PTRACE_SEIZE, tid, 0usize, 0usize) })?;
        Ok(Self {
            tid,
            stopped: false,
            pending: 0,
        })
    }

    /// Asks the thread to stop (a blocked system call is interrupted, to be restarted).
    pub fn interrupt(&self) -> io::Result<()> {
        // SAFETY: as above.
        check(unsafe { libc::ptrace(libc::PTRACE_INTERRUPT, self.tid, 0usize, 0usize) }).map(drop)
    }

    /// Waits for the next stop, polling, at most `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> io::Result<Option<Stop>> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut status = 0;
            // SAFETY: valid out-pointer; __WALL waits for a thread that is not a child.
            let r = unsafe { libc::waitpid(self.tid, &mut status, libc::__WALL | libc::WNOHANG) };
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
            if r == self.tid {
                if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                    return Ok(Some(Stop::Gone));
                }
                if libc::WIFSTOPPED(status) {
                    self.stopped = true;
                    let event = status >> 16;
                    if event == libc::PTRACE_EVENT_STOP {
                        return Ok(Some(Stop::Interrupted));
                    }
                    self.pending = libc::WSTOPSIG(status);
                    return Ok(Some(Stop::Signal(self.pending)));
                }
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Resumes a stopped thread, delivering the signal it stopped with, if any.
    pub fn cont(&mut self) -> io::Result<()> {
        // SAFETY: ptrace on a stopped tracee; the data argument is a signal number.
        check(unsafe { libc::ptrace(libc::PTRACE_CONT, self.tid, 0usize, self.pending as usize) })?;
        self.stopped = false;
        self.pending = 0;
        Ok(())
    }

    pub fn regs(&self) -> io::Result<libc::user_regs_struct> {
        // SAFETY: user_regs_struct is plain integers; all-zero is a valid value.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        // SAFETY: a stopped tracee; the kernel fills the struct the pointer names.
        check(unsafe { libc::ptrace(libc::PTRACE_GETREGS, self.tid, 0usize, &mut regs as *mut _) })?;
        Ok(regs)
    }

    pub fn set_regs(&self, regs: &libc::user_regs_struct) -> io::Result<()> {
        // SAFETY: a stopped tracee; the kernel reads the struct the pointer names.
        check(unsafe { libc::ptrace(libc::PTRACE_SETREGS, self.tid, 0usize, regs as *const _) }).map(drop)
    }

    /// Lets the thread go: it resumes with the registers it has now.
    pub fn detach(mut self) -> io::Result<()> {
        self.stopped = false;
        // SAFETY: ptrace on a stopped tracee; the data argument is a signal number.
        check(unsafe { libc::ptrace(libc::PTRACE_DETACH, self.tid, 0usize, self.pending as usize) }).map(drop)
    }
}

impl Drop for Tracee {
    /// A tracee left stopped is let go as it is. One that is not stopped cannot be detached by
    /// request: it is detached when the tracing thread ends (injections run on a thread of
    /// their own for this).
    fn drop(&mut self) {
        if self.stopped {
            // SAFETY: as in detach.
            unsafe { libc::ptrace(libc::PTRACE_DETACH, self.tid, 0usize, self.pending as usize) };
        }
    }
}
