//! What the workload did, call by call: the ground truth written to `--out`.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// Direction of a copy, named as the observer names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Dir {
    CpuToGpu,
    GpuToCpu,
    GpuToGpu,
}

impl Dir {
    pub fn name(self) -> &'static str {
        match self {
            Dir::CpuToGpu => "cpu_to_gpu",
            Dir::GpuToCpu => "gpu_to_cpu",
            Dir::GpuToGpu => "gpu_to_gpu",
        }
    }
}

/// The host end of a copy, named as the observer names it (`host_memory`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum HostMem {
    Pinned,
    Pageable,
}

impl HostMem {
    pub fn name(self) -> &'static str {
        match self {
            HostMem::Pinned => "pinned",
            HostMem::Pageable => "pageable",
        }
    }
}

/// One kind of copy: API, direction, host memory, bytes per copy.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct CopyKey {
    api: &'static str,
    dir: Dir,
    host: Option<HostMem>,
    bytes: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Live {
    api: &'static str,
    bytes: u64,
}

/// A leak as the observer reports it: unfreed allocations of one API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leak {
    pub api: &'static str,
    pub count: u64,
    pub bytes: u64,
}

/// Counts of every driver call, split at the window start: before it (set-up) and inside it.
#[derive(Debug, Default)]
pub struct Ledger {
    in_window: bool,
    before: BTreeMap<&'static str, u64>,
    calls: BTreeMap<&'static str, u64>,
    bytes: BTreeMap<&'static str, u64>,
    kernels: BTreeMap<&'static str, u64>,
    copies: BTreeMap<CopyKey, u64>,
    failed: BTreeMap<(&'static str, i32), u64>,
    live: BTreeMap<u64, Live>,
}

/// Generic copy APIs: their direction is not in their name.
pub fn is_generic_copy(api: &str) -> bool {
    api.starts_with("cuMemcpy") && !["HtoD", "DtoH", "DtoD"].iter().any(|d| api.contains(d))
}

impl Ledger {
    pub fn new() -> Self {
        Self::default()
    }

    /// From now on calls count as inside the measured window.
    pub fn open_window(&mut self) {
        self.in_window = true;
    }

    /// One call of `api` (failed calls count too: the observer sees them).
    pub fn call(&mut self, api: &'static str) {
        let map = if self.in_window {
            &mut self.calls
        } else {
            &mut self.before
        };
        *map.entry(api).or_default() += 1;
    }

    /// A call that returned this CUresult (not CUDA_SUCCESS).
    pub fn failed(&mut self, api: &'static str, code: i32) {
        if self.in_window {
            *self.failed.entry((api, code)).or_default() += 1;
        }
    }

    /// Bytes a call moves, sets, allocates or frees.
    pub fn add_bytes(&mut self, api: &'static str, bytes: u64) {
        if self.in_window {
            *self.bytes.entry(api).or_default() += bytes;
        }
    }

    pub fn launch(&mut self, kernel: &'static str) {
        if self.in_window {
            *self.kernels.entry(kernel).or_default() += 1;
        }
    }

    pub fn copy(&mut self, api: &'static str, dir: Dir, host: Option<HostMem>, bytes: u64) {
        self.add_bytes(api, bytes);
        if self.in_window {
            *self.copies.entry(CopyKey { api, dir, host, bytes }).or_default() += 1;
        }
    }

    /// A successful allocation at `addr`.
    pub fn alloc(&mut self, api: &'static str, addr: u64, bytes: u64) {
        self.add_bytes(api, bytes);
        self.live.insert(addr, Live { api, bytes });
    }

    /// A free of `addr`; its bytes (those of the matching allocation) count for `api`.
    pub fn free(&mut self, api: &'static str, addr: u64) {
        if let Some(l) = self.live.remove(&addr) {
            self.add_bytes(api, l.bytes);
        }
    }

    pub fn calls(&self, api: &str) -> u64 {
        self.calls.get(api).copied().unwrap_or(0)
    }

    pub fn calls_before(&self, api: &str) -> u64 {
        self.before.get(api).copied().unwrap_or(0)
    }

    pub fn bytes(&self, api: &str) -> u64 {
        self.bytes.get(api).copied().unwrap_or(0)
    }

    pub fn kernel_launches(&self, kernel: &str) -> u64 {
        self.kernels.get(kernel).copied().unwrap_or(0)
    }

    pub fn total_calls(&self) -> u64 {
        self.calls.values().sum()
    }

    /// Allocations not freed, per API.
    pub fn leaks(&self) -> Vec<Leak> {
        let mut by: BTreeMap<&'static str, Leak> = BTreeMap::new();
        for l in self.live.values() {
            let e = by.entry(l.api).or_insert(Leak {
                api: l.api,
                count: 0,
                bytes: 0,
            });
            e.count += 1;
            e.bytes += l.bytes;
        }
        by.into_values().collect()
    }

    fn copies_json(&self, generic_only: bool) -> Value {
        let rows: Vec<Value> = self
            .copies
            .iter()
            .filter(|(k, _)| !generic_only || is_generic_copy(k.api))
            .map(|(k, n)| {
                json!({
                    "api": k.api,
                    "direction": k.dir.name(),
                    "host_memory": k.host.map(HostMem::name),
                    "bytes_per_copy": k.bytes,
                    "count": n,
                    "bytes": k.bytes * n,
                })
            })
            .collect();
        Value::Array(rows)
    }

