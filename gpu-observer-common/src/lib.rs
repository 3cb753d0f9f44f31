//! Event ABI shared by the gpu-observer eBPF programs and the agent.
//!
//! Everything here is `#![no_std]` and `#[repr(C)]` so the eBPF side writes exactly the bytes the
//! agent reads. The `user` feature adds `aya::Pod` impls and std-only helpers.
#![no_std]

pub mod api;
pub mod cupti;
pub mod event;
#[cfg(feature = "user")]
mod names_of;

/// Names of the maps and programs in the eBPF object; the agent looks them up by these.
pub mod names {
    pub const EVENTS: &str = "EVENTS";
    pub const CONFIG: &str = "CONFIG";
    pub const OBSERVED: &str = "OBSERVED";
    pub const DROPS: &str = "DROPS";
    pub const DROPS_BY_PID: &str = "DROPS_BY_PID";
    pub const PROG_LAUNCH_KERNEL: &str = "launch_kernel";
    pub const PROG_LAUNCH_KERNEL_EX: &str = "launch_kernel_ex";
    pub const PROG_GRAPH_LAUNCH: &str = "graph_launch";
    pub const PROG_API_ENTER: &str = "api_enter";
    pub const PROG_API_EXIT: &str = "api_exit";
    pub const PROG_IOCTL_ENTER: &str = "ioctl_enter";
    pub const PROG_IOCTL_EXIT: &str = "ioctl_exit";
    pub const PROG_PROCESS_EXIT: &str = "process_exit";
    pub const PROG_CUPTI_BATCH: &str = "cupti_batch";
    pub const PROG_CUPTI_NAME: &str = "cupti_name";
    pub const PROG_TASK_NEWTASK: &str = "task_newtask";
    pub const FOLLOWED: &str = "FOLLOWED";
    pub const FOLLOW_MISSED: &str = "FOLLOW_MISSED";
}

/// Slots of the `CONFIG` array map, written by the agent before attaching.
pub mod config {
    /// tgid to observe, 0 = every process.
    pub const FILTER_TGID: u32 = 0;
    /// The agent's own tgid: never observed (it loads NVML/CUDA itself later).
    pub const AGENT_TGID: u32 = 1;
    /// Non-zero: every program returns at once (set while the agent shuts down).
    pub const DISABLED: u32 = 2;
    /// Non-zero: with `FILTER_TGID`, its descendants are observed too (the `FOLLOWED` map,
    /// kept by the `task_newtask` tracepoint).
    pub const FOLLOW_CHILDREN: u32 = 3;
    /// Fleet mode: non-zero while a capture window is open. Entries of probes attached with
    /// `api::Flags::WINDOWED` record nothing while it is zero.
    pub const WINDOW_OPEN: u32 = 4;
    pub const LEN: u32 = 5;
}

/// The `task/task_newtask` tracepoint's record, as its tracefs format file gives it (the agent
/// checks these against the running kernel's format before it relies on them).
pub mod newtask {
    pub const PID_OFFSET: usize = 8;
    pub const CLONE_FLAGS_OFFSET: usize = 32;
    /// A new thread of the same process, not a new process.
    pub const CLONE_THREAD: u64 = 0x0001_0000;
}

/// Bounds of the eBPF hash maps. Bounded so a leak in a probed process can never grow kernel memory.
pub mod limits {
    /// Processes observed at once (also: processes of a followed tree at once).
    pub const MAX_PROCESSES: u32 = 16_384;
    /// Threads inside a probed CUDA call (or an ioctl) at once.
    pub const MAX_INFLIGHT_THREADS: u32 = 65_536;
    /// (process, kind) pairs whose ring-buffer drops are counted (LRU beyond; per CPU, as
    /// many values as the per-process map it replaced).
    pub const MAX_DROP_KEYS: u32 = 16_384;
    /// Default ring buffer size: 8 MiB (docs/DESIGN.md "Defaults").
    pub const DEFAULT_RING_BYTES: u32 = 8 * 1024 * 1024;
}
