//! The `--out` JSON and the console summary.

use serde_json::{Value, json};

use crate::driver::error_name;
use crate::ledger::Ledger;
use crate::ptx;
use crate::workload::{Config, Outcome};

fn hex(v: Option<usize>) -> Value {
    v.map_or(Value::Null, |h| Value::String(format!("{h:#x}")))
}

/// Everything the comparer needs: who, when, and what was called.
pub fn build(pid: u32, libcuda: &str, cfg: &Config, ledger: &Ledger, out: &Outcome) -> Value {
    let mut v = ledger.to_json(&ptx::KERNELS);
    let (hyp, detail) = out.hypotheses_json();
    let extra = json!({
        "workload": "cuda-ground-truth",
        "pid": pid,
        "libcuda": libcuda,
        "iters": cfg.iters,
        "elems": cfg.elems,
        "buffer_bytes": cfg.bytes(),
        "window_start_ns": out.window_start_ns,
        "window_end_ns": out.window_end_ns,
        "launch": {"grid": [cfg.grid(), 1, 1], "block": [ptx::BLOCK, 1, 1], "shared_mem_bytes": 0},
        "handles": {"module": hex(out.module_handle), "stream": hex(out.stream_handle)},
        "invalid_ptx_result": out.invalid_ptx_result,
        "invalid_ptx_error": out.invalid_ptx_result.map(error_name),
        "iterations_done": out.iterations_done,
        "hypotheses": hyp,
        "hypothesis_details": detail,
        "all_pass": out.all_pass(),
        "error": out.error,
    });
    if let (Some(obj), Value::Object(more)) = (v.as_object_mut(), extra) {
        obj.extend(more);
    }
    v
}

/// A few lines for a human.
pub fn summary(ledger: &Ledger, out: &Outcome) -> String {
    let mut s = String::new();
    let ms = out.window_end_ns.saturating_sub(out.window_start_ns) as f64 / 1e6;
    s.push_str(&format!(
        "cuda-ground-truth: window {ms:.1} ms, {} driver calls, {} iterations\n",
        ledger.total_calls(),
        out.iterations_done
    ));
    for (name, c) in [("H1", &out.h1), ("H2", &out.h2), ("H3", &out.h3), ("H9", &out.h9)] {
        s.push_str(&format!(
            "  {name} {}: {}\n",
            if c.pass { "PASS" } else { "FAIL" },
            c.detail
        ));
    }
    if let Some(e) = &out.error {
        s.push_str(&format!("  stopped: {e}\n"));
    }
    s.push_str(&format!(
        "cuda-ground-truth: {}",
        if out.all_pass() { "PASS" } else { "FAIL" }
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emu::Emu;
    use crate::gpu::Gpu;
    use crate::workload::{measured, setup};

    fn clock() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static T: AtomicU64 = AtomicU64::new(5_000);
        T.fetch_add(1, Ordering::Relaxed)
    }

    #[test]
    fn output_has_the_contract_fields() {
        let mut gpu = Gpu::new(Emu::default());
        let ctx = setup(&mut gpu, 0).unwrap();
        let cfg = Config { iters: 2, elems: 300 };
        let out = measured(&mut gpu, ctx, &cfg, clock);
        let v = build(42, "libcuda.so.1", &cfg, &gpu.ledger, &out);
        for k in [
            "pid",
            "window_start_ns",
            "window_end_ns",
            "calls",
            "bytes",
            "kernels",
            "kernel_names",
            "generic_copies",
            "leaks",
            "hypotheses",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert_eq!(v["pid"], 42);
        assert_eq!(v["calls"]["cuModuleLoadData"], 2);
        assert_eq!(v["calls"]["cuModuleGetFunction"], 3);
        assert_eq!(v["calls"]["cuLaunchKernel"], 6);
        assert_eq!(v["calls_before_window"]["cuInit"], 1);
        assert!(v["calls"].get("cuInit").is_none());
        assert_eq!(v["kernels"]["write_value"], 2);
        assert_eq!(v["leaks"], json!([{"api": "cuMemAlloc_v2", "count": 1, "bytes": 1200}]));
        assert_eq!(v["hypotheses"], json!({"H1": true, "H2": true, "H3": true, "H9": true}));
        assert_eq!(v["invalid_ptx_error"], "CUDA_ERROR_INVALID_PTX");
        assert_eq!(
            v["failed_calls"],
            json!([{"api": "cuModuleLoadData", "result": 218, "count": 1}])
        );
        assert_eq!(v["launch"]["grid"], json!([2, 1, 1]));
        assert!(v["handles"]["stream"].as_str().unwrap().starts_with("0x"));
        assert!(v["window_end_ns"].as_u64() > v["window_start_ns"].as_u64());
        assert!(summary(&gpu.ledger, &out).ends_with("PASS"));
    }
}
