//! `nvml` lines and the NVML parts of the summaries. Metric keys are the OpenTelemetry
//! hardware names (`hw.gpu.*`, `hw.power`, `hw.temperature`, …) in OTel units (bytes, watts,
//! ratios 0–1) so the OTLP export can use them as they are; NVML values with no OTel name yet
//! are under `gpu.*`. A metric the GPU does not report is absent, never 0.
//!
//! Built as JSON values: these lines come ten times a second per device, not per CUDA call.

use std::io::{self, Write};

use serde_json::{Map, Value, json};

use super::JsonlWriter;
use crate::nvml::{
    Agg, DeviceSample, Line, ProcUse, ProcessSample, QUERY_NAMES,
    query::{Clocks, THROTTLE_REASONS},
};

/// Inserts `key: v` when there is a value.
fn put(m: &mut Map<String, Value>, key: &str, v: Option<impl Into<Value>>) {
    if let Some(v) = v {
        m.insert(key.to_string(), v.into());
    }
}

/// An object of the values present; `None` when none is.
fn group<'a>(items: impl IntoIterator<Item = (&'a str, Option<Value>)>) -> Option<Value> {
    let m: Map<String, Value> = items
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
        .collect();
    (!m.is_empty()).then_some(Value::Object(m))
}

fn ratio(percent: Option<u32>) -> Option<Value> {
    percent.map(|p| json!(f64::from(p) / 100.0))
}

fn clocks(c: &Clocks) -> Option<Value> {
    group([
        ("graphics", c.graphics.map(Value::from)),
        ("sm", c.sm.map(Value::from)),
        ("memory", c.memory.map(Value::from)),
    ])
}

pub fn throttle_names(bits: u64) -> Vec<&'static str> {
    THROTTLE_REASONS
        .iter()
        .filter(|(bit, _)| bits & bit != 0)
        .map(|(_, name)| *name)
        .collect()
}

fn head(kind: &str, ts_ns: u64, pid: Option<u32>, comm: Option<&str>) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("type".into(), "nvml".into());
    m.insert("scope".into(), kind.into());
    m.insert("ts_ns".into(), ts_ns.into());
    m.insert("pid".into(), pid.into());
    m.insert("tid".into(), Value::Null);
    m.insert("comm".into(), comm.into());
    m
}

fn device_line(s: &DeviceSample, uuid: Option<&str>, name: Option<&str>) -> Map<String, Value> {
    let mut m = head("device", s.ts_ns, None, None);
    m.insert("device".into(), s.device.into());
    put(&mut m, "uuid", uuid);
    put(&mut m, "name", name);
    put(
        &mut m,
        "hw.gpu.utilization",
        group([
            ("general", ratio(s.util_gpu)),
            ("encoder", ratio(s.util_encoder)),
            ("decoder", ratio(s.util_decoder)),
        ]),
    );
    put(&mut m, "gpu.memory_controller.utilization", ratio(s.util_memory));
    put(&mut m, "hw.gpu.memory.usage", s.memory_used);
    put(&mut m, "hw.gpu.memory.free", s.memory_free);
    put(&mut m, "hw.gpu.memory.reserved", s.memory_reserved);
    put(&mut m, "hw.gpu.memory.limit", s.memory_total);
    if let (Some(used), Some(total)) = (s.memory_used, s.memory_total)
        && total > 0
    {
        m.insert("hw.gpu.memory.utilization".into(), json!(used as f64 / total as f64));
    }
    put(&mut m, "hw.power", s.power_mw.map(|mw| f64::from(mw) / 1000.0));
    put(
        &mut m,
        "hw.gpu.power.limit",
        s.power_limit_mw.map(|mw| f64::from(mw) / 1000.0),
    );
    put(&mut m, "hw.temperature", s.temperature_c);
    put(&mut m, "hw.fan.speed_ratio", ratio(s.fan_percent));
    put(&mut m, "hw.gpu.clock", clocks(&s.clocks));
    put(
        &mut m,
        "hw.gpu.pcie.throughput",
        group([
            ("transmit", s.pcie_tx_bps.map(Value::from)),
            ("receive", s.pcie_rx_bps.map(Value::from)),
        ]),
    );
    put(
        &mut m,
        "hw.gpu.io",
        group([
            ("transmit", s.io_tx_bytes.map(Value::from)),
            ("receive", s.io_rx_bytes.map(Value::from)),
        ]),
    );
    put(
        &mut m,
        "hw.gpu.pcie.link",
        group([
            ("generation", s.link.generation.map(Value::from)),
            ("width", s.link.width.map(Value::from)),
        ]),
    );
    put(
        &mut m,
        "hw.gpu.throttle_reasons",
        s.throttle_reasons.map(throttle_names),
    );
    put(
        &mut m,
        "hw.errors",
        group([
            ("ecc_corrected", s.ecc_corrected.map(Value::from)),
            ("ecc_uncorrected", s.ecc_uncorrected.map(Value::from)),
            ("xid", s.xid_errors.map(Value::from)),
        ]),
    );
    put(&mut m, "xid_last", s.last_xid);
    m
}

fn process_line(p: &ProcessSample, uuid: Option<&str>, comm: Option<&str>) -> Map<String, Value> {
    let mut m = head("process", p.ts_ns, Some(p.pid), comm);
    m.insert("device".into(), p.device.into());
    put(&mut m, "uuid", uuid);
    put(&mut m, "hw.gpu.memory.usage", p.memory_bytes);
    put(
        &mut m,
        "hw.gpu.utilization",
        group([
            ("general", ratio(p.util_sm)),
            ("encoder", ratio(p.util_encoder)),
            ("decoder", ratio(p.util_decoder)),
        ]),
    );
    put(&mut m, "gpu.memory_controller.utilization", ratio(p.util_memory));
    m
}

