//! What an injection reads about its target before touching it: its mappings, its threads and
//! what each is doing, its loader, its glibc. All of it comes from a process the observer does
//! not trust: files are read bounded (`symbols::elf_facts`), through the mapping itself
//! (`/proc/<pid>/map_files`, no path lookup in the target's namespace), and every number is
//! checked before use.

use std::fs;

use super::super::{
    discover,
    open::{self, Opened},
    symbols::{self, ElfFacts},
};

/// One line of `/proc/<pid>/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub perms: [u8; 4],
    pub offset: u64,
    /// `major:minor` as maps writes it.
    pub dev: String,
    pub ino: u64,
    pub path: String,
}

impl Mapping {
    pub fn executable(&self) -> bool {
        self.perms[2] == b'x'
    }

    /// The file's base name (`libc.so.6`).
    pub fn file_name(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }
}

pub fn maps(pid: u32) -> std::io::Result<Vec<Mapping>> {
    let text = fs::read(format!("/proc/{pid}/maps"))?;
    Ok(parse_maps(&text))
}

pub fn parse_maps(text: &[u8]) -> Vec<Mapping> {
    discover::maps_lines(text)
        .filter(|l| l.end > l.start)
        .filter_map(|l| {
            Some(Mapping {
                start: l.start,
                end: l.end,
                perms: <[u8; 4]>::try_from(l.perms.as_bytes()).ok()?,
                offset: l.offset,
                dev: l.dev.to_string(),
                ino: l.ino,
                path: l.path.to_string(),
            })
        })
        .collect()
}

/// The address where byte `offset` of `file`'s file is mapped (by a mapping of that file).
pub fn address_of(maps: &[Mapping], file: &Mapping, offset: u64) -> Option<u64> {
    maps.iter()
        .find(|m| m.ino == file.ino && m.dev == file.dev && m.offset <= offset && offset - m.offset < m.end - m.start)
        .map(|m| m.start + (offset - m.offset))
}

/// Opens the file behind a mapping through `/proc/<pid>/map_files`: the very file mapped,
/// whatever its path means in the target's mount namespace, checked as any mapped library is
/// (a regular file of bounded size, the inode the maps line names).
pub fn open_mapping(pid: u32, m: &Mapping) -> Result<Opened, String> {
    open::open_map_file(pid, m.start, m.end, m.ino, &m.path).map_err(|r| r.detail)
}

/// A mapped library's facts ([`symbols::elf_facts`]), read through its mapping.
pub fn facts(pid: u32, m: &Mapping, wanted: &[&str]) -> Result<ElfFacts, String> {
    let opened = open_mapping(pid, m)?;
    let shown = format!("{} (in pid {pid})", m.path);
    symbols::elf_facts(&opened, &shown, wanted).map_err(|r| r.detail)
}

/// What a thread is doing, from `/proc/<pid>/task/<tid>/{stat,syscall}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Thread {
    pub tid: i32,
    /// `R`, `S`, `D`, `T`, …
    pub state: u8,
    /// The system call it is blocked in, with its arguments (none while it runs user code).
    pub syscall: Option<(i64, [u64; 6])>,
}

/// Most threads looked at (the first ones: the main thread and the oldest helpers).
const MAX_THREADS: usize = 4096;

pub fn threads(pid: u32) -> Vec<Thread> {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut tids: Vec<i32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
        .collect();
    tids.sort_unstable();
    tids.truncate(MAX_THREADS);
    tids.into_iter()
        .filter_map(|tid| {
            let stat = fs::read(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
            let syscall = fs::read(format!("/proc/{pid}/task/{tid}/syscall")).ok()?;
            Some(Thread {
                tid,
                state: state_of(&stat)?,
                syscall: parse_syscall(&syscall),
            })
        })
        .collect()
}

/// The state letter of a `stat` line: after the last `)` (the name may hold any byte).
fn state_of(stat: &[u8]) -> Option<u8> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    stat.get(close + 2).copied()
}

/// `nr a1 … a6 sp pc`, `-1 sp pc` (user code) or `running`.
fn parse_syscall(text: &[u8]) -> Option<(i64, [u64; 6])> {
    let text = std::str::from_utf8(text).ok()?;
    let mut f = text.split_whitespace();
    let nr: i64 = f.next()?.parse().ok()?;
    if nr < 0 {
        return None;
    }
    let mut args = [0u64; 6];
    for a in &mut args {
        *a = u64::from_str_radix(f.next()?.trim_start_matches("0x"), 16).ok()?;
    }
    Some((nr, args))
}

/// How suitable a blocked system call is to borrow its thread from (lower is better; None:
/// never). A thread waiting for time, a descriptor or a condition holds no lock the loader
/// needs; one waiting for a lock (`FUTEX_WAIT` on a value of 2: glibc's contended lowlevellock)
/// might hold another (malloc's, the loader's), and `dlopen` on it could deadlock with itself.
/// Calls that fail with EINTR after a stop instead of restarting (`epoll_wait`) are left out.
pub fn rank(nr: i64, args: &[u64; 6]) -> Option<u8> {
    const FUTEX: i64 = 202;
    const FUTEX_CMD_MASK: u64 = 0x7f;
    const FUTEX_WAIT: u64 = 0;
    const FUTEX_WAIT_BITSET: u64 = 9;
    match nr {
        // nanosleep, clock_nanosleep
        35 | 230 => Some(0),
        // poll, ppoll, select, pselect6, wait4, rt_sigtimedwait
        7 | 271 | 23 | 270 | 61 | 128 => Some(1),
        FUTEX => match args[1] & FUTEX_CMD_MASK {
            FUTEX_WAIT_BITSET => Some(2),
            FUTEX_WAIT if args[2] != 2 => Some(2),
            _ => None,
        },
        // read, recvfrom, recvmsg, accept, accept4
        0 | 45 | 47 | 43 | 288 => Some(3),
        _ => None,
    }
}

