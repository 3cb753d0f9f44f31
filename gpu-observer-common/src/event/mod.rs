//! Records the eBPF programs write into the `EVENTS` ring buffer.
//!
//! Each record starts with an [`EventHeader`]; its `kind` says which struct follows. Sizes are
//! multiples of 8 so records stay aligned in the ring.

#[cfg(feature = "user")]
mod user;

use crate::cupti::GpuRecord;
#[cfg(feature = "user")]
pub use user::read_record;

/// Kind of a ring-buffer record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum EventKind {
    /// [`LaunchEvent`], from an entry-only probe.
    Launch = 1,
    /// [`CallEvent`]: a probed call that returned (copy, memset, alloc, free, sync, init).
    Call = 2,
    /// [`IoctlEvent`]: an ioctl of an observed thread that returned.
    Ioctl = 3,
    /// [`EventHeader`] alone: the process (thread group leader) exited.
    ProcessExit = 4,
    /// [`NameEvent`]: a call that named a kernel handle.
    Name = 5,
    /// [`GpuEvent`]: a record from the CUPTI injection library.
    Gpu = 6,
    /// [`GpuNameEvent`]: a kernel name CUPTI reported.
    GpuName = 7,
}

impl EventKind {
    pub const COUNT: u32 = 8;

    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => Self::Launch,
            2 => Self::Call,
            3 => Self::Ioctl,
            4 => Self::ProcessExit,
            5 => Self::Name,
            6 => Self::Gpu,
            7 => Self::GpuName,
            _ => return None,
        })
    }
}

/// The key of a (process, kind) drop counter: `tgid << 8 | kind`.
#[inline(always)]
pub const fn drop_key(tgid: u32, kind: EventKind) -> u64 {
    ((tgid as u64) << 8) | kind as u64
}

pub const COMM_LEN: usize = 16;

/// Common prefix of every record.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct EventHeader {
    /// An [`EventKind`] as u32.
    pub kind: u32,
    /// 1-based index into [`crate::api::APIS`], 0 when none.
    pub api: u32,
    pub pid: u32,
    pub tid: u32,
    /// CLOCK_MONOTONIC ns (`bpf_ktime_get_ns`); for calls, their entry.
    pub ts_ns: u64,
    pub comm: [u8; COMM_LEN],
}

/// A kernel or graph launch, read at entry.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct LaunchEvent {
    pub hdr: EventHeader,
    /// `CUfunction` (or `CUgraphExec` for graph launches).
    pub function: u64,
    pub stream: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    /// 0 when the arguments were read in full; else a bit per part that could not be read.
    pub read_errors: u32,
}

/// Bits of [`LaunchEvent::read_errors`].
pub mod read_error {
    /// The stack arguments of `cuLaunchKernel` (blockDimZ, shared memory, stream).
    pub const STACK: u32 = 1;
    /// The `CUlaunchConfig` of `cuLaunchKernelEx`.
    pub const CONFIG: u32 = 2;
    /// An out-pointer of an allocation, read at return.
    pub const OUT_PTR: u32 = 4;
    /// The kernel name string.
    pub const NAME: u32 = 8;
}

/// A probed call from entry to return. Arguments are raw; the agent decodes them by API.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct CallEvent {
    pub hdr: EventHeader,
    /// The six register arguments at entry.
    pub args: [u64; 6],
    /// Values read through out-pointers at return (see [`crate::api::Flags`]).
    pub out: [u64; 2],
    pub duration_ns: u64,
    /// Time this thread spent in ioctls during the call.
    pub ioctl_ns: u64,
    pub ioctl_count: u32,
    /// `CUresult` returned.
    pub result: u32,
    /// Nested probed calls this call made (counted, not reported).
    pub nested: u32,
    pub read_errors: u32,
    /// [`call_flags`] bits.
    pub flags: u32,
    pub _pad: u32,
}

/// Bits of [`CallEvent::flags`].
pub mod call_flags {
    /// The call never returned (longjmp or an exception out of the driver): a later probed call
    /// on the thread entered at or above its stack frame. `duration_ns`, `result` and `out` are
    /// unknown (0).
    pub const ABANDONED: u32 = 1;
}

