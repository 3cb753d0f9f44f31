//! NVTX ranges from CUPTI's marker records: paired, classified, and the stack of ranges open
//! on a thread at a given time (a kernel's launch).
//!
//! CUPTI records a push/pop range and a start/end range alike (a start and an end record
//! with one id, the thread that made each call): a range that ends on the thread that opened
//! it, innermost first, is a thread range; one that ends out of that order or on another
//! thread is a process range.

use std::sync::Arc;

/// The ranges open on a thread at a launch, outermost first (labels: [`label`]).
pub type NvtxStack = Arc<[Arc<str>]>;

/// What kind of NVTX marker a [`NvtxRange`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvtxKind {
    /// Opened and closed on one thread, nested (`nvtxRangePush`/`Pop`).
    Thread,
    /// Process-wide (`nvtxRangeStart`/`End`): ended out of nesting order or on another thread.
    Process,
    /// A point in time (`nvtxMark`).
    Mark,
}

impl NvtxKind {
    pub const fn name(self) -> &'static str {
        match self {
            NvtxKind::Thread => "thread",
            NvtxKind::Process => "process",
            NvtxKind::Mark => "mark",
        }
    }
}

/// A finished range (or a mark, or a range still open when its process exited or the run
/// ended), as the sinks get it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvtxRange {
    pub pid: u32,
    pub comm: [u8; 16],
    /// The thread that opened it (0 when CUPTI named none).
    pub tid: u32,
    /// CUPTI's marker id.
    pub id: u32,
    pub kind: NvtxKind,
    pub name: Arc<str>,
    /// The NVTX domain (None: the default domain).
    pub domain: Option<Arc<str>>,
    pub start_ns: u64,
    /// None for a mark, and for a range still open when its process exited or the run ended.
    pub end_ns: Option<u64>,
    /// Thread ranges: how many ranges were open beneath it on its thread (0: outermost).
    pub depth: u32,
}

impl NvtxRange {
    /// How it is shown in stacks and on timelines ([`label`]).
    pub fn label(&self) -> Arc<str> {
        label(self.domain.as_deref(), &self.name)
    }
}

/// A range's name as stacks show it: the name, after its domain when it has one
/// (`NCCL: AllReduce`).
pub fn label(domain: Option<&str>, name: &str) -> Arc<str> {
    match domain {
        Some(d) => format!("{d}: {name}").into(),
        None => name.into(),
    }
}

use std::collections::{BTreeMap, HashMap, VecDeque};

use gpu_observer_common::cupti::{GpuRecord, marker};

use super::cupti_join::Pool;

/// Names that came before their start record (the library sends each name just before it).
const MAX_NAMES: usize = 4096;
/// Threads with ranges.
const MAX_THREADS: usize = 1024;
/// Ranges open on one thread; deeper starts are refused and counted.
const MAX_OPEN: usize = 256;
/// Ended ranges a thread keeps, for the stacks of launches whose GPU records come later
/// (CUPTI delivers a flush period, 0.5 s, or more after the launch; `emit_nvtx` opens a range
/// per PyTorch op, ~10 000 a second on a busy thread).
const MAX_ENDED: usize = 65_536;
/// How long an ended range is kept (GPU records join within seconds of their launch).
const ENDED_AGE_NS: u64 = 30_000_000_000;
/// Range ids remembered between start and end, all threads.
const MAX_IDS: usize = 65_536;
/// Ends waiting for their start.
const MAX_EARLY: usize = 4096;
/// Bytes charged to the CUPTI share of the memory budget for a kept range: the node (~100
/// bytes) in its map, its key in the open or ended list, and a name of typical length.
const NODE_COST: u64 = 192;

/// What the NVTX state counted, per process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NvtxStats {
    /// Thread (push/pop) ranges ended.
    pub thread_ranges: u64,
    /// Process (start/end) ranges ended.
    pub process_ranges: u64,
    pub marks: u64,
    /// Ranges still open when the process exited or the run ended.
    pub open_at_end: u64,
    /// Ends whose start was never seen (before the observer came, or dropped).
    pub unmatched_ends: u64,
    /// Starts and marks whose name never came (dropped): named `?`.
    pub unnamed: u64,
    /// Ranges not kept (too deep, too many threads or ids, or aged out) and so missing
    /// from later stacks.
    pub evicted: u64,
    /// GPU records that got a stack of ranges.
    pub stacks: u64,
}

