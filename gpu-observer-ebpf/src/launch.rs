//! Kernel and graph launches: entry-only uprobes, one record per call, no per-thread state.

use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_probe_read_user, generated::bpf_get_attach_cookie},
    macros::uprobe,
    programs::ProbeContext,
};
use gpu_observer_common::{
    api::Flags,
    event::{EventKind, LaunchEvent, read_error},
};

use crate::emit::{enter_probe, header, reserve, submit};

/// The attach cookie: the API id and its flags.
#[inline(always)]
pub fn cookie(ctx: &ProbeContext) -> u32 {
    // SAFETY: helper reading the cookie of the attachment that fired.
    unsafe { bpf_get_attach_cookie(ctx.as_ptr()) as u32 }
}

/// The API id from the attach cookie.
#[inline(always)]
pub fn api_id(ctx: &ProbeContext) -> u32 {
    cookie(ctx) & Flags::ID_MASK
}

#[inline(always)]
fn arg(ctx: &ProbeContext, n: usize) -> u64 {
    ctx.arg::<u64>(n).unwrap_or(0)
}

/// `cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra)` and
/// `cuLaunchCooperativeKernel` (same layout without `extra`), `_ptsz` twins too.
#[uprobe]
pub fn launch_kernel(ctx: ProbeContext) -> u32 {
    let Some((ids, ts)) = enter_probe(cookie(&ctx)) else {
        return 0;
    };
    // Arguments 7-9 (blockDimZ, sharedMemBytes, hStream) sit on the stack above the return
    // address; 32-bit ones use the low half of an 8-byte slot.
    // SAFETY: ctx.regs points at the probed task's saved registers for the program's run.
    let sp = unsafe { (*ctx.regs).rsp };
    // SAFETY: reads user memory through the helper, which fails cleanly on a bad address.
    let stack = unsafe { bpf_probe_read_user((sp + 8) as *const [u64; 3]) };
    let (stack, errors) = match stack {
        Ok(s) => (s, 0),
        Err(_) => ([0u64; 3], read_error::STACK),
    };
    let Some(mut entry) = reserve::<LaunchEvent>(EventKind::Launch, ids.tgid) else {
        return 0;
    };
    entry.write(LaunchEvent {
        hdr: header(EventKind::Launch, api_id(&ctx), ids, ts),
        function: arg(&ctx, 0),
        stream: stack[2],
        grid: [arg(&ctx, 1) as u32, arg(&ctx, 2) as u32, arg(&ctx, 3) as u32],
        block: [arg(&ctx, 4) as u32, arg(&ctx, 5) as u32, stack[0] as u32],
        shared_mem_bytes: stack[1] as u32,
        read_errors: errors,
    });
    submit(entry);
    0
}

/// The head of `CUlaunchConfig` up to `hStream`.
#[repr(C)]
#[derive(Clone, Copy)]
struct LaunchConfigHead {
    dims: [u32; 6],
    shared_mem_bytes: u32,
    _pad: u32,
    stream: u64,
}

/// `cuLaunchKernelEx(const CUlaunchConfig* config, CUfunction f, void** params, void** extra)`.
#[uprobe]
pub fn launch_kernel_ex(ctx: ProbeContext) -> u32 {
    let Some((ids, ts)) = enter_probe(cookie(&ctx)) else {
        return 0;
    };
    let config = arg(&ctx, 0) as *const LaunchConfigHead;
    // SAFETY: user memory read through the helper, which fails cleanly on a bad address.
    let (head, errors) = match unsafe { bpf_probe_read_user(config) } {
        Ok(h) => (h, 0),
        Err(_) => (
            LaunchConfigHead {
                dims: [0; 6],
                shared_mem_bytes: 0,
                _pad: 0,
                stream: 0,
            },
            read_error::CONFIG,
        ),
    };
    let Some(mut entry) = reserve::<LaunchEvent>(EventKind::Launch, ids.tgid) else {
        return 0;
    };
    entry.write(LaunchEvent {
        hdr: header(EventKind::Launch, api_id(&ctx), ids, ts),
        function: arg(&ctx, 1),
        stream: head.stream,
        grid: [head.dims[0], head.dims[1], head.dims[2]],
        block: [head.dims[3], head.dims[4], head.dims[5]],
        shared_mem_bytes: head.shared_mem_bytes,
        read_errors: errors,
    });
    submit(entry);
    0
}

/// `cuGraphLaunch(CUgraphExec exec, CUstream stream)`: the exec handle goes in `function`.
#[uprobe]
pub fn graph_launch(ctx: ProbeContext) -> u32 {
    let Some((ids, ts)) = enter_probe(cookie(&ctx)) else {
        return 0;
    };
    let Some(mut entry) = reserve::<LaunchEvent>(EventKind::Launch, ids.tgid) else {
        return 0;
    };
    entry.write(LaunchEvent {
        hdr: header(EventKind::Launch, api_id(&ctx), ids, ts),
        function: arg(&ctx, 0),
        stream: arg(&ctx, 1),
        grid: [0; 3],
        block: [0; 3],
        shared_mem_bytes: 0,
        read_errors: 0,
    });
    submit(entry);
    0
}
