//! `gpu-observer devices`: what NVML sees, as a table or JSON. No eBPF, no root.

use std::{fmt::Write as _, io::Write};

use anyhow::{Context, Result, anyhow};

use crate::{
    cli::{Cli, Format},
    nvml::{DeviceInfo, query},
};

pub fn print(cli: &Cli) -> Result<()> {
    let lib = query::open(cli.nvml_lib.as_deref()).map_err(|why| anyhow!("NVML unavailable: {why}"))?;
    let devices = lib.discover().map_err(|why| anyhow!("{why}"))?;
    let text = match cli.format.unwrap_or(Format::Terminal) {
        Format::Json | Format::Jsonl => serde_json::to_string_pretty(&devices)? + "\n",
        Format::Dashboard | Format::Terminal | Format::None => table(&devices),
    };
    let mut out: Box<dyn Write> = match &cli.output {
        Some(p) => {
            Box::new(std::fs::File::create(p).with_context(|| format!("cannot create --output {}", p.display()))?)
        }
        None => Box::new(std::io::stdout()),
    };
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

fn table(devices: &[DeviceInfo]) -> String {
    let mut out = String::new();
    if let Some(d) = devices.first() {
        let _ = writeln!(
            out,
            "driver {}, CUDA {}",
            d.driver_version.as_deref().unwrap_or("?"),
            d.cuda_driver_version.as_deref().unwrap_or("?")
        );
    }
    let _ = writeln!(
        out,
        "{:>3} {:<26} {:<41} {:>10} {:>4} {:<16} {:>4} {:>15} {:>8} {:>9}",
        "IDX", "NAME", "UUID", "MEMORY", "CC", "PCI BUS", "SMS", "MAX SM/MEM MHz", "POWER W", "PCIE MAX"
    );
    for d in devices {
        let _ = writeln!(
            out,
            "{:>3} {:<26} {:<41} {:>10} {:>4} {:<16} {:>4} {:>15} {:>8} {:>9}",
            d.index,
            d.name,
            d.uuid.as_deref().unwrap_or("-"),
            d.memory_total_bytes
                .map_or_else(|| "-".into(), |b| format!("{} MiB", b >> 20)),
            d.compute_capability.as_deref().unwrap_or("-"),
            d.pci_bus_id.as_deref().unwrap_or("-"),
            opt(d.sm_count),
            format!("{}/{}", opt(d.max_clocks_mhz.sm), opt(d.max_clocks_mhz.memory)),
            opt(d.power_limit_watts),
            format!("gen{} x{}", opt(d.pcie_max_link.generation), opt(d.pcie_max_link.width)),
        );
    }
    if devices.is_empty() {
        out.push_str("(NVML sees no GPU)\n");
    }
    out
}
