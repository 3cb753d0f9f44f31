//! Copies, memsets, allocations, frees, syncs and init calls: an entry probe saves the raw
//! arguments per thread, the return probe emits one record with the duration, the result, the
//! values behind out-pointers and the ioctls issued inside. The agent decodes the arguments.

use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_probe_read_user, bpf_probe_read_user_str_bytes, generated::bpf_get_attach_cookie},
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use gpu_observer_common::{
    api::Flags,
    event::{CallEvent, EventKind, Inflight, NameEvent, read_error},
};

use crate::{
    emit::{current, enter, header, now, reserve, submit},
    maps::INFLIGHT,
};

#[uprobe]
pub fn api_enter(ctx: ProbeContext) -> u32 {
    let Some(ids) = enter() else {
        return 0;
    };
    if let Some(p) = INFLIGHT.get_ptr_mut(ids.tid) {
        // A probed call made from inside another (the driver calling its own exported entry):
        // only the outer one is reported; its return probe fires last.
        // SAFETY: per-thread entry, only this thread touches it.
        unsafe {
            (*p).depth += 1;
            (*p).nested += 1;
        }
        return 0;
    }
    let mut args = [0u64; 6];
    let mut i = 0;
    while i < 6 {
        args[i] = ctx.arg::<u64>(i).unwrap_or(0);
        i += 1;
    }
    let state = Inflight {
        ts_ns: now(),
        args,
        ioctl_ns: 0,
        // SAFETY: helper reading the cookie of the attachment that fired.
        cookie: unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32,
        ioctl_count: 0,
        depth: 0,
        nested: 0,
    };
    let _ = INFLIGHT.insert(ids.tid, state, 0);
    0
}

#[uretprobe]
pub fn api_exit(ctx: RetProbeContext) -> u32 {
    let ids = current();
    let Some(p) = INFLIGHT.get_ptr_mut(ids.tid) else {
        return 0; // entered before the probes were attached, or filtered out
    };
    // SAFETY: per-thread entry, only this thread touches it.
    let state = unsafe {
        if (*p).depth > 0 {
            (*p).depth -= 1;
            return 0;
        }
        *p
    };
    let _ = INFLIGHT.remove(ids.tid);
    let end = now();
    let result = ctx.ret::<u64>() as u32;
    let mut out = [0u64; 2];
    let mut errors = 0;
    if result == 0 {
        if state.cookie & Flags::DEREF_ARG0 != 0 {
            // SAFETY: user memory read through the helper, which fails cleanly on a bad address.
            match unsafe { bpf_probe_read_user(state.args[0] as *const u64) } {
                Ok(v) => out[0] = v,
                Err(_) => errors |= read_error::OUT_PTR,
            }
        }
        if state.cookie & Flags::DEREF_ARG1 != 0 {
            // SAFETY: as above.
            match unsafe { bpf_probe_read_user(state.args[1] as *const u64) } {
                Ok(v) => out[1] = v,
                Err(_) => errors |= read_error::OUT_PTR,
            }
        }
    }
    let call = |kind: EventKind, errors: u32| CallEvent {
        hdr: header(kind, state.cookie & Flags::ID_MASK, ids, state.ts_ns),
        args: state.args,
        out,
        duration_ns: end - state.ts_ns,
        ioctl_ns: state.ioctl_ns,
        ioctl_count: state.ioctl_count,
        result,
        nested: state.nested,
        read_errors: errors,
    };
    if result == 0 && state.cookie & (Flags::NAME_ARG2 | Flags::NAME_OUT0) != 0 {
        emit_name(&state, ids.tgid, errors, call);
        return 0;
    }
    let Some(mut entry) = reserve::<CallEvent>(EventKind::Call, ids.tgid) else {
        return 0;
    };
    entry.write(call(EventKind::Call, errors));
    submit(entry);
    0
}

/// A call that named a kernel handle: the record carries the name, copied from the caller.
#[inline(always)]
fn emit_name(state: &Inflight, tgid: u32, errors: u32, call: impl Fn(EventKind, u32) -> CallEvent) {
    let name_ptr = if state.cookie & Flags::NAME_ARG2 != 0 {
        state.args[2]
    } else {
        // SAFETY: user memory read through the helper, which fails cleanly on a bad address.
        unsafe { bpf_probe_read_user(state.args[0] as *const u64) }.unwrap_or(0)
    };
    let Some(mut entry) = reserve::<NameEvent>(EventKind::Name, tgid) else {
        return;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: p points to the reserved record, valid until submit; the string read is bounded
    // by the buffer and fails cleanly on a bad address.
    let copied = unsafe {
        (*p).name[0] = 0;
        bpf_probe_read_user_str_bytes(name_ptr as *const u8, &mut (*p).name).is_ok()
    };
    let errors = if copied { errors } else { errors | read_error::NAME };
    // SAFETY: as above.
    unsafe { (*p).call = call(EventKind::Name, errors) };
    submit(entry);
}