    /// The accounting part of the output JSON (`calls`, `bytes`, `kernels`, copies, leaks).
    /// `names` maps a kernel's entry name to its demangled name.
    pub fn to_json(&self, names: &[(&str, &str)]) -> Value {
        let kernel_names: BTreeMap<&str, &str> = names
            .iter()
            .filter(|(entry, _)| self.kernels.contains_key(entry))
            .copied()
            .collect();
        json!({
            "calls": self.calls,
            "bytes": self.bytes,
            "calls_before_window": self.before,
            "kernels": self.kernels,
            "kernel_names": kernel_names,
            "copies": self.copies_json(false),
            "generic_copies": self.copies_json(true),
            "failed_calls": self.failed.iter().map(|((api, code), n)| json!({
                "api": api, "result": code, "count": n,
            })).collect::<Vec<_>>(),
            "leaks": self.leaks().iter().map(|l| json!({
                "api": l.api, "count": l.count, "bytes": l.bytes,
            })).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_before_the_window_are_kept_apart() {
        let mut l = Ledger::new();
        l.call("cuInit");
        l.add_bytes("cuInit", 5);
        l.open_window();
        l.call("cuMemAlloc_v2");
        l.call("cuMemAlloc_v2");
        assert_eq!(l.calls_before("cuInit"), 1);
        assert_eq!(l.calls("cuInit"), 0);
        assert_eq!(l.calls("cuMemAlloc_v2"), 2);
        assert_eq!(l.bytes("cuInit"), 0);
        assert_eq!(l.total_calls(), 2);
    }

    #[test]
    fn frees_count_the_bytes_of_their_allocation_and_leaks_remain() {
        let mut l = Ledger::new();
        l.open_window();
        l.alloc("cuMemAlloc_v2", 0x1000, 64);
        l.alloc("cuMemAlloc_v2", 0x2000, 32);
        l.alloc("cuMemAllocHost_v2", 0x9000, 16);
        l.free("cuMemFree_v2", 0x1000);
        l.free("cuMemFreeHost", 0x9000);
        l.free("cuMemFree_v2", 0xdead); // unknown: no bytes
        assert_eq!(l.bytes("cuMemAlloc_v2"), 96);
        assert_eq!(l.bytes("cuMemFree_v2"), 64);
        assert_eq!(l.bytes("cuMemFreeHost"), 16);
        assert_eq!(
            l.leaks(),
            vec![Leak {
                api: "cuMemAlloc_v2",
                count: 1,
                bytes: 32
            }]
        );
    }

    #[test]
    fn generic_copy_apis() {
        for a in [
            "cuMemcpy",
            "cuMemcpyAsync",
            "cuMemcpy_ptds",
            "cuMemcpyPeer",
            "cuMemcpyPeerAsync_ptsz",
        ] {
            assert!(is_generic_copy(a), "{a}");
        }
        for a in [
            "cuMemcpyHtoD_v2",
            "cuMemcpyDtoHAsync_v2",
            "cuMemcpyDtoD_v2",
            "cuMemsetD32_v2",
        ] {
            assert!(!is_generic_copy(a), "{a}");
        }
    }

    #[test]
    fn json_groups_copies_and_names_kernels() {
        let mut l = Ledger::new();
        l.call("cuInit");
        l.open_window();
        for _ in 0..3 {
            l.call("cuMemcpy");
            l.copy("cuMemcpy", Dir::GpuToGpu, None, 8);
            l.call("cuMemcpy");
            l.copy("cuMemcpy", Dir::CpuToGpu, Some(HostMem::Pinned), 8);
            l.call("cuMemcpyHtoD_v2");
            l.copy("cuMemcpyHtoD_v2", Dir::CpuToGpu, Some(HostMem::Pageable), 4);
            l.call("cuLaunchKernel");
            l.launch("_Z9scale_vecPffj");
        }
        let v = l.to_json(&[
            ("_Z9scale_vecPffj", "scale_vec(float*, float, unsigned int)"),
            ("unused", "unused"),
        ]);
        assert_eq!(v["calls"]["cuMemcpy"], 6);
        assert_eq!(v["calls"]["cuLaunchKernel"], 3);
        assert_eq!(v["calls_before_window"]["cuInit"], 1);
        assert_eq!(v["bytes"]["cuMemcpy"], 48);
        assert_eq!(v["bytes"]["cuMemcpyHtoD_v2"], 12);
        assert_eq!(v["kernels"]["_Z9scale_vecPffj"], 3);
        assert_eq!(
            v["kernel_names"]["_Z9scale_vecPffj"],
            "scale_vec(float*, float, unsigned int)"
        );
        assert!(v["kernel_names"].get("unused").is_none());
        let g = v["generic_copies"].as_array().unwrap();
        assert_eq!(g.len(), 2);
        let d2d = g.iter().find(|r| r["direction"] == "gpu_to_gpu").unwrap();
        assert_eq!((d2d["count"].as_u64(), d2d["bytes"].as_u64()), (Some(3), Some(24)));
        assert!(d2d["host_memory"].is_null());
        let h2d = g.iter().find(|r| r["direction"] == "cpu_to_gpu").unwrap();
        assert_eq!(h2d["host_memory"], "pinned");
        assert_eq!(v["copies"].as_array().unwrap().len(), 3);
        assert_eq!(v["leaks"].as_array().unwrap().len(), 0);
    }
}
