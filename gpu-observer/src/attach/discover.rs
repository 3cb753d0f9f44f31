//! Finding libcuda (and gpu-observer's CUPTI injection library) in running processes through
//! `/proc/<pid>/maps`.
//!
//! A scan only reads maps: each mapping is named by the device and inode its maps line gives,
//! and the file is opened (inside the process's root, see [`super::open`]) only the first time
//! a mapping is seen. Files are told apart by the (device, inode) of the opened descriptor, so
//! the copy bind-mounted into many containers by the NVIDIA toolkit is attached once.

use std::{fs, path::PathBuf};

/// Which library a mapping is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LibKind {
    Cuda,
    /// `libgpu_observer_cupti.so`, loaded through `CUDA_INJECTION64_PATH`: its hooks are probed.
    Hooks,
}

/// A libcuda (or injection library) file mapped by a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappedLibrary {
    pub kind: LibKind,
    pub pid: u32,
    /// The path as the process sees it (from its maps); opened inside its root
    /// ([`super::open::open_mapped`]).
    pub path: String,
    /// The mapping's identity as its maps line gives it.
    pub mapping: MappingId,
    /// A library with no path (the memfd `--gpu-timing` loads from): the address range of
    /// one of its mappings, opened through `/proc/<pid>/map_files`.
    pub range: Option<(u64, u64)>,
}

/// A mapped file as `/proc/<pid>/maps` names it: device (major:minor, as written there) and
/// inode. Read without touching the file, so a scan never blocks on it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MappingId {
    pub dev: String,
    pub ino: u64,
}

/// Identity of a file across mount namespaces: `fstat` of the descriptor the agent opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileKey {
    pub dev: u64,
    pub ino: u64,
}

/// Whether a file name is a libcuda (`libcuda.so`, `libcuda.so.1`, `libcuda.so.580.95.05`).
pub fn is_libcuda(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name == "libcuda.so" || name.starts_with("libcuda.so.")
}

/// Whether a file name is gpu-observer's CUPTI injection library.
pub fn is_hook_library(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name == gpu_observer_common::cupti::LIBRARY_FILE
}

fn kind_of(path: &str) -> Option<LibKind> {
    if is_libcuda(path) {
        Some(LibKind::Cuda)
    } else if is_hook_library(path) {
        Some(LibKind::Hooks)
    } else {
        None
    }
}

/// The distinct libcuda (and injection library) files a process maps.
pub fn scan_pid(pid: u32) -> Vec<MappedLibrary> {
    let Ok(maps) = fs::read(format!("/proc/{pid}/maps")) else {
        return Vec::new(); // gone, or a kernel thread
    };
    parse_maps(pid, &maps)
}

/// One line of `/proc/<pid>/maps`: `start-end perms offset dev inode path`, borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapsLine<'a> {
    pub start: u64,
    pub end: u64,
    pub perms: &'a str,
    pub offset: u64,
    /// `major:minor` as maps writes it.
    pub dev: &'a str,
    pub ino: u64,
    /// Empty for an anonymous mapping; `[stack]`, `/memfd:… (deleted)` and the like as written.
    pub path: &'a str,
}

/// Most maps lines looked at (a process may have at most `vm.max_map_count`, 65 530 by default).
const MAX_MAPPINGS: usize = 1 << 16;

/// The lines of a maps text that parse, at most [`MAX_MAPPINGS`].
pub fn maps_lines(text: &[u8]) -> impl Iterator<Item = MapsLine<'_>> {
    text.split(|&b| b == b'\n').take(MAX_MAPPINGS).filter_map(|line| {
        let line = std::str::from_utf8(line).ok()?;
        let mut f = line.splitn(6, ' ');
        let (start, end) = f.next()?.split_once('-')?;
        let perms = f.next()?;
        let offset = u64::from_str_radix(f.next()?, 16).ok()?;
        let dev = f.next()?;
        let ino = f.next()?.parse().ok()?;
        Some(MapsLine {
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
            perms,
            offset,
            dev,
            ino,
            path: f.next().map_or("", str::trim_start),
        })
    })
}

