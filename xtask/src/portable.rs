//! The CUPTI injection library that is shipped: linked by zig (through cargo-zigbuild) against
//! glibc 2.17's symbol versions instead of this machine's glibc, so that it loads in any process
//! with glibc ≥ 2.17 (Rust std's own floor) — also in a container whose glibc is older than the
//! build machine's, where the observer injects it into running processes.
//!
//! `build(release)` writes `target/portable/{debug,release}/libgpu_observer_cupti.so` (cargo's
//! own files stay in `target/portable-build`) and fails if the library needs a newer
//! `GLIBC_x.y` than 2.17 (read from its `.gnu.version_r`). The tools are PyPI wheels, pinned,
//! in `.tools/zig` (installed by `cargo xtask setup`).

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, Result, bail};
use object::read::elf::{ElfFile64, FileHeader as _};

use crate::{output, pip_install, root, status, tools};

/// The newest glibc symbol version the library may need.
pub const GLIBC_FLOOR: [u32; 2] = [2, 17];

/// cargo-zigbuild, and the zig it links with. Upstream's CI tests cargo-zigbuild with zig 0.16.0.
const PACKAGES: [&str; 2] = ["cargo-zigbuild==0.24.1", "ziglang==0.16.0"];

const LIBRARY: &str = "libgpu_observer_cupti.so";

fn dir() -> PathBuf {
    tools().join("zig")
}

/// Installs the pinned cargo-zigbuild and zig into `.tools/zig` (once).
pub fn install() -> Result<()> {
    pip_install(&dir(), &PACKAGES)
}

/// Where [`build`] puts the library: `target/portable/<profile>/libgpu_observer_cupti.so`.
pub fn library_path(release: bool) -> PathBuf {
    root()
        .join("target/portable")
        .join(if release { "release" } else { "debug" })
        .join(LIBRARY)
}

/// Builds the injection library for glibc ≥ 2.17 with cargo-zigbuild, copies it to
/// [`library_path`] and checks its glibc requirement; returns its absolute path.
pub fn build(release: bool) -> Result<PathBuf> {
    install()?;
    let start = Instant::now();
    let host = output(Command::new("rustc").arg("-vV"))?
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .context("rustc -vV names no host")?;
    if !host.ends_with("-linux-gnu") {
        bail!("the portable CUPTI library is built for a *-linux-gnu host, not {host}");
    }
    let [major, minor] = GLIBC_FLOOR;
    let build_dir = root().join("target/portable-build");
    let mut c = Command::new(dir().join("bin/cargo-zigbuild"));
    c.current_dir(root())
        .args(["zigbuild", "--package", "gpu-observer-cupti", "--lib", "--target"])
        .arg(format!("{host}.{major}.{minor}"))
        // Its own target directory: other linker settings than the host build's.
        .env("CARGO_TARGET_DIR", &build_dir)
        .env("CARGO_ZIGBUILD_ZIG_PATH", dir().join("ziglang/zig"));
    if release {
        c.arg("--release");
    }
    status(&mut c).context("building the portable CUPTI library (cargo-zigbuild)")?;
    let profile = if release { "release" } else { "debug" };
    let built = build_dir.join(&host).join(profile).join(LIBRARY);
    let dst = library_path(release);
    std::fs::create_dir_all(dst.parent().context("library path has no parent")?)?;
    // A new file renamed into place: a process may have the old one mapped.
    let tmp = dst.with_extension("so.tmp");
    std::fs::copy(&built, &tmp).with_context(|| format!("copy {}", built.display()))?;
    std::fs::rename(&tmp, &dst)?;
    let needed = glibc_versions(&dst)?;
    let max = needed.iter().max().cloned().unwrap_or_default();
    if needed.iter().any(|v| v.as_slice() > GLIBC_FLOOR.as_slice()) {
        bail!(
            "{} needs GLIBC_{} (the newest of {}), above the {major}.{minor} it is built for",
            dst.display(),
            dotted(&max),
            needed
                .iter()
                .map(|v| format!("GLIBC_{}", dotted(v)))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    eprintln!(
        "xtask: portable CUPTI library {} (needs GLIBC_{} at most; built in {:.1} s)",
        dst.display(),
        dotted(&max),
        start.elapsed().as_secs_f64()
    );
    Ok(dst)
}

fn dotted(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(".")
}

/// Every `GLIBC_x.y[.z]` version the library's `.gnu.version_r` asks of any library, as
/// numbers; a `GLIBC_` version that is not numbered (`GLIBC_PRIVATE`) is an error.
pub fn glibc_versions(path: &Path) -> Result<Vec<Vec<u32>>> {
    let data = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let file = ElfFile64::<object::Endianness>::parse(data.as_slice())
        .with_context(|| format!("{} is not a 64-bit ELF file", path.display()))?;
    let endian = file.endian();
    let sections = file.elf_header().sections(endian, data.as_slice())?;
    let mut versions = Vec::new();
    let Some((mut needs, link)) = sections.gnu_verneed(endian, data.as_slice())? else {
        return Ok(versions);
    };
    let strings = sections.strings(endian, data.as_slice(), link)?;
    while let Some((need, mut aux)) = needs.next()? {
        let lib = String::from_utf8_lossy(need.file(endian, strings)?).into_owned();
        while let Some(a) = aux.next()? {
            let name = String::from_utf8_lossy(a.name(endian, strings)?).into_owned();
            let Some(number) = name.strip_prefix("GLIBC_") else {
                continue;
            };
            let parsed: Option<Vec<u32>> = number.split('.').map(|n| n.parse().ok()).collect();
            versions.push(
                parsed.with_context(|| {
                    format!("{} needs {name} of {lib}: not a released glibc version", path.display())
                })?,
            );
        }
    }
    Ok(versions)
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_machines_xtask_needs_some_glibc_version() {
        // The xtask binary itself is linked against this machine's glibc.
        let exe = std::env::current_exe().unwrap();
        let versions = super::glibc_versions(&exe).unwrap();
        assert!(versions.iter().any(|v| v.first() == Some(&2)), "{versions:?}");
    }

    #[test]
    fn versions_compare_as_numbers() {
        let v: Vec<u32> = vec![2, 3, 4];
        assert!(v.as_slice() < super::GLIBC_FLOOR.as_slice());
        assert!([2u32, 34].as_slice() > super::GLIBC_FLOOR.as_slice());
        assert_eq!(super::dotted(&v), "2.3.4");
    }
}
