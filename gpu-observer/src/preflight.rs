//! Checks before loading anything, and load errors turned into what a person should do.

use std::path::Path;

use anyhow::{Result, bail};

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
        warnings.push(
            "this kernel exposes no BTF (/sys/kernel/btf/vmlinux); gpu-observer's programs do not \
             need it, but a kernel built with CONFIG_DEBUG_INFO_BTF=y is the supported setup"
                .to_string(),
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
    if !tracefs.iter().any(|p| Path::new(p).exists()) && mount_tracefs() {
        warnings.push("mounted tracefs at /sys/kernel/tracing (it was not mounted)".to_string());
    }
    if !tracefs.iter().any(|p| Path::new(p).exists()) {
        bail!(
            "syscall tracepoints are not reachable: mount tracefs (`mount -t tracefs nodev /sys/kernel/tracing`) \
             on a kernel with CONFIG_FTRACE_SYSCALLS=y"
        );
    }
    Ok(warnings)
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

fn effective_caps() -> Option<u64> {
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
}
