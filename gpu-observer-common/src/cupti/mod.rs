//! What the CUPTI injection library (`gpu-observer-cupti`) hands to the eBPF side.
//!
//! The library converts CUPTI activity records into fixed-size [`GpuRecord`]s and passes
//! batches of them to an exported hook function that does nothing; the agent's uprobe on that
//! function copies each record into the ring buffer (bounded reads by pointer, parcagpu's USDT
//! idea). No socket, no shared file: it works across containers. The library calls the hook
//! only while [`SEMAPHORE_SYMBOL`] is non-zero, and the kernel keeps that counter (a uprobe
//! reference counter, as for USDT is-enabled semaphores): it is raised while an agent's uprobe
//! is attached and back to zero when the agent goes, so without an observer nothing is
//! collected at all.

#[cfg(feature = "user")]
mod user;

use crate::api::Family;

/// `void gpu_observer_cupti_batch(const GpuRecord *records, uint32_t count)`.
pub const BATCH_SYMBOL: &str = "gpu_observer_cupti_batch";
/// `void gpu_observer_cupti_name(uint64_t key, const char *name)`: a kernel name CUPTI
/// reported (`key` is CUPTI's name pointer, the same in every record of that kernel).
pub const NAME_SYMBOL: &str = "gpu_observer_cupti_name";
/// `uint16_t` the kernel raises while a uprobe with this reference counter is attached.
pub const SEMAPHORE_SYMBOL: &str = "gpu_observer_cupti_semaphore";
/// File name of the injection library (`CUDA_INJECTION64_PATH`).
pub const LIBRARY_FILE: &str = "libgpu_observer_cupti.so";
/// `uint32_t` an observer writes (through `/proc/<pid>/mem`) to switch a library it injected
/// into a running process (`--gpu-timing`) on and off: see [`control`].
pub const CONTROL_SYMBOL: &str = "gpu_observer_cupti_control";
/// Name of the memfd an injected library is loaded from: `/proc/<pid>/maps` shows its
/// mappings as `/memfd:gpu-observer-cupti (deleted)`.
pub const MEMFD_NAME: &str = "gpu-observer-cupti";

/// Values of [`CONTROL_SYMBOL`]. A library loaded through `CUDA_INJECTION64_PATH` collects
/// whenever an observer is attached unless the word is [`control::PAUSE`]; one injected late
/// collects only while an observer is attached *and* the word is [`control::ON`], so that
/// attaching without `--gpu-timing` never turns CUPTI on in a process that did not ask for it.
/// A library that sees no observer attached sets `PAUSE` back to `OFF` itself, so an observer
/// killed between two capture windows leaves no process paused for the next one.
pub mod control {
    /// The initial word: a library loaded at start collects while observed, one injected late
    /// does not (the state after injection and after a withdraw).
    pub const OFF: u32 = 0;
    /// Collect while an observer is attached.
    pub const ON: u32 = 1;
    /// Fleet mode between capture windows: collect nothing, whichever way the library came
    /// (CUPTI's own cost is paid only in the windows; docs/DESIGN.md "Fleet mode").
    pub const PAUSE: u32 = 2;
}

/// Records per hook call; the eBPF program copies at most this many.
pub const MAX_BATCH: u32 = 32;

/// What a [`GpuRecord`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum GpuRecordKind {
    /// A driver API call CUPTI timed: `tid`, `cbid`, `start_ns`..`end_ns`, `correlation_id`.
    Api = 1,
    /// A kernel's execution on the GPU.
    Kernel = 2,
    /// A copy's execution on the GPU (`bytes`, `copy_kind`, `src_kind`, `dst_kind`).
    Memcpy = 3,
    /// A memset's execution on the GPU (`bytes`, `value`).
    Memset = 4,
    /// A device's attributes, in `aux` (see [`device_aux`]).
    Device = 5,
    /// The library's state and counters, in `aux` (see [`status_aux`]).
    Status = 6,
    /// A runtime API call CUPTI timed (`cudaLaunchKernel`, `cudaMemcpyAsync`, ...): the driver
    /// call the uprobes saw happened inside it. CUPTI gives work launched through the runtime
    /// the runtime call's correlation id, and records no driver API call for it.
    RuntimeApi = 7,
    /// An NVTX marker CUPTI recorded (the injection library is the process's NVTX tool):
    /// `start_ns` its time, `correlation_id` the marker id (a range's start and end share it),
    /// `cbid` CUPTI's marker flags ([`marker`]), `tid` the thread (0 when CUPTI names none),
    /// `src_kind` CUPTI's object kind, `name_key` the key its name was sent under (0 for an
    /// end, which has none).
    Marker = 8,
}

