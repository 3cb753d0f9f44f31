//! The libcuda entry points gpu-observer probes, and how to read their arguments.
//!
//! Every variant is listed (`_v2`, `_ptds`, `_ptsz`): programs built with
//! `--default-stream per-thread` call only the `_ptsz`/`_ptds` twins (docs/DESIGN.md "Measured costs"), so a tracer that
//! stops at the first variant misses all of their work. The id of an entry is its index in
//! [`APIS`] plus one; it travels to the eBPF program as the attach cookie (low 16 bits), with
//! [`Flags`] in the bits above.

/// Which eBPF program handles an entry point, and what the agent makes of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Family {
    /// `cuLaunchKernel` layout: f, grid, block in registers and on the stack. Entry probe only.
    Launch,
    /// `cuLaunchKernelEx`: a `CUlaunchConfig*`. Entry probe only.
    LaunchEx,
    /// `cuGraphLaunch(exec, stream)`. Entry probe only.
    GraphLaunch,
    Memcpy,
    Memset,
    Alloc,
    Free,
    Sync,
    /// Driver/context initialization: worth timing for the ioctls it issues.
    Init,
    /// Module and library loads/unloads (`handle` out-pointer on loads).
    Module,
    /// Calls that name a kernel handle: `cuModuleGetFunction`, `cuLibraryGetKernel`,
    /// `cuKernelGetFunction`, `cuFuncGetName`, `cuKernelGetName`.
    Symbol,
    /// `cuLaunchHostFunc(stream, fn, userData)`: a host function queued in a stream, which
    /// stalls the stream until it has run on a driver thread. Entry + return: the call's own
    /// time, its stream and the function.
    HostFunc,
}

impl Family {
    /// Launches are entry-only: a return probe doubles their cost (docs/DESIGN.md "Measured costs").
    pub const fn has_return_probe(self) -> bool {
        !matches!(self, Family::Launch | Family::LaunchEx | Family::GraphLaunch)
    }
}

/// Direction a copy API implies by its name alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Direction {
    None,
    CpuToGpu,
    GpuToCpu,
    GpuToGpu,
    /// Generic (`cuMemcpy`) and peer copies: unified addressing hides the direction.
    Unknown,
}

/// What kind of memory an allocation/free API manages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum MemKind {
    None,
    Device,
    Managed,
    /// Page-locked host memory.
    Host,
}

/// Flags carried in the cookie: what the return probe must read through an out-pointer.
pub struct Flags;
impl Flags {
    /// arg0 is an out-pointer (`CUdeviceptr*`, `void**`): read it at return.
    pub const DEREF_ARG0: u32 = 1 << 16;
    /// arg1 is an out-pointer (`size_t* pPitch`): read it at return.
    pub const DEREF_ARG1: u32 = 1 << 17;
    /// arg2 is a NUL-terminated name (`cuModuleGetFunction(&f, mod, name)`): copy it at return.
    pub const NAME_ARG2: u32 = 1 << 18;
    /// arg0 is a `const char**` the call fills (`cuFuncGetName(&name, f)`): copy `*arg0` at return.
    pub const NAME_OUT0: u32 = 1 << 19;
    /// Fleet mode: the probe follows the capture windows, and its entry records only while
    /// the window is open (`config::WINDOW_OPEN`); the links are attached a little before and
    /// closed a little after, so the captured time is exactly the gate's.
    pub const WINDOWED: u32 = 1 << 20;
    pub const ID_MASK: u32 = 0xffff;
}

/// No argument at this position.
pub const NO_ARG: u8 = u8::MAX;

/// One probed entry point and where its interesting arguments are (0-based register args).
#[derive(Clone, Copy, Debug)]
pub struct ApiSpec {
    pub name: &'static str,
    pub family: Family,
    pub direction: Direction,
    pub mem: MemKind,
    /// Argument holding the byte count (element count for memsets, width for 2D memsets).
    pub bytes_arg: u8,
    /// Second factor of the size: height for 2D memsets and pitched allocations.
    pub height_arg: u8,
    /// Element size multiplying the count (memsets), 1 otherwise.
    pub elem_size: u8,
    pub stream_arg: u8,
    /// Destination pointer; for alloc/free the allocation's address (out-pointer for alloc).
    pub dst_arg: u8,
    pub src_arg: u8,
    /// Flags for the cookie (out-pointers to read at return).
    pub flags: u32,
}

impl ApiSpec {
    pub const fn is_async(&self) -> bool {
        self.stream_arg != NO_ARG
    }
}

