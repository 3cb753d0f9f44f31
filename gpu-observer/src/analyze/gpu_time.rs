//! GPU time by bottleneck class, for fleets: the wall time each process held a context on a
//! GPU, attributed to the class of its current verdict window and summed into keys that name
//! no process (GPU, class, pod) — the `gpu.cuda.time` counter, so dashboards can sum
//! GPU-hours wasted per class, per pod, per namespace without a series per pid.
//!
//! Who holds a context: the processes NVML lists on a GPU in its latest process round, when
//! NVML lists processes; otherwise (no NVML) every live observed process that has made a CUDA
//! call, on a GPU that is not known. A process NVML lists but the probes never saw call is
//! `idle`. Time counts from a process's second tick (its first has no window yet).

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use arc_swap::ArcSwap;

use super::verdict::Class;
use crate::procinfo::ProcInfo;

/// Keys kept at once; past it the least recently counted is forgotten (counted as evicted).
pub const MAX_KEYS: usize = 4096;
/// Processes whose pod is remembered.
const MAX_PODS: usize = 4096;

/// The Kubernetes names of a process's container.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pod {
    pub pod: String,
    pub namespace: String,
    pub container: String,
}

/// What GPU time is counted under.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub struct Key {
    /// The GPU's UUID; empty when it is not known.
    pub gpu: Arc<str>,
    pub class: Class,
    pub pod: Option<Arc<Pod>>,
}

/// The totals as exported: seconds per key since the start, and keys forgotten.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    pub seconds: BTreeMap<Key, f64>,
    pub evicted_keys: u64,
}

/// Where the totals are published; readers (the OTLP metric callback) never wait.
pub type Published = Arc<ArcSwap<Totals>>;

/// One process holding contexts now: its pid, the class it is counted under, the GPUs (UUIDs;
/// one empty name when unknown).
pub struct Holder {
    pub pid: u32,
    pub class: Class,
    pub gpus: Vec<Arc<str>>,
}

/// The accumulator, owned by the verdict tracker.
pub struct GpuTime {
    totals: Totals,
    /// When each key was last counted, for eviction.
    touched: HashMap<Key, u64>,
    pods: HashMap<u32, Option<Arc<Pod>>>,
    last_ns: Option<u64>,
    out: Published,
}

impl GpuTime {
    pub fn new(out: Published) -> Self {
        Self {
            totals: Totals::default(),
            touched: HashMap::new(),
            pods: HashMap::new(),
            last_ns: None,
            out,
        }
    }

    /// Counts the time since the last tick for each holder and publishes the totals.
    /// `procinfo` names the pods of processes not seen before.
    pub fn tick(&mut self, now_ns: u64, holders: &[Holder], procinfo: &ProcInfo) {
        let dt_s = match self.last_ns.replace(now_ns) {
            Some(then) if now_ns > then => (now_ns - then) as f64 / 1e9,
            _ => return,
        };
        let live: std::collections::HashSet<u32> = holders.iter().map(|h| h.pid).collect();
        self.pods.retain(|pid, _| live.contains(pid));
        for h in holders {
            if !self.pods.contains_key(&h.pid) && self.pods.len() >= MAX_PODS {
                continue;
            }
            let pod = self
                .pods
                .entry(h.pid)
                .or_insert_with(|| {
                    procinfo
                        .container(h.pid)
                        .and_then(|c| c.pod)
                        .map(|(pod, namespace, container)| {
                            Arc::new(Pod {
                                pod,
                                namespace,
                                container,
                            })
                        })
                })
                .clone();
            for gpu in &h.gpus {
                let key = Key {
                    gpu: gpu.clone(),
                    class: h.class,
                    pod: pod.clone(),
                };
                self.count(key, dt_s, now_ns);
            }
        }
        self.out.store(Arc::new(self.totals.clone()));
    }

    fn count(&mut self, key: Key, dt_s: f64, now_ns: u64) {
        if !self.touched.contains_key(&key)
            && self.touched.len() >= MAX_KEYS
            && let Some(oldest) = self.touched.iter().min_by_key(|(_, at)| **at).map(|(k, _)| k.clone())
        {
            self.touched.remove(&oldest);
            self.totals.seconds.remove(&oldest);
            self.totals.evicted_keys += 1;
        }
        self.touched.insert(key.clone(), now_ns);
        *self.totals.seconds.entry(key).or_default() += dt_s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pid: u32, class: Class, gpus: &[&str]) -> Holder {
        Holder {
            pid,
            class,
            gpus: gpus.iter().map(|g| Arc::from(*g)).collect(),
        }
    }

    fn seconds(t: &Totals, gpu: &str, class: Class) -> f64 {
        t.seconds
            .iter()
            .filter(|(k, _)| &*k.gpu == gpu && k.class == class)
            .map(|(_, s)| *s)
            .sum()
    }

    #[test]
    fn time_between_ticks_goes_to_each_holders_class_on_each_of_its_gpus() {
        let out = Published::default();
        let mut t = GpuTime::new(out.clone());
        let info = ProcInfo::new("/nonexistent", "/nonexistent");
        // The first tick only starts the clock.
        t.tick(1_000_000_000, &[holder(1, Class::Idle, &["GPU-a"])], &info);
        assert!(out.load().seconds.is_empty());
        t.tick(
            3_000_000_000,
            &[
                holder(1, Class::LaunchBound, &["GPU-a", "GPU-b"]),
                holder(2, Class::LaunchBound, &["GPU-a"]),
                holder(3, Class::Idle, &[""]),
            ],
            &info,
        );
        t.tick(3_500_000_000, &[holder(1, Class::GpuBound, &["GPU-a"])], &info);
        let got = out.load();
        // Two processes × 2 s on GPU-a, then 0.5 s gpu_bound; 2 s on GPU-b; 2 s unknown GPU.
        assert_eq!(seconds(&got, "GPU-a", Class::LaunchBound), 4.0);
        assert_eq!(seconds(&got, "GPU-b", Class::LaunchBound), 2.0);
        assert_eq!(seconds(&got, "GPU-a", Class::GpuBound), 0.5);
        assert_eq!(seconds(&got, "", Class::Idle), 2.0);
        assert_eq!(got.seconds.len(), 4);
        // No process outside a container has pod names.
        assert!(got.seconds.keys().all(|k| k.pod.is_none()));
        // The same time again: nothing counted.
        t.tick(3_500_000_000, &[holder(1, Class::GpuBound, &["GPU-a"])], &info);
        assert_eq!(seconds(&out.load(), "GPU-a", Class::GpuBound), 0.5);
    }

    #[test]
    fn keys_are_bounded_and_the_least_recently_counted_is_forgotten_and_counted() {
        let out = Published::default();
        let mut t = GpuTime::new(out.clone());
        let info = ProcInfo::new("/nonexistent", "/nonexistent");
        t.tick(0, &[], &info);
        for i in 0..MAX_KEYS as u64 + 2 {
            let gpu = format!("GPU-{i}");
            t.tick((i + 1) * 1_000_000_000, &[holder(1, Class::Idle, &[&gpu])], &info);
        }
        let got = out.load();
        assert_eq!(got.seconds.len(), MAX_KEYS);
        assert_eq!(got.evicted_keys, 2);
        assert_eq!(seconds(&got, "GPU-0", Class::Idle), 0.0);
        assert_eq!(seconds(&got, "GPU-2", Class::Idle), 1.0);
    }
}
