//! Export: where events and summaries go. Sinks take the event stream (JSON lines, OTLP
//! spans); views read snapshots (the terminal, OTLP metrics, the summaries).

pub mod attributes;
pub mod dashboard;
pub mod devices;
pub mod flamegraph;
pub mod jsonl;
pub mod otlp;
pub mod perfetto;

pub mod output;
pub mod terminal;
pub mod text;

mod sink;
pub use sink::{AnomalyLine, Flagged, GpuTimingEvent, GpuTimingNote, LeakReport, Sink, Summary};