const fn spec(name: &'static str, family: Family) -> ApiSpec {
    ApiSpec {
        name,
        family,
        direction: Direction::None,
        mem: MemKind::None,
        bytes_arg: NO_ARG,
        height_arg: NO_ARG,
        elem_size: 1,
        stream_arg: NO_ARG,
        dst_arg: NO_ARG,
        src_arg: NO_ARG,
        flags: 0,
    }
}

const fn launch(name: &'static str) -> ApiSpec {
    spec(name, Family::Launch)
}

const fn graph(name: &'static str) -> ApiSpec {
    ApiSpec {
        stream_arg: 1,
        ..spec(name, Family::GraphLaunch)
    }
}

/// `(dst, src, bytes[, stream])`
const fn copy(name: &'static str, direction: Direction, stream: bool) -> ApiSpec {
    ApiSpec {
        direction,
        dst_arg: 0,
        src_arg: 1,
        bytes_arg: 2,
        stream_arg: if stream { 3 } else { NO_ARG },
        ..spec(name, Family::Memcpy)
    }
}

/// `(dst, dstCtx, src, srcCtx, bytes[, stream])`
const fn peer(name: &'static str, stream: bool) -> ApiSpec {
    ApiSpec {
        direction: Direction::Unknown,
        dst_arg: 0,
        src_arg: 2,
        bytes_arg: 4,
        stream_arg: if stream { 5 } else { NO_ARG },
        ..spec(name, Family::Memcpy)
    }
}

/// `(dst, value, N[, stream])`
const fn memset(name: &'static str, elem_size: u8, stream: bool) -> ApiSpec {
    ApiSpec {
        dst_arg: 0,
        bytes_arg: 2,
        elem_size,
        stream_arg: if stream { 3 } else { NO_ARG },
        ..spec(name, Family::Memset)
    }
}

/// `(dst, pitch, value, width, height[, stream])`
const fn memset2d(name: &'static str, elem_size: u8, stream: bool) -> ApiSpec {
    ApiSpec {
        dst_arg: 0,
        bytes_arg: 3,
        height_arg: 4,
        elem_size,
        stream_arg: if stream { 5 } else { NO_ARG },
        ..spec(name, Family::Memset)
    }
}

/// `(out_ptr*, bytes[, ..., stream at stream_arg])`
const fn alloc(name: &'static str, mem: MemKind, stream_arg: u8) -> ApiSpec {
    ApiSpec {
        mem,
        dst_arg: 0,
        bytes_arg: 1,
        stream_arg,
        flags: Flags::DEREF_ARG0,
        ..spec(name, Family::Alloc)
    }
}

/// `(ptr[, stream])`
const fn free(name: &'static str, mem: MemKind, stream: bool) -> ApiSpec {
    ApiSpec {
        mem,
        dst_arg: 0,
        stream_arg: if stream { 1 } else { NO_ARG },
        ..spec(name, Family::Free)
    }
}

/// `(out_handle*, ...)` for loads, `(handle)` for unloads.
const fn module(name: &'static str, load: bool) -> ApiSpec {
    ApiSpec {
        dst_arg: 0,
        flags: if load { Flags::DEREF_ARG0 } else { 0 },
        ..spec(name, Family::Module)
    }
}

/// `(out_handle*, owner, name)`, `(out_function*, kernel)` or `(out_name**, handle)`.
const fn symbol(name: &'static str, flags: u32) -> ApiSpec {
    ApiSpec {
        dst_arg: 0,
        src_arg: 1,
        flags,
        ..spec(name, Family::Symbol)
    }
}

/// `(stream, fn, userData)`
const fn host_func(name: &'static str) -> ApiSpec {
    ApiSpec {
        stream_arg: 0,
        dst_arg: 1,
        ..spec(name, Family::HostFunc)
    }
}

const fn sync(name: &'static str, handle_arg: u8) -> ApiSpec {
    ApiSpec {
        stream_arg: handle_arg,
        ..spec(name, Family::Sync)
    }
}

use Direction::{CpuToGpu as H2D, GpuToCpu as D2H, GpuToGpu as D2D, Unknown as ANY};
use MemKind::{Device, Host, Managed};