/// The libraries in the text of `/proc/<pid>/maps`.
fn parse_maps(pid: u32, maps: &[u8]) -> Vec<MappedLibrary> {
    let mut found: Vec<MappedLibrary> = Vec::new();
    // Cheap reject first: most processes never map libcuda.
    if !contains(maps, b"libcuda.so")
        && !contains(maps, b"libgpu_observer_cupti")
        && !contains(maps, b"/memfd:gpu-observer")
    {
        return found;
    }
    for MapsLine {
        start,
        end,
        dev,
        ino,
        path,
        ..
    } in maps_lines(maps)
    {
        let injected = super::inject::is_injected(path);
        if !path.starts_with('/') || (path.ends_with(" (deleted)") && !injected) || ino == 0 {
            continue;
        }
        let Some(kind) = (if injected { Some(LibKind::Hooks) } else { kind_of(path) }) else {
            continue;
        };
        let mapping = MappingId {
            dev: dev.to_string(),
            ino,
        };
        if found.iter().any(|l| l.mapping == mapping) {
            continue;
        }
        found.push(MappedLibrary {
            kind,
            pid,
            path: path.to_string(),
            mapping,
            range: injected.then_some((start, end)),
        });
    }
    found
}

/// Every process's libcuda files, the agent's own process excluded.
pub fn scan_all() -> Vec<MappedLibrary> {
    let me = std::process::id();
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid != me {
            out.extend(scan_pid(pid));
        }
    }
    out
}

/// Well-known places of the host's libcuda, attached up front so processes started later are
/// observed from their very first call (`cuInit`), before any scan could see them.
pub fn well_known() -> Vec<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "/usr/lib64/libcuda.so.1",
        "/usr/lib/libcuda.so.1",
        "/usr/local/nvidia/lib64/libcuda.so.1",
        "/usr/local/cuda/compat/libcuda.so.1",
        "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    ]
    .iter()
    .map(PathBuf::from)
    .filter(|p| p.is_file())
    .collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_libcuda_names_only() {
        assert!(is_libcuda("/usr/lib/x86_64-linux-gnu/libcuda.so.1"));
        assert!(is_libcuda("/usr/lib/libcuda.so.580.159.04"));
        assert!(is_libcuda("libcuda.so"));
        assert!(!is_libcuda("/usr/lib/libcudart.so.13"));
        assert!(!is_libcuda("/usr/lib/libcuda_fake.so"));
        assert!(!is_libcuda("/opt/libcuda.so.1/other.so"));
        assert!(is_hook_library("/opt/gpu-observer/libgpu_observer_cupti.so"));
        assert!(!is_hook_library("/opt/libgpu_observer_cupti.so.bak"));
        assert_eq!(kind_of("/usr/lib/libcuda.so.1"), Some(LibKind::Cuda));
        assert_eq!(kind_of("/x/libgpu_observer_cupti.so"), Some(LibKind::Hooks));
        assert_eq!(kind_of("/x/libc.so.6"), None);
    }

    #[test]
    fn maps_lines_give_path_device_and_inode() {
        let maps = b"7f00-7f01 r--p 00000000 fd:01 1234 /usr/lib/libcuda.so.1\n\
7f01-7f02 r-xp 00001000 fd:01 1234 /usr/lib/libcuda.so.1\n\
7f02-7f03 r--p 00000000 00:2a 99 /home/u/x/libcuda.so.580.1\n\
7f03-7f04 r--p 00000000 00:2a 98 /home/u/x/libcuda.so.2 (deleted)\n\
7f04-7f05 rw-p 00000000 00:00 0 \n\
7f05-7f06 r--p 00000000 08:02 77 /opt/libgpu_observer_cupti.so\n\
7f06-7f07 r--p 00000000 08:02 76 /usr/lib/libc.so.6\n\
7f08-7f09 r--p 00000000 00:01 194 /memfd:gpu-observer-cupti (deleted)\n\
7f09-7f0a r--p 00000000 00:01 195 /memfd:other (deleted)\n";
        let got = parse_maps(5, maps);
        let ids: Vec<(LibKind, &str, &str, u64)> = got
            .iter()
            .map(|l| (l.kind, l.path.as_str(), l.mapping.dev.as_str(), l.mapping.ino))
            .collect();
        assert_eq!(
            ids,
            [
                (LibKind::Cuda, "/usr/lib/libcuda.so.1", "fd:01", 1234),
                (LibKind::Cuda, "/home/u/x/libcuda.so.580.1", "00:2a", 99),
                (LibKind::Hooks, "/opt/libgpu_observer_cupti.so", "08:02", 77),
                (LibKind::Hooks, "/memfd:gpu-observer-cupti (deleted)", "00:01", 194),
            ]
        );
        assert!(got.iter().all(|l| l.pid == 5));
        // Only the memfd (which has no path to open) is opened through its address range.
        let ranges: Vec<_> = got.iter().map(|l| l.range).collect();
        assert_eq!(ranges, [None, None, None, Some((0x7f08, 0x7f09))]);
    }

    #[test]
    fn scanning_a_process_without_libcuda_finds_nothing() {
        assert!(scan_pid(std::process::id()).is_empty());
        assert!(scan_pid(u32::MAX).is_empty());
    }
}