impl GpuRecordKind {
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => Self::Api,
            2 => Self::Kernel,
            3 => Self::Memcpy,
            4 => Self::Memset,
            5 => Self::Device,
            6 => Self::Status,
            7 => Self::RuntimeApi,
            8 => Self::Marker,
            _ => return None,
        })
    }
}

/// One record, the same layout for every kind (fields a kind does not use are zero).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct GpuRecord {
    /// A [`GpuRecordKind`].
    pub kind: u32,
    /// CUPTI's correlation id: the same in an API record and the work it launched.
    pub correlation_id: u32,
    /// CLOCK_MONOTONIC ns (the library makes CUPTI use that clock).
    pub start_ns: u64,
    pub end_ns: u64,
    pub device: u32,
    pub context: u32,
    /// CUPTI's stream id (not the `CUstream` handle).
    pub stream: u32,
    /// Api: the calling thread (gettid).
    pub tid: u32,
    /// Api: CUPTI's driver callback id; Kernel: the launch type.
    pub cbid: u32,
    /// Api: the CUresult returned.
    pub result: u32,
    pub grid: [i32; 3],
    pub block: [i32; 3],
    pub registers_per_thread: u32,
    pub static_shared_mem: u32,
    pub dynamic_shared_mem: u32,
    /// CUDA graph the kernel/copy ran in, 0 if none.
    pub graph_id: u32,
    /// Memcpy/memset bytes.
    pub bytes: u64,
    /// Kernel: CUPTI's name pointer (key of the name passed to [`NAME_SYMBOL`]).
    pub name_key: u64,
    /// Memcpy: CUPTI_ACTIVITY_MEMCPY_KIND_*; memset: the value.
    pub copy_kind: u32,
    /// Memcpy: CUPTI_ACTIVITY_MEMORY_KIND_* of source and destination; memset: of the target.
    pub src_kind: u16,
    pub dst_kind: u16,
    /// Device and Status records.
    pub aux: [u64; 8],
}

/// What a Marker record is (`CUpti_ActivityFlag`'s marker bits, cupti_activity.h).
pub mod marker {
    /// A point in time (`nvtxMark`).
    pub const INSTANTANEOUS: u32 = 1 << 0;
    /// A range began (`nvtxRangePush`, `nvtxRangeStart`).
    pub const START: u32 = 1 << 1;
    /// A range ended (`nvtxRangePop`, `nvtxRangeEnd`).
    pub const END: u32 = 1 << 2;
    /// `CUPTI_ACTIVITY_OBJECT_THREAD`: the marker belongs to thread `tid`.
    pub const OBJECT_THREAD: u16 = 2;
    /// Name keys of markers have this bit set: they never collide with a kernel name's key
    /// (CUPTI's pointer, a user-space address). The rest is the marker id.
    pub const NAME_KEY_BIT: u64 = 1 << 63;
    /// Separates a marker's NVTX domain from its name in the string sent with the key (a
    /// default-domain marker has none).
    pub const DOMAIN_SEPARATOR: u8 = 0x1f;
}

/// Slots of [`GpuRecord::aux`] in a Device record (from `cuDeviceGetAttribute`).
pub mod device_aux {
    pub const SM_COUNT: usize = 0;
    pub const MAX_THREADS_PER_SM: usize = 1;
    pub const MAX_BLOCKS_PER_SM: usize = 2;
    pub const REGISTERS_PER_SM: usize = 3;
    pub const SHARED_MEM_PER_SM: usize = 4;
    /// Shared memory the system reserves per block (1 KiB on sm_80+).
    pub const RESERVED_SHARED_MEM_PER_BLOCK: usize = 5;
    pub const WARP_SIZE: usize = 6;
    /// major * 10 + minor.
    pub const COMPUTE_CAPABILITY: usize = 7;
}

