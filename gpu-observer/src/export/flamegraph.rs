//! `--flamegraph FILE`: kernel flamegraph stacks (being written).

use std::path::Path;

use anyhow::Result;

use crate::{correlate::cupti_join::GpuActivity, decode::Event, export::Sink};

pub struct FlamegraphSink {
    _file: std::fs::File,
}

impl FlamegraphSink {
    pub fn create(path: &Path) -> Result<Self> {
        Ok(Self {
            _file: crate::export::output::create("--flamegraph", path)?,
        })
    }
}

impl Sink for FlamegraphSink {
    fn describe(&self) -> String {
        "the flamegraph".into()
    }

    fn event(&mut self, _ev: &Event) -> Result<()> {
        Ok(())
    }

    fn gpu(&mut self, _a: &GpuActivity) -> Result<()> {
        Ok(())
    }
}