fn agg(a: &Agg, scale: f64) -> Option<Value> {
    Some(json!({ "mean": a.mean()? * scale, "max": a.max()? * scale }))
}

/// Bytes stay integers.
fn agg_bytes(a: &Agg) -> Option<Value> {
    Some(json!({ "mean": a.mean()?.round() as u64, "max": a.max()? as u64 }))
}

impl<W: Write> JsonlWriter<W> {
    fn value_line(&mut self, m: Map<String, Value>) -> io::Result<()> {
        serde_json::to_writer(&mut self.out, &Value::Object(m)).map_err(io::Error::other)?;
        self.out.write_all(b"\n")
    }

    /// One `nvml` line: a device's description (once), a device sample, or a process sample.
    pub fn nvml(&mut self, line: &Line, comm: Option<&str>, hub_devices: &[crate::nvml::DeviceInfo]) -> io::Result<()> {
        let info = |d: u32| hub_devices.iter().find(|i| i.index == d);
        let m = match line {
            Line::Info(d, ts_ns) => {
                let mut m = head("info", *ts_ns, None, None);
                m.insert("device".into(), d.index.into());
                if let Value::Object(fields) = serde_json::to_value(d).map_err(io::Error::other)? {
                    m.extend(fields.into_iter().filter(|(k, _)| k != "index"));
                }
                m
            }
            Line::Device(s) => {
                let d = info(s.device);
                device_line(s, d.and_then(|d| d.uuid.as_deref()), d.map(|d| d.name.as_str()))
            }
            Line::Process(p) => process_line(p, info(p.device).and_then(|d| d.uuid.as_deref()), comm),
        };
        self.value_line(m)
    }

    /// `,"nvml":{…}` (or `null`) inside a process summary.
    pub(super) fn nvml_process(&mut self, u: Option<&ProcUse>) -> io::Result<()> {
        let v = match u {
            None => Value::Null,
            Some(u) => {
                let mut m = Map::new();
                m.insert("devices".into(), json!(u.devices));
                m.insert("memory_bytes".into(), u.memory_bytes.into());
                m.insert("memory_max_bytes".into(), u.memory_max_bytes.into());
                put(&mut m, "sm_utilization_mean", u.sm_util_mean().map(|p| p / 100.0));
                put(
                    &mut m,
                    "sm_utilization_max",
                    (u.sm_util_samples > 0).then(|| f64::from(u.sm_util_max) / 100.0),
                );
                Value::Object(m)
            }
        };
        self.out.write_all(b",\"nvml\":")?;
        serde_json::to_writer(&mut self.out, &v).map_err(io::Error::other)
    }

    /// A `summary` line per device (the whole run, not only the history window).
    pub(super) fn nvml_devices(&mut self, hub: &crate::nvml::View) -> io::Result<()> {
        for (d, t) in hub.devices.iter().zip(&hub.totals) {
            let mut m = Map::new();
            m.insert("type".into(), "summary".into());
            m.insert("scope".into(), "device".into());
            m.insert("pid".into(), Value::Null);
            m.insert("device".into(), d.index.into());
            put(&mut m, "uuid", d.uuid.as_deref());
            m.insert("name".into(), d.name.clone().into());
            m.insert("samples".into(), t.samples.into());
            put(&mut m, "hw.gpu.utilization", agg(&t.util_gpu, 0.01));
            put(&mut m, "gpu.memory_controller.utilization", agg(&t.util_memory, 0.01));
            put(&mut m, "hw.gpu.memory.usage", agg_bytes(&t.memory_used));
            put(&mut m, "hw.gpu.memory.limit", d.memory_total_bytes);
            put(&mut m, "hw.power", agg(&t.power_w, 1.0));
            put(&mut m, "hw.temperature", agg(&t.temperature_c, 1.0));
            put(&mut m, "hw.gpu.clock.sm", agg(&t.sm_clock_mhz, 1.0));
            m.insert("throttled_samples".into(), t.throttled_samples.into());
            self.value_line(m)?;
        }
        Ok(())
    }

    /// `,"nvml":{…}` in the total summary: state, and what the sampler cost (docs/DESIGN.md "Measured costs").
    pub(super) fn nvml_total(&mut self, hub: &crate::nvml::View) -> io::Result<()> {
        let c = &hub.cost;
        let mut queries = Map::new();
        for (name, s) in QUERY_NAMES.iter().zip(c.stats.iter()) {
            if s.count > 0 {
                queries.insert(
                    (*name).into(),
                    json!({
                        "count": s.count,
                        "errors": s.errors,
                        "mean": s.total_ns / s.count,
                        "max": s.max_ns,
                    }),
                );
            }
        }
        let v = json!({
            "state": hub.state.name(),
            "message": hub.message,
            "devices": hub.devices.len(),
            "interval_ms": hub.interval.as_millis() as u64,
            "samples": c.samples,
            "lines_dropped": hub.lines_dropped,
            "sampler_cpu_ns": c.cpu_ns,
            "sampler_wall_ns": c.wall_ns,
            "sampler_cpu_ratio": c.cpu_ratio(),
            "query_ns": queries,
        });
        self.out.write_all(b",\"nvml\":")?;
        serde_json::to_writer(&mut self.out, &v).map_err(io::Error::other)
    }
}
