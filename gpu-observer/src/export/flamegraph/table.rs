//! The stacks of one weighting (GPU ns, or launches), aggregated in memory and bounded.
//!
//! A stack is kept as its process id and the frames after the process frame, joined by `;`:
//! the process frame is spelled only when the file is written, from the best name the sink
//! learnt for that pid by then, so one process is one frame however its stacks arrived.

use std::collections::HashMap;

/// Distinct stacks kept, over all processes. A stack is at most a few KB (frames are cut to
/// 256 characters, NVTX nesting to 64 levels), ~100 bytes in practice: a few MB for a run
/// that reaches the bound.
pub const MAX_STACKS: usize = 65_536;
/// Bytes of stack text kept: the bound that counts when the stacks are long (deep NVTX
/// nesting, long template names), so a hostile process cannot make the table huge.
pub const MAX_STACK_BYTES: usize = 32 << 20;
/// Processes with an `[other stacks]` frame of their own; beyond, all in one
/// `[other processes]` frame.
pub const MAX_OTHER: usize = 4_096;

/// The frame of a process's stacks that were not kept (a bound was reached).
pub const OTHER_STACKS: &str = "[other stacks]";
/// The frame of the stacks of processes beyond [`MAX_OTHER`], once the bounds are reached.
pub const OTHER_PROCESSES: &str = "[other processes]";

#[derive(Debug, Default)]
pub struct Table {
    by_pid: HashMap<u32, HashMap<Box<str>, u64>>,
    stacks: usize,
    bytes: usize,
    /// Weight of the stacks not kept, by process.
    other: HashMap<u32, u64>,
    other_processes: u64,
    /// Records (or launches) added, and of those, how many went to `[other …]`.
    pub added: u64,
    pub folded: u64,
}

impl Table {
    pub fn add(&mut self, pid: u32, stack: &str, weight: u64) {
        self.added += 1;
        if let Some(w) = self.by_pid.get_mut(&pid).and_then(|m| m.get_mut(stack)) {
            *w = w.saturating_add(weight);
            return;
        }
        if self.stacks < MAX_STACKS && self.bytes + stack.len() <= MAX_STACK_BYTES {
            self.by_pid.entry(pid).or_default().insert(stack.into(), weight);
            self.stacks += 1;
            self.bytes += stack.len();
            return;
        }
        self.folded += 1;
        if let Some(w) = self.other.get_mut(&pid) {
            *w = w.saturating_add(weight);
        } else if self.other.len() < MAX_OTHER {
            self.other.insert(pid, weight);
        } else {
            self.other_processes = self.other_processes.saturating_add(weight);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.added == 0
    }

    /// A process's weight, kept and folded (not what went to `[other processes]`).
    pub fn of_pid(&self, pid: u32) -> u64 {
        let kept = self
            .by_pid
            .get(&pid)
            .map_or(0, |m| m.values().fold(0u64, |a, w| a.saturating_add(*w)));
        kept.saturating_add(self.other.get(&pid).copied().unwrap_or(0))
    }

    /// The processes it has stacks of (`[other processes]` aside).
    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.by_pid
            .keys()
            .chain(self.other.keys().filter(|p| !self.by_pid.contains_key(p)))
            .copied()
    }

    pub fn other_processes(&self) -> u64 {
        self.other_processes
    }

    /// The folded lines (`frames weight`), sorted so the file is the same for the same
    /// stacks; stacks of weight 0 (a record whose end is not after its start) are left out,
    /// as a flamegraph has nothing to draw for them. `process` spells a process frame.
    pub fn lines(&self, process: impl Fn(u32) -> String) -> Vec<String> {
        let mut out = Vec::with_capacity(self.stacks + self.other.len() + 1);
        for (pid, stacks) in &self.by_pid {
            let p = process(*pid);
            out.extend(
                stacks
                    .iter()
                    .filter(|(_, w)| **w > 0)
                    .map(|(s, w)| format!("{p};{s} {w}")),
            );
        }
        out.extend(
            self.other
                .iter()
                .filter(|(_, w)| **w > 0)
                .map(|(pid, w)| format!("{};{OTHER_STACKS} {w}", process(*pid))),
        );
        if self.other_processes > 0 {
            out.push(format!("{OTHER_PROCESSES} {}", self.other_processes));
        }
        out.sort_unstable();
        out
    }
}
