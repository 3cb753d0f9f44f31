//! The shipped CUPTI injection library (the portable build: cargo-zigbuild against glibc 2.17,
//! `cargo xtask portable-cupti`) keeps what the observer relies on: it loads with glibc ≥ 2.17,
//! exports the entry points and the hooks, the semaphore is alone in a page of its own `.probes`
//! section (a file offset the kernel can count in, outside RELRO), and each hook starts with the
//! 5-byte nop the kernel emulates.
//!
//! `cargo xtask test` builds it and sets `GPU_OBSERVER_TEST_PORTABLE_CUPTI` to its absolute path.

use std::{
    ffi::CString,
    path::{Path, PathBuf},
};

use object::{
    Endianness, Object, ObjectSection, ObjectSymbol, SectionIndex, elf,
    read::elf::{Dyn as _, ElfFile64, FileHeader as _, ProgramHeader as _, SectionHeader as _},
};

const ENV: &str = "GPU_OBSERVER_TEST_PORTABLE_CUPTI";

/// The newest glibc symbol version it may need.
const GLIBC_FLOOR: [u32; 2] = [2, 17];

const EXPORTS: [&str; 5] = [
    "gpu_observer_cupti_semaphore",
    "gpu_observer_cupti_batch",
    "gpu_observer_cupti_name",
    "InitializeInjection",
    "InitializeInjectionNvtx2",
];

const HOOKS: [&str; 2] = ["gpu_observer_cupti_batch", "gpu_observer_cupti_name"];

/// `nopl 0x0(%rax,%rax,1)`: the kernel emulates it instead of single-stepping.
const NOP5: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];

/// Libraries every glibc system has (glibc's own, and GCC's unwinder).
const SYSTEM_LIBS: [&str; 7] = [
    "libc.so.6",
    "ld-linux-x86-64.so.2",
    "libpthread.so.0",
    "libdl.so.2",
    "libm.so.6",
    "librt.so.1",
    "libgcc_s.so.1",
];

fn library() -> PathBuf {
    let path = match std::env::var_os(ENV) {
        Some(p) => PathBuf::from(p),
        None => {
            // Under `cargo xtask test` (it sets GPU_OBSERVER_BIN) the variable must be there.
            assert!(
                std::env::var_os("GPU_OBSERVER_BIN").is_none(),
                "{ENV} is not set: `cargo xtask test` sets it to the portable CUPTI library it builds"
            );
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/portable/debug/libgpu_observer_cupti.so")
        }
    };
    assert!(
        path.is_file(),
        "{} not built: run `cargo xtask test` (or `cargo xtask portable-cupti`); {ENV} names it",
        path.display()
    );
    path
}

fn read() -> (PathBuf, Vec<u8>) {
    let path = library();
    let data = std::fs::read(&path).unwrap();
    (path, data)
}

fn parse(data: &[u8]) -> ElfFile64<'_, Endianness> {
    ElfFile64::parse(data).expect("a 64-bit ELF file")
}

#[test]
fn needs_glibc_2_17_at_most_and_only_system_libraries() {
    let (path, data) = read();
    let file = parse(&data);
    let endian = file.endian();
    let sections = file.elf_header().sections(endian, data.as_slice()).unwrap();

    let (mut needs, link) = sections
        .gnu_verneed(endian, data.as_slice())
        .unwrap()
        .expect(".gnu.version_r");
    let strings = sections.strings(endian, data.as_slice(), link).unwrap();
    let mut glibc = Vec::new();
    while let Some((need, mut aux)) = needs.next().unwrap() {
        let lib = String::from_utf8_lossy(need.file(endian, strings).unwrap()).into_owned();
        while let Some(a) = aux.next().unwrap() {
            let name = String::from_utf8_lossy(a.name(endian, strings).unwrap()).into_owned();
            if let Some(number) = name.strip_prefix("GLIBC_") {
                let v: Vec<u32> = number
                    .split('.')
                    .map(|n| {
                        n.parse()
                            .unwrap_or_else(|_| panic!("{lib}: {name} is not a numbered glibc version"))
                    })
                    .collect();
                glibc.push((v, format!("{lib}: {name}")));
            }
        }
    }
    glibc.sort();
    let (max, which) = glibc.last().expect("some GLIBC_ version needed");
    assert!(
        max.as_slice() <= GLIBC_FLOOR.as_slice(),
        "{} needs {which}, newer than glibc 2.17; all: {glibc:?}",
        path.display()
    );

    let (dynamic, link) = sections.dynamic(endian, data.as_slice()).unwrap().expect(".dynamic");
    let strings = sections.strings(endian, data.as_slice(), link).unwrap();
    let needed: Vec<String> = dynamic
        .iter()
        .filter(|d| d.tag32(endian) == Some(elf::DT_NEEDED))
        .map(|d| String::from_utf8_lossy(d.string(endian, strings).unwrap()).into_owned())
        .collect();
    assert!(needed.iter().any(|n| n == "libc.so.6"), "{needed:?}");
    for n in &needed {
        assert!(
            SYSTEM_LIBS.contains(&n.as_str()),
            "NEEDED {n} is not a glibc system library: {needed:?}"
        );
    }
}

