//! Opening a library file that an observed process maps, without trusting that process.
//!
//! The agent runs as root; the path comes from another user's `/proc/<pid>/maps` and is looked
//! up in that user's mount namespace, which the user may control (user + mount namespaces). So:
//!
//! - the path is resolved *inside* the process's root (`openat2` with `RESOLVE_IN_ROOT` on an
//!   `O_PATH` descriptor of `/proc/<pid>/root`, or a component-by-component walk where the
//!   kernel lacks `openat2`): an absolute symlink planted in the namespace cannot lead root to a
//!   host file;
//! - the lookup stops at an `O_PATH` descriptor, and the file is opened for reading only once
//!   `fstat` says it is a regular file of bounded size: a FIFO or a device bind-mounted over the
//!   path is never opened (opening a FIFO for reading blocks until a writer comes);
//! - the file must be the one the mapping names (same inode number as `/proc/<pid>/maps` gives);
//! - the caller attaches uprobes through `/proc/self/fd/N` of the descriptor opened here (see
//!   [`Opened::kernel_path`]), so the kernel's own lookup cannot be steered to another file.

use std::{
    collections::VecDeque,
    ffi::{CStr, CString, OsStr},
    fs::File,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

use super::{FileKey, stats::Reason};

/// Largest library file the agent reads (real libcuda is ~100 MB; see docs/SECURITY.md).
pub const MAX_LIBRARY_BYTES: u64 = 1 << 30;

/// Symlinks followed in one lookup at most: the kernel's own limit (MAXSYMLINKS).
const MAX_LINKS: u32 = 40;

/// Why a file was not used: the reason (counted) and the detail (said once).
#[derive(Debug)]
pub struct Refused {
    pub reason: Reason,
    pub detail: String,
}

impl Refused {
    pub fn new(reason: Reason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

impl std::error::Error for Refused {}

/// A validated library file, open for reading.
#[derive(Debug)]
pub struct Opened {
    pub file: File,
    pub key: FileKey,
    pub size: u64,
}

impl Opened {
    /// The path that names this very file for the kernel while it stays open: uprobes attached
    /// through it land on the inode validated here, whatever the name means by then.
    pub fn kernel_path(&self) -> CString {
        fd_path(self.file.as_raw_fd())
    }
}

/// `/proc/self/fd/N`: the agent's own name for an open file (a number has no NUL, so the
/// empty fallback is never taken).
pub fn fd_path(fd: RawFd) -> CString {
    CString::new(format!("/proc/self/fd/{fd}")).unwrap_or_default()
}

fn cstr(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path has a NUL byte"))
}

fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `openat(dir, name, flags)`, the new descriptor owned.
fn openat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: name is a valid C string; openat has no other preconditions.
    let fd = check(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) }.into())?;
    // SAFETY: a successful openat returns a new descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: all-zero is a valid stat buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: st is a valid, writable stat buffer.
    check(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }.into())?;
    Ok(st)
}

fn file_type(mode: libc::mode_t) -> libc::mode_t {
    mode & libc::S_IFMT
}

/// The target of the symlink `fd` (an `O_PATH | O_NOFOLLOW` descriptor of it).
fn readlink(fd: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: buf is writable for its length; an empty path reads the link `fd` itself.
    let n = check(
        unsafe { libc::readlinkat(fd.as_raw_fd(), c"".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) } as libc::c_long,
    )?;
    buf.truncate(n as usize);
    Ok(buf)
}

/// `openat2(root, path, O_PATH, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`.
fn openat2_in_root(root: BorrowedFd<'_>, path: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: all-zero is a valid open_how.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: path is a valid C string and how a valid open_how of the size passed.
    let fd = check(unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            path.as_ptr(),
            &how as *const libc::open_how,
            size_of::<libc::open_how>(),
        )
    })?;
    // SAFETY: a successful openat2 returns a new descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The walk `openat2(RESOLVE_IN_ROOT)` does, for kernels without it (before 5.6, or a seccomp
