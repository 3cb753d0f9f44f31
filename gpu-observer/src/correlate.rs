//! Correlate: per-process state and totals built from the event stream.
//!
//! Bounded: live allocations are capped per process, and exited processes keep only their
//! counters (and are forgotten past a cap, counted).

use std::collections::{BTreeMap, HashMap, VecDeque};

use gpu_observer_common::api::{Direction, Family, MemKind};

use crate::decode::{Body, Event};

/// Live allocations remembered per process (address → bytes), for the size of frees.
const MAX_LIVE_ALLOCS: usize = 1 << 20;
/// Exited processes whose counters are kept for the final summary.
const MAX_EXITED: usize = 4096;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Amount {
    pub count: u64,
    pub bytes: u64,
    pub ns: u64,
}

impl Amount {
    fn add(&mut self, bytes: u64, ns: u64) {
        self.count += 1;
        self.bytes += bytes;
        self.ns += ns;
    }
}

/// Directions in a fixed order for tables and JSON.
pub const DIRECTIONS: [Direction; 4] = [
    Direction::CpuToGpu,
    Direction::GpuToCpu,
    Direction::GpuToGpu,
    Direction::Unknown,
];

pub fn direction_name(d: Direction) -> &'static str {
    match d {
        Direction::CpuToGpu => "cpu_to_gpu",
        Direction::GpuToCpu => "gpu_to_cpu",
        Direction::GpuToGpu => "gpu_to_gpu",
        Direction::Unknown | Direction::None => "unknown",
    }
}

pub fn mem_name(m: MemKind) -> Option<&'static str> {
    match m {
        MemKind::Device => Some("device"),
        MemKind::Managed => Some("managed"),
        MemKind::Host => Some("host"),
        MemKind::None => None,
    }
}

/// Counters of one process.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub events: u64,
    pub launches: u64,
    pub launch_apis: BTreeMap<&'static str, u64>,
    /// Indexed like [`DIRECTIONS`].
    pub copies: [Amount; 4],
    pub memsets: Amount,
    pub allocs: Amount,
    pub frees: Amount,
    /// Bytes allocated and not freed (device + managed + host).
    pub outstanding_bytes: u64,
    pub syncs: Amount,
    pub inits: Amount,
    pub ioctls: Amount,
    /// ioctls issued inside a probed call.
    pub ioctls_in_calls: u64,
    /// Calls that returned an error.
    pub failed_calls: u64,
    pub call_apis: BTreeMap<&'static str, u64>,
    /// Frees of pointers the agent never saw allocated (allocated before it attached).
    pub unknown_frees: u64,
}

impl Stats {
    pub fn copy(&self, d: Direction) -> Amount {
        DIRECTIONS
            .iter()
            .position(|x| *x == d)
            .map(|i| self.copies[i])
            .unwrap_or_default()
    }
}

#[derive(Debug)]
pub struct Process {
    pub pid: u32,
    pub comm: String,
    pub first_ts: u64,
    pub last_ts: u64,
    pub exited: bool,
    pub stats: Stats,
    live: HashMap<u64, u64>,
}

#[derive(Debug, Default)]
pub struct Correlator {
    pub procs: HashMap<u32, Process>,
    pub events: u64,
    pub decode_errors: u64,
    /// Exited processes forgotten because of [`MAX_EXITED`].
    pub forgotten: u64,
    exited_order: VecDeque<u32>,
}