/// Every probed entry point. Order is ABI: ids are indices + 1.
pub const APIS: &[ApiSpec] = &[
    // Launches (entry-only).
    launch("cuLaunchKernel"),
    launch("cuLaunchKernel_ptsz"),
    launch("cuLaunchCooperativeKernel"),
    launch("cuLaunchCooperativeKernel_ptsz"),
    spec("cuLaunchKernelEx", Family::LaunchEx),
    spec("cuLaunchKernelEx_ptsz", Family::LaunchEx),
    graph("cuGraphLaunch"),
    graph("cuGraphLaunch_ptsz"),
    // Copies.
    copy("cuMemcpyHtoD_v2", H2D, false),
    copy("cuMemcpyHtoD_v2_ptds", H2D, false),
    copy("cuMemcpyDtoH_v2", D2H, false),
    copy("cuMemcpyDtoH_v2_ptds", D2H, false),
    copy("cuMemcpyDtoD_v2", D2D, false),
    copy("cuMemcpyDtoD_v2_ptds", D2D, false),
    copy("cuMemcpyHtoDAsync_v2", H2D, true),
    copy("cuMemcpyHtoDAsync_v2_ptsz", H2D, true),
    copy("cuMemcpyDtoHAsync_v2", D2H, true),
    copy("cuMemcpyDtoHAsync_v2_ptsz", D2H, true),
    copy("cuMemcpyDtoDAsync_v2", D2D, true),
    copy("cuMemcpyDtoDAsync_v2_ptsz", D2D, true),
    copy("cuMemcpy", ANY, false),
    copy("cuMemcpy_ptds", ANY, false),
    copy("cuMemcpyAsync", ANY, true),
    copy("cuMemcpyAsync_ptsz", ANY, true),
    peer("cuMemcpyPeer", false),
    peer("cuMemcpyPeer_ptds", false),
    peer("cuMemcpyPeerAsync", true),
    peer("cuMemcpyPeerAsync_ptsz", true),
    // Memsets.
    memset("cuMemsetD8_v2", 1, false),
    memset("cuMemsetD8_v2_ptds", 1, false),
    memset("cuMemsetD16_v2", 2, false),
    memset("cuMemsetD16_v2_ptds", 2, false),
    memset("cuMemsetD32_v2", 4, false),
    memset("cuMemsetD32_v2_ptds", 4, false),
    memset("cuMemsetD8Async", 1, true),
    memset("cuMemsetD8Async_ptsz", 1, true),
    memset("cuMemsetD16Async", 2, true),
    memset("cuMemsetD16Async_ptsz", 2, true),
    memset("cuMemsetD32Async", 4, true),
    memset("cuMemsetD32Async_ptsz", 4, true),
    memset2d("cuMemsetD2D8_v2", 1, false),
    memset2d("cuMemsetD2D8_v2_ptds", 1, false),
    memset2d("cuMemsetD2D16_v2", 2, false),
    memset2d("cuMemsetD2D16_v2_ptds", 2, false),
    memset2d("cuMemsetD2D32_v2", 4, false),
    memset2d("cuMemsetD2D32_v2_ptds", 4, false),
    memset2d("cuMemsetD2D8Async", 1, true),
    memset2d("cuMemsetD2D8Async_ptsz", 1, true),
    memset2d("cuMemsetD2D16Async", 2, true),
    memset2d("cuMemsetD2D16Async_ptsz", 2, true),
    memset2d("cuMemsetD2D32Async", 4, true),
    memset2d("cuMemsetD2D32Async_ptsz", 4, true),
    // Allocations.
    alloc("cuMemAlloc_v2", Device, NO_ARG),
    alloc("cuMemAllocAsync", Device, 2),
    alloc("cuMemAllocAsync_ptsz", Device, 2),
    alloc("cuMemAllocFromPoolAsync", Device, 3),
    alloc("cuMemAllocFromPoolAsync_ptsz", Device, 3),
    // (dptr*, pPitch*, widthBytes, height, elemSize): bytes = pitch * height, read at return.
    ApiSpec {
        bytes_arg: 2,
        height_arg: 3,
        flags: Flags::DEREF_ARG0 | Flags::DEREF_ARG1,
        ..alloc("cuMemAllocPitch_v2", Device, NO_ARG)
    },
    alloc("cuMemAllocManaged", Managed, NO_ARG),
    alloc("cuMemAllocHost_v2", Host, NO_ARG),
    alloc("cuMemHostAlloc", Host, NO_ARG),
    free("cuMemFree_v2", Device, false),
    free("cuMemFreeAsync", Device, true),
    free("cuMemFreeAsync_ptsz", Device, true),
    free("cuMemFreeHost", Host, false),
    // Synchronization (stream_arg holds the stream/event/context handle).
    sync("cuCtxSynchronize", NO_ARG),
    sync("cuCtxSynchronize_v2", 0),
    sync("cuStreamSynchronize", 0),
    sync("cuStreamSynchronize_ptsz", 0),
    sync("cuEventSynchronize", 0),
    // Initialization.
    spec("cuInit", Family::Init),
    spec("cuDevicePrimaryCtxRetain", Family::Init),
    // Modules and libraries (appended: ids are ABI).
    module("cuModuleLoad", true),
    module("cuModuleLoadData", true),
    module("cuModuleLoadDataEx", true),
    module("cuModuleLoadFatBinary", true),
    module("cuModuleUnload", false),
    module("cuLibraryLoadData", true),
    module("cuLibraryLoadFromFile", true),
    module("cuLibraryUnload", false),
    // Kernel names.
    symbol("cuModuleGetFunction", Flags::DEREF_ARG0 | Flags::NAME_ARG2),
    symbol("cuLibraryGetKernel", Flags::DEREF_ARG0 | Flags::NAME_ARG2),
    symbol("cuKernelGetFunction", Flags::DEREF_ARG0),
    symbol("cuFuncGetName", Flags::NAME_OUT0),
    symbol("cuKernelGetName", Flags::NAME_OUT0),
    // Host memory registered with the driver: pinned like cuMemAllocHost (address is arg0).
    ApiSpec {
        flags: 0,
        ..alloc("cuMemHostRegister_v2", Host, NO_ARG)
    },
    free("cuMemHostUnregister", Host, false),
    // Host functions queued in streams. Appended: ids are the table's order, and recordings
    // (tests/data) keep theirs.
    host_func("cuLaunchHostFunc"),
    host_func("cuLaunchHostFunc_ptsz"),
];