#[derive(Debug)]
struct Node {
    start: u64,
    /// u64::MAX while open.
    end: u64,
    name: Arc<str>,
    domain: Option<Arc<str>>,
    /// The range open beneath it on its thread when it started (its key).
    parent: Option<Key>,
    /// Found to be a process range (ended out of nesting order or on another thread): not
    /// part of stacks.
    process: bool,
}

/// A range's place on its thread: start time, then arrival order (unique).
type Key = (u64, u64);

#[derive(Debug, Default)]
struct Thread {
    nodes: BTreeMap<Key, Node>,
    /// Open ranges, outermost first (thread ranges nest; process ranges are taken out).
    open: Vec<Key>,
    /// Ended ranges in end order, for the bound.
    ended: VecDeque<(u64, Key)>,
    seq: u64,
    /// Bumped when a range turns out to be a process range: cached stacks may hold it.
    generation: u64,
    /// The last stack built (innermost range, generation).
    cache: Option<(Key, u64, NvtxStack)>,
}

/// A process's NVTX ranges, from its marker records.
#[derive(Debug, Default)]
pub struct Nvtx {
    names: HashMap<u32, (Arc<str>, Option<Arc<str>>)>,
    name_order: VecDeque<u32>,
    threads: HashMap<u32, Thread>,
    /// Where each open range is: id → (thread, key).
    ids: HashMap<u32, (u32, Key)>,
    /// Ends that came before their start: id → (thread, time). CUPTI buffers each thread's
    /// records apart, so a range ended on another thread can be delivered first (seen on the
    /// H100 and in CUPTI's own order of records).
    early: HashMap<u32, (u32, u64)>,
    early_order: VecDeque<u32>,
    /// Bytes charged to the pool for the kept ranges.
    held: u64,
    pub stats: NvtxStats,
}

impl Nvtx {
    /// A marker's name, sent before its record.
    pub fn name(&mut self, id: u32, name: Arc<str>, domain: Option<Arc<str>>) {
        if self.names.insert(id, (name, domain)).is_none() {
            self.name_order.push_back(id);
        }
        while self.names.len() > MAX_NAMES
            && let Some(old) = self.name_order.pop_front()
        {
            if self.names.remove(&old).is_some() {
                self.stats.unnamed += 1;
            }
        }
    }

    fn take_name(&mut self, id: u32) -> (Arc<str>, Option<Arc<str>>) {
        match self.names.remove(&id) {
            Some(n) => n,
            None => {
                self.stats.unnamed += 1;
                (Arc::from("?"), None)
            }
        }
    }

