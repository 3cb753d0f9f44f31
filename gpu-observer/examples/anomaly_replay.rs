//! Replays a `--trace-all --format jsonl` capture through the anomaly detector under another
//! mode, threshold or warm-up (docs/VALIDATION.md, "Anomalies"): the same calls and GPU records,
//! judged again, without the GPU. Prints what was checked and flagged, by kind of series and by
//! series, and with `--findings FILE` writes every finding as a JSON line.
//!
//! `cargo run --release --example anomaly_replay -- capture.jsonl --mode sigma`
//!
//! Only a capture of every event (`--trace-all`) replays exactly: without it, calls and kernels
//! under the 100 µs threshold are not in the file. Series are independent, so the order across
//! series (the agent's batches) does not matter; within one, lines are in the order written.

use std::{
    collections::{BTreeMap, HashMap},
    io::{BufRead, BufReader, Write},
    path::PathBuf,
    sync::Arc,
};

use anyhow::{Context, Result};
use clap::Parser;
use gpu_observer::{
    analyze::anomaly::{Config, Detector, Finding, Mode, What},
    decode::{Call, HostMemory, KernelName},
};
use gpu_observer_common::api::{self, Direction};
use serde_json::Value;

#[derive(Parser)]
struct Args {
    /// The capture (JSON lines, as `gpu-observer --trace-all --format jsonl` writes them).
    capture: PathBuf,
    #[arg(long, value_enum, default_value_t = Mode::Robust)]
    mode: Mode,
    /// Default: the mode's (as the agent's).
    #[arg(long)]
    threshold: Option<f64>,
    #[arg(long, default_value_t = Config::default().warmup)]
    warmup: u32,
    /// Write every finding here, one JSON object per line.
    #[arg(long)]
    findings: Option<PathBuf>,
    /// Series to list, most flagged first.
    #[arg(long, default_value_t = 12)]
    top: usize,
}

fn direction(name: Option<&str>) -> Direction {
    match name {
        Some("cpu_to_gpu") => Direction::CpuToGpu,
        Some("gpu_to_cpu") => Direction::GpuToCpu,
        Some("gpu_to_gpu") => Direction::GpuToGpu,
        Some("none") => Direction::None,
        _ => Direction::Unknown,
    }
}

/// CUPTI's memcpy kind from the name correlate/cupti_join.rs writes.
fn copy_kind(name: Option<&str>) -> u32 {
    let names = [
        "htod", "dtoh", "htoa", "atoh", "atoa", "atod", "dtoa", "dtod", "htoh", "ptop",
    ];
    name.and_then(|n| names.iter().position(|k| *k == n))
        .map_or(0, |i| i as u32 + 1)
}

fn shape(v: &Value) -> [i32; 3] {
    let mut out = [0; 3];
    for (o, x) in out.iter_mut().zip(v.as_array().into_iter().flatten()) {
        *o = x.as_i64().and_then(|x| i32::try_from(x).ok()).unwrap_or(0);
    }
    out
}

fn key(w: &What) -> String {
    match w {
        What::Kernel { name, grid, block } => {
            let n: String = name.demangled.chars().take(70).collect();
            format!("kernel {n} grid {grid:?} block {block:?}")
        }
        What::Call { api, size } => format!("call {api} size {size}"),
        What::Bandwidth {
            direction,
            size,
            on_gpu,
        } => {
            format!(
                "bandwidth {} size {size} {}",
                direction.name(),
                if *on_gpu { "gpu" } else { "call" }
            )
        }
    }
}

