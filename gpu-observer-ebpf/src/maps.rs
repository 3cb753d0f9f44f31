//! Maps shared by the probe families. All bounded; per-thread state lives in LRU maps so a
//! thread that dies inside a call can never leak an entry for good.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, LruPerCpuHashMap, PerCpuArray, RingBuf},
};
use gpu_observer_common::{
    config,
    event::{EventKind, Inflight, IoctlStart},
    limits,
};

#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(limits::DEFAULT_RING_BYTES, 0);

#[map]
pub static CONFIG: Array<u32> = Array::with_max_entries(config::LEN, 0);

/// tgid → 1 for processes whose ioctls are recorded (set by the agent and on the first probed call).
#[map]
pub static OBSERVED: LruHashMap<u32, u32> = LruHashMap::with_max_entries(limits::MAX_PROCESSES, 0);

/// tgid → its parent's tgid, for the descendants of the followed process (`FOLLOW_CHILDREN`).
/// Not an LRU: a member must never be evicted while it runs. A child that finds the map full
/// is counted in `FOLLOW_MISSED` (the agent says so).
#[map]
pub static FOLLOWED: HashMap<u32, u32> = HashMap::with_max_entries(limits::MAX_PROCESSES, 0);

/// Children of followed processes that did not fit in `FOLLOWED`.
#[map]
pub static FOLLOW_MISSED: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// tid → the probed call the thread is inside.
#[map]
pub static INFLIGHT: LruHashMap<u32, Inflight> = LruHashMap::with_max_entries(limits::MAX_INFLIGHT_THREADS, 0);

/// tid → the ioctl the thread is inside.
#[map]
pub static IOCTLS: LruHashMap<u32, IoctlStart> = LruHashMap::with_max_entries(limits::MAX_INFLIGHT_THREADS, 0);

/// Records that did not fit in the ring, per CPU, indexed by [`EventKind`].
#[map]
pub static DROPS: PerCpuArray<u64> = PerCpuArray::with_max_entries(EventKind::COUNT, 0);

/// Records that did not fit in the ring, per process and kind: key `tgid << 8 | kind`
/// ([`gpu_observer_common::event::drop_key`]); per CPU, so no add is ever lost.
#[map]
pub static DROPS_BY_PID: LruPerCpuHashMap<u64, u64> = LruPerCpuHashMap::with_max_entries(limits::MAX_DROP_KEYS, 0);
