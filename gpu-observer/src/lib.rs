//! gpu-observer: see what every CUDA process on this machine does with its GPUs, through eBPF
//! uprobes on libcuda and syscall tracepoints, with no change to the observed programs.
//!
//! Data flow, one module per stage (docs/DESIGN.md draws it):
//! `attach` (eBPF programs on libcuda, the ring buffer) → `pipeline` (the reader thread:
//! `decode` → `correlate` → the `export` sinks, and `snapshot`s for every view) ; `nvml`
//! samples the devices on a thread of its own; `observe` starts, ticks and stops a run.

pub mod analyze;
pub mod attach;
pub mod cli;
pub mod clock;
pub mod correlate;
pub mod decode;
pub mod export;
pub mod ioctl_names;
pub mod nvml;
pub mod observe;
pub mod pipeline;
pub mod preflight;
pub mod procinfo;
pub mod rules;
pub mod snapshot;
pub mod spawn;

/// A line on stderr. Messages name paths and processes that observed programs control: what
/// is left of their control characters is escaped here (export/text.rs).
pub fn say(msg: impl std::fmt::Display) {
    eprintln!("gpu-observer: {}", export::text::message(&msg.to_string()));
}
