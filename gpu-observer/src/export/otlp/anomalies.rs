//! Anomalies over OTLP (docs/DESIGN.md "Anomalies"): what the reader hands the span thread for
//! each finding, the `gpu.anomaly` span event it becomes on the flagged call's span, and the
//! totals of the `gpu.anomalies` counter.
//!
//! The counter names no process and no kernel (cardinality): its keys are what was slow
//! (kernel, call, bandwidth), the detector's mode and the pod, at most [`MAX_KEYS`] of them —
//! past it the least recently counted is forgotten and counted (`anomaly_keys_evicted`), as
//! `gpu.cuda.time` does (analyze/gpu_time.rs).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::SystemTime,
};

use opentelemetry::KeyValue;

use crate::{
    analyze::{
        anomaly::{Finding, Mode, What},
        gpu_time::Pod,
    },
    correlate::cupti_join::GpuActivity,
    decode::Event,
};

/// Keys of the counter kept at once.
pub(super) const MAX_KEYS: usize = 4096;

/// The span event's name.
pub(super) const EVENT_NAME: &str = "gpu.anomaly";

/// Which span a finding belongs to: a call's (its thread and entry time), or a GPU record's
/// (its correlation id and GPU start: a graph launch's kernels share the id).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SpanKey {
    Call {
        pid: u32,
        tid: u32,
        ts_ns: u64,
    },
    Gpu {
        pid: u32,
        correlation_id: u32,
        start_ns: u64,
    },
}

impl SpanKey {
    pub(super) fn of_event(ev: &Event) -> Self {
        SpanKey::Call {
            pid: ev.pid,
            tid: ev.tid,
            ts_ns: ev.ts_ns,
        }
    }

    pub(super) fn of_gpu(a: &GpuActivity) -> Self {
        SpanKey::Gpu {
            pid: a.pid,
            correlation_id: a.rec.correlation_id,
            start_ns: a.rec.start_ns,
        }
    }

    pub(super) fn pid(self) -> u32 {
        match self {
            SpanKey::Call { pid, .. } | SpanKey::Gpu { pid, .. } => pid,
        }
    }
}

/// One finding, as the reader hands it to the span thread (after the batch's events and GPU
/// records, so after the span it belongs to was built).
#[derive(Clone, Debug)]
pub(super) struct Flag {
    pub at: SpanKey,
    pub comm: [u8; 16],
    /// When the call began (a GPU record: when it started on the GPU): the event's time.
    pub ts_ns: u64,
    pub finding: Finding,
    pub mode: Mode,
    /// The call's or record's last finding: its span can go.
    pub last: bool,
}

/// The `gpu.anomaly` span event of a finding, at `time`. What the JSON line adds to the key is
/// the span's own already: a kernel series' launch shape is its `gpu_kernel` span's
/// `gpu.cuda.grid_dim`/`block_dim`, and a bandwidth measured on the GPU is on a `gpu_memcpy`
/// span, one measured in the call on the call's.
pub(super) fn span_event(f: &Finding, mode: Mode, time: SystemTime) -> opentelemetry::trace::Event {
    let mut attrs = vec![KeyValue::new("gpu.anomaly.what", f.what.kind())];
    match &f.what {
        What::Kernel { name, .. } => attrs.push(KeyValue::new("gpu.anomaly.key", name.demangled.to_string())),
        What::Call { api, size } => attrs.extend([
            KeyValue::new("gpu.anomaly.key", *api),
            KeyValue::new("gpu.anomaly.size_class", i64::from(*size)),
        ]),
        What::Bandwidth { direction, size, .. } => attrs.extend([
            KeyValue::new("gpu.anomaly.key", direction.name()),
            KeyValue::new("gpu.anomaly.size_class", i64::from(*size)),
        ]),
    }
    attrs.extend([
        KeyValue::new("gpu.anomaly.observed", f.observed),
        KeyValue::new("gpu.anomaly.typical", f.typical),
        KeyValue::new("gpu.anomaly.unit", f.what.unit()),
        KeyValue::new("gpu.anomaly.deviation", f.deviation),
        KeyValue::new("gpu.anomaly.mode", mode.name()),
    ]);
    opentelemetry::trace::Event::new(EVENT_NAME, time, attrs, 0)
}

