//! Where each probed entry point lives in a library file.
//!
//! Resolved once per file with `object` over bounded reads of the open file — never a memory
//! mapping: the file belongs to another user, who can truncate it at any moment, and a mapped
//! page past the new end faults the agent with SIGBUS (docs/SECURITY.md). A short read is a
//! bad file. Before the symbol tables are read, their sizes are checked against limits, and the
//! whole parse has a deadline.

use std::{
    cell::Cell,
    collections::BTreeMap,
    fs::File,
    os::unix::fs::FileExt,
    sync::{
        atomic::{AtomicUsize, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use gpu_observer_common::{api, cupti};
use object::{
    Endianness, Object, ObjectSection, ObjectSymbol,
    elf::{FileHeader64, SHT_DYNSYM, SHT_SYMTAB, SHT_SYMTAB_SHNDX},
    read::{
        ReadCache, ReadCacheOps,
        elf::{ElfFile64, FileHeader, SectionHeader},
    },
};

use super::{
    open::{Opened, Refused},
    stats::Reason,
};

/// Most symbols (dynamic + static) a library may have. Real libcuda exports a few thousand
/// dynamic symbols and ships stripped (no full symbol table); only libcuda and the injection
/// library are ever parsed. The bound keeps one parse to tens of milliseconds.
pub const MAX_SYMBOLS: u64 = 1 << 16;

/// Most bytes of symbol tables, section names and ELF headers read eagerly, and, as a second
/// bound, twice that for everything one parse reads (symbol names included).
pub const MAX_TABLE_BYTES: u64 = 32 << 20;

/// Most sections or program headers (what a header can claim without extended numbering).
const MAX_HEADERS: usize = 0xffff;

/// How long one library's parse (and opening it) may take: a few ms for real libcuda.
pub const PARSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Parses still running after their deadline (blocked in the kernel: a read from a file
/// system its user serves, say). Past this many, no new parse is started.
const MAX_STUCK: usize = 2;

static RUNNING: AtomicUsize = AtomicUsize::new(0);

/// Probed entry points found in a library: API id → file offset of the function.
#[derive(Debug, Default)]
pub struct LibrarySymbols {
    pub offsets: BTreeMap<u32, u64>,
    /// Entry points of [`api::REQUIRED`] that the file does not export.
    pub missing_required: Vec<&'static str>,
}

/// Reads of the open file through `pread`, never past the size it had when validated, at most
/// a byte budget, until a deadline. What stopped it is left in `fault`.
struct Bounded<'a> {
    file: &'a File,
    len: u64,
    pos: u64,
    budget: u64,
    deadline: Instant,
    fault: &'a Cell<Option<Reason>>,
}

impl ReadCacheOps for Bounded<'_> {
    fn len(&mut self) -> Result<u64, ()> {
        Ok(self.len)
    }

    fn seek(&mut self, pos: u64) -> Result<u64, ()> {
        self.pos = pos;
        Ok(pos)
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<usize, ()> {
        if Instant::now() > self.deadline {
            self.fault.set(Some(Reason::ParseTimeout));
            return Err(());
        }
        let want = (buf.len() as u64)
            .min(self.budget)
            .min(self.len.saturating_sub(self.pos)) as usize;
        if want == 0 {
            if self.budget == 0 && !buf.is_empty() {
                self.fault.set(Some(Reason::TablesTooLarge));
                return Err(());
            }
            return Ok(0);
        }
        let n = self.file.read_at(&mut buf[..want], self.pos).map_err(|_| ())?;
        self.pos += n as u64;
        self.budget -= n as u64;
        Ok(n)
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ()> {
        let mut done = 0;
        while done < buf.len() {
            match self.read(&mut buf[done..])? {
                // The file is shorter than it was: someone truncated it.
                0 => return Err(()),
                n => done += n,
            }
        }
        Ok(())
    }
}

/// Checks what `ElfFile::parse` will read eagerly (program and section headers, section names,
/// symbol tables) against the limits, reading only the ELF header and section headers.
fn precheck(data: &ReadCache<Bounded<'_>>, shown: &str) -> Result<(), Refused> {
    let bad = |what: &str| Refused::new(Reason::BadElf, format!("{shown}: {what}"));
    let header = FileHeader64::<Endianness>::parse(data).map_err(|_| bad("not a 64-bit ELF file"))?;
    let endian = header.endian().map_err(|_| bad("not a 64-bit ELF file"))?;
    let shnum = header.shnum(endian, data).map_err(|e| bad(&e.to_string()))?;
    let phnum = header.phnum(endian, data).map_err(|e| bad(&e.to_string()))?;
    if shnum > MAX_HEADERS || phnum > MAX_HEADERS {
        return Err(bad(&format!(
            "{shnum} sections, {phnum} program headers: more than {MAX_HEADERS}"
        )));
    }
    let headers = header.section_headers(endian, data).map_err(|e| bad(&e.to_string()))?;
    let shstrndx = if headers.is_empty() {
        None
    } else {
        Some(header.shstrndx(endian, data).map_err(|e| bad(&e.to_string()))? as usize)
    };
    let (mut symbols, mut bytes) = (0u64, (shnum as u64 + phnum as u64) * 64);
    for (i, sh) in headers.iter().enumerate() {
        let size = sh.sh_size(endian);
        match sh.sh_type(endian) {
            SHT_SYMTAB | SHT_DYNSYM => {
                symbols += size / size_of::<object::elf::Sym64<Endianness>>() as u64;
                bytes = bytes.saturating_add(size);
            }
            SHT_SYMTAB_SHNDX => bytes = bytes.saturating_add(size),
            _ if Some(i) == shstrndx => bytes = bytes.saturating_add(size),
            _ => {}
        }
    }
    if symbols > MAX_SYMBOLS {
        return Err(Refused::new(
            Reason::TooManySymbols,
            format!("{shown} has {symbols} symbols, more than the {MAX_SYMBOLS} a library may have"),
        ));
    }
    if bytes > MAX_TABLE_BYTES {
        return Err(Refused::new(
            Reason::TablesTooLarge,
            format!("{shown} has {bytes} bytes of symbol tables and headers, more than {MAX_TABLE_BYTES}"),
        ));
    }
    Ok(())
}

/// A parse of an open library with bounded reads (sizes checked first, a byte budget, a
/// deadline); `why` turns a failure into its refusal.
fn with_elf<T>(
    opened: &Opened,
    shown: &str,
    f: impl for<'d> FnOnce(
        &ElfFile64<'d, Endianness, &'d ReadCache<Bounded<'_>>>,
        &Cell<Option<Reason>>,
        Instant,
    ) -> Result<T, String>,
) -> Result<T, Refused> {
    let fault = Cell::new(None);
    let deadline = Instant::now() + PARSE_TIMEOUT;
    let cache = ReadCache::new(Bounded {
        file: &opened.file,
        len: opened.size,
        pos: 0,
        budget: 2 * MAX_TABLE_BYTES,
        deadline,
        fault: &fault,
    });
    // A failed read says why in `fault`; anything else is a malformed or truncated file.
    let why = |detail: String| match fault.get() {
        Some(Reason::ParseTimeout) => Refused::new(
            Reason::ParseTimeout,
            format!("{shown}: parsing took longer than {PARSE_TIMEOUT:?}"),
        ),
        Some(Reason::TablesTooLarge) => Refused::new(
            Reason::TablesTooLarge,
            format!("{shown}: parsing needs more than {} bytes", 2 * MAX_TABLE_BYTES),
        ),
        _ => Refused::new(Reason::BadElf, format!("{shown}: {detail} (truncated or malformed)")),
    };
    precheck(&cache, shown).map_err(|r| if fault.get().is_some() { why(r.detail) } else { r })?;
    let elf = ElfFile64::<Endianness, _>::parse(&cache).map_err(|e| why(e.to_string()))?;
    f(&elf, &fault, deadline).map_err(why)
}

/// Calls `f` on each defined symbol of a parsed library (name, file offset: the symbol's place
/// in its section, from the section's start in the file — what uprobes and uprobe reference
/// counters take), dynamic symbols first.
fn defined_in<'d>(
    elf: &ElfFile64<'d, Endianness, &'d ReadCache<Bounded<'_>>>,
    fault: &Cell<Option<Reason>>,
    deadline: Instant,
    mut f: impl FnMut(&str, u64),
) -> Result<(), String> {
    for (n, sym) in elf.dynamic_symbols().chain(elf.symbols()).enumerate() {
        if n % 4096 == 0 && Instant::now() > deadline {
            fault.set(Some(Reason::ParseTimeout));
            return Err(String::new());
        }
        if !sym.is_definition() {
            continue;
        }
        let Ok(name) = sym.name() else {
            if fault.get().is_some() {
                return Err(String::new());
            }
            continue;
        };
        let Some(index) = sym.section_index() else {
            continue;
        };
        let Ok(section) = elf.section_by_index(index) else {
            continue;
        };
        let Some((file_start, _)) = section.file_range() else {
            continue;
        };
        // A malformed symbol below its section's address is skipped, not wrapped.
        if let Some(in_section) = sym.address().checked_sub(section.address()) {
            f(name, in_section + file_start);
        }
    }
    Ok(())
}

/// Parses the open library with bounded reads and calls `f` on each defined symbol
/// ([`defined_in`]).
fn each_defined(opened: &Opened, shown: &str, f: impl FnMut(&str, u64)) -> Result<(), Refused> {
    with_elf(opened, shown, |elf, fault, deadline| {
        defined_in(elf, fault, deadline, f)
    })
}

/// What loading a library into a running process needs to know of a library file
/// (`attach::inject`): where some symbols are, which symbol versions it defines and needs,
/// and where its code is.
#[derive(Debug, Default)]
pub struct ElfFacts {
    /// File offsets of the wanted symbols that are defined (the first definition).
    pub symbols: BTreeMap<String, u64>,
    /// Version names it defines (a libc: `GLIBC_2.2.5` … `GLIBC_2.39`).
    pub defines: Vec<String>,
    /// (file, version) it needs (`libc.so.6`, `GLIBC_2.34`).
    pub needs: Vec<(String, String)>,
    /// File ranges of its executable `PT_LOAD` segments: [offset, offset + file size).
    pub code: Vec<(u64, u64)>,
}

/// Most version definitions or needs read from one file (glibc defines ~50).
const MAX_VERSIONS: usize = 4096;

pub fn elf_facts(opened: &Opened, shown: &str, wanted: &[&str]) -> Result<ElfFacts, Refused> {
    use object::{
        elf::{PF_X, PT_LOAD},
        read::elf::ProgramHeader,
    };
    with_elf(opened, shown, |elf, fault, deadline| {
        let mut out = ElfFacts::default();
        defined_in(elf, fault, deadline, |name, offset| {
            if wanted.contains(&name) && !out.symbols.contains_key(name) {
                out.symbols.insert(name.to_string(), offset);
            }
        })?;
        let endian = elf.endian();
        let data = elf.data();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let sections = elf.elf_section_table();
        if let Some((mut defs, link)) = sections.gnu_verdef(endian, data).map_err(|e| e.to_string())? {
            let strings = sections.strings(endian, data, link).map_err(|e| e.to_string())?;
            while let Some((_, mut aux)) = defs.next().map_err(|e| e.to_string())? {
                if let Some(a) = aux.next().map_err(|e| e.to_string())?
                    && out.defines.len() < MAX_VERSIONS
                {
                    out.defines
                        .push(text(a.name(endian, strings).map_err(|e| e.to_string())?));
                }
            }
        }
        if let Some((mut needs, link)) = sections.gnu_verneed(endian, data).map_err(|e| e.to_string())? {
            let strings = sections.strings(endian, data, link).map_err(|e| e.to_string())?;
            while let Some((need, mut aux)) = needs.next().map_err(|e| e.to_string())? {
                let file = text(need.file(endian, strings).map_err(|e| e.to_string())?);
                while let Some(a) = aux.next().map_err(|e| e.to_string())? {
                    if out.needs.len() < MAX_VERSIONS {
                        out.needs
                            .push((file.clone(), text(a.name(endian, strings).map_err(|e| e.to_string())?)));
                    }
                }
            }
        }
        for ph in elf.elf_program_headers() {
            if ph.p_type(endian) == PT_LOAD && ph.p_flags(endian) & PF_X != 0 {
                let start = ph.p_offset(endian);
                out.code.push((start, start.saturating_add(ph.p_filesz(endian))));
            }
        }
        Ok(out)
    })
}

/// The probed entry points of a libcuda file; refuses a file that lacks [`api::REQUIRED`].
pub fn resolve(opened: &Opened, shown: &str) -> Result<LibrarySymbols, Refused> {
    let mut out = LibrarySymbols::default();
    each_defined(opened, shown, |name, offset| {
        if let Some(id) = api::id_of(name) {
            out.offsets.entry(id).or_insert(offset);
        }
    })?;
    out.missing_required = api::REQUIRED
        .iter()
        .copied()
        .filter(|name| api::id_of(name).is_none_or(|id| !out.offsets.contains_key(&id)))
        .collect();
    if !out.missing_required.is_empty() {
        return Err(Refused::new(
            Reason::NotLibcuda,
            format!(
                "{shown} does not export {}: not a libcuda",
                out.missing_required.join(", ")
            ),
        ));
    }
    Ok(out)
}

/// File offsets of the CUPTI injection library's hooks and semaphore.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HookSymbols {
    pub batch: u64,
    pub name: u64,
    pub semaphore: u64,
}

pub fn resolve_hooks(opened: &Opened, shown: &str) -> Result<HookSymbols, Refused> {
    const NAMES: [&str; 3] = [cupti::BATCH_SYMBOL, cupti::NAME_SYMBOL, cupti::SEMAPHORE_SYMBOL];
    let mut found = [None; 3];
    each_defined(opened, shown, |n, offset| {
        if let Some(i) = NAMES.iter().position(|s| *s == n) {
            found[i].get_or_insert(offset);
        }
    })?;
    let get = |i: usize| {
        found[i].ok_or_else(|| {
            Refused::new(
                Reason::NotHookLibrary,
                format!(
                    "{shown} does not export {}: not a gpu-observer injection library",
                    NAMES[i]
                ),
            )
        })
    };
    Ok(HookSymbols {
        batch: get(0)?,
        name: get(1)?,
        semaphore: get(2)?,
    })
}

/// Runs `work` (opening and parsing a file) on a thread of its own and waits for it at most
/// [`PARSE_TIMEOUT`] and a second: a read the kernel never completes (a file system served by
/// the file's owner) then costs that thread, not the agent. The thread finishes or stays
/// blocked; past [`MAX_STUCK`] such threads, new work is refused at once.
pub fn time_boxed<T: Send + 'static>(
    shown: &str,
    work: impl FnOnce() -> Result<T, Refused> + Send + 'static,
) -> Result<T, Refused> {
    let timeout = |detail: String| Refused::new(Reason::ParseTimeout, detail);
    if RUNNING.load(Ordering::SeqCst) >= MAX_STUCK {
        return Err(timeout(format!(
            "{shown}: not read: {MAX_STUCK} earlier library reads are still blocked"
        )));
    }
    let (tx, rx) = mpsc::sync_channel(1);
    RUNNING.fetch_add(1, Ordering::SeqCst);
    let spawned = std::thread::Builder::new().name("library-parse".into()).spawn(move || {
        let r = work();
        RUNNING.fetch_sub(1, Ordering::SeqCst);
        let _ = tx.send(r);
    });
    if let Err(e) = spawned {
        RUNNING.fetch_sub(1, Ordering::SeqCst);
        return Err(timeout(format!("{shown}: cannot start a parse thread: {e}")));
    }
    let limit = PARSE_TIMEOUT + Duration::from_secs(1);
    rx.recv_timeout(limit).unwrap_or_else(|_| {
        Err(timeout(format!(
            "{shown}: opening and parsing took longer than {limit:?} (blocked in the kernel)"
        )))
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::attach::open::open_host;

    fn temp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("gpu-observer-symbols-{}-{name}", std::process::id()));
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    /// A minimal ELF64 header claiming `nsyms` symbols in a .symtab whose bytes are absent.
    fn elf_claiming(nsyms: u64) -> Vec<u8> {
        let mut f = vec![0u8; 64 + 3 * 64];
        f[..4].copy_from_slice(b"\x7fELF");
        f[4] = 2; // 64-bit
        f[5] = 1; // little endian
        f[6] = 1;
        f[16] = 3; // ET_DYN
        f[18] = 62; // x86-64
        f[20] = 1;
        f[40..48].copy_from_slice(&64u64.to_le_bytes()); // e_shoff
        f[52..54].copy_from_slice(&64u16.to_le_bytes()); // e_ehsize
        f[58..60].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
        f[60..62].copy_from_slice(&3u16.to_le_bytes()); // e_shnum
        f[62..64].copy_from_slice(&2u16.to_le_bytes()); // e_shstrndx
        let sh = |i: usize, ty: u32, size: u64, link: u32, f: &mut Vec<u8>| {
            let o = 64 + i * 64;
            f[o + 4..o + 8].copy_from_slice(&ty.to_le_bytes());
            f[o + 24..o + 32].copy_from_slice(&256u64.to_le_bytes()); // sh_offset
            f[o + 32..o + 40].copy_from_slice(&size.to_le_bytes());
            f[o + 40..o + 44].copy_from_slice(&link.to_le_bytes());
            f[o + 56..o + 64].copy_from_slice(&24u64.to_le_bytes());
        };
        sh(1, SHT_SYMTAB, nsyms * 24, 2, &mut f);
        sh(2, object::elf::SHT_STRTAB, 1, 0, &mut f);
        f.resize(257, 0);
        f
    }

    #[test]
    fn limits_and_bad_files_are_refused_with_their_reason() {
        let too_many = temp("many", &elf_claiming(MAX_SYMBOLS + 1));
        let r = resolve(&open_host(&too_many).unwrap(), "many").unwrap_err();
        assert_eq!(r.reason, Reason::TooManySymbols, "{r}");

        // Claims 10 symbols (240 bytes) that the file does not hold: a short read.
        let short = temp("short", &elf_claiming(10));
        let r = resolve(&open_host(&short).unwrap(), "short").unwrap_err();
        assert_eq!(r.reason, Reason::BadElf, "{r}");

        let text = temp("text", b"#!/bin/sh\n");
        let r = resolve(&open_host(&text).unwrap(), "text").unwrap_err();
        assert_eq!(
            (r.reason, r.detail.as_str()),
            (Reason::BadElf, "text: not a 64-bit ELF file")
        );

        // This test binary is an ELF without the CUDA entry points.
        let me = std::env::current_exe().unwrap();
        let r = resolve(&open_host(&me).unwrap(), "me").unwrap_err();
        assert_eq!(r.reason, Reason::NotLibcuda, "{r}");
        assert!(
            r.detail.contains("does not export cuLaunchKernel, cuMemcpyHtoD_v2"),
            "{r}"
        );
        let r = resolve_hooks(&open_host(&me).unwrap(), "me").unwrap_err();
        assert_eq!(r.reason, Reason::NotHookLibrary, "{r}");
        for p in [too_many, short, text] {
            std::fs::remove_file(p).unwrap();
        }
    }

    #[test]
    fn a_blocked_worker_times_out_and_later_ones_are_refused_at_once() {
        let start = Instant::now();
        let (release, wait) = mpsc::channel::<()>();
        let wait = std::sync::Mutex::new(wait);
        let r = time_boxed("slow", move || {
            let _ = wait.lock().unwrap().recv();
            Ok(())
        });
        assert_eq!(r.unwrap_err().reason, Reason::ParseTimeout);
        assert!(start.elapsed() >= PARSE_TIMEOUT);
        assert_eq!(time_boxed("fast", || Ok(7)).unwrap(), 7);
        drop(release);
    }
}
