//! The CUPTI injection library's hooks: it passes batches of GPU activity records (and kernel
//! names) by pointer to functions that do nothing; these entry probes copy them into the ring.
//! Every read is bounded (at most `MAX_BATCH` records of a fixed size, names up to `NAME_LEN`)
//! and fails cleanly on a bad pointer.

use aya_ebpf::{
    helpers::{bpf_probe_read_user_buf, bpf_probe_read_user_str_bytes},
    macros::uprobe,
    programs::ProbeContext,
};
use gpu_observer_common::{
    cupti::{GpuRecord, MAX_BATCH},
    event::{EventKind, GpuEvent, GpuNameEvent},
};

use crate::emit::{enter, header, now, reserve, submit};

const RECORD: usize = core::mem::size_of::<GpuRecord>();

#[uprobe]
pub fn cupti_batch(ctx: ProbeContext) -> u32 {
    let Some(ids) = enter() else {
        return 0;
    };
    let base: u64 = ctx.arg(0).unwrap_or(0);
    let count: u32 = ctx.arg(1).unwrap_or(0);
    let ts = now();
    let mut i = 0u32;
    while i < MAX_BATCH && i < count {
        let Some(mut entry) = reserve::<GpuEvent>(EventKind::Gpu, ids.tgid) else {
            return 0;
        };
        let p = entry.as_mut_ptr();
        let src = (base + u64::from(i) * RECORD as u64) as *const u8;
        // SAFETY: p points to the reserved record until submit/discard; the read is bounded by
        // the record's size and fails cleanly on a bad address.
        let ok = unsafe {
            let dst = core::slice::from_raw_parts_mut((&raw mut (*p).rec).cast::<u8>(), RECORD);
            bpf_probe_read_user_buf(src, dst).is_ok()
        };
        if !ok {
            entry.discard(0);
            return 0;
        }
        // SAFETY: as above.
        unsafe { (*p).hdr = header(EventKind::Gpu, 0, ids, ts) };
        submit(entry);
        i += 1;
    }
    0
}

#[uprobe]
pub fn cupti_name(ctx: ProbeContext) -> u32 {
    let Some(ids) = enter() else {
        return 0;
    };
    let key: u64 = ctx.arg(0).unwrap_or(0);
    let name: u64 = ctx.arg(1).unwrap_or(0);
    let Some(mut entry) = reserve::<GpuNameEvent>(EventKind::GpuName, ids.tgid) else {
        return 0;
    };
    let p = entry.as_mut_ptr();
    // SAFETY: p points to the reserved record until submit; the string read is bounded by the
    // buffer and fails cleanly on a bad address.
    unsafe {
        (*p).hdr = header(EventKind::GpuName, 0, ids, now());
        (*p).key = key;
        (*p).name[0] = 0;
        let _ = bpf_probe_read_user_str_bytes(name as *const u8, &mut (*p).name);
    }
    submit(entry);
    0
}
