//! cuda-ground-truth command line: see `--help` and the crate documentation.

use std::io::Write;

use cuda_ground_truth::args::{self, Parsed};
use cuda_ground_truth::driver::LibCuda;
use cuda_ground_truth::gpu::Gpu;
use cuda_ground_truth::workload::{self, Config};
use cuda_ground_truth::{monotonic_ns, report, wait_for, write_atomically};

fn run() -> i32 {
    let a = match args::parse(std::env::args().skip(1)) {
        Ok(Parsed::Run(a)) => a,
        Ok(Parsed::Help) => {
            println!("{}", args::USAGE);
            return 0;
        }
        Err(e) => {
            eprintln!("cuda-ground-truth: error: {e}\n\n{}", args::USAGE);
            return 2;
        }
    };
    let pid = std::process::id();
    let drv = match LibCuda::load(&a.libcuda) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("cuda-ground-truth: error: {e}");
            return 2;
        }
    };
    let libcuda = drv.path().to_string();
    let mut gpu = Gpu::new(drv);
    let ctx = match workload::setup(&mut gpu, a.device) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cuda-ground-truth: error: no usable GPU (device {}): {e}", a.device);
            return 2;
        }
    };
    println!(
        "cuda-ground-truth: pid {pid}: context {:#x} ready on device {} ({libcuda})",
        Gpu::<LibCuda>::context_handle(&ctx),
        a.device
    );
    if let Some(f) = &a.wait_start {
        println!("cuda-ground-truth: waiting for {}", f.display());
        std::io::stdout().flush().ok();
        if !wait_for(f, a.wait_timeout) {
            eprintln!(
                "cuda-ground-truth: error: {} did not appear within {} s (--wait-start)",
                f.display(),
                a.wait_timeout.as_secs()
            );
            return 3;
        }
    }
    let cfg = Config {
        iters: a.iters,
        elems: a.elems,
    };
    let out = workload::measured(&mut gpu, ctx, &cfg, monotonic_ns);
    let v = report::build(pid, &libcuda, &cfg, &gpu.ledger, &out);
    println!("{}", report::summary(&gpu.ledger, &out));
    let mut rc = if out.all_pass() { 0 } else { 1 };
    if let Some(path) = &a.out {
        match write_atomically(path, &v) {
            Ok(()) => println!("cuda-ground-truth: wrote {}", path.display()),
            Err(e) => {
                eprintln!("cuda-ground-truth: error: cannot write {}: {e}", path.display());
                rc = 1;
            }
        }
    }
    std::io::stdout().flush().ok();
    if !a.pause_before_exit.is_zero() {
        std::thread::sleep(a.pause_before_exit);
    }
    rc
}

fn main() {
    std::process::exit(run());
}
