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
    /// Per pid: the launches waiting, each with the [`Process::serial`] of the process it was
    /// observed in (a pid reused, or a process forgotten and seen again, is another process:
    /// its statistics must not count the old one's launches; the serial is taken when the
    /// launch is observed, since the process may be gone and its pid reused before the batch
    /// ends).
    queues: HashMap<u32, VecDeque<(Event, u64)>>,
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
                if let Some(first) = waits(&ev) {
                    self.queues.entry(ev.pid).or_default().push_back((ev, first));
                } else {
                    batch.push(ev);
                }
            }
        }
        for (pid, function, name) in std::mem::take(&mut self.learned) {
            let Some(q) = self.queues.get_mut(&pid) else { continue };
            let mut rest = VecDeque::with_capacity(q.len());
            for (mut ev, first) in q.drain(..) {
                if let Body::Launch(l) = &mut ev.body
                    && l.function == function
                {
                    l.kernel = Some(name.clone());
                    self.count -= 1;
                    self.named += 1;
                    release(&mut ev, first, procs);
                    batch.push(ev);
                } else {
                    rest.push_back((ev, first));
                }
            }
            *q = rest;
        }
        for q in self.queues.values_mut() {
            while q
                .front()
                .is_some_and(|(ev, _)| now_ns == u64::MAX || ev.ts_ns.saturating_add(HOLD_NS) < now_ns)
            {
                let Some((mut ev, first)) = q.pop_front() else { break };
                self.count -= 1;
                self.unnamed += 1;
                release(&mut ev, first, procs);
                batch.push(ev);
            }
        }
        self.queues.retain(|_, q| !q.is_empty());
    }
}

/// The serial of the process a launch marked to wait was observed in.
fn waits(ev: &Event) -> Option<u64> {
    match &ev.body {
        Body::Launch(l) => l.held,
        _ => None,
    }
}

/// A launch goes out: counted named or unresolved in its process, as if it had just been
/// observed (not in another process that now has its pid).
fn release(ev: &mut Event, serial: u64, procs: &mut HashMap<u32, Process>) {
    let Body::Launch(l) = &mut ev.body else { return };
    l.held = None;
    if let Some(p) = procs.get_mut(&ev.pid)
        && p.serial == serial
    {
        super::count_launch(p, l.kernel.as_ref());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Launch;

    fn launch(pid: u32, ts_ns: u64, function: u64) -> Event {
        Event {
            ts_ns,
            pid,
            tid: pid,
            comm: [0; 16],
            api: None,
            body: Body::Launch(Launch {
                held: Some(1),
                ..Launch::of(function)
            }),
        }
    }

    fn kernel_of(ev: &Event) -> Option<&str> {
        match &ev.body {
            Body::Launch(l) => l.kernel.as_ref().map(|k| &*k.demangled),
            _ => None,
        }
    }

    #[test]
    fn a_held_launch_goes_out_named_once_its_handle_is_learned_or_unnamed_when_its_time_is_up() {
        let mut procs = HashMap::from([(7, Process::new(7, 1, 0))]);
        let mut held = Held::default();
        held.mark();
        held.mark();
        let mut batch = vec![launch(7, 100, 0xA), launch(7, 200, 0xB)];
        held.settle(&mut batch, 300, &mut procs);
        assert!(batch.is_empty(), "both wait");
        held.learn(7, 0xA, Arc::new(KernelName::new("gemm")));
        held.settle(&mut batch, 400, &mut procs);
        assert_eq!(batch.iter().map(kernel_of).collect::<Vec<_>>(), [Some("gemm")]);
        let p = &procs[&7];
        assert_eq!((p.stats.named_launches, p.stats.unresolved_launches), (1, 0));
        // 0xB is never named: it goes out when HOLD_NS has passed since its launch.
        batch.clear();
        held.settle(&mut batch, 200 + HOLD_NS, &mut procs);
        assert!(batch.is_empty(), "not yet: exactly HOLD_NS");
        held.settle(&mut batch, 201 + HOLD_NS, &mut procs);
        assert_eq!(batch.iter().map(kernel_of).collect::<Vec<_>>(), [None]);
        let p = &procs[&7];
        assert_eq!((p.stats.named_launches, p.stats.unresolved_launches), (1, 1));
        assert_eq!((held.named, held.unnamed, held.count), (1, 1, 0));
        assert!(matches!(&batch[0].body, Body::Launch(l) if l.held.is_none()));
    }

    #[test]
    fn a_launch_of_a_process_gone_is_not_counted_in_the_next_one_with_its_pid() {
        let mut procs = HashMap::from([(7, Process::new(7, 1, 0))]);
        let mut held = Held::default();
        held.mark();
        let mut batch = vec![launch(7, 100, 0xA)];
        held.settle(&mut batch, 100, &mut procs);
        procs.insert(7, Process::new(7, 2, 150));
        held.settle(&mut batch, u64::MAX, &mut procs);
        assert_eq!(batch.len(), 1, "written all the same");
        let p = &procs[&7];
        assert_eq!((p.stats.named_launches, p.stats.unresolved_launches), (0, 0));
    }

    #[test]
    fn a_launch_whose_process_was_replaced_within_its_batch_is_not_counted_in_the_new_one() {
        // Observed in serial 1; the process exited, was forgotten and its pid came back as
        // serial 2, all before the batch ended (found by the pipeline's property test).
        let mut procs = HashMap::from([(7, Process::new(7, 2, 150))]);
        let mut held = Held::default();
        held.mark();
        let mut batch = vec![launch(7, 100, 0xA)];
        held.settle(&mut batch, 200, &mut procs);
        held.settle(&mut batch, u64::MAX, &mut procs);
        assert_eq!(batch.len(), 1);
        let p = &procs[&7];
        assert_eq!((p.stats.named_launches, p.stats.unresolved_launches), (0, 0));
    }
}