/// Slots of [`GpuRecord::aux`] in a Status record. Counters are cumulative for the process.
/// A Status record's `cbid` is the process's [`NvtxState`].
pub mod status_aux {
    /// A [`super::CuptiState`].
    pub const STATE: usize = 0;
    /// The CUptiResult that decided the state (0 when none).
    pub const CUPTI_RESULT: usize = 1;
    /// Records CUPTI itself dropped (its buffers were full).
    pub const CUPTI_DROPPED: usize = 2;
    /// Records left out by the library's rate limit.
    pub const RATE_LIMITED: usize = 3;
    /// Records handed to the hook.
    pub const FORWARDED: usize = 4;
    /// Activity buffers CUPTI completed.
    pub const BUFFERS: usize = 5;
    /// The activity buffer size in bytes.
    pub const BUFFER_BYTES: usize = 6;
    /// The rate limit in records per second (0: none).
    pub const RATE_LIMIT: usize = 7;
    /// A status record's `device` field: [`INJECTED`] when the library was loaded into a
    /// running process (`--gpu-timing`), 0 when through `CUDA_INJECTION64_PATH`.
    pub const INJECTED: u32 = 1;
}

/// What the injection library could do in its process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum CuptiState {
    /// Activity collection on: GPU timestamps flow.
    Active = 1,
    /// Another CUPTI subscriber holds the process (nsys, ncu, an in-process profiler):
    /// `CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED`. Uprobes still see every call.
    Busy = 2,
    /// libcupti could not be loaded.
    NoCupti = 3,
    /// A CUPTI call failed (its result is in the record).
    Failed = 4,
    /// The observer went away (or withdrew): collection stopped.
    Idle = 5,
    /// About to enable collection (a library injected late says so first, so that the agent
    /// waits for the names of the launches CUPTI records from the enable on); not a state
    /// of its own: the next status says how the enable went.
    Starting = 6,
}

impl CuptiState {
    pub fn from_u64(v: u64) -> Option<Self> {
        Some(match v {
            1 => Self::Active,
            2 => Self::Busy,
            3 => Self::NoCupti,
            4 => Self::Failed,
            5 => Self::Idle,
            6 => Self::Starting,
            _ => return None,
        })
    }
}

/// Whether the process's NVTX calls reach CUPTI (the injection library is its NVTX tool).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum NvtxState {
    /// No NVTX call has initialized NVTX with this library yet (the process may use none, or
    /// `NVTX_INJECTION64_PATH` names another tool).
    NotLoaded = 0,
    /// NVTX hands its calls to CUPTI: ranges and marks are recorded while observed.
    Active = 1,
    /// CUPTI could not be the NVTX tool (no libcupti, or it refused): NVTX calls do nothing.
    Failed = 2,
}

impl NvtxState {
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::NotLoaded,
            1 => Self::Active,
            2 => Self::Failed,
            _ => return None,
        })
    }
}