/// Longest kernel name copied (mangled C++ names of template kernels run to hundreds of bytes).
pub const NAME_LEN: usize = 1024;

/// A [`CallEvent`] that named a kernel handle, with the name (NUL-terminated, maybe truncated).
#[derive(Clone, Copy)]
#[repr(C)]
pub struct NameEvent {
    pub call: CallEvent,
    pub name: [u8; NAME_LEN],
}

/// A [`GpuRecord`] the injection library passed to its hook, as it was.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct GpuEvent {
    pub hdr: EventHeader,
    pub rec: GpuRecord,
}

/// A kernel name the injection library passed to its name hook.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct GpuNameEvent {
    pub hdr: EventHeader,
    /// CUPTI's name pointer: the `name_key` of the kernel's records.
    pub key: u64,
    pub name: [u8; NAME_LEN],
}

/// An ioctl issued by an observed thread.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct IoctlEvent {
    pub hdr: EventHeader,
    pub arg: u64,
    pub duration_ns: u64,
    pub ret: i64,
    pub fd: u32,
    pub cmd: u32,
    /// API id of the probed call the thread was inside, 0 if none.
    pub parent_api: u32,
    pub _pad: u32,
}

/// The eBPF-side state of a thread inside a probed call (map value, not a ring record).
///
/// Stale state (a call that never returned) is told from nesting by the stack pointer, as the
/// kernel tells dead uretprobe instances (`arch_uretprobe_is_alive`): a call entered below `sp`
/// runs inside this one; one entered above it, or at it from the same return address, means
/// this one was abandoned. See `gpu-observer-ebpf/src/calls.rs`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct Inflight {
    pub ts_ns: u64,
    pub args: [u64; 6],
    pub ioctl_ns: u64,
    /// User stack pointer at entry: the address of the return slot.
    pub sp: u64,
    /// The return address read at `[sp]` at entry.
    pub ret_addr: u64,
    /// Attach cookie: API id and flags.
    pub cookie: u32,
    pub ioctl_count: u32,
    /// Probed calls entered while this one runs (not reported on their own).
    pub nested: u32,
    /// 1 when `tail` holds a call entered at the same `sp` from another return address.
    pub has_tail: u32,
    pub tail: TailCall,
}

/// A call entered at the same stack pointer as the one in flight but from another return
/// address: either a tail call (the slot then holds the uretprobe trampoline) or a call from
/// another site of the same frame after the first was abandoned. Its return tells which.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct TailCall {
    pub ts_ns: u64,
    pub args: [u64; 6],
    pub ret_addr: u64,
    /// The outer call's ioctl counters when this one entered (what came after is this one's).
    pub ioctl_ns_before: u64,
    pub ioctl_count_before: u32,
    pub cookie: u32,
}

/// The eBPF-side state of a thread inside an ioctl.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct IoctlStart {
    pub ts_ns: u64,
    pub arg: u64,
    pub fd: u32,
    pub cmd: u32,
    pub parent_api: u32,
    pub _pad: u32,
}

/// The ioctl type byte of the nvidia RM driver (`'F'`): `/dev/nvidiactl`, `/dev/nvidiaN`.
pub const NV_IOCTL_MAGIC: u32 = 0x46;

/// `_IOC_TYPE(cmd)`.
pub const fn ioctl_type(cmd: u32) -> u32 {
    (cmd >> 8) & 0xff
}

const _: () = {
    assert!(core::mem::size_of::<EventHeader>() == 40);
    assert!(core::mem::size_of::<LaunchEvent>().is_multiple_of(8));
    assert!(core::mem::size_of::<CallEvent>().is_multiple_of(8));
    assert!(core::mem::size_of::<IoctlEvent>().is_multiple_of(8));
    assert!(core::mem::size_of::<NameEvent>().is_multiple_of(8));
    assert!(core::mem::size_of::<GpuEvent>().is_multiple_of(8));
    assert!(core::mem::size_of::<GpuNameEvent>().is_multiple_of(8));
};