/// Threads to borrow, best first: sleeping (`S`) in a system call [`rank`] accepts; helper
/// threads before the main thread (it usually drives the work).
pub fn candidates(pid: u32, threads: &[Thread]) -> Vec<i32> {
    let mut c: Vec<(u8, bool, i32)> = threads
        .iter()
        .filter(|t| t.state == b'S')
        .filter_map(|t| {
            let (nr, args) = t.syscall?;
            Some((rank(nr, &args)?, t.tid as u32 == pid, t.tid))
        })
        .collect();
    c.sort_unstable();
    c.into_iter().map(|(_, _, tid)| tid).collect()
}

/// `GLIBC_2.34` → (2, 34, 0); other names → None.
pub fn glibc_version(name: &str) -> Option<(u32, u32, u32)> {
    let v = name.strip_prefix("GLIBC_")?;
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??, parts.next().flatten().unwrap_or(0)))
}

/// The newest `GLIBC_x.y` among names.
pub fn newest_glibc<'a>(names: impl IntoIterator<Item = &'a str>) -> Option<(u32, u32, u32)> {
    names.into_iter().filter_map(glibc_version).max()
}

pub fn show_version(v: (u32, u32, u32)) -> String {
    if v.2 == 0 {
        format!("{}.{}", v.0, v.1)
    } else {
        format!("{}.{}.{}", v.0, v.1, v.2)
    }
}

/// Whether the process is traced, and by whom (`TracerPid`).
pub fn tracer(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|&t| t != 0)
}

/// `kernel.yama.ptrace_scope`, when Yama is there.
pub fn yama_scope() -> Option<u32> {
    fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether this process has CAP_SYS_PTRACE (bit 19 of its effective set).
pub fn has_cap_sys_ptrace() -> bool {
    crate::preflight::effective_caps().is_some_and(|caps| caps & (1 << 19) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse_and_addresses_resolve() {
        let maps = parse_maps(
            b"7f0000000000-7f0000028000 r--p 00000000 08:02 77 /usr/lib/x86_64-linux-gnu/libc.so.6\n\
7f0000028000-7f000019d000 r-xp 00028000 08:02 77 /usr/lib/x86_64-linux-gnu/libc.so.6\n\
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]\n\
garbage\n",
        );
        assert_eq!(maps.len(), 3);
        assert!(maps[1].executable() && !maps[0].executable());
        assert_eq!(maps[1].file_name(), "libc.so.6");
        assert_eq!(address_of(&maps, &maps[0], 0x28010), Some(0x7f0000028010));
        assert_eq!(address_of(&maps, &maps[0], 0x19d000), None);
        let other = Mapping {
            ino: 78,
            ..maps[0].clone()
        };
        assert_eq!(address_of(&maps, &other, 0x10), None);
    }

    #[test]
    fn thread_state_and_syscall_parse() {
        assert_eq!(state_of(b"12 (a) b) S 1 2"), Some(b'S'));
        assert_eq!(
            parse_syscall(b"202 0x7f01 0x89 0x0 0x0 0x0 0xffffffff 0x7ffd 0x7f02\n"),
            Some((202, [0x7f01, 0x89, 0, 0, 0, 0xffffffff]))
        );
        assert_eq!(parse_syscall(b"-1 0x7ffd 0x7f02\n"), None);
        assert_eq!(parse_syscall(b"running\n"), None);
    }

    #[test]
    fn lock_waits_and_unknown_calls_are_never_borrowed() {
        assert_eq!(rank(35, &[0; 6]), Some(0));
        assert_eq!(rank(202, &[0, 0x89, 0, 0, 0, 0]), Some(2), "FUTEX_WAIT_BITSET_PRIVATE");
        assert_eq!(rank(202, &[0, 0x80, 1, 0, 0, 0]), Some(2), "FUTEX_WAIT on a condition");
        assert_eq!(rank(202, &[0, 0x80, 2, 0, 0, 0]), None, "a contended lock");
        assert_eq!(rank(232, &[0; 6]), None, "epoll_wait returns EINTR after a stop");
        assert_eq!(rank(16, &[0; 6]), None, "ioctl: maybe inside the driver");
        let t = |tid, state, nr: Option<i64>| Thread {
            tid,
            state,
            syscall: nr.map(|n| (n, [0u64; 6])),
        };
        let threads = [
            t(10, b'S', Some(0)),
            t(11, b'R', None),
            t(12, b'S', Some(35)),
            t(13, b'D', Some(35)),
            t(14, b'S', Some(16)),
            t(15, b'S', Some(0)),
        ];
        assert_eq!(candidates(10, &threads), vec![12, 15, 10]);
    }

    #[test]
    fn glibc_versions_compare_as_numbers() {
        assert_eq!(glibc_version("GLIBC_2.2.5"), Some((2, 2, 5)));
        assert_eq!(glibc_version("GLIBC_PRIVATE"), None);
        assert_eq!(
            newest_glibc(["GLIBC_2.9", "GLIBC_2.34", "GLIBC_2.17", "GCC_3.0"]),
            Some((2, 34, 0))
        );
        assert_eq!(show_version((2, 2, 5)), "2.2.5");
        assert_eq!(show_version((2, 17, 0)), "2.17");
    }
}
