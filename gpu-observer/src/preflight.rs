//! Checks before loading anything, and load errors turned into what a person should do.

use std::path::Path;

use anyhow::{Result, bail};

const CAP_DAC_READ_SEARCH: u32 = 2;
const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Fails with an actionable message when this process cannot load BPF programs or uprobes.
pub fn check() -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let caps = effective_caps().unwrap_or(0);
    let has = |cap: u32| caps & (1u64 << cap) != 0;
    if !(has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON))) {
        bail!(
            "gpu-observer needs root (or CAP_BPF + CAP_PERFMON) to load eBPF programs and uprobes: \
             run it as `sudo gpu-observer ...`"
        );
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        // The ioctl program reads the thread's user stack pointer through the BTF task helpers
        // (to tell an ioctl inside a CUDA call from one after a call that never returned).
        bail!(
            "this kernel exposes no BTF (/sys/kernel/btf/vmlinux is missing): gpu-observer's ioctl \
             program needs it; use a kernel built with CONFIG_DEBUG_INFO_BTF=y (the default of \
             current distributions)"
        );
    }
    if !Path::new("/sys/bus/event_source/devices/uprobe").exists() {
        bail!(
            "this kernel has no uprobe support (/sys/bus/event_source/devices/uprobe is missing): \
             gpu-observer needs a kernel built with CONFIG_UPROBE_EVENTS=y and CONFIG_BPF_EVENTS=y"
        );
    }
    let tracefs = [
        "/sys/kernel/tracing/events/syscalls",
        "/sys/kernel/debug/tracing/events/syscalls",
    ];
    let reachable = || tracefs.iter().any(|p| Path::new(p).exists());
    if !reachable() {
        // Mounted but unreadable is a missing capability, not a missing mount: tracefs is
        // root's (mode 0700), and a non-root user with only CAP_BPF + CAP_PERFMON cannot look
        // inside it.
        if let Some(at) = tracefs_mount()
            && !has(CAP_DAC_READ_SEARCH)
        {
            bail!(
                "tracefs is mounted at {at} but this process cannot read it: it lacks CAP_DAC_READ_SEARCH \
                 (tracefs belongs to root, mode 0700). Run as root, or grant CAP_DAC_READ_SEARCH besides \
                 CAP_BPF and CAP_PERFMON (and CAP_SYS_PTRACE to find other users' libraries)"
            );
        }
        if mount_tracefs() {
            warnings.push("mounted tracefs at /sys/kernel/tracing (it was not mounted)".to_string());
        }
    }
    if !reachable() {
        bail!(
            "syscall tracepoints are not reachable: mount tracefs (`mount -t tracefs nodev /sys/kernel/tracing`) \
             on a kernel with CONFIG_FTRACE_SYSCALLS=y"
        );
    }
    if !has(CAP_SYS_PTRACE) {
        warnings.push(
            "this process lacks CAP_SYS_PTRACE: the memory maps and root directories of other users' \
             processes (/proc/<pid>/maps, /proc/<pid>/root) cannot be read, so their libcuda is found \
             only in the usual driver paths; grant CAP_SYS_PTRACE (or run as root) to see every process"
                .to_string(),
        );
    }
    Ok(warnings)
}

/// Where tracefs is mounted, from this process's mount table (readable without privileges).
fn tracefs_mount() -> Option<String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    table.lines().find_map(|l| {
        // ... mount-point ... - fstype source options
        let (left, right) = l.split_once(" - ")?;
        (right.split(' ').next()? == "tracefs").then(|| left.split(' ').nth(4).unwrap_or("?").to_string())
    })
}