/// CUPTI's callback ids (`cupti_driver_cbid.h`, a stable ABI: values are never reused) of the
/// probed entry points that put work on the GPU. API records of other calls are not forwarded.
pub const DRIVER_CBIDS: &[(u32, &str)] = &[
    (216, "cuMemsetD8Async"),
    (218, "cuMemsetD16Async"),
    (220, "cuMemsetD32Async"),
    (222, "cuMemsetD2D8Async"),
    (224, "cuMemsetD2D16Async"),
    (226, "cuMemsetD2D32Async"),
    (249, "cuMemsetD8_v2"),
    (250, "cuMemsetD16_v2"),
    (251, "cuMemsetD32_v2"),
    (252, "cuMemsetD2D8_v2"),
    (253, "cuMemsetD2D16_v2"),
    (254, "cuMemsetD2D32_v2"),
    (276, "cuMemcpyHtoD_v2"),
    (277, "cuMemcpyHtoDAsync_v2"),
    (278, "cuMemcpyDtoH_v2"),
    (279, "cuMemcpyDtoHAsync_v2"),
    (280, "cuMemcpyDtoD_v2"),
    (281, "cuMemcpyDtoDAsync_v2"),
    (305, "cuMemcpy"),
    (306, "cuMemcpyAsync"),
    (307, "cuLaunchKernel"),
    (318, "cuMemcpyPeer"),
    (319, "cuMemcpyPeerAsync"),
    (397, "cuMemcpyHtoD_v2_ptds"),
    (398, "cuMemcpyDtoH_v2_ptds"),
    (399, "cuMemcpyDtoD_v2_ptds"),
    (408, "cuMemcpy_ptds"),
    (409, "cuMemcpyPeer_ptds"),
    (411, "cuMemsetD8_v2_ptds"),
    (412, "cuMemsetD16_v2_ptds"),
    (413, "cuMemsetD32_v2_ptds"),
    (414, "cuMemsetD2D8_v2_ptds"),
    (415, "cuMemsetD2D16_v2_ptds"),
    (416, "cuMemsetD2D32_v2_ptds"),
    (418, "cuMemcpyAsync_ptsz"),
    (421, "cuMemcpyHtoDAsync_v2_ptsz"),
    (422, "cuMemcpyDtoHAsync_v2_ptsz"),
    (423, "cuMemcpyDtoDAsync_v2_ptsz"),
    (426, "cuMemcpyPeerAsync_ptsz"),
    (428, "cuMemsetD8Async_ptsz"),
    (429, "cuMemsetD16Async_ptsz"),
    (430, "cuMemsetD32Async_ptsz"),
    (431, "cuMemsetD2D8Async_ptsz"),
    (432, "cuMemsetD2D16Async_ptsz"),
    (433, "cuMemsetD2D32Async_ptsz"),
    (442, "cuLaunchKernel_ptsz"),
    (477, "cuLaunchCooperativeKernel"),
    (478, "cuLaunchCooperativeKernel_ptsz"),
    (514, "cuGraphLaunch"),
    (515, "cuGraphLaunch_ptsz"),
    (652, "cuLaunchKernelEx"),
    (653, "cuLaunchKernelEx_ptsz"),
];

/// The probed entry point (name) of a CUPTI driver callback id, if it launches GPU work.
pub fn api_of_cbid(cbid: u32) -> Option<&'static str> {
    DRIVER_CBIDS
        .binary_search_by_key(&cbid, |(c, _)| *c)
        .ok()
        .map(|i| DRIVER_CBIDS[i].1)
}

