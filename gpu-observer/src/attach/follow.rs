//! Following a process tree (`--pid N`, `run`): the `task_newtask` tracepoint adds every new
//! child of a member to the BPF map `FOLLOWED` before the child runs, so no early call of a
//! new worker is missed; descendants already running when the observer starts are found in
//! /proc here. Members leave at their exit (`sched_process_exit`).

use anyhow::{Result, bail};
use gpu_observer_common::newtask;

use super::Probes;
use crate::procinfo::ProcInfo;

/// Where tracefs lists the tracepoint's record layout.
const FORMAT_FILES: [&str; 2] = [
    "/sys/kernel/tracing/events/task/task_newtask/format",
    "/sys/kernel/debug/tracing/events/task/task_newtask/format",
];

/// The eBPF program reads `pid` and `clone_flags` at fixed offsets: refuses a kernel whose
/// record says otherwise (a clear error, rather than following the wrong processes).
pub fn check_newtask_format() -> Result<()> {
    let Some(text) = FORMAT_FILES.iter().find_map(|p| std::fs::read_to_string(p).ok()) else {
        bail!("cannot read task/task_newtask's format in tracefs: following children needs it (or use --no-children)");
    };
    let offset_of = |field: &str| {
        text.lines()
            .find(|l| l.contains(&format!(" {field};")))
            .and_then(|l| l.split("offset:").nth(1))
            .and_then(|r| r.split(';').next())
            .and_then(|n| n.trim().parse::<usize>().ok())
    };
    let (pid, flags) = (offset_of("pid"), offset_of("clone_flags"));
    if pid != Some(newtask::PID_OFFSET) || flags != Some(newtask::CLONE_FLAGS_OFFSET) {
        bail!(
            "this kernel's task/task_newtask record has pid at {pid:?} and clone_flags at {flags:?}, not {} and {}: \
             following children is not supported here (use --no-children)",
            newtask::PID_OFFSET,
            newtask::CLONE_FLAGS_OFFSET
        );
    }
    Ok(())
}

/// Adds `root`'s descendants that already run. Walked twice: a child forked by a process the
/// first walk had not added yet is found by the second (by then its parent is a member, so any
/// later child is added by the tracepoint). Returns how many were added.
pub fn seed(probes: &mut Probes, root: u32, procinfo: &ProcInfo) -> Result<usize> {
    let mut added = 0;
    for _ in 0..2 {
        let members = procinfo.descendants(root);
        added = members.len();
        probes.follow(&members)?;
    }
    Ok(added)
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_kernels_newtask_record_matches_the_programs_offsets() {
        // The build and CI machine's kernel: the offsets the eBPF program reads.
        if std::path::Path::new(super::FORMAT_FILES[0]).exists() {
            super::check_newtask_format().unwrap();
        }
    }
}
