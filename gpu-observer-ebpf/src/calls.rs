//! Copies, memsets, allocations, frees, syncs and init calls: an entry probe saves the raw
//! arguments per thread, the return probe emits one record with the duration, the result, the
//! values behind out-pointers and the ioctls issued inside. The agent decodes the arguments.
//!
//! A call that never returns (longjmp or a C++ exception out of the driver) leaves its state
//! behind. It is told from nesting by the user stack pointer, the rule the kernel applies to its
//! own uretprobe return instances (`arch_uretprobe_is_alive`): at entry, `[sp]` is the return
//! slot, and while the call runs every deeper call has a lower `sp`. So a new entry
//! - below the saved `sp` is nested (counted in the outer call, not reported);
//! - above it, or at it with the same return address (the same call site called again), means
//!   the saved call was abandoned: it is emitted flagged `ABANDONED` (no duration or result) and
//!   the new call takes its place, so calls stay exactly counted;
//! - at it from another return address is ambiguous: a tail call from the outer function (the
//!   slot then holds the uretprobe trampoline, which the outer's return probe put there) or a
//!   call from another site of the same frame after the outer was abandoned (the try/catch
//!   pattern). It is kept as `tail` and its return decides: the kernel returns a tail call to
//!   the outer call's return address, a call of its own to its own.
//!
//! A return probe belongs to the saved call when its `sp` is the saved `sp` + 8 (the slot was
//! popped); a lower one is a nested call's return.