/// What the counter counts under.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub(super) struct Key {
    pub what: &'static str,
    pub mode: &'static str,
    pub pod: Option<Arc<Pod>>,
}

/// The counter's totals: written by the span thread, read by the metric callback.
#[derive(Debug, Default)]
pub(super) struct Tally {
    /// Count, and when it was last counted (for eviction).
    counts: HashMap<Key, (u64, u64)>,
    clock: u64,
}

pub(super) type SharedTally = Arc<Mutex<Tally>>;

impl Tally {
    /// Counts one finding; returns whether a key was forgotten to make room for it.
    pub(super) fn count(&mut self, key: Key) -> bool {
        self.clock += 1;
        let clock = self.clock;
        if let Some(c) = self.counts.get_mut(&key) {
            *c = (c.0 + 1, clock);
            return false;
        }
        // A scan, but only when a new key finds every slot taken: rare (3 kinds × the pods of
        // one node fill 4 096 only past a thousand pods).
        let evicted = self.counts.len() >= MAX_KEYS
            && self
                .counts
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(k, _)| k.clone())
                .is_some_and(|old| self.counts.remove(&old).is_some());
        self.counts.insert(key, (1, clock));
        evicted
    }

    /// Every key and its count.
    pub(super) fn each(&self, mut f: impl FnMut(&Key, u64)) {
        for (k, (n, _)) in &self.counts {
            f(k, *n);
        }
    }
}

/// The pod of a process, from its OTLP attributes (resource.rs reads them from /proc).
pub(super) fn pod_of(attrs: &[KeyValue]) -> Option<Arc<Pod>> {
    let get = |key: &str| {
        attrs
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.as_str().into_owned())
    };
    Some(Arc::new(Pod {
        pod: get("k8s.pod.name")?,
        namespace: get("k8s.namespace.name")?,
        container: get("k8s.container.name")?,
    }))
}

#[cfg(test)]
mod tests {
    use gpu_observer_common::api::Direction;
    use opentelemetry::Value;

    use super::*;
    use crate::decode::KernelName;

    fn attrs(e: &opentelemetry::trace::Event) -> Vec<(String, Value)> {
        e.attributes
            .iter()
            .map(|kv| (kv.key.as_str().to_string(), kv.value.clone()))
            .collect()
    }

    fn s(k: &str, v: &str) -> (String, Value) {
        (k.to_string(), Value::from(v.to_string()))
    }

    #[test]
    fn a_kernel_finding_is_an_event_with_its_name_and_numbers_and_no_size_class() {
        let f = Finding {
            what: What::Kernel {
                name: Arc::new(KernelName::new("_Z6kernelPf")),
                grid: [4, 1, 1],
                block: [128, 1, 1],
            },
            observed: 20_000.0,
            typical: 2_000.0,
            deviation: 115.13,
        };
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_nanos(1_234);
        let e = span_event(&f, Mode::Robust, t);
        assert_eq!(e.name, "gpu.anomaly");
        assert_eq!(e.timestamp, t);
        assert_eq!(
            attrs(&e),
            vec![
                s("gpu.anomaly.what", "kernel"),
                s("gpu.anomaly.key", "kernel(float*)"),
                ("gpu.anomaly.observed".into(), Value::F64(20_000.0)),
                ("gpu.anomaly.typical".into(), Value::F64(2_000.0)),
                s("gpu.anomaly.unit", "ns"),
                ("gpu.anomaly.deviation".into(), Value::F64(115.13)),
                s("gpu.anomaly.mode", "robust"),
            ]
        );
    }

