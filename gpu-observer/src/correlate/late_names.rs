//! Names for launches of handles loaded before the observer came.
//!
//! A process observed late (`--pid`) obtained most of its function handles before the uprobes
//! were there to see `cuModuleGetFunction` (JAX and CuPy load every module once, at start), so
//! its launches have no name. Once CUPTI runs in it (`--gpu-timing`), each kernel record
//! carries the kernel's name and joins the launch that made it ([`super::cupti_join`]): that
//! names the handle for good. A launch of a handle still unnamed, in a process whose CUPTI is
//! active, waits here until its name comes (its own kernel record, ~0.5 s later) or
//! [`HOLD_NS`] passes; then it is written, named or not. Later launches of the handle are
//! named at once, also after GPU timing is withdrawn.

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
};

use super::Process;
use crate::decode::{Body, Event, KernelName};

/// How long a launch waits for its name (CUPTI delivers every 0.5 s; the join needs its API
/// record too).
pub const HOLD_NS: u64 = 3_000_000_000;
/// Launches waiting, all processes (beyond: written unnamed at once, counted).
const MAX_HELD: usize = 65_536;
/// Names learned and not yet applied (the correlator applies them after every batch).
const MAX_LEARNED: usize = 65_536;

#[derive(Default)]
pub struct Held {
    queues: HashMap<u32, VecDeque<Event>>,
    count: usize,
    learned: Vec<(u32, u64, Arc<KernelName>)>,
    /// A launch was marked to wait in the current batch.
    marked: bool,
    /// Launches that waited and got their name.
    pub named: u64,
    /// Launches that waited in vain ([`HOLD_NS`]), or found no room to wait.
    pub unnamed: u64,
}

impl Held {
    /// Whether one more launch may wait (call [`Self::mark`] when it does).
    pub fn has_room(&self) -> bool {
        self.count < MAX_HELD
    }

    pub fn mark(&mut self) {
        self.count += 1;
        self.marked = true;
    }

    /// CUPTI named `function` of `pid`.
    pub fn learn(&mut self, pid: u32, function: u64, name: Arc<KernelName>) {
        if self.learned.len() < MAX_LEARNED {
            self.learned.push((pid, function, name));
        }
    }

    /// Takes the launches marked to wait out of `batch`, and appends to it those whose name
    /// came and those that waited past [`HOLD_NS`] before `now_ns` (`u64::MAX`: all of them),
    /// counting each in its process's launch statistics as it goes out.
    pub fn settle(&mut self, batch: &mut Vec<Event>, now_ns: u64, procs: &mut HashMap<u32, Process>) {
        if self.marked {
            self.marked = false;
            for ev in std::mem::take(batch) {
                if waits(&ev) {
                    self.queues.entry(ev.pid).or_default().push_back(ev);
                } else {
                    batch.push(ev);
                }
            }
        }
        for (pid, function, name) in std::mem::take(&mut self.learned) {
            let Some(q) = self.queues.get_mut(&pid) else { continue };
            let mut rest = VecDeque::with_capacity(q.len());
            for mut ev in q.drain(..) {
                if let Body::Launch(l) = &mut ev.body
                    && l.function == function
                {
                    l.kernel = Some(name.clone());
                    self.count -= 1;
                    self.named += 1;
                    release(&mut ev, procs);
                    batch.push(ev);
                } else {
                    rest.push_back(ev);
                }
            }
            *q = rest;
        }
        for q in self.queues.values_mut() {
            while q
                .front()
                .is_some_and(|ev| now_ns == u64::MAX || ev.ts_ns.saturating_add(HOLD_NS) < now_ns)
            {
                let Some(mut ev) = q.pop_front() else { break };
                self.count -= 1;
                self.unnamed += 1;
                release(&mut ev, procs);
                batch.push(ev);
            }
        }
        self.queues.retain(|_, q| !q.is_empty());
    }
}

fn waits(ev: &Event) -> bool {
    matches!(&ev.body, Body::Launch(l) if l.held)
}

/// A launch goes out: counted named or unresolved, as if it had just been observed.
fn release(ev: &mut Event, procs: &mut HashMap<u32, Process>) {
    let Body::Launch(l) = &mut ev.body else { return };
    l.held = false;
    if let Some(p) = procs.get_mut(&ev.pid) {
        super::count_launch(p, l.kernel.as_ref());
    }
}
