//! Processes coming and going: a followed process's children join the tree when they are
//! created; an exit drops per-thread state, leaves the tree and tells the agent.

use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use gpu_observer_common::{
    config,
    event::{EventHeader, EventKind},
    newtask,
};

use crate::{
    emit::{config, current, followed, header, now, reserve, submit},
    maps::{FOLLOW_MISSED, FOLLOWED, INFLIGHT, IOCTLS, OBSERVED},
};

/// `task/task_newtask`, in the parent: a new process (not a thread) whose parent is followed
/// joins the tree before it can run a single instruction, so none of its calls is missed.
#[tracepoint]
pub fn task_newtask(ctx: TracePointContext) -> u32 {
    let root = config(config::FILTER_TGID);
    if root == 0 || config(config::FOLLOW_CHILDREN) == 0 {
        return 0;
    }
    let parent = current().tgid;
    if parent != root && !followed(parent) {
        return 0;
    }
    // SAFETY: offsets inside the tracepoint's record (checked by the agent at load time).
    let (pid, flags) = unsafe {
        (
            ctx.read_at::<i32>(newtask::PID_OFFSET).unwrap_or(0),
            ctx.read_at::<u64>(newtask::CLONE_FLAGS_OFFSET)
                .unwrap_or(newtask::CLONE_THREAD),
        )
    };
    if pid <= 0 || flags & newtask::CLONE_THREAD != 0 {
        return 0;
    }
    if FOLLOWED.insert(pid as u32, parent, 0).is_err()
        && let Some(n) = FOLLOW_MISSED.get_ptr_mut(0)
    {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *n += 1 };
    }
    0
}

#[tracepoint]
pub fn process_exit(_ctx: TracePointContext) -> u32 {
    let ids = current();
    if ids.tid == ids.tgid {
        // Leaves the tree (a pid reused later is not a descendant).
        let _ = FOLLOWED.remove(ids.tgid);
    }
    if OBSERVED.get_ptr(ids.tgid).is_none() {
        return 0;
    }
    let _ = INFLIGHT.remove(ids.tid);
    let _ = IOCTLS.remove(ids.tid);
    if ids.tid != ids.tgid {
        return 0;
    }
    // The group leader is gone: the process is over for the agent.
    let _ = OBSERVED.remove(ids.tgid);
    let Some(mut entry) = reserve::<EventHeader>(EventKind::ProcessExit, ids.tgid) else {
        return 0;
    };
    entry.write(header(EventKind::ProcessExit, 0, ids, now()));
    submit(entry);
    0
}
