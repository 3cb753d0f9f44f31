//! `--perfetto FILE`: a Perfetto trace (being written: see the plan in docs/DESIGN.md).

use std::path::Path;

use anyhow::Result;

use crate::{correlate::cupti_join::GpuActivity, decode::Event, export::Sink};

pub struct PerfettoSink {
    _file: std::fs::File,
    _max_bytes: u64,
}

impl PerfettoSink {
    pub fn create(path: &Path, max_bytes: u64) -> Result<Self> {
        Ok(Self {
            _file: crate::export::output::create("--perfetto", path)?,
            _max_bytes: max_bytes,
        })
    }
}

impl Sink for PerfettoSink {
    fn describe(&self) -> String {
        "the Perfetto trace".into()
    }

    fn event(&mut self, _ev: &Event) -> Result<()> {
        Ok(())
    }

    fn gpu(&mut self, _a: &GpuActivity) -> Result<()> {
        Ok(())
    }
}