/// filter that denies it): one component at a time with `O_PATH | O_NOFOLLOW`, symlinks read
/// and followed here — an absolute target restarts at `root`, `..` never climbs above it — at
/// most [`MAX_LINKS`] of them. Returns an `O_PATH` descriptor of what `path` names.
pub fn walk_in_root(root: BorrowedFd<'_>, path: &[u8]) -> io::Result<OwnedFd> {
    let split = |p: &[u8]| -> Vec<Vec<u8>> {
        p.split(|&b| b == b'/')
            .filter(|c| !c.is_empty() && *c != b".")
            .map(<[u8]>::to_vec)
            .collect()
    };
    let mut dirs: Vec<OwnedFd> = vec![openat(root, c".", libc::O_PATH | libc::O_DIRECTORY)?];
    let mut todo: VecDeque<Vec<u8>> = split(path).into();
    let mut links = 0;
    while let Some(name) = todo.pop_front() {
        if name == b".." {
            // Physical `..` of the directory we are in, clamped at the root.
            if dirs.len() > 1 {
                dirs.pop();
            }
            continue;
        }
        // The root is never popped (see `..` above).
        let Some(here) = dirs.last().map(AsFd::as_fd) else {
            return Err(std::io::Error::other("path walk lost its root"));
        };
        let fd = openat(here, &cstr(&name)?, libc::O_PATH | libc::O_NOFOLLOW)?;
        let st = fstat(fd.as_fd())?;
        match file_type(st.st_mode) {
            libc::S_IFLNK => {
                links += 1;
                if links > MAX_LINKS {
                    return Err(io::Error::from_raw_os_error(libc::ELOOP));
                }
                let target = readlink(fd.as_fd())?;
                if target.first() == Some(&b'/') {
                    dirs.truncate(1);
                }
                for c in split(&target).into_iter().rev() {
                    todo.push_front(c);
                }
            }
            libc::S_IFDIR => dirs.push(fd),
            _ if todo.is_empty() => return Ok(fd),
            _ => return Err(io::Error::from_raw_os_error(libc::ENOTDIR)),
        }
    }
    // The path names a directory (dirs[0] at least is one).
    dirs.pop().ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))
}

/// Whether openat2 is usable; a kernel without it (ENOSYS) or a seccomp filter that denies it
/// (EPERM) sends every lookup through [`walk_in_root`].
fn openat2_missing(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM))
}

/// `path` looked up inside `root`, as an `O_PATH` descriptor; `use_openat2` false forces the
/// fallback walk (tests).
pub fn lookup_in_root(root: BorrowedFd<'_>, path: &[u8], use_openat2: bool) -> io::Result<OwnedFd> {
    if use_openat2 {
        match openat2_in_root(root, &cstr(path)?) {
            Err(e) if openat2_missing(&e) => {}
            r => return r,
        }
    }
    walk_in_root(root, path)
}

/// Opens the regular file behind `o_path` for reading, after checking its type and size.
/// `expected_ino`: the inode number the mapping has, when the file comes from a mapping.
fn open_checked(o_path: OwnedFd, shown: &str, expected_ino: Option<u64>) -> Result<Opened, Refused> {
    let st = fstat(o_path.as_fd()).map_err(|e| Refused::new(Reason::Unreachable, format!("{shown}: {e}")))?;
    if let Some(kind) = not_regular(st.st_mode) {
        return Err(Refused::new(
            Reason::NotRegularFile,
            format!("{shown} is {kind}, not a library file"),
        ));
    }
    let size = st.st_size as u64;
    if size > MAX_LIBRARY_BYTES {
        return Err(Refused::new(
            Reason::TooLarge,
            format!("{shown} is {size} bytes, more than the {MAX_LIBRARY_BYTES} a library may have"),
        ));
    }
    // The inode alone: /proc/<pid>/maps gives the device of the inode's superblock, which is not
    // the st_dev that stat reports on btrfs subvolumes (one anonymous device per subvolume) or
    // overlayfs (the overlay's device; maps shows the layer's) — comparing it would refuse real
    // libraries in containers. The attach goes through this descriptor in any case.
    if let Some(ino) = expected_ino
        && st.st_ino != ino
    {
        return Err(Refused::new(
            Reason::Changed,
            format!(
                "{shown} is inode {}, not the inode {ino} the process maps: the path now names another file",
                st.st_ino
            ),
        ));
    }
    // Reopen the very inode for reading: never blocks (it is a regular file) and O_NONBLOCK
    // keeps it so should it be swapped for a FIFO between the two steps (it cannot: same inode).
    let proc_path = fd_path(o_path.as_raw_fd());
    // SAFETY: proc_path is a valid C string.
    let fd = unsafe {
        libc::open(
            proc_path.as_ptr(),
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY,
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return Err(Refused::new(Reason::Unreachable, format!("{shown}: {e}")));
    }
    // SAFETY: a successful open returns a new descriptor that we now own.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    Ok(Opened {
        file,
        key: FileKey {
            dev: st.st_dev,
            ino: st.st_ino,
        },
        size,
    })
}

