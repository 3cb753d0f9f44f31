//! Where each probed entry point lives in a libcuda file.
//!
//! Resolved once per file with `object` (aya would re-read the whole file for every symbol, and
//! real libcuda is ~100 MB with ~80 probed symbols).

use std::{collections::BTreeMap, fs::File, path::Path};

use anyhow::{Context, Result};
use gpu_observer_common::api;
use object::{Object, ObjectSection, ObjectSymbol};

/// Probed entry points found in a library: API id → file offset of the function.
#[derive(Debug, Default)]
pub struct LibrarySymbols {
    pub offsets: BTreeMap<u32, u64>,
    /// Entry points of [`api::REQUIRED`] that the file does not export.
    pub missing_required: Vec<&'static str>,
}

pub fn resolve(path: &Path) -> Result<LibrarySymbols> {
    let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
    // SAFETY: read-only private mapping; a library being replaced underneath is the same risk
    // the dynamic loader takes, and we only read symbol tables.
    let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("map {}", path.display()))?;
    let elf = object::File::parse(&*map).with_context(|| format!("{} is not an ELF file", path.display()))?;
    let mut out = LibrarySymbols::default();
    for sym in elf.dynamic_symbols().chain(elf.symbols()) {
        if !sym.is_definition() {
            continue;
        }
        let Ok(name) = sym.name() else { continue };
        let Some(id) = api::id_of(name) else { continue };
        if out.offsets.contains_key(&id) {
            continue;
        }
        let Some(index) = sym.section_index() else {
            continue;
        };
        let Ok(section) = elf.section_by_index(index) else {
            continue;
        };
        let Some((file_start, _)) = section.file_range() else {
            continue;
        };
        // uprobes take a file offset: the symbol's place in its section, from the section's start.
        let offset = sym.address() - section.address() + file_start;
        out.offsets.insert(id, offset);
    }
    out.missing_required = api::REQUIRED
        .iter()
        .copied()
        .filter(|name| api::id_of(name).is_none_or(|id| !out.offsets.contains_key(&id)))
        .collect();
    Ok(out)
}