fn main() -> Result<()> {
    let a = Args::parse();
    let cfg = Config {
        mode: a.mode,
        threshold: a.threshold.unwrap_or(a.mode.default_threshold()),
        warmup: a.warmup,
    };
    let mut d = Detector::new(cfg);
    let file = std::fs::File::open(&a.capture).with_context(|| format!("{}", a.capture.display()))?;
    let mut out = match &a.findings {
        Some(p) => Some(std::io::BufWriter::new(std::fs::File::create(p)?)),
        None => None,
    };
    let mut names: HashMap<String, Arc<KernelName>> = HashMap::new();
    // kind of series → (checked, flagged); series → flagged.
    let mut by_kind: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
    let mut by_series: HashMap<String, u64> = HashMap::new();
    let mut bad = 0u64;
    for line in BufReader::new(file).lines() {
        let line = line?;
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            bad += 1;
            continue;
        };
        let (ty, pid) = (v["type"].as_str().unwrap_or(""), v["pid"].as_u64().unwrap_or(0) as u32);
        let ts = v["ts_ns"].as_u64().unwrap_or(0);
        let mut found = Vec::new();
        let before = d.counts().checked;
        let kind = match ty {
            "memcpy" | "memset" | "sync" | "host_func" => {
                let Some(spec) = v["api"].as_str().and_then(api::id_of).and_then(api::by_id) else {
                    continue;
                };
                let mut c = Call::returned(spec, v["duration_ns"].as_u64().unwrap_or(0));
                c.bytes = v["bytes"].as_u64();
                c.result = v["result"].as_u64().unwrap_or(0) as u32;
                c.direction = direction(v["direction"].as_str());
                c.host_memory = match v["host_memory"].as_str() {
                    Some("pageable") => Some(HostMemory::Pageable),
                    Some("pinned") => Some(HostMemory::Pinned),
                    _ => None,
                };
                d.call(pid, spec, &c, |f| found.push(f));
                "call"
            }
            "gpu_kernel" => {
                let Some(n) = v["kernel_mangled"].as_str().or(v["kernel"].as_str()) else {
                    continue;
                };
                let name = names
                    .entry(n.to_string())
                    .or_insert_with(|| Arc::new(KernelName::new(n)))
                    .clone();
                let dur = v["gpu_duration_ns"].as_u64().unwrap_or(0);
                found.extend(d.kernel(pid, &name, shape(&v["grid"]), shape(&v["block"]), dur));
                "kernel"
            }
            "gpu_memcpy" => {
                let (bytes, dur) = (
                    v["bytes"].as_u64().unwrap_or(0),
                    v["gpu_duration_ns"].as_u64().unwrap_or(0),
                );
                found.extend(d.gpu_copy(pid, copy_kind(v["copy_kind"].as_str()), bytes, dur));
                "gpu_copy"
            }
            "process_exit" => {
                d.forget(pid);
                continue;
            }
            _ => continue,
        };
        let e = by_kind.entry(kind).or_default();
        e.0 += d.counts().checked - before;
        e.1 += found.len() as u64;
        for f in &found {
            *by_series.entry(key(&f.what)).or_default() += 1;
            if let Some(o) = out.as_mut() {
                write_finding(o, ts, pid, f)?;
            }
        }
    }
    let c = d.counts();
    let rate = |f: u64, n: u64| if n == 0 { 0.0 } else { f as f64 * 100.0 / n as f64 };
    println!(
        "mode {} threshold {} warmup {}: checked {} flagged {} ({:.3} %), series {}, unreadable lines {bad}",
        cfg.mode.name(),
        cfg.threshold,
        cfg.warmup,
        c.checked,
        c.flagged,
        rate(c.flagged, c.checked),
        c.keys
    );
    for (k, (n, f)) in &by_kind {
        println!("  {k:9} checked {n:8} flagged {f:6} ({:.3} %)", rate(*f, *n));
    }
    let mut series: Vec<_> = by_series.into_iter().collect();
    series.sort_by(|x, y| y.1.cmp(&x.1).then_with(|| x.0.cmp(&y.0)));
    for (k, n) in series.into_iter().take(a.top) {
        println!("  {n:6}  {k}");
    }
    if let Some(mut o) = out {
        o.flush()?;
    }
    Ok(())
}

fn write_finding(o: &mut impl Write, ts: u64, pid: u32, f: &Finding) -> Result<()> {
    let line = serde_json::json!({
        "ts_ns": ts, "pid": pid, "series": key(&f.what), "observed": f.observed,
        "typical": f.typical, "unit": f.what.unit(), "deviation": f.deviation,
    });
    writeln!(o, "{line}")?;
    Ok(())
}