impl Correlator {
    /// Folds one event in; fills in what only the agent knows (the size of a free).
    pub fn observe(&mut self, ev: &mut Event) {
        self.events += 1;
        let p = self.procs.entry(ev.pid).or_insert_with(|| Process {
            pid: ev.pid,
            comm: String::new(),
            first_ts: ev.ts_ns,
            last_ts: ev.ts_ns,
            exited: false,
            stats: Stats::default(),
            live: HashMap::new(),
        });
        if p.comm.is_empty() || ev.tid == ev.pid {
            let comm = ev.comm();
            if p.comm != comm {
                p.comm = comm.to_string();
            }
        }
        p.first_ts = p.first_ts.min(ev.ts_ns);
        p.last_ts = p.last_ts.max(ev.ts_ns);
        let s = &mut p.stats;
        s.events += 1;
        let api = ev.api;
        match &mut ev.body {
            Body::Launch(_) => {
                s.launches += 1;
                *s.launch_apis
                    .entry(api.map_or("?", |a| a.name))
                    .or_default() += 1;
            }
            Body::Call(c) => {
                let spec = api.expect("calls carry their api");
                *s.call_apis.entry(spec.name).or_default() += 1;
                if c.result != 0 {
                    s.failed_calls += 1;
                }
                let ok = c.result == 0;
                match spec.family {
                    Family::Memcpy => {
                        let i = DIRECTIONS
                            .iter()
                            .position(|d| *d == c.direction)
                            .unwrap_or(3);
                        s.copies[i].add(c.bytes.unwrap_or(0), c.duration_ns);
                    }
                    Family::Memset => s.memsets.add(c.bytes.unwrap_or(0), c.duration_ns),
                    Family::Alloc => {
                        let bytes = c.bytes.unwrap_or(0);
                        s.allocs.add(bytes, c.duration_ns);
                        if let (true, Some(addr)) = (ok, c.address) {
                            if p.live.len() < MAX_LIVE_ALLOCS {
                                p.live.insert(addr, bytes);
                            }
                            s.outstanding_bytes += bytes;
                        }
                    }
                    Family::Free => {
                        let freed = c.address.and_then(|a| {
                            if ok {
                                p.live.remove(&a)
                            } else {
                                p.live.get(&a).copied()
                            }
                        });
                        match freed {
                            Some(b) => {
                                c.bytes = Some(b);
                                if ok {
                                    s.outstanding_bytes = s.outstanding_bytes.saturating_sub(b);
                                }
                            }
                            None if c.address != Some(0) => s.unknown_frees += 1,
                            None => {}
                        }
                        s.frees.add(c.bytes.unwrap_or(0), c.duration_ns);
                    }
                    Family::Sync => s.syncs.add(0, c.duration_ns),
                    Family::Init => s.inits.add(0, c.duration_ns),
                    Family::Launch | Family::LaunchEx | Family::GraphLaunch => {}
                }
            }
            Body::Ioctl(i) => {
                s.ioctls.add(0, i.duration_ns);
                if i.parent.is_some() {
                    s.ioctls_in_calls += 1;
                }
            }
            Body::ProcessExit => {
                p.exited = true;
                p.live = HashMap::new();
                self.exited_order.push_back(ev.pid);
                if self.exited_order.len() > MAX_EXITED {
                    let old = self.exited_order.pop_front();
                    if let Some(old) = old
                        && self.procs.get(&old).is_some_and(|p| p.exited)
                    {
                        self.procs.remove(&old);
                        self.forgotten += 1;
                    }
                }
            }
        }
    }

    /// Processes in pid order.
    pub fn sorted(&self) -> Vec<&Process> {
        let mut v: Vec<&Process> = self.procs.values().collect();
        v.sort_by_key(|p| p.pid);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{Call, Event};
    use gpu_observer_common::api;

    fn call_ev(name: &str, address: Option<u64>, bytes: Option<u64>, result: u32) -> Event {
        let spec = api::by_id(api::id_of(name).unwrap()).unwrap();
        Event {
            ts_ns: 1,
            pid: 10,
            tid: 10,
            comm: *b"train\0\0\0\0\0\0\0\0\0\0\0",
            api: Some(spec),
            body: Body::Call(Call {
                bytes,
                direction: spec.direction,
                mem: spec.mem,
                stream: None,
                dst: None,
                src: None,
                address,
                duration_ns: 100,
                result,
                ioctl_count: 0,
                ioctl_ns: 0,
                nested: 0,
                read_errors: 0,
            }),
        }
    }

    #[test]
    fn frees_get_their_size_from_the_allocation_and_outstanding_bytes_follow() {
        let mut c = Correlator::default();
        c.observe(&mut call_ev("cuMemAlloc_v2", Some(0x1000), Some(4096), 0));
        c.observe(&mut call_ev("cuMemAlloc_v2", Some(0x9000), Some(100), 0));
        let mut free = call_ev("cuMemFree_v2", Some(0x1000), None, 0);
        c.observe(&mut free);
        let Body::Call(f) = &free.body else {
            unreachable!()
        };
        assert_eq!(f.bytes, Some(4096));
        let s = &c.procs[&10].stats;
        assert_eq!(
            (
                s.allocs.count,
                s.allocs.bytes,
                s.frees.bytes,
                s.outstanding_bytes
            ),
            (2, 4196, 4096, 100)
        );
        c.observe(&mut call_ev("cuMemFree_v2", Some(0x5555), None, 0));
        assert_eq!(c.procs[&10].stats.unknown_frees, 1);
        assert_eq!(c.procs[&10].comm, "train");
    }

    #[test]
    fn failed_calls_are_counted_and_do_not_track_memory() {
        let mut c = Correlator::default();
        c.observe(&mut call_ev("cuMemAlloc_v2", None, Some(1 << 40), 2));
        let s = &c.procs[&10].stats;
        assert_eq!(
            (s.failed_calls, s.outstanding_bytes, s.allocs.count),
            (1, 0, 1)
        );
    }
}