    /// A Marker record: a mark, or a range's start or end (ended ranges go to `out`).
    pub fn record(&mut self, pid: u32, comm: [u8; 16], rec: &GpuRecord, out: &mut Vec<NvtxRange>, pool: &mut Pool) {
        let (id, ts, tid) = (rec.correlation_id, rec.start_ns, rec.tid);
        let range = |kind, name, domain, start_ns, end_ns, depth| NvtxRange {
            pid,
            comm,
            tid,
            id,
            kind,
            name,
            domain,
            start_ns,
            end_ns,
            depth,
        };
        if rec.cbid & marker::INSTANTANEOUS != 0 {
            let (name, domain) = self.take_name(id);
            self.stats.marks += 1;
            out.push(range(NvtxKind::Mark, name, domain, ts, None, 0));
        } else if rec.cbid & marker::START != 0 {
            let (name, domain) = self.take_name(id);
            self.start(tid, id, ts, name, domain, pool, out, pid, comm);
        } else if rec.cbid & marker::END != 0 {
            self.end(tid, id, ts, out, pid, comm, pool);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        tid: u32,
        id: u32,
        ts: u64,
        name: Arc<str>,
        domain: Option<Arc<str>>,
        pool: &mut Pool,
        out: &mut Vec<NvtxRange>,
        pid: u32,
        comm: [u8; 16],
    ) {
        if let Some((_, end)) = self.early.remove(&id) {
            // Its end came first: ended before it could hold anything seen since, and (being
            // delivered apart) on another thread: a process range.
            self.stats.process_ranges += 1;
            out.push(NvtxRange {
                pid,
                comm,
                tid,
                id,
                kind: NvtxKind::Process,
                name,
                domain,
                start_ns: ts,
                end_ns: Some(end.max(ts)),
                depth: 0,
            });
            return;
        }
        if self.ids.len() >= MAX_IDS
            || (self.threads.len() >= MAX_THREADS && !self.threads.contains_key(&tid))
            || *pool.used + NODE_COST > pool.limit
        {
            self.stats.evicted += 1;
            return;
        }
        let t = self.threads.entry(tid).or_default();
        if t.open.len() >= MAX_OPEN {
            self.stats.evicted += 1;
            return;
        }
        t.seq += 1;
        let key = (ts, t.seq);
        let node = Node {
            start: ts,
            end: u64::MAX,
            name,
            domain,
            parent: t.open.last().copied(),
            process: false,
        };
        t.nodes.insert(key, node);
        t.open.push(key);
        *pool.used += NODE_COST;
        self.held += NODE_COST;
        if let Some((old_tid, old_key)) = self.ids.insert(id, (tid, key)) {
            // An id reused while its range was open (ids are CUPTI's, per process): the old
            // range is forgotten.
            self.stats.evicted += 1;
            if let Some(o) = self.threads.get_mut(&old_tid) {
                o.open.retain(|k| *k != old_key);
                if o.nodes.remove(&old_key).is_some() {
                    *pool.used -= NODE_COST;
                    self.held -= NODE_COST;
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn end(&mut self, tid: u32, id: u32, ts: u64, out: &mut Vec<NvtxRange>, pid: u32, comm: [u8; 16], pool: &mut Pool) {
        let Some((start_tid, key)) = self.ids.remove(&id) else {
            // Its start may still come (another thread's buffer): wait for it, bounded.
            if self.early.insert(id, (tid, ts)).is_none() {
                self.early_order.push_back(id);
            }
            while self.early.len() > MAX_EARLY
                && let Some(old) = self.early_order.pop_front()
            {
                if self.early.remove(&old).is_some() {
                    self.stats.unmatched_ends += 1;
                }
            }
            return;
        };
        let Some(t) = self.threads.get_mut(&start_tid) else {
            self.stats.unmatched_ends += 1;
            return;
        };
        // Nesting order on its own thread makes it a thread range, and whatever is still
        // open above it a process range (thread ranges close innermost first).
        let pos = t.open.iter().position(|k| *k == key);
        let thread_range = start_tid == tid && pos.is_some() && !t.nodes.get(&key).is_some_and(|n| n.process);
        let depth = match (thread_range, pos) {
            (true, Some(p)) => {
                for above in t.open.drain(p + 1..) {
                    if let Some(n) = t.nodes.get_mut(&above) {
                        n.process = true;
                    }
                    t.generation += 1;
                }
                t.open.pop();
                p as u32
            }
            (_, Some(p)) => {
                t.open.remove(p);
                0
            }
            _ => 0,
        };
        let Some(n) = t.nodes.get_mut(&key) else {
            self.stats.unmatched_ends += 1;
            return;
        };
        if !thread_range && !n.process {
            n.process = true;
            t.generation += 1;
        }
        n.end = ts.max(n.start);
        let kind = if thread_range {
            self.stats.thread_ranges += 1;
            NvtxKind::Thread
        } else {
            self.stats.process_ranges += 1;
            NvtxKind::Process
        };
        out.push(NvtxRange {
            pid,
            comm,
            tid: start_tid,
            id,
            kind,
            name: n.name.clone(),
            domain: n.domain.clone(),
            start_ns: n.start,
            end_ns: Some(n.end),
            depth,
        });
        t.ended.push_back((n.end, key));
        // Keep ended ranges a while (bounded), oldest ended first out.
        while let Some(&(end, old)) = t.ended.front() {
            if t.ended.len() <= MAX_ENDED && end.saturating_add(ENDED_AGE_NS) >= ts {
                break;
            }
            t.ended.pop_front();
            if t.nodes.remove(&old).is_some() {
                *pool.used -= NODE_COST;
                self.held -= NODE_COST;
            }
        }
    }

    /// The thread ranges open on `tid` at `ts`, outermost first (None: none).
    pub fn stack(&mut self, tid: u32, ts: u64) -> Option<NvtxStack> {
        let t = self.threads.get_mut(&tid)?;
        let (&first, _) = t.nodes.range(..=(ts, u64::MAX)).next_back()?;
        // The innermost thread range holding ts: from the last range that started before it,
        // up through the ranges it was opened in.
        let mut cur = Some(first);
        let inner = loop {
            let key = cur?;
            let n = t.nodes.get(&key)?;
            if !n.process && n.start <= ts && ts < n.end {
                break key;
            }
            cur = n.parent;
        };
        if let Some((k, g, s)) = &t.cache
            && *k == inner
            && *g == t.generation
        {
            self.stats.stacks += 1;
            return Some(s.clone());
        }
        let mut labels = Vec::new();
        let mut cur = Some(inner);
        while let Some(key) = cur {
            let Some(n) = t.nodes.get(&key) else { break };
            if !n.process {
                labels.push(label(n.domain.as_deref(), &n.name));
            }
            cur = n.parent;
        }
        labels.reverse();
        let stack: NvtxStack = labels.into();
        t.cache = Some((inner, t.generation, stack.clone()));
        self.stats.stacks += 1;
        Some(stack)
    }

    /// The process exited or the run ends: its open ranges go out unended.
    pub fn finish(&mut self, pid: u32, comm: [u8; 16], out: &mut Vec<NvtxRange>, pool: &mut Pool) {
        let mut open: Vec<(u32, u32, Key)> = self.ids.drain().map(|(id, (tid, key))| (id, tid, key)).collect();
        open.sort_by_key(|&(_, tid, key)| (key, tid));
        for (id, tid, key) in open {
            let Some(t) = self.threads.get(&tid) else { continue };
            let Some(n) = t.nodes.get(&key) else { continue };
            self.stats.open_at_end += 1;
            let depth = t.open.iter().position(|k| *k == key);
            out.push(NvtxRange {
                pid,
                comm,
                tid,
                id,
                kind: if n.process || depth.is_none() {
                    NvtxKind::Process
                } else {
                    NvtxKind::Thread
                },
                name: n.name.clone(),
                domain: n.domain.clone(),
                start_ns: n.start,
                end_ns: None,
                depth: depth.unwrap_or(0) as u32,
            });
        }
        self.stats.unmatched_ends += self.early.len() as u64;
        self.early = HashMap::new();
        self.early_order = VecDeque::new();
        self.threads = HashMap::new();
        *pool.used -= self.held;
        self.held = 0;
        self.names = HashMap::new();
        self.name_order = VecDeque::new();
    }
}

#[cfg(test)]
mod tests {
    use gpu_observer_common::cupti::GpuRecordKind;

    use super::*;

    const COMM: [u8; 16] = *b"train\0\0\0\0\0\0\0\0\0\0\0";

    /// An output range as the tests compare it: id, kind, name, start, end, depth.
    type Ended<'a> = (u32, NvtxKind, &'a str, u64, Option<u64>, u32);

    struct World {
        n: Nvtx,
        out: Vec<NvtxRange>,
        used: u64,
        evicted: u64,
        names_evicted: u64,
        limit: u64,
    }

    impl World {
        fn new() -> Self {
            Self {
                n: Nvtx::default(),
                out: Vec::new(),
                used: 0,
                evicted: 0,
                names_evicted: 0,
                limit: u64::MAX,
            }
        }

        fn pool(&mut self) -> Pool<'_> {
            Pool {
                limit: self.limit,
                used: &mut self.used,
                evicted: &mut self.evicted,
                names_evicted: &mut self.names_evicted,
            }
        }

        fn marker(&mut self, flags: u32, id: u32, tid: u32, ts: u64, name: Option<&str>) {
            if let Some(name) = name {
                self.n.name(id, name.into(), None);
            }
            let rec = GpuRecord {
                kind: GpuRecordKind::Marker as u32,
                cbid: flags,
                correlation_id: id,
                tid,
                start_ns: ts,
                ..Default::default()
            };
            let (mut n, mut out) = (std::mem::take(&mut self.n), std::mem::take(&mut self.out));
            n.record(7, COMM, &rec, &mut out, &mut self.pool());
            (self.n, self.out) = (n, out);
        }

        fn start(&mut self, id: u32, tid: u32, ts: u64, name: &str) {
            self.marker(marker::START, id, tid, ts, Some(name));
        }

        fn end(&mut self, id: u32, tid: u32, ts: u64) {
            self.marker(marker::END, id, tid, ts, None);
        }

        fn stack(&mut self, tid: u32, ts: u64) -> Option<Vec<String>> {
            self.n.stack(tid, ts).map(|s| s.iter().map(|l| l.to_string()).collect())
        }

        fn ended(&self) -> Vec<Ended<'_>> {
            self.out
                .iter()
                .map(|r| (r.id, r.kind, &*r.name, r.start_ns, r.end_ns, r.depth))
                .collect()
        }
    }

    #[test]
    fn pushes_and_pops_nest_and_a_launch_gets_the_ranges_open_on_its_thread() {
        let mut w = World::new();
        w.start(1, 10, 100, "step");
        w.start(2, 10, 110, "forward");
        assert_eq!(w.stack(10, 115).unwrap(), ["step", "forward"]);
        w.end(2, 10, 200);
        w.start(3, 10, 210, "backward");
        w.end(3, 10, 300);
        w.end(1, 10, 400);
        // Launches at any time within, before and after (the stacks are asked for later).
        assert_eq!(w.stack(10, 150).unwrap(), ["step", "forward"]);
        assert_eq!(w.stack(10, 205).unwrap(), ["step"]);
        assert_eq!(w.stack(10, 250).unwrap(), ["step", "backward"]);
        assert_eq!(w.stack(10, 99), None);
        assert_eq!(w.stack(10, 400), None);
        assert_eq!(w.stack(11, 150), None, "another thread has no ranges");
        assert_eq!(
            w.ended(),
            [
                (2, NvtxKind::Thread, "forward", 110, Some(200), 1),
                (3, NvtxKind::Thread, "backward", 210, Some(300), 1),
                (1, NvtxKind::Thread, "step", 100, Some(400), 0),
            ]
        );
        assert_eq!((w.n.stats.thread_ranges, w.n.stats.process_ranges), (3, 0));
        // Every kept range is charged, and all of it comes back at the end.
        assert_eq!(w.used, 3 * NODE_COST);
        let (mut n, mut out) = (std::mem::take(&mut w.n), Vec::new());
        n.finish(7, COMM, &mut out, &mut w.pool());
        assert!(out.is_empty());
        assert_eq!(w.used, 0);
    }

    #[test]
    fn a_range_ended_out_of_order_or_on_another_thread_is_a_process_range_and_leaves_the_stacks() {
        let mut w = World::new();
        w.start(1, 10, 100, "outer");
        w.start(2, 10, 110, "inner");
        w.end(2, 10, 120);
        w.start(3, 10, 130, "proc_range"); // nvtxRangeStart: looks like a push
        w.marker(marker::INSTANTANEOUS, 4, 10, 135, Some("a_mark"));
        assert_eq!(w.stack(10, 140).unwrap(), ["outer", "proc_range"], "undecided yet");
        w.end(1, 10, 150); // the pop of "outer" comes first: "proc_range" was no push
        assert_eq!(w.stack(10, 140).unwrap(), ["outer"]);
        w.start(5, 11, 160, "t_outer");
        w.end(3, 11, 170); // ended on another thread
        w.end(5, 11, 180);
        assert_eq!(w.stack(11, 165).unwrap(), ["t_outer"]);
        assert_eq!(
            w.ended(),
            [
                (2, NvtxKind::Thread, "inner", 110, Some(120), 1),
                (4, NvtxKind::Mark, "a_mark", 135, None, 0),
                (1, NvtxKind::Thread, "outer", 100, Some(150), 0),
                (3, NvtxKind::Process, "proc_range", 130, Some(170), 0),
                (5, NvtxKind::Thread, "t_outer", 160, Some(180), 0),
            ]
        );
        let s = w.n.stats;
        assert_eq!((s.thread_ranges, s.process_ranges, s.marks), (3, 1, 1));
    }

    #[test]
    fn an_end_under_an_open_range_makes_the_ranges_above_it_process_ranges() {
        // push a, start b, pop a (and start a, push b, end a, which CUPTI records alike): the
        // range that ends is taken for the pop, the one still open above it for a start.
        let mut w = World::new();
        w.start(1, 10, 100, "a");
        w.start(2, 10, 110, "b");
        w.end(1, 10, 120);
        w.end(2, 10, 130);
        assert_eq!(
            w.ended(),
            [
                (1, NvtxKind::Thread, "a", 100, Some(120), 0),
                (2, NvtxKind::Process, "b", 110, Some(130), 0),
            ]
        );
        assert_eq!(w.stack(10, 115).unwrap(), ["a"]);
    }

    #[test]
    fn ends_without_starts_names_without_records_and_open_ranges_are_counted() {
        let mut w = World::new();
        w.end(99, 10, 50);
        w.marker(marker::START, 1, 10, 100, None);
        w.start(2, 10, 110, "kept open");
        assert_eq!(w.stack(10, 120).unwrap(), ["?", "kept open"]);
        let (mut n, mut out) = (std::mem::take(&mut w.n), Vec::new());
        n.finish(7, COMM, &mut out, &mut w.pool());
        let open: Vec<_> = out.iter().map(|r| (r.id, r.kind, r.end_ns, r.depth)).collect();
        assert_eq!(open, [(1, NvtxKind::Thread, None, 0), (2, NvtxKind::Thread, None, 1)]);
        let s = n.stats;
        // The end of 99 waited for a start that never came: unmatched at the end.
        assert_eq!((s.unmatched_ends, s.unnamed, s.open_at_end), (1, 1, 2));
        assert_eq!(w.used, 0);
    }

    #[test]
    fn memory_is_bounded_by_the_pool_and_by_depth_and_both_are_counted() {
        let mut w = World::new();
        w.limit = 2 * NODE_COST;
        for id in 1..=3 {
            w.start(id, 10, 100 + u64::from(id), "r");
        }
        assert_eq!((w.n.stats.evicted, w.used), (1, 2 * NODE_COST));
        let mut w = World::new();
        for id in 1..=(MAX_OPEN as u32 + 5) {
            w.start(id, 10, u64::from(id), "deep");
        }
        assert_eq!(w.n.stats.evicted, 5);
        assert_eq!(w.stack(10, 10_000).unwrap().len(), MAX_OPEN);
    }

    #[test]
    fn ended_ranges_age_out_but_the_stack_of_a_recent_launch_is_kept() {
        let mut w = World::new();
        w.start(1, 10, 0, "old");
        w.end(1, 10, 10);
        w.start(2, 10, ENDED_AGE_NS + 100, "new");
        w.end(2, 10, ENDED_AGE_NS + 200);
        assert_eq!(w.stack(10, 5), None, "aged out");
        assert_eq!(w.stack(10, ENDED_AGE_NS + 150).unwrap(), ["new"]);
        assert_eq!(w.used, NODE_COST);
    }

    #[test]
    fn domains_prefix_their_ranges_in_stacks() {
        let mut w = World::new();
        w.n.name(1, "AllReduce".into(), Some("NCCL".into()));
        w.marker(marker::START, 1, 10, 100, None);
        assert_eq!(w.stack(10, 101).unwrap(), ["NCCL: AllReduce"]);
        assert_eq!(w.n.stats.unnamed, 0);
    }

    #[test]
    fn an_end_delivered_before_its_start_makes_a_process_range() {
        let mut w = World::new();
        w.end(5, 11, 900); // nvtxRangeEnd on a helper thread, its buffer delivered first
        w.start(1, 10, 150, "step");
        w.start(5, 10, 100, "epoch");
        w.end(1, 10, 200);
        assert_eq!(
            w.ended(),
            [
                (5, NvtxKind::Process, "epoch", 100, Some(900), 0),
                (1, NvtxKind::Thread, "step", 150, Some(200), 0),
            ]
        );
        assert_eq!(w.stack(10, 160).unwrap(), ["step"]);
        assert_eq!(w.n.stats.unmatched_ends, 0);
    }
}