/// Opens `path` as process `pid` sees it (a path from its maps), checked as described in the
/// module documentation.
pub fn open_mapped(pid: u32, path: &str, expected_ino: u64) -> Result<Opened, Refused> {
    let shown = format!("{path} (in pid {pid})");
    let unreachable = |e: io::Error| Refused::new(Reason::Unreachable, format!("{shown}: {e}"));
    let root_path = cstr(format!("/proc/{pid}/root").as_bytes()).map_err(unreachable)?;
    // SAFETY: root_path is a valid C string.
    let root = unsafe { libc::open(root_path.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if root < 0 {
        return Err(unreachable(io::Error::last_os_error()));
    }
    // SAFETY: a successful open returns a new descriptor that we now own.
    let root = unsafe { OwnedFd::from_raw_fd(root) };
    let o_path = lookup_in_root(root.as_fd(), path.as_bytes(), true).map_err(unreachable)?;
    open_checked(o_path, &shown, Some(expected_ino))
}

/// Opens the file behind one mapping of process `pid` through `/proc/<pid>/map_files/`: the
/// very file mapped (a memfd included), whatever its path means in the process's namespace,
/// checked as [`open_mapped`] checks (a regular file of bounded size, the maps line's inode).
pub fn open_map_file(pid: u32, start: u64, end: u64, expected_ino: u64, shown_path: &str) -> Result<Opened, Refused> {
    let shown = format!("{shown_path} (in pid {pid})");
    let unreachable = |e: io::Error| Refused::new(Reason::Unreachable, format!("{shown}: {e}"));
    let link = cstr(format!("/proc/{pid}/map_files/{start:x}-{end:x}").as_bytes()).map_err(unreachable)?;
    // SAFETY: link is a valid C string; O_PATH never opens the file itself.
    let fd = unsafe { libc::open(link.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(unreachable(io::Error::last_os_error()));
    }
    // SAFETY: a successful open returns a new descriptor that we now own.
    open_checked(unsafe { OwnedFd::from_raw_fd(fd) }, &shown, Some(expected_ino))
}

/// Opens a path the agent's own user named (`--libcuda`, `--nvml-lib`, the driver's usual
/// paths, the injection library): symlinks followed as usual, but checked as a mapped file is —
/// a FIFO or device is refused instead of blocking the agent in open().
pub fn open_host(path: &Path) -> Result<Opened, Refused> {
    let shown = path.display().to_string();
    let unreachable = |e: io::Error| Refused::new(Reason::Unreachable, format!("{shown}: {e}"));
    let c = cstr(path.as_os_str().as_bytes()).map_err(unreachable)?;
    // SAFETY: c is a valid C string; O_PATH never opens the file itself.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(unreachable(io::Error::last_os_error()));
    }
    // SAFETY: a successful open returns a new descriptor that we now own.
    let o_path = unsafe { OwnedFd::from_raw_fd(fd) };
    open_checked(o_path, &shown, None)
}

/// What a path is, for a message (`--nvml-lib` given a FIFO): None for a regular file or a
/// path that does not exist (its loader says why).
pub fn not_a_file(path: &OsStr) -> Option<&'static str> {
    use std::os::unix::fs::MetadataExt;
    not_regular(std::fs::metadata(path).ok()?.mode())
}

/// What a file of this mode is, when it is not a regular file (for the refusal's message).
fn not_regular(mode: libc::mode_t) -> Option<&'static str> {
    match file_type(mode) {
        libc::S_IFREG => None,
        libc::S_IFIFO => Some("a FIFO (named pipe)"),
        libc::S_IFCHR => Some("a character device"),
        libc::S_IFBLK => Some("a block device"),
        libc::S_IFSOCK => Some("a socket"),
        libc::S_IFDIR => Some("a directory"),
        _ => Some("not a regular file"),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    /// A tree with a root, a library, and links that try to leave the root.
    fn tree() -> (std::path::PathBuf, std::path::PathBuf) {
        let base = std::env::temp_dir().join(format!(
            "gpu-observer-open-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&base);
        let root = base.join("root");
        let outside = base.join("outside");
        for d in [root.join("usr/lib"), root.join("x/y"), outside.clone()] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(root.join("usr/lib/libcuda.so.1"), b"inside").unwrap();
        std::fs::write(outside.join("secret"), b"outside").unwrap();
        // Absolute target: means root/usr/lib/... inside, never the host's /usr/lib.
        symlink("/usr/lib/libcuda.so.1", root.join("x/abs")).unwrap();
        // Relative through ..: climbs to root/usr.
        symlink("../../usr/lib/libcuda.so.1", root.join("x/y/rel")).unwrap();
        // Escapes: too many .. is clamped at the root; an absolute host path is looked up inside.
        symlink("../../../../../../outside/secret", root.join("x/escape_dots")).unwrap();
        symlink(outside.join("secret"), root.join("x/escape_abs")).unwrap();
        // A loop.
        symlink("loop_b", root.join("x/loop_a")).unwrap();
        symlink("loop_a", root.join("x/loop_b")).unwrap();
        // A directory link followed by more components.
        symlink("/usr", root.join("x/usr_link")).unwrap();
        (base, root)
    }

    fn read(root: &Path, path: &str, openat2: bool) -> io::Result<String> {
        let r = File::open(root).unwrap();
        let fd = lookup_in_root(r.as_fd(), path.as_bytes(), openat2)?;
        let opened = open_checked(fd, path, None).map_err(io::Error::other)?;
        let mut s = String::new();
        io::Read::read_to_string(&mut &opened.file, &mut s)?;
        Ok(s)
    }

    #[test]
    fn lookups_stay_inside_the_root_with_and_without_openat2() {
        let (base, root) = tree();
        for openat2 in [false, true] {
            let ok = |p: &str| read(&root, p, openat2).unwrap_or_else(|e| panic!("{p} (openat2 {openat2}): {e}"));
            assert_eq!(ok("/usr/lib/libcuda.so.1"), "inside");
            assert_eq!(ok("/x/abs"), "inside");
            assert_eq!(ok("x/y/rel"), "inside");
            assert_eq!(ok("/x/usr_link/lib/./libcuda.so.1"), "inside");
            assert_eq!(ok("/../../x/abs"), "inside");
            for escape in ["/x/escape_dots", "/x/escape_abs"] {
                let e = read(&root, escape, openat2).unwrap_err();
                assert_eq!(
                    e.raw_os_error(),
                    Some(libc::ENOENT),
                    "{escape} (openat2 {openat2}): {e}"
                );
            }
            let e = read(&root, "/x/loop_a", openat2).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "openat2 {openat2}: {e}");
            let e = read(&root, "/x/abs/more", openat2).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ENOTDIR), "openat2 {openat2}: {e}");
        }
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let (base, root) = tree();
        let fifo = root.join("usr/lib/fifo");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: c is a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for openat2 in [false, true] {
            let r = File::open(&root).unwrap();
            let fd = lookup_in_root(r.as_fd(), b"/usr/lib/fifo", openat2).unwrap();
            let e = open_checked(fd, "fifo", None).unwrap_err();
            assert_eq!(e.reason, Reason::NotRegularFile);
            assert_eq!(e.detail, "fifo is a FIFO (named pipe), not a library file");
        }
        assert_eq!(open_host(&fifo).unwrap_err().reason, Reason::NotRegularFile);
        assert_eq!(not_a_file(fifo.as_os_str()), Some("a FIFO (named pipe)"));
        assert_eq!(not_a_file(root.join("usr/lib/libcuda.so.1").as_os_str()), None);
        assert_eq!(not_a_file(root.join("nothing").as_os_str()), None);
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn another_inode_at_the_mapped_path_is_refused() {
        let (base, root) = tree();
        let r = File::open(&root).unwrap();
        let fd = lookup_in_root(r.as_fd(), b"/usr/lib/libcuda.so.1", true).unwrap();
        let ino = fstat(fd.as_fd()).unwrap().st_ino;
        let e = open_checked(fd, "lib", Some(ino + 1)).unwrap_err();
        assert_eq!(e.reason, Reason::Changed);
        let fd = lookup_in_root(r.as_fd(), b"/usr/lib/libcuda.so.1", true).unwrap();
        let opened = open_checked(fd, "lib", Some(ino)).unwrap();
        assert_eq!((opened.key.ino, opened.size), (ino, 6));
        std::fs::remove_dir_all(base).unwrap();
    }
}
