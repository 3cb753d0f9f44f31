//! ioctls of observed processes, from the syscall tracepoints (no kprobes here).
//!
//! Recorded: every nvidia RM ioctl (type `'F'`) and any ioctl issued inside a probed CUDA call
//! (nvidia-uvm numbers have no type byte), each tagged with that call.

use aya_ebpf::{
    bindings::pt_regs,
    helpers::{
        bpf_probe_read_kernel,
        generated::{bpf_get_current_task_btf, bpf_task_pt_regs},
    },
    macros::tracepoint,
    programs::TracePointContext,
};
use gpu_observer_common::{
    api::Flags,
    event::{EventKind, IoctlEvent, IoctlStart, NV_IOCTL_MAGIC, ioctl_type},
};

use crate::{
    emit::{current, header, is_observed, now, reserve, submit},
    maps::{INFLIGHT, IOCTLS},
};

// Offsets in the syscalls/sys_{enter,exit}_ioctl records, as their tracefs format files give them.
const ENTER_FD: usize = 16;
const ENTER_CMD: usize = 24;
const ENTER_ARG: usize = 32;
const EXIT_RET: usize = 16;

#[tracepoint]
pub fn ioctl_enter(ctx: TracePointContext) -> u32 {
    let ids = current();
    if !is_observed(ids.tgid) {
        return 0;
    }
    // SAFETY: offsets of the stable syscall tracepoint format.
    let (fd, cmd, arg) = unsafe {
        (
            ctx.read_at::<u64>(ENTER_FD).unwrap_or(0) as u32,
            ctx.read_at::<u64>(ENTER_CMD).unwrap_or(0) as u32,
            ctx.read_at::<u64>(ENTER_ARG).unwrap_or(0),
        )
    };
    let parent_api = match INFLIGHT.get_ptr(ids.tid) {
        // SAFETY: per-thread entry read by its own thread.
        Some(p) => unsafe {
            // Made below the call's return slot: inside it. At or above it: the call was
            // abandoned (longjmp) and this ioctl is the caller's own (calls.rs).
            let inside = user_sp().is_none_or(|sp| sp < (*p).sp);
            // While a same-frame candidate is undecided, it is the call running now.
            let cookie = if (*p).has_tail != 0 {
                (*p).tail.cookie
            } else {
                (*p).cookie
            };
            if inside { cookie & Flags::ID_MASK } else { 0 }
        },
        None => 0,
    };
    if parent_api == 0 && ioctl_type(cmd) != NV_IOCTL_MAGIC {
        return 0;
    }
    let start = IoctlStart {
        ts_ns: now(),
        arg,
        fd,
        cmd,
        parent_api,
        _pad: 0,
    };
    let _ = IOCTLS.insert(ids.tid, start, 0);
    0
}

/// The user stack pointer of the current thread at its syscall.
#[inline(always)]
fn user_sp() -> Option<u64> {
    // SAFETY: helpers without preconditions on the current task; the saved user registers are
    // read through the kernel-read helper, which fails cleanly.
    unsafe {
        let regs = bpf_task_pt_regs(bpf_get_current_task_btf()) as *const pt_regs;
        bpf_probe_read_kernel(&(*regs).rsp).ok()
    }
}

#[tracepoint]
pub fn ioctl_exit(ctx: TracePointContext) -> u32 {
    let ids = current();
    let Some(p) = IOCTLS.get_ptr(ids.tid) else {
        return 0;
    };
    // SAFETY: per-thread entry read by its own thread.
    let start = unsafe { *p };
    let _ = IOCTLS.remove(ids.tid);
    let end = now();
    let duration = end - start.ts_ns;
    if start.parent_api != 0
        && let Some(call) = INFLIGHT.get_ptr_mut(ids.tid)
    {
        // SAFETY: per-thread entry, only this thread touches it.
        unsafe {
            (*call).ioctl_count += 1;
            (*call).ioctl_ns += duration;
        }
    }
    // SAFETY: offset of the stable syscall tracepoint format.
    let ret = unsafe { ctx.read_at::<i64>(EXIT_RET).unwrap_or(0) };
    let Some(mut entry) = reserve::<IoctlEvent>(EventKind::Ioctl, ids.tgid) else {
        return 0;
    };
    entry.write(IoctlEvent {
        hdr: header(EventKind::Ioctl, 0, ids, start.ts_ns),
        arg: start.arg,
        duration_ns: duration,
        ret,
        fd: start.fd,
        cmd: start.cmd,
        parent_api: start.parent_api,
        _pad: 0,
    });
    submit(entry);
    0
}
