//! What every probe does first (filter, mark observed) and last (reserve, fill, submit).

use aya_ebpf::{
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    maps::ring_buf::RingBufEntry,
};
use gpu_observer_common::{
    api::Flags,
    config,
    event::{COMM_LEN, EventHeader, EventKind},
};

use crate::maps::{CONFIG, DROPS, DROPS_BY_PID, EVENTS, FOLLOWED, OBSERVED};

const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
const BPF_RB_RING_SIZE: u64 = 1;

/// The calling thread's ids.
#[derive(Clone, Copy)]
pub struct Ids {
    pub tgid: u32,
    pub tid: u32,
}

#[inline(always)]
pub fn current() -> Ids {
    let v = bpf_get_current_pid_tgid();
    Ids {
        tgid: (v >> 32) as u32,
        tid: v as u32,
    }
}

#[inline(always)]
pub fn config(slot: u32) -> u32 {
    CONFIG.get(slot).copied().unwrap_or(0)
}

/// Whether a probed libcuda call of this process is recorded (`--pid`/`run`: the process and,
/// unless `--no-children`, its descendants; never the agent).
#[inline(always)]
fn wanted(ids: Ids) -> bool {
    if disabled() || config(config::AGENT_TGID) == ids.tgid {
        return false;
    }
    let filter = config(config::FILTER_TGID);
    filter == 0 || filter == ids.tgid || (config(config::FOLLOW_CHILDREN) != 0 && followed(ids.tgid))
}

/// A descendant of the followed process.
#[inline(always)]
pub fn followed(tgid: u32) -> bool {
    // SAFETY: a lookup of a plain u32 key; the value is not read.
    unsafe { FOLLOWED.get(tgid) }.is_some()
}

/// Prologue of every uprobe: the caller's ids if this process is observed (and now marked so).
#[inline(always)]
pub fn enter() -> Option<Ids> {
    let ids = current();
    if !wanted(ids) {
        return None;
    }
    mark_observed(ids);
    Some(ids)
}

/// Prologue of a libcuda entry probe: [`enter`] and the call's timestamp, unless the probe
/// follows the capture windows (its cookie says so) and none is open — its link is still
/// being attached or closed. The window is looked at before and after the timestamp, so a
/// recorded call's timestamp lies between two moments it was open: inside the agent's open
/// and close timestamps (taken before opening, after closing), exactly.
#[inline(always)]
pub fn enter_probe(cookie: u32) -> Option<(Ids, u64)> {
    let windowed = cookie & Flags::WINDOWED != 0;
    if windowed && config(config::WINDOW_OPEN) == 0 {
        return None;
    }
    let ids = enter()?;
    let ts = now();
    if windowed && config(config::WINDOW_OPEN) == 0 {
        return None;
    }
    Some((ids, ts))
}

/// Calls of probed libcuda functions make a process observed: its ioctls are recorded from now on.
#[inline(always)]
fn mark_observed(ids: Ids) {
    if OBSERVED.get_ptr(ids.tgid).is_none() {
        let _ = OBSERVED.insert(ids.tgid, 1, 0);
    }
}

#[inline(always)]
pub fn is_observed(tgid: u32) -> bool {
    !disabled() && OBSERVED.get_ptr(tgid).is_some()
}

/// The agent is shutting down: probes still attached must cost as little as possible.
#[inline(always)]
pub fn disabled() -> bool {
    config(config::DISABLED) != 0
}

#[inline(always)]
pub fn header(kind: EventKind, api: u32, ids: Ids, ts_ns: u64) -> EventHeader {
    EventHeader {
        kind: kind as u32,
        api,
        pid: ids.tgid,
        tid: ids.tid,
        ts_ns,
        comm: bpf_get_current_comm().unwrap_or([0u8; COMM_LEN]),
    }
}

#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: helper without preconditions.
    unsafe { bpf_ktime_get_ns() }
}

/// Reserves a record, counting it as dropped (per CPU and per process) when the ring is full.
#[inline(always)]
pub fn reserve<T: 'static>(kind: EventKind, tgid: u32) -> Option<RingBufEntry<T>> {
    let entry = EVENTS.reserve::<T>(0);
    if entry.is_none() {
        count_drop(kind, tgid);
    }
    entry
}

#[inline(always)]
fn count_drop(kind: EventKind, tgid: u32) {
    if let Some(p) = DROPS.get_ptr_mut(kind as u32) {
        // SAFETY: per-CPU slot, only this CPU writes it while preemption is off in the program.
        unsafe { *p += 1 };
    }
    let key = gpu_observer_common::event::drop_key(tgid, kind);
    match DROPS_BY_PID.get_ptr_mut(key) {
        // SAFETY: per-CPU value, only this CPU writes it while the program runs.
        Some(p) => unsafe { *p += 1 },
        None => {
            let _ = DROPS_BY_PID.insert(key, 1u64, 0);
        }
    }
}

/// Submits without waking the agent (it polls on a timer; docs/DESIGN.md "Measured costs": wakeups cost ~2 µs per
/// record) unless the ring is half full, so a burst is drained before it overflows.
#[inline(always)]
pub fn submit<T>(entry: RingBufEntry<T>) {
    let filling = EVENTS.query(BPF_RB_AVAIL_DATA) > EVENTS.query(BPF_RB_RING_SIZE) / 2;
    entry.submit(if filling { BPF_RB_FORCE_WAKEUP } else { BPF_RB_NO_WAKEUP });
}