/// Number of probed entry points.
pub const API_COUNT: usize = APIS.len();

/// The spec for an id carried in an event (1-based), if valid.
pub fn by_id(id: u32) -> Option<&'static ApiSpec> {
    (id as usize).checked_sub(1).and_then(|i| APIS.get(i))
}

/// The id of an entry point by exact symbol name.
pub fn id_of(name: &str) -> Option<u32> {
    let mut i = 0;
    while i < APIS.len() {
        if str_eq(APIS[i].name, name) {
            return Some(i as u32 + 1);
        }
        i += 1;
    }
    None
}

fn str_eq(a: &str, b: &str) -> bool {
    a.as_bytes() == b.as_bytes()
}

/// The attach cookie for an entry point: id in the low 16 bits, flags above.
pub fn cookie(id: u32) -> u64 {
    let flags = by_id(id).map_or(0, |s| s.flags);
    u64::from(id | flags)
}

/// Symbols whose absence means the file is not a usable libcuda.
pub const REQUIRED: &[&str] = &["cuLaunchKernel", "cuMemcpyHtoD_v2", "cuMemAlloc_v2", "cuCtxSynchronize"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_roundtrip_and_names_are_unique() {
        for (i, s) in APIS.iter().enumerate() {
            let id = id_of(s.name).unwrap();
            assert_eq!(id as usize, i + 1);
            assert_eq!(by_id(id).unwrap().name, s.name);
        }
        assert!(by_id(0).is_none());
        assert!(by_id(API_COUNT as u32 + 1).is_none());
        assert!(API_COUNT < Flags::ID_MASK as usize);
    }

    #[test]
    fn cookie_carries_flags_for_out_pointers() {
        let pitch = id_of("cuMemAllocPitch_v2").unwrap();
        let c = cookie(pitch) as u32;
        assert_eq!(c & Flags::ID_MASK, pitch);
        assert_ne!(c & Flags::DEREF_ARG0, 0);
        assert_ne!(c & Flags::DEREF_ARG1, 0);
        let launch = id_of("cuLaunchKernel").unwrap();
        assert_eq!(cookie(launch), u64::from(launch));
    }

    #[test]
    fn every_variant_family_is_probed() {
        for name in [
            "cuLaunchKernel_ptsz",
            "cuLaunchKernelEx_ptsz",
            "cuGraphLaunch_ptsz",
            "cuMemcpyHtoDAsync_v2_ptsz",
            "cuMemcpyDtoH_v2_ptds",
            "cuStreamSynchronize_ptsz",
        ] {
            assert!(id_of(name).is_some(), "{name}");
        }
        assert!(REQUIRED.iter().all(|n| id_of(n).is_some()));
    }
}
