//! Process and thread exit: drop their per-thread state and tell the agent.

use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use gpu_observer_common::event::{EventHeader, EventKind};

use crate::{
    emit::{current, header, now, reserve, submit},
    maps::{INFLIGHT, IOCTLS, OBSERVED},
};

#[tracepoint]
pub fn process_exit(_ctx: TracePointContext) -> u32 {
    let ids = current();
    if OBSERVED.get_ptr(ids.tgid).is_none() {
        return 0;
    }
    let _ = INFLIGHT.remove(ids.tid);
    let _ = IOCTLS.remove(ids.tid);
    if ids.tid != ids.tgid {
        return 0;
    }
    // The group leader is gone: the process is over for the agent.
    let _ = OBSERVED.remove(ids.tgid);
    let Some(mut entry) = reserve::<EventHeader>(EventKind::ProcessExit, ids.tgid) else {
        return 0;
    };
    entry.write(header(EventKind::ProcessExit, 0, ids, now()));
    submit(entry);
    0
}
