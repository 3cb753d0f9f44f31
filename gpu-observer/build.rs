//! Builds the eBPF object with aya-build on the stable toolchain (`Toolchain::Custom("stable")`:
//! aya-build's default runs nightly): `-Z build-std`
//! needs RUSTC_BOOTSTRAP, and bpf-linker comes from the project's tool dir (`cargo xtask setup`).

use std::{env, path::PathBuf};

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let root = manifest_dir.parent().ok_or_else(|| {
        anyhow::anyhow!(
            "{} has no parent: the crate lives in the workspace",
            manifest_dir.display()
        )
    })?;
    let tools = root.join(".tools").join("bin");
    let path = env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![tools.clone()];
    dirs.extend(env::split_paths(&path));
    let new_path = env::join_paths(dirs)?;
    if which(&tools, "bpf-linker").is_none() && env::var_os("AYA_BUILD_SKIP").is_none() {
        anyhow::bail!(
            "bpf-linker not found in {} or PATH: run `cargo xtask setup` first",
            tools.display()
        );
    }
    // SAFETY: build scripts are single-threaded here; the child cargo inherits these.
    unsafe {
        env::set_var("PATH", new_path);
        env::set_var("RUSTC_BOOTSTRAP", "1");
    }
    println!("cargo:rerun-if-changed=../gpu-observer-common/src");
    let ebpf_dir = root.join("gpu-observer-ebpf");
    let ebpf = aya_build::Package {
        name: "gpu-observer-ebpf",
        root_dir: ebpf_dir
            .to_str()
            .ok_or_else(|| anyhow::anyhow!("{} is not UTF-8: move the checkout", ebpf_dir.display()))?,
        ..Default::default()
    };
    aya_build::build_ebpf([ebpf], aya_build::Toolchain::Custom("stable"))
}

fn which(tools: &std::path::Path, bin: &str) -> Option<PathBuf> {
    let local = tools.join(bin);
    if local.is_file() {
        return Some(local);
    }
    env::split_paths(&env::var_os("PATH")?)
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}
