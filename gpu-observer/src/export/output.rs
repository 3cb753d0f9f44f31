//! Opening an output file (`--output`, `--perfetto`, `--flamegraph`, `--record-ring`) as root
//! without being steered by other users' links and files.
//!
//! The observer runs as root and `--output` often points into a sticky, world-writable
//! directory such as /tmp, where any user can plant a symlink (to /etc/shadow, say) or a file
//! of their own under the name root is about to write. The rules are the kernel's own
//! `fs.protected_symlinks` and `fs.protected_regular` (and `protected_fifos`), applied whatever
//! those sysctls say: in a sticky world-writable directory, a symlink is followed, and an
//! existing file or FIFO is opened, only when it belongs to us or to the directory's owner.
//! Elsewhere a symlink is followed as usual (`--output /dev/stdout` works). A new file is
//! created without following links, mode 0600: the output describes every user's processes.

use std::{
    fs::File,
    io,
    os::unix::fs::{MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};

/// Mode of a file the observer creates.
pub const MODE: u32 = 0o600;

/// Opens (creating or truncating) `path` for writing, refusing what a hostile user planted;
/// `flag` names the option it came from in messages (`--output`).
pub fn create(flag: &str, path: &Path) -> Result<File> {
    let dir = parent_of(path);
    let dir_meta =
        std::fs::metadata(&dir).with_context(|| format!("{flag} {}: directory {}", path.display(), dir.display()))?;
    let shared = dir_meta.mode() & 0o1002 == 0o1002; // sticky and world-writable
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let trusted = |uid: u32| uid == me || uid == dir_meta.uid();
    let follow = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            if shared && !trusted(m.uid()) {
                bail!(
                    "{flag} {}: refusing to follow a symlink owned by uid {} in the sticky world-writable directory {} (it could point anywhere root can write); remove it or choose another path",
                    path.display(),
                    m.uid(),
                    dir.display()
                );
            }
            true
        }
        Ok(m) => {
            refuse_foreign(flag, path, &dir, shared && !trusted(m.uid()), m.uid())?;
            false
        }
        Err(_) => false,
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true)
        .create(true)
        .mode(MODE)
        // Non-blocking: a FIFO without a reader fails at once instead of hanging the observer.
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | if follow { 0 } else { libc::O_NOFOLLOW });
    let file = opts.open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => anyhow::anyhow!(
            "{flag} {}: it became a symlink while being opened; refused",
            path.display()
        ),
        Some(libc::ENXIO) => anyhow::anyhow!(
            "{flag} {}: a FIFO with no reader; start the reader first",
            path.display()
        ),
        _ => anyhow::Error::new(e).context(format!("cannot create {flag} {}", path.display())),
    })?;
    let m = file.metadata().with_context(|| format!("{flag} {}", path.display()))?;
    // Again on what was opened: the file may have been planted after the look above.
    refuse_foreign(flag, path, &dir, shared && !follow && !trusted(m.uid()), m.uid())?;
    if m.file_type().is_file() {
        file.set_len(0)
            .with_context(|| format!("cannot truncate {flag} {}", path.display()))?;
    }
    clear_nonblock(&file).with_context(|| format!("{flag} {}", path.display()))?;
    Ok(file)
}

fn refuse_foreign(flag: &str, path: &Path, dir: &Path, foreign: bool, uid: u32) -> Result<()> {
    if foreign {
        bail!(
            "{flag} {}: refusing to write to a file owned by uid {uid} in the sticky world-writable directory {}; remove it or choose another path",
            path.display(),
            dir.display()
        );
    }
    Ok(())
}

fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Writes block again once open (a pipe's reader is slow, not absent).
fn clear_nonblock(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on an fd we own, with integer arguments only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpu-observer-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_new_file_is_private_and_an_existing_one_of_ours_is_truncated() {
        let d = dir("new");
        let p = d.join("out.jsonl");
        std::fs::write(&p, "old contents").unwrap();
        std::fs::remove_file(&p).unwrap();
        drop(create("--output", &p).unwrap());
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, MODE);
        std::fs::write(&p, "old contents").unwrap();
        drop(create("--output", &p).unwrap());
        assert_eq!(std::fs::read(&p).unwrap().len(), 0);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn our_own_symlinks_outside_shared_directories_are_followed() {
        let d = dir("link");
        let target = d.join("target");
        std::fs::write(&target, "x").unwrap();
        std::os::unix::fs::symlink(&target, d.join("link")).unwrap();
        drop(create("--output", &d.join("link")).unwrap());
        assert_eq!(std::fs::read(&target).unwrap().len(), 0);
        let _ = std::fs::remove_dir_all(&d);
    }
}
