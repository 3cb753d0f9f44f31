//! The span attributes of GPU work (`gpu.*` for kernels, `gpu_transfer.*` for copies and memsets):
//! one list that every exporter writes as it is (JSON lines now, OTLP spans later).

use gpu_observer_common::cupti::GpuRecordKind;

use crate::correlate::cupti_join::{GpuActivity, copy_kind_name};

/// An attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
}

fn dims(d: [i32; 3]) -> Value {
    Value::Str(format!("[{},{},{}]", d[0], d[1], d[2]))
}

/// A kernel span's `gpu.*` attributes, a transfer span's `gpu_transfer.*` (memsets too, in the
/// transfer form: no memset attributes were ever defined).
pub fn span_attributes(a: &GpuActivity, threshold_us: u64, is_slow: bool) -> Vec<(&'static str, Value)> {
    let mut v = work_attributes(a, threshold_us, is_slow);
    if let Some(stack) = &a.nvtx {
        v.push(("gpu.nvtx", Value::Str(nvtx_path(stack))));
    }
    v
}

/// An NVTX stack as one string, outermost first (`step / forward / aten::mm`).
pub fn nvtx_path(stack: &[std::sync::Arc<str>]) -> String {
    stack.join(NVTX_SEPARATOR)
}

/// Between the ranges of a [`nvtx_path`].
pub const NVTX_SEPARATOR: &str = " / ";

fn work_attributes(a: &GpuActivity, threshold_us: u64, is_slow: bool) -> Vec<(&'static str, Value)> {
    let r = &a.rec;
    let duration_us = (a.duration_ns() / 1000) as i64;
    match a.kind() {
        Some(GpuRecordKind::Kernel) => {
            let mut v = vec![
                ("gpu.backend", Value::Str("cuda".into())),
                (
                    "gpu.kernel",
                    Value::Str(
                        a.kernel
                            .as_ref()
                            .map_or_else(|| "unknown".into(), |k| k.demangled.to_string()),
                    ),
                ),
                ("gpu.duration_us", Value::Int(duration_us)),
                ("gpu.cuda.device_id", Value::Int(i64::from(r.device))),
                ("gpu.cuda.context_id", Value::Int(i64::from(r.context))),
                ("gpu.cuda.stream_id", Value::Int(i64::from(r.stream))),
                ("gpu.cuda.grid_dim", dims(r.grid)),
                ("gpu.cuda.block_dim", dims(r.block)),
            ];
            if let Some(sm) = a.sm_count {
                v.push(("gpu.cuda.sm_count", Value::Int(i64::from(sm))));
            }
            if let Some(o) = a.occupancy {
                v.push(("gpu.cuda.occupancy", Value::Float(o)));
            }
            v.extend([
                (
                    "gpu.cuda.shared_mem_bytes",
                    Value::Int(i64::from(r.static_shared_mem) + i64::from(r.dynamic_shared_mem)),
                ),
                (
                    "gpu.cuda.registers_per_thread",
                    Value::Int(i64::from(r.registers_per_thread)),
                ),
                ("gpu.is_slow", Value::Bool(is_slow)),
                ("gpu.threshold_us", Value::Int(threshold_us as i64)),
            ]);
            v
        }
        _ => {
            let direction = match copy_kind_name(r.copy_kind) {
                _ if a.kind() == Some(GpuRecordKind::Memset) => "memset",
                "htod" => "cpu_to_gpu",
                "dtoh" => "gpu_to_cpu",
                "dtod" | "ptop" => "gpu_to_gpu",
                "htoh" => "cpu_to_cpu",
                _ => "unknown",
            };
            vec![
                ("gpu_transfer.direction", Value::Str(direction.into())),
                ("gpu_transfer.bytes", Value::Int(r.bytes as i64)),
                ("gpu_transfer.duration_us", Value::Int(duration_us)),
                (
                    "gpu_transfer.bandwidth_mbps",
                    Value::Float(crate::rules::bandwidth_mbps(r.bytes, a.duration_ns())),
                ),
                ("gpu_transfer.is_slow", Value::Bool(is_slow)),
                ("gpu_transfer.threshold_us", Value::Int(threshold_us as i64)),
            ]
        }
    }
}