    #[test]
    fn call_and_bandwidth_findings_carry_their_size_class() {
        let call = Finding {
            what: What::Call {
                api: "cuMemcpyHtoD_v2",
                size: 21,
            },
            observed: 9e5,
            typical: 1e5,
            deviation: 12.5,
        };
        assert_eq!(
            attrs(&span_event(&call, Mode::Sigma, SystemTime::UNIX_EPOCH)),
            vec![
                s("gpu.anomaly.what", "call"),
                s("gpu.anomaly.key", "cuMemcpyHtoD_v2"),
                ("gpu.anomaly.size_class".into(), Value::I64(21)),
                ("gpu.anomaly.observed".into(), Value::F64(9e5)),
                ("gpu.anomaly.typical".into(), Value::F64(1e5)),
                s("gpu.anomaly.unit", "ns"),
                ("gpu.anomaly.deviation".into(), Value::F64(12.5)),
                s("gpu.anomaly.mode", "sigma"),
            ]
        );
        let bw = Finding {
            what: What::Bandwidth {
                direction: Direction::GpuToCpu,
                size: 29,
                on_gpu: true,
            },
            observed: 8e9,
            typical: 25e9,
            deviation: 9.0,
        };
        assert_eq!(
            attrs(&span_event(&bw, Mode::Robust, SystemTime::UNIX_EPOCH)),
            vec![
                s("gpu.anomaly.what", "bandwidth"),
                s("gpu.anomaly.key", "gpu_to_cpu"),
                ("gpu.anomaly.size_class".into(), Value::I64(29)),
                ("gpu.anomaly.observed".into(), Value::F64(8e9)),
                ("gpu.anomaly.typical".into(), Value::F64(25e9)),
                s("gpu.anomaly.unit", "B/s"),
                ("gpu.anomaly.deviation".into(), Value::F64(9.0)),
                s("gpu.anomaly.mode", "robust"),
            ]
        );
    }

    fn key(what: &'static str, pod: Option<&str>) -> Key {
        Key {
            what,
            mode: "robust",
            pod: pod.map(|p| {
                Arc::new(Pod {
                    pod: p.into(),
                    namespace: "ml".into(),
                    container: "main".into(),
                })
            }),
        }
    }

    fn totals(t: &Tally) -> Vec<(Key, u64)> {
        let mut v = Vec::new();
        t.each(|k, n| v.push((k.clone(), n)));
        v.sort_by_key(|(k, _)| (k.what, k.pod.as_ref().map(|p| p.pod.clone())));
        v
    }

    #[test]
    fn the_tally_counts_by_key_and_forgets_the_least_recently_counted_past_its_bound() {
        let mut t = Tally::default();
        assert!(!t.count(key("kernel", None)));
        assert!(!t.count(key("kernel", None)));
        assert!(!t.count(key("call", Some("train-0"))));
        assert_eq!(
            totals(&t),
            vec![(key("call", Some("train-0")), 1), (key("kernel", None), 2)]
        );
        for i in 2..MAX_KEYS {
            assert!(!t.count(key("kernel", Some(&format!("p{i}")))));
        }
        // Full: the kernel key without a pod is counted again, so the call key is the oldest.
        assert!(!t.count(key("kernel", None)));
        assert!(t.count(key("bandwidth", None)));
        let all = totals(&t);
        assert_eq!(all.len(), MAX_KEYS);
        assert!(!all.iter().any(|(k, _)| *k == key("call", Some("train-0"))));
        assert!(all.contains(&(key("kernel", None), 3)));
        assert!(all.contains(&(key("bandwidth", None), 1)));
    }

    #[test]
    fn the_pod_comes_from_the_k8s_attributes_and_needs_all_three() {
        let mut a = vec![
            KeyValue::new("process.pid", 7),
            KeyValue::new("k8s.pod.name", "train-0"),
            KeyValue::new("k8s.namespace.name", "ml"),
        ];
        assert_eq!(pod_of(&a), None);
        a.push(KeyValue::new("k8s.container.name", "main"));
        assert_eq!(
            pod_of(&a).as_deref(),
            Some(&Pod {
                pod: "train-0".into(),
                namespace: "ml".into(),
                container: "main".into()
            })
        );
    }
}
