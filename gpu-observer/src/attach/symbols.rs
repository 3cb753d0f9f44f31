//! Where each probed entry point lives in a libcuda file.
//!
//! Resolved once per file with `object` (aya would re-read the whole file for every symbol, and
//! real libcuda is ~100 MB with ~80 probed symbols).

use std::{collections::BTreeMap, fs::File, path::Path};

use anyhow::{Context, Result};
use gpu_observer_common::{api, cupti};
use object::{Object, ObjectSection, ObjectSymbol};

/// Probed entry points found in a library: API id → file offset of the function.
#[derive(Debug, Default)]
pub struct LibrarySymbols {
    pub offsets: BTreeMap<u32, u64>,
    /// Entry points of [`api::REQUIRED`] that the file does not export.
    pub missing_required: Vec<&'static str>,
}

/// Maps a library file and parses it as ELF.
fn with_elf<T>(path: &Path, f: impl FnOnce(&object::File) -> T) -> Result<T> {
    let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
    // SAFETY: read-only private mapping; a library being replaced underneath is the same risk
    // the dynamic loader takes, and we only read symbol tables.
    let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("map {}", path.display()))?;
    let elf = object::File::parse(&*map).with_context(|| format!("{} is not an ELF file", path.display()))?;
    Ok(f(&elf))
}

/// Defined symbols by name with their file offsets: what uprobes (and uprobe reference
/// counters) take — the symbol's place in its section, from the section's start in the file.
fn defined<'a>(elf: &'a object::File<'a>) -> impl Iterator<Item = (&'a str, u64)> + 'a {
    elf.dynamic_symbols().chain(elf.symbols()).filter_map(|sym| {
        if !sym.is_definition() {
            return None;
        }
        let name = sym.name().ok()?;
        let section = elf.section_by_index(sym.section_index()?).ok()?;
        let (file_start, _) = section.file_range()?;
        Some((name, sym.address() - section.address() + file_start))
    })
}

pub fn resolve(path: &Path) -> Result<LibrarySymbols> {
    with_elf(path, |elf| {
        let mut out = LibrarySymbols::default();
        for (name, offset) in defined(elf) {
            if let Some(id) = api::id_of(name) {
                out.offsets.entry(id).or_insert(offset);
            }
        }
        out.missing_required = api::REQUIRED
            .iter()
            .copied()
            .filter(|name| api::id_of(name).is_none_or(|id| !out.offsets.contains_key(&id)))
            .collect();
        out
    })
}

/// File offsets of the CUPTI injection library's hooks and semaphore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HookSymbols {
    pub batch: u64,
    pub name: u64,
    pub semaphore: u64,
}

pub fn resolve_hooks(path: &Path) -> Result<HookSymbols> {
    const NAMES: [&str; 3] = [cupti::BATCH_SYMBOL, cupti::NAME_SYMBOL, cupti::SEMAPHORE_SYMBOL];
    let found = with_elf(path, |elf| {
        let mut found = [None; 3];
        for (n, offset) in defined(elf) {
            if let Some(i) = NAMES.iter().position(|s| *s == n) {
                found[i].get_or_insert(offset);
            }
        }
        found
    })?;
    let get = |i: usize| {
        found[i].with_context(|| {
            format!(
                "{} does not export {}: not a gpu-observer injection library",
                path.display(),
                NAMES[i]
            )
        })
    };
    Ok(HookSymbols {
        batch: get(0)?,
        name: get(1)?,
        semaphore: get(2)?,
    })
}