#[test]
fn exports_the_entry_points_and_the_hooks() {
    let (path, data) = read();
    let file = parse(&data);
    for name in EXPORTS {
        let sym = file
            .dynamic_symbols()
            .find(|s| s.name() == Ok(name))
            .unwrap_or_else(|| panic!("{} does not export {name}", path.display()));
        assert!(sym.is_definition() && sym.is_global(), "{name}: {sym:?}");
    }
}

#[test]
fn the_semaphore_is_alone_in_a_writable_page_of_probes_outside_relro() {
    let (_, data) = read();
    let file = parse(&data);
    let endian = file.endian();
    let sym = file
        .dynamic_symbols()
        .find(|s| s.name() == Ok("gpu_observer_cupti_semaphore"))
        .expect("the semaphore is exported");
    let section = file
        .section_by_index(sym.section_index().expect("the semaphore is in a section"))
        .unwrap();
    assert_eq!(section.name(), Ok(".probes"));
    let header = section.elf_section_header();
    assert_eq!(
        header.sh_type(endian),
        elf::SHT_PROGBITS,
        "data with a file offset, not NOBITS"
    );
    let flags = header.sh_flags(endian);
    assert_eq!(
        flags & u64::from(elf::SHF_ALLOC | elf::SHF_WRITE),
        u64::from(elf::SHF_ALLOC | elf::SHF_WRITE),
        "writable data: {flags:#x}"
    );
    let (offset, size) = section.file_range().expect(".probes has file contents");
    assert_eq!(offset % 4096, 0, ".probes file offset {offset:#x}");
    assert_eq!(section.address() % 4096, 0, ".probes address {:#x}", section.address());
    let sym_offset = offset + (sym.address() - section.address());
    assert_eq!(sym_offset % 4096, 0, "semaphore file offset {sym_offset:#x}");
    assert!(
        size >= 4096 && sym.size() >= 4096,
        "a whole page: {size} {}",
        sym.size()
    );

    // The kernel counts in the first writable mapping of the semaphore's file page; while the
    // loader relocates, RELRO is writable: the page must not be RELRO's.
    let page = sym_offset / 4096;
    for ph in file.elf_program_headers() {
        if ph.p_type(endian) == elf::PT_GNU_RELRO && ph.p_filesz(endian) > 0 {
            let first = ph.p_offset(endian) / 4096;
            let last = (ph.p_offset(endian) + ph.p_filesz(endian) - 1) / 4096;
            assert!(
                !(first..=last).contains(&page),
                "semaphore page {page:#x} is in RELRO's pages {first:#x}..={last:#x}"
            );
        }
    }
}

#[test]
fn each_hook_starts_with_a_5_byte_nop() {
    let (_, data) = read();
    let file = parse(&data);
    for name in HOOKS {
        let sym = file
            .dynamic_symbols()
            .find(|s| s.name() == Ok(name))
            .unwrap_or_else(|| panic!("{name} exported"));
        let index: SectionIndex = sym.section_index().expect("in a section");
        let section = file.section_by_index(index).unwrap();
        assert_eq!(section.name(), Ok(".text"), "{name}");
        let code = section.data_range(sym.address(), 5).unwrap().expect("5 bytes of code");
        assert_eq!(code, NOP5, "{name} starts with {code:02x?}");
    }
}

#[test]
fn loads_here_with_every_symbol_bound() {
    let path = CString::new(library().into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: a valid C string; the library has no constructors of its own (Rust std's only
    // record argv) and stays loaded (RTLD_NODELETE): its statics outlive any thread it starts.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE) };
    if handle.is_null() {
        // SAFETY: dlerror returns a valid C string after a failed dlopen.
        let err = unsafe { std::ffi::CStr::from_ptr(libc::dlerror()) };
        panic!("dlopen {path:?}: {err:?}");
    }
    for name in EXPORTS {
        let c = CString::new(name).unwrap();
        // SAFETY: a handle from dlopen and a valid C string.
        let sym = unsafe { libc::dlsym(handle, c.as_ptr()) };
        assert!(!sym.is_null(), "dlsym {name}");
    }
    // SAFETY: the handle from dlopen, closed once.
    unsafe { libc::dlclose(handle) };
}
