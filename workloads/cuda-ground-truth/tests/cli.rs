//! The binary's behaviour without a GPU: clean messages and exit codes, never a panic.

use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cuda-ground-truth"))
        .args(args)
        .output()
        .expect("spawn the binary")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn a_missing_libcuda_is_exit_2_with_a_message() {
    let dir = std::env::temp_dir().join(format!("cgt-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out_json = dir.join("gt.json");
    let o = run(&[
        "--libcuda",
        "/nonexistent/libcuda.so.1",
        "--out",
        out_json.to_str().unwrap(),
    ]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert!(
        err.contains("cannot load the CUDA driver library /nonexistent/libcuda.so.1"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out_json.exists(), "no JSON without a driver");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_library_without_driver_symbols_is_exit_2() {
    let o = run(&["--libcuda", "libc.so.6"]);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains("lacks the driver entry point cuInit"), "{err}");
}

#[test]
fn usage_errors_are_exit_2_and_help_is_exit_0() {
    let o = run(&["--iters", "lots"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("usage:"));
    let o = run(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(text(&o.stdout).contains("--wait-start FILE"));
}