/// CUPTI's runtime callback ids (`cupti_runtime_cbid.h`, stable like the driver's) of the
/// runtime calls that put work on the GPU, with the family of the driver call made inside.
pub const RUNTIME_CBIDS: &[(u32, &str, Family)] = &[
    (13, "cudaLaunch_v3020", Family::Launch),
    (31, "cudaMemcpy_v3020", Family::Memcpy),
    (32, "cudaMemcpy2D_v3020", Family::Memcpy),
    (33, "cudaMemcpyToArray_v3020", Family::Memcpy),
    (34, "cudaMemcpy2DToArray_v3020", Family::Memcpy),
    (35, "cudaMemcpyFromArray_v3020", Family::Memcpy),
    (36, "cudaMemcpy2DFromArray_v3020", Family::Memcpy),
    (37, "cudaMemcpyArrayToArray_v3020", Family::Memcpy),
    (38, "cudaMemcpy2DArrayToArray_v3020", Family::Memcpy),
    (39, "cudaMemcpyToSymbol_v3020", Family::Memcpy),
    (40, "cudaMemcpyFromSymbol_v3020", Family::Memcpy),
    (41, "cudaMemcpyAsync_v3020", Family::Memcpy),
    (42, "cudaMemcpyToArrayAsync_v3020", Family::Memcpy),
    (43, "cudaMemcpyFromArrayAsync_v3020", Family::Memcpy),
    (44, "cudaMemcpy2DAsync_v3020", Family::Memcpy),
    (45, "cudaMemcpy2DToArrayAsync_v3020", Family::Memcpy),
    (46, "cudaMemcpy2DFromArrayAsync_v3020", Family::Memcpy),
    (47, "cudaMemcpyToSymbolAsync_v3020", Family::Memcpy),
    (48, "cudaMemcpyFromSymbolAsync_v3020", Family::Memcpy),
    (49, "cudaMemset_v3020", Family::Memset),
    (50, "cudaMemset2D_v3020", Family::Memset),
    (51, "cudaMemsetAsync_v3020", Family::Memset),
    (52, "cudaMemset2DAsync_v3020", Family::Memset),
    (142, "cudaMemset3D_v3020", Family::Memset),
    (143, "cudaMemset3DAsync_v3020", Family::Memset),
    (144, "cudaMemcpy3D_v3020", Family::Memcpy),
    (145, "cudaMemcpy3DAsync_v3020", Family::Memcpy),
    (160, "cudaMemcpyPeer_v4000", Family::Memcpy),
    (161, "cudaMemcpyPeerAsync_v4000", Family::Memcpy),
    (162, "cudaMemcpy3DPeer_v4000", Family::Memcpy),
    (163, "cudaMemcpy3DPeerAsync_v4000", Family::Memcpy),
    (211, "cudaLaunchKernel_v7000", Family::Launch),
    (213, "cudaLaunch_ptsz_v7000", Family::Launch),
    (214, "cudaLaunchKernel_ptsz_v7000", Family::Launch),
    (215, "cudaMemcpy_ptds_v7000", Family::Memcpy),
    (216, "cudaMemcpy2D_ptds_v7000", Family::Memcpy),
    (217, "cudaMemcpyToArray_ptds_v7000", Family::Memcpy),
    (218, "cudaMemcpy2DToArray_ptds_v7000", Family::Memcpy),
    (219, "cudaMemcpyFromArray_ptds_v7000", Family::Memcpy),
    (220, "cudaMemcpy2DFromArray_ptds_v7000", Family::Memcpy),
    (221, "cudaMemcpyArrayToArray_ptds_v7000", Family::Memcpy),
    (222, "cudaMemcpy2DArrayToArray_ptds_v7000", Family::Memcpy),
    (223, "cudaMemcpyToSymbol_ptds_v7000", Family::Memcpy),
    (224, "cudaMemcpyFromSymbol_ptds_v7000", Family::Memcpy),
    (225, "cudaMemcpyAsync_ptsz_v7000", Family::Memcpy),
    (226, "cudaMemcpyToArrayAsync_ptsz_v7000", Family::Memcpy),
    (227, "cudaMemcpyFromArrayAsync_ptsz_v7000", Family::Memcpy),
    (228, "cudaMemcpy2DAsync_ptsz_v7000", Family::Memcpy),
    (229, "cudaMemcpy2DToArrayAsync_ptsz_v7000", Family::Memcpy),
    (230, "cudaMemcpy2DFromArrayAsync_ptsz_v7000", Family::Memcpy),
    (231, "cudaMemcpyToSymbolAsync_ptsz_v7000", Family::Memcpy),
    (232, "cudaMemcpyFromSymbolAsync_ptsz_v7000", Family::Memcpy),
    (233, "cudaMemset_ptds_v7000", Family::Memset),
    (234, "cudaMemset2D_ptds_v7000", Family::Memset),
    (235, "cudaMemsetAsync_ptsz_v7000", Family::Memset),
    (236, "cudaMemset2DAsync_ptsz_v7000", Family::Memset),
    (243, "cudaMemset3D_ptds_v7000", Family::Memset),
    (244, "cudaMemset3DAsync_ptsz_v7000", Family::Memset),
    (245, "cudaMemcpy3D_ptds_v7000", Family::Memcpy),
    (246, "cudaMemcpy3DAsync_ptsz_v7000", Family::Memcpy),
    (249, "cudaMemcpy3DPeer_ptds_v7000", Family::Memcpy),
    (250, "cudaMemcpy3DPeerAsync_ptsz_v7000", Family::Memcpy),
    (269, "cudaLaunchCooperativeKernel_v9000", Family::Launch),
    (270, "cudaLaunchCooperativeKernel_ptsz_v9000", Family::Launch),
    (272, "cudaLaunchCooperativeKernelMultiDevice_v9000", Family::Launch),
    (311, "cudaGraphLaunch_v10000", Family::GraphLaunch),
    (312, "cudaGraphLaunch_ptsz_v10000", Family::GraphLaunch),
    (430, "cudaLaunchKernelExC_v11060", Family::Launch),
    (431, "cudaLaunchKernelExC_ptsz_v11060", Family::Launch),
    (482, "cudaMemcpyBatchAsync_v12080", Family::Memcpy),
    (483, "cudaMemcpyBatchAsync_ptsz_v12080", Family::Memcpy),
    (484, "cudaMemcpy3DBatchAsync_v12080", Family::Memcpy),
    (485, "cudaMemcpy3DBatchAsync_ptsz_v12080", Family::Memcpy),
    (509, "cudaMemcpyBatchAsync_v13000", Family::Memcpy),
    (510, "cudaMemcpyBatchAsync_ptsz_v13000", Family::Memcpy),
    (511, "cudaMemcpy3DBatchAsync_v13000", Family::Memcpy),
    (512, "cudaMemcpy3DBatchAsync_ptsz_v13000", Family::Memcpy),
];