/// Fails at once for a `--pid` that can never load CUDA, instead of waiting for it forever.
pub fn check_pid(pid: u32) -> Result<()> {
    let missing = || {
        anyhow::anyhow!(
            "no process with pid {pid}: check it with `ps -p {pid}` (gpu-observer without --pid observes every process)"
        )
    };
    if pid == 0 {
        return Err(missing());
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|_| missing())?;
    match classify(&stat) {
        Some(Unobservable::Zombie) => {
            bail!("process {pid} is a zombie (it has exited; its parent has not reaped it): it can never load CUDA")
        }
        Some(Unobservable::KernelThread) => bail!("process {pid} is a kernel thread: it can never load CUDA"),
        None => Ok(()),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Unobservable {
    Zombie,
    KernelThread,
}

/// `PF_KTHREAD` in the flags of /proc/<pid>/stat (include/linux/sched.h).
const PF_KTHREAD: u64 = 0x0020_0000;

/// Reads the state and flags of a /proc/<pid>/stat line. The command name (field 2) is in
/// parentheses and may itself hold spaces and parentheses: fields are counted after its last `)`.
fn classify(stat: &str) -> Option<Unobservable> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); flags is field 9.
    let state = *fields.first()?;
    let flags: u64 = fields.get(6)?.parse().ok()?;
    if state == "Z" || state == "X" {
        Some(Unobservable::Zombie)
    } else if flags & PF_KTHREAD != 0 {
        Some(Unobservable::KernelThread)
    } else {
        None
    }
}

/// Mounts tracefs where the kernel expects it (minimal VMs and some containers leave it out).
fn mount_tracefs() -> bool {
    let target = c"/sys/kernel/tracing";
    // SAFETY: valid NUL-terminated strings; no data argument.
    let rc = unsafe {
        libc::mount(
            c"nodev".as_ptr(),
            target.as_ptr(),
            c"tracefs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    rc == 0
}

/// This process's effective capabilities (`CapEff`).
pub(crate) fn effective_caps() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line.trim_start_matches("CapEff:").trim(), 16).ok()
}

/// Turns an object-load failure into the likely cause.
pub fn explain_load_error(e: aya::EbpfError) -> anyhow::Error {
    let text = format!("{e:#}");
    if text.contains("Operation not permitted") {
        anyhow::anyhow!(
            "loading eBPF maps was refused ({text}): run as root, and check that no LSM or \
                         `kernel.unprivileged_bpf_disabled` policy blocks BPF"
        )
    } else if text.contains("Function not implemented") || text.contains("Invalid argument") {
        anyhow::anyhow!(
            "this kernel lacks the BPF support gpu-observer needs ({text}): it needs \
                         CONFIG_BPF_SYSCALL=y and BPF ring buffers (Linux 5.8 or later)"
        )
    } else {
        anyhow::anyhow!("loading the eBPF object failed: {text}")
    }
}

/// Turns a program-load failure (verifier, missing helper) into a message naming the program.
pub fn explain_program_error(name: &str) -> impl FnOnce(aya::programs::ProgramError) -> anyhow::Error + '_ {
    move |e| {
        anyhow::anyhow!(
            "the kernel refused eBPF program `{name}`: {e:#}\n\
             gpu-observer needs Linux 5.15 or later (BPF ring buffer, attach cookies)"
        )
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_own_capabilities() {
        assert!(super::effective_caps().is_some());
    }

    #[test]
    fn zombies_and_kernel_threads_are_told_apart_from_processes() {
        use super::{Unobservable::*, classify};
        let line = |comm: &str, state: &str, flags: u64| {
            format!("42 ({comm}) {state} 1 42 42 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 1 0 100")
        };
        assert_eq!(classify(&line("python3", "S", 0x400000)), None);
        assert_eq!(classify(&line("a) Z 1 (b", "R", 0)), None, "a name that fakes fields");
        assert_eq!(classify(&line("defunct", "Z", 0x400000)), Some(Zombie));
        assert_eq!(classify(&line("kthreadd", "S", 0x208040)), Some(KernelThread));
        assert_eq!(classify("garbage"), None);
    }

    #[test]
    fn pid_2_is_a_kernel_thread_and_we_are_not() {
        let e = super::check_pid(2).unwrap_err().to_string();
        assert!(e.contains("kernel thread"), "{e}");
        super::check_pid(std::process::id()).unwrap();
        assert!(super::check_pid(0).unwrap_err().to_string().contains("no process"));
    }
}