use aya_ebpf::{
    helpers::{bpf_probe_read_user, bpf_probe_read_user_str_bytes},
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use gpu_observer_common::{
    api::Flags,
    event::{CallEvent, EventKind, Inflight, NameEvent, TailCall, call_flags, read_error},
};

use crate::{
    emit::{Ids, current, enter_probe, header, now, reserve, submit},
    launch::cookie,
    maps::INFLIGHT,
};

/// One call as a record reports it.
#[derive(Clone, Copy)]
struct Call {
    ts_ns: u64,
    args: [u64; 6],
    ioctl_ns: u64,
    cookie: u32,
    ioctl_count: u32,
    nested: u32,
}

impl Call {
    /// The outer call of a state; when a tail candidate is kept, the ioctls before it entered.
    #[inline(always)]
    fn outer(s: &Inflight) -> Self {
        let (ioctl_ns, ioctl_count) = if s.has_tail != 0 {
            (s.tail.ioctl_ns_before, s.tail.ioctl_count_before)
        } else {
            (s.ioctl_ns, s.ioctl_count)
        };
        Call {
            ts_ns: s.ts_ns,
            args: s.args,
            ioctl_ns,
            cookie: s.cookie,
            ioctl_count,
            nested: s.nested,
        }
    }

    /// The tail candidate of a state, with the ioctls since it entered.
    #[inline(always)]
    fn tail(s: &Inflight) -> Self {
        Call {
            ts_ns: s.tail.ts_ns,
            args: s.tail.args,
            ioctl_ns: s.ioctl_ns - s.tail.ioctl_ns_before,
            cookie: s.tail.cookie,
            ioctl_count: s.ioctl_count - s.tail.ioctl_count_before,
            nested: 0,
        }
    }

    #[inline(always)]
    fn event(&self, kind: EventKind, ids: Ids, out: [u64; 2], end: u64, result: u32, errors: u32) -> CallEvent {
        CallEvent {
            hdr: header(kind, self.cookie & Flags::ID_MASK, ids, self.ts_ns),
            args: self.args,
            out,
            duration_ns: end - self.ts_ns,
            ioctl_ns: self.ioctl_ns,
            ioctl_count: self.ioctl_count,
            result,
            nested: self.nested,
            read_errors: errors,
            flags: 0,
            _pad: 0,
        }
    }
}

#[uprobe]
pub fn api_enter(ctx: ProbeContext) -> u32 {
    let cookie = cookie(&ctx);
    let Some((ids, ts_ns)) = enter_probe(cookie) else {
        return 0;
    };
    // SAFETY: the registers of the probed thread at entry, given by the kernel.
    let sp = unsafe { (*ctx.regs).rsp };
    // SAFETY: user memory read through the helper, which fails cleanly on a bad address.
    let ret_addr = unsafe { bpf_probe_read_user(sp as *const u64) }.unwrap_or(0);
    let mut args = [0u64; 6];
    let mut i = 0;
    while i < 6 {
        args[i] = ctx.arg::<u64>(i).unwrap_or(0);
        i += 1;
    }
    if let Some(p) = INFLIGHT.get_ptr_mut(ids.tid) {
        // SAFETY: per-thread entry, only this thread touches it.
        let s = unsafe { &mut *p };
        if sp < s.sp {
            // A probed call made from inside another (the driver calling its own exported
            // entry): only the outer one is reported.
            s.nested += 1;
            return 0;
        }
        if sp == s.sp && ret_addr != s.ret_addr && s.has_tail == 0 {
            s.tail = TailCall {
                ts_ns,
                args,
                ret_addr,
                ioctl_ns_before: s.ioctl_ns,
                ioctl_count_before: s.ioctl_count,
                cookie,
            };
            s.has_tail = 1;
            return 0;
        }
        // Entered at or above the saved frame: the saved call (and its tail candidate, when a
        // second call at the same frame comes before any return) will never return.
        abandon(s, ids);
    }
    let state = Inflight {
        ts_ns,
        args,
        ioctl_ns: 0,
        sp,
        ret_addr,
        cookie,
        ioctl_count: 0,
        nested: 0,
        has_tail: 0,
        tail: TailCall {
            ts_ns: 0,
            args: [0; 6],
            ret_addr: 0,
            ioctl_ns_before: 0,
            ioctl_count_before: 0,
            cookie: 0,
        },
    };
    let _ = INFLIGHT.insert(ids.tid, state, 0);
    0
}

/// Emits the saved call (and its tail candidate) as abandoned.
#[inline(always)]
fn abandon(s: &Inflight, ids: Ids) {
    emit_abandoned(&Call::outer(s), ids);
    if s.has_tail != 0 {
        emit_abandoned(&Call::tail(s), ids);
    }
}

#[inline(always)]
fn emit_abandoned(c: &Call, ids: Ids) {
    let Some(mut entry) = reserve::<CallEvent>(EventKind::Call, ids.tgid) else {
        return;
    };
    let mut ev = c.event(EventKind::Call, ids, [0; 2], c.ts_ns, 0, 0);
    ev.flags = call_flags::ABANDONED;
    entry.write(ev);
    submit(entry);
}

#[uretprobe]
pub fn api_exit(ctx: RetProbeContext) -> u32 {
    let ids = current();
    let Some(p) = INFLIGHT.get_ptr_mut(ids.tid) else {
        return 0; // entered before the probes were attached, or filtered out
    };
    // SAFETY: the registers at the return, given by the kernel: `rsp` is past the popped return
    // slot and `rip` the address the call returns to.
    let (sp, ip) = unsafe { ((*ctx.regs).rsp, (*ctx.regs).rip) };
    // SAFETY: per-thread entry, only this thread touches it.
    let s = unsafe { &*p };
    let own = s.sp.wrapping_add(8);
    if sp < own {
        return 0; // a nested call's return
    }
    if sp > own {
        // A call whose entry was not seen returns from above the saved frame: the saved call
        // was abandoned.
        abandon(s, ids);
        let _ = INFLIGHT.remove(ids.tid);
        return 0;
    }
    let end = now();
    // The tail candidate returned to its own caller, not to the outer call's: it was a call
    // from another site after the outer call was abandoned, not a tail call.
    let separate = s.has_tail != 0 && ip == s.tail.ret_addr && ip != s.ret_addr;
    let done = if separate {
        emit_abandoned(&Call::outer(s), ids);
        Call::tail(s)
    } else {
        let mut c = Call::outer(s);
        // A tail call ran inside the outer call: nested, with its ioctls.
        c.nested += s.has_tail;
        c.ioctl_ns = s.ioctl_ns;
        c.ioctl_count = s.ioctl_count;
        c
    };
    let _ = INFLIGHT.remove(ids.tid);
    let result = ctx.ret::<u64>() as u32;
    let mut out = [0u64; 2];
    let mut errors = 0;
    if result == 0 {
        if done.cookie & Flags::DEREF_ARG0 != 0 {
            // SAFETY: user memory read through the helper, which fails cleanly on a bad address.
            match unsafe { bpf_probe_read_user(done.args[0] as *const u64) } {
                Ok(v) => out[0] = v,
                Err(_) => errors |= read_error::OUT_PTR,
            }
        }
        if done.cookie & Flags::DEREF_ARG1 != 0 {
            // SAFETY: as above.
            match unsafe { bpf_probe_read_user(done.args[1] as *const u64) } {
                Ok(v) => out[1] = v,
                Err(_) => errors |= read_error::OUT_PTR,
            }
        }
    }
    if result == 0 && done.cookie & (Flags::NAME_ARG2 | Flags::NAME_OUT0) != 0 {
        emit_name(&done, ids, out, end, result, errors);
        return 0;
    }
    let Some(mut entry) = reserve::<CallEvent>(EventKind::Call, ids.tgid) else {
        return 0;
    };
    entry.write(done.event(EventKind::Call, ids, out, end, result, errors));
    submit(entry);
    0
}

/// A call that named a kernel handle: the record carries the name, copied from the caller.
#[inline(always)]
fn emit_name(c: &Call, ids: Ids, out: [u64; 2], end: u64, result: u32, errors: u32) {
    let name_ptr = if c.cookie & Flags::NAME_ARG2 != 0 {
        c.args[2]
    } else {
        // SAFETY: user memory read through the helper, which fails cleanly on a bad address.
        unsafe { bpf_probe_read_user(c.args[0] as *const u64) }.unwrap_or(0)
    };
    let Some(mut entry) = reserve::<NameEvent>(EventKind::Name, ids.tgid) else {
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
    unsafe { (*p).call = c.event(EventKind::Name, ids, out, end, result, errors) };
    submit(entry);
}