/// The runtime call and the family of driver call it makes, if it launches GPU work.
pub fn runtime_api_of_cbid(cbid: u32) -> Option<(&'static str, Family)> {
    RUNTIME_CBIDS
        .binary_search_by_key(&cbid, |(c, _, _)| *c)
        .ok()
        .map(|i| (RUNTIME_CBIDS[i].1, RUNTIME_CBIDS[i].2))
}

const _: () = {
    assert!(core::mem::size_of::<GpuRecord>() == 176);
    assert!(core::mem::size_of::<GpuRecord>().is_multiple_of(8));
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{self, Family};

    #[test]
    fn cbids_are_sorted_and_name_probed_work_apis() {
        assert!(DRIVER_CBIDS.windows(2).all(|w| w[0].0 < w[1].0));
        for (cbid, name) in DRIVER_CBIDS {
            let spec = api::by_id(api::id_of(name).unwrap_or(0)).unwrap_or_else(|| panic!("{name} not probed"));
            assert!(matches!(
                spec.family,
                Family::Launch | Family::LaunchEx | Family::GraphLaunch | Family::Memcpy | Family::Memset
            ));
            assert_eq!(api_of_cbid(*cbid), Some(*name));
        }
        // Every probed entry point that puts work on the GPU has its callback id.
        for spec in api::APIS.iter().filter(|s| {
            matches!(
                s.family,
                Family::Launch | Family::LaunchEx | Family::GraphLaunch | Family::Memcpy | Family::Memset
            )
        }) {
            assert!(
                DRIVER_CBIDS.iter().any(|(_, n)| *n == spec.name),
                "{} lacks a cbid",
                spec.name
            );
        }
        assert_eq!(api_of_cbid(1), None);
    }

    #[test]
    fn runtime_cbids_are_sorted_and_name_work_calls() {
        assert!(RUNTIME_CBIDS.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(
            runtime_api_of_cbid(211),
            Some(("cudaLaunchKernel_v7000", Family::Launch))
        );
        assert_eq!(
            runtime_api_of_cbid(430),
            Some(("cudaLaunchKernelExC_v11060", Family::Launch))
        );
        assert_eq!(runtime_api_of_cbid(41), Some(("cudaMemcpyAsync_v3020", Family::Memcpy)));
        assert_eq!(
            runtime_api_of_cbid(311),
            Some(("cudaGraphLaunch_v10000", Family::GraphLaunch))
        );
        assert_eq!(runtime_api_of_cbid(1), None);
        assert!(RUNTIME_CBIDS.iter().all(|(_, n, _)| n.starts_with("cudaLaunch")
            || n.starts_with("cudaGraphLaunch")
            || n.starts_with("cudaMemcpy")
            || n.starts_with("cudaMemset")));
    }
}
