//! Who exports and about whom: the OTLP resource (this agent on this node) and the attributes
//! of each observed process, read from /proc once per pid and shared by spans and metrics.

use std::{collections::HashMap, sync::Arc};

use opentelemetry::KeyValue;
use opentelemetry_sdk::Resource;

use crate::procinfo::ProcInfo;

/// Process attribute sets cached, and their bytes; past either the cache is emptied (they are
/// read again from /proc when next needed).
const PROC_ATTRS_ENTRIES: usize = 4096;
const PROC_ATTRS_BYTES: usize = 4 << 20;

/// Resource: who exports. `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` are read by the SDK.
pub(super) fn resource(backends: &str, driver: Option<String>, cuda: Option<String>) -> Resource {
    let mut attrs = vec![KeyValue::new("gpu.tracing.backends", backends.to_string())];
    let node = std::env::var("K8S_NODE_NAME").ok().filter(|n| !n.is_empty());
    // In a pod the UTS hostname is the pod's name: the node's name (downward API) is the host's.
    // OTEL_RESOURCE_ATTRIBUTES wins over both.
    let from_env = std::env::var("OTEL_RESOURCE_ATTRIBUTES").unwrap_or_default();
    if !from_env.split(',').any(|kv| kv.trim_start().starts_with("host.name=")) {
        attrs.push(KeyValue::new(
            "host.name",
            node.clone().unwrap_or_else(|| ProcInfo::host().hostname()),
        ));
    }
    if let Some(node) = node {
        attrs.push(KeyValue::new("k8s.node.name", node));
    }
    if let Some(d) = driver {
        attrs.push(KeyValue::new("gpu.driver.version", d));
    }
    if let Some(c) = cuda {
        attrs.push(KeyValue::new("gpu.cuda.driver.version", c));
    }
    let mut b = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        b = b.with_service_name("gpu-observer");
    }
    b.with_attributes(attrs).build()
}

/// Attributes of a process (pid, executable, command line when asked, Kubernetes identity),
/// computed once per pid; shared by the span thread and the metric callbacks.
pub(super) struct ProcAttrs {
    info: ProcInfo,
    cache: HashMap<u32, Arc<Vec<KeyValue>>>,
    /// Bytes of the strings in `cache` (about).
    bytes: usize,
    command_line: bool,
}

pub(super) type SharedProcAttrs = Arc<std::sync::Mutex<ProcAttrs>>;

impl ProcAttrs {
    pub(super) fn new(command_line: bool) -> SharedProcAttrs {
        Arc::new(std::sync::Mutex::new(Self {
            info: ProcInfo::host(),
            cache: HashMap::new(),
            bytes: 0,
            command_line,
        }))
    }

    pub(super) fn forget(&mut self, pid: u32) {
        if let Some(v) = self.cache.remove(&pid) {
            self.bytes = self.bytes.saturating_sub(attrs_bytes(&v));
        }
    }

    pub(super) fn of(&mut self, pid: u32, comm: &str) -> Arc<Vec<KeyValue>> {
        if let Some(v) = self.cache.get(&pid) {
            return v.clone();
        }
        if self.cache.len() >= PROC_ATTRS_ENTRIES || self.bytes >= PROC_ATTRS_BYTES {
            self.cache = HashMap::new();
            self.bytes = 0;
        }
        let (cl, info) = (self.command_line, &self.info);
        let v = self
            .cache
            .entry(pid)
            .or_insert_with(|| {
                let exe = info.exe_name(pid).unwrap_or_else(|| comm.to_string());
                let mut v = vec![
                    KeyValue::new("process.pid", i64::from(pid)),
                    KeyValue::new("process.executable.name", exe),
                ];
                if cl && let Some((line, truncated)) = info.command_line(pid) {
                    v.push(KeyValue::new("process.command_line", line));
                    if truncated {
                        v.push(KeyValue::new("gpu_observer.command_line_truncated", true));
                    }
                }
                if let Some(c) = info.container(pid) {
                    v.push(KeyValue::new("container.id", c.id));
                    if let Some((pod, ns, container)) = c.pod {
                        v.push(KeyValue::new("k8s.pod.name", pod));
                        v.push(KeyValue::new("k8s.namespace.name", ns));
                        v.push(KeyValue::new("k8s.container.name", container));
                    }
                }
                Arc::new(v)
            })
            .clone();
        self.bytes += attrs_bytes(&v);
        v
    }
}

/// Bytes an attribute set holds (keys, values and their slots).
fn attrs_bytes(v: &[KeyValue]) -> usize {
    v.iter()
        .map(|kv| 64 + kv.key.as_str().len() + kv.value.as_str().len())
        .sum()
}
