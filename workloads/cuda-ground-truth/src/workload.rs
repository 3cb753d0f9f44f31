//! The call sequence and its self-checks (H1-H3 and H9, see lib.rs).

use serde_json::{Value, json};

use crate::driver::{CuResult, Driver, error_name};
use crate::gpu::{Arg, Context, Gpu, GtError, GtResult};
use crate::ptx;

/// What to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Loop iterations (step 5).
    pub iters: u32,
    /// 32-bit elements per buffer (N).
    pub elems: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            iters: 200,
            elems: 1 << 20,
        }
    }
}

impl Config {
    pub fn bytes(&self) -> usize {
        self.elems as usize * 4
    }

    pub fn grid(&self) -> u32 {
        self.elems.div_ceil(ptx::BLOCK)
    }
}

/// A falsifiable claim and whether it survived.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Check {
    pub pass: bool,
    pub detail: String,
}

impl Check {
    fn set(&mut self, pass: bool, detail: impl Into<String>) {
        self.pass = pass;
        self.detail = detail.into();
    }
}

/// The result of the measured part (steps 2-7).
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub window_start_ns: u64,
    pub window_end_ns: u64,
    /// H1: a valid PTX module loads (non-null handle) and its three kernels resolve.
    pub h1: Check,
    /// H2: kernels write what they should (every element, every iteration).
    pub h2: Check,
    /// H3: HtoD then DtoH gives back the same bytes.
    pub h3: Check,
    /// H9: loading invalid PTX returns an error code instead of crashing.
    pub h9: Check,
    pub invalid_ptx_result: Option<CuResult>,
    pub module_handle: Option<usize>,
    pub stream_handle: Option<usize>,
    /// The step that stopped the sequence, if any.
    pub error: Option<String>,
    pub iterations_done: u32,
}

impl Outcome {
    pub fn all_pass(&self) -> bool {
        self.error.is_none() && [&self.h1, &self.h2, &self.h3, &self.h9].iter().all(|c| c.pass)
    }

    pub fn hypotheses_json(&self) -> (Value, Value) {
        let pass = json!({"H1": self.h1.pass, "H2": self.h2.pass, "H3": self.h3.pass, "H9": self.h9.pass});
        let detail = json!({"H1": self.h1.detail, "H2": self.h2.detail, "H3": self.h3.detail, "H9": self.h9.detail});
        (pass, detail)
    }
}

/// Step 1: cuInit, cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxSetCurrent.
pub fn setup<D: Driver>(gpu: &mut Gpu<D>, device: i32) -> GtResult<Context> {
    gpu.init()?;
    gpu.primary_context(device)
}

/// Steps 2-7 inside the window `[clock() before, clock() after]`; every driver call they make
/// is in `gpu.ledger` as inside the window.
pub fn measured<D: Driver>(gpu: &mut Gpu<D>, ctx: Context, cfg: &Config, clock: fn() -> u64) -> Outcome {
    let mut out = Outcome::default();
    gpu.ledger.open_window();
    out.window_start_ns = clock();
    if let Err(e) = steps(gpu, ctx, cfg, &mut out) {
        out.error = Some(e.to_string());
    }
    out.window_end_ns = clock();
    for c in [&mut out.h1, &mut out.h2, &mut out.h3, &mut out.h9] {
        if !c.pass && c.detail.is_empty() {
            c.detail = "not reached".into();
        }
    }
    out
}

/// `value` written by write_value in iteration `iter`.
pub fn iter_value(iter: u32) -> u32 {
    iter.wrapping_add(7)
}

/// Input of add_one/scale_vec at element `i` of iteration `iter` (small integers: exact in f32).
pub fn float_input(iter: u32, i: usize) -> f32 {
    ((i % 1024) as u32 + iter % 64) as f32
}

/// Scale factor passed to scale_vec.
pub const FACTOR: f32 = 2.0;

/// The H3 byte pattern.
pub fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131).wrapping_add(17) ^ (i >> 12)) as u8
}

/// First index where `got` differs from `want(i)`, and how many differ.
fn mismatches<T: PartialEq + Copy>(got: &[T], want: impl Fn(usize) -> T) -> Option<(usize, usize)> {
    let mut first = None;
    let mut n = 0;
    for (i, g) in got.iter().enumerate() {
        if *g != want(i) {
            n += 1;
            first.get_or_insert(i);
        }
    }
    first.map(|f| (f, n))
}

fn steps<D: Driver>(gpu: &mut Gpu<D>, ctx: Context, cfg: &Config, out: &mut Outcome) -> GtResult<()> {
    // Step 2 (H9): invalid PTX must give an error code.
    match gpu.load_module(ptx::INVALID_MODULE) {
        Err(code) => {
            out.invalid_ptx_result = Some(code);
            out.h9.set(
                true,
                format!("cuModuleLoadData(invalid PTX) returned {} ({code})", error_name(code)),
            );
        }
        Ok(m) => {
            out.invalid_ptx_result = Some(0);
            out.h9.set(false, "cuModuleLoadData accepted invalid PTX");
            gpu.unload_module(m)?;
        }
    }

    // Step 3 (H1): the real module and its three kernels.
    let module = gpu.load_module(ptx::MODULE).map_err(|code| {
        out.h1.set(
            false,
            format!("cuModuleLoadData(valid PTX) failed: {} ({code})", error_name(code)),
        );
        GtError::Cuda {
            api: crate::driver::sym::MODULE_LOAD_DATA,
            code,
        }
    })?;
    let handle = Gpu::<D>::module_handle(&module);
    out.module_handle = Some(handle);
    if handle == 0 {
        out.h1
            .set(false, "cuModuleLoadData succeeded with a null module handle");
    }
    let write_value = gpu.get_function(&module, ptx::WRITE_VALUE)?;
    let add_one = gpu.get_function(&module, ptx::ADD_ONE)?;
    let scale_vec = gpu.get_function(&module, ptx::SCALE_VEC)?;
    if handle != 0 {
        out.h1.set(
            true,
            format!(
                "module {handle:#x}; functions write_value, add_one, {} resolved",
                ptx::SCALE_VEC
            ),
        );
    }

    // Step 4: stream, buffers.
    let stream = gpu.create_stream()?;
    out.stream_handle = Some(Gpu::<D>::stream_handle(&stream));
    let bytes = cfg.bytes();
    let n = cfg.elems;
    let grid = cfg.grid();
    let a = gpu.alloc(bytes)?;
    let b = gpu.alloc(bytes)?;
    let c = gpu.alloc(bytes)?;
    let mut pinned = gpu.alloc_host(bytes)?;
    let mut pageable = vec![0xa5u8; bytes];

    // Step 5 (H2).
    let mut bad: Vec<String> = Vec::new();
    let mut bad_iters = 0u32;
    for iter in 0..cfg.iters {
        let value = iter_value(iter);
        let mut iter_bad = false;
        gpu.htod(&a, &pageable)?;
        gpu.launch(
            &write_value,
            grid,
            ptx::BLOCK,
            &stream,
            &[Arg::Buf(&a), Arg::U32(value), Arg::U32(n)],
        )?;
        gpu.dtoh_async(&mut pinned, &a, &stream)?;
        gpu.stream_synchronize(&stream)?;
        if let Some((i, k)) = mismatches(pinned.as_u32(), |_| value) {
            iter_bad = true;
            if bad.len() < 5 {
                bad.push(format!(
                    "iter {iter}: write_value: {k} words differ, first [{i}] = {} (want {value})",
                    pinned.as_u32()[i]
                ));
            }
        }
        gpu.copy_dtod(&b, &a)?;
        for (i, x) in pinned.as_f32_mut().iter_mut().enumerate() {
            *x = float_input(iter, i);
        }
        gpu.copy_pinned_to_dev(&c, &pinned)?;
        gpu.launch(&add_one, grid, ptx::BLOCK, &stream, &[Arg::Buf(&c), Arg::U32(n)])?;
        gpu.launch(
            &scale_vec,
            grid,
            ptx::BLOCK,
            &stream,
            &[Arg::Buf(&c), Arg::F32(FACTOR), Arg::U32(n)],
        )?;
        gpu.stream_synchronize(&stream)?;
        gpu.copy_dev_to_pinned(&mut pinned, &c)?;
        let want = |i: usize| (float_input(iter, i) + 1.0) * FACTOR;
        if let Some((i, k)) = mismatches(pinned.as_f32(), want) {
            iter_bad = true;
            if bad.len() < 5 {
                bad.push(format!(
                    "iter {iter}: add_one+scale_vec: {k} floats differ, first [{i}] = {} (want {})",
                    pinned.as_f32()[i],
                    want(i)
                ));
            }
        }
        gpu.memset_d32(&b, 0, n as usize)?;
        bad_iters += u32::from(iter_bad);
        out.iterations_done = iter + 1;
    }
    if cfg.iters == 0 {
        out.h2.set(false, "no iterations run (--iters 0)");
    } else if bad_iters == 0 {
        out.h2.set(
            true,
            format!(
                "{} iterations: write_value and add_one+scale_vec results exact on all {n} elements",
                cfg.iters
            ),
        );
    } else {
        out.h2.set(
            false,
            format!("{bad_iters} of {} iterations wrong: {}", cfg.iters, bad.join("; ")),
        );
    }

    // Step 6 (H3): byte-exact round trip through A.
    for (i, x) in pageable.iter_mut().enumerate() {
        *x = pattern(i);
    }
    gpu.htod(&a, &pageable)?;
    let mut back = vec![0u8; bytes];
    gpu.dtoh(&mut back, &a)?;
    match mismatches(&back, |i| pageable[i]) {
        None => out.h3.set(true, format!("{bytes} bytes HtoD then DtoH: identical")),
        Some((i, k)) => out.h3.set(
            false,
            format!(
                "{k} of {bytes} bytes differ, first [{i}] = {:#04x} (want {:#04x})",
                back[i], pageable[i]
            ),
        ),
    }

    // Step 7: clean up everything but C (the expected leak).
    gpu.ctx_synchronize()?;
    gpu.free(a)?;
    gpu.free(b)?;
    gpu.free_host(pinned)?;
    let _leaked = c;
    gpu.destroy_stream(stream)?;
    gpu.unload_module(module)?;
    gpu.release_context(ctx)?;
    Ok(())
}

/// Calls per API the sequence makes inside the window when nothing fails (for tests and the
/// printed summary): `iters` loop iterations.
pub fn expected_calls(iters: u64) -> Vec<(&'static str, u64)> {
    use crate::driver::sym::*;
    vec![
        (MODULE_LOAD_DATA, 2),
        (MODULE_GET_FUNCTION, 3),
        (STREAM_CREATE, 1),
        (MEM_ALLOC, 3),
        (MEM_ALLOC_HOST, 1),
        (MEMCPY_HTOD, iters + 1),
        (LAUNCH_KERNEL, 3 * iters),
        (MEMCPY_DTOH_ASYNC, iters),
        (STREAM_SYNCHRONIZE, 2 * iters),
        (MEMCPY, 3 * iters),
        (MEMSET_D32, iters),
        (MEMCPY_DTOH, 1),
        (CTX_SYNCHRONIZE, 1),
        (MEM_FREE, 2),
        (MEM_FREE_HOST, 1),
        (STREAM_DESTROY, 1),
        (MODULE_UNLOAD, 1),
        (PRIMARY_CTX_RELEASE, 1),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sym;
    use crate::emu::{Emu, Faults};

    fn fake_clock() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static T: AtomicU64 = AtomicU64::new(1_000);
        T.fetch_add(10, Ordering::Relaxed)
    }

    fn run(emu: Emu, cfg: Config) -> (Gpu<Emu>, Outcome) {
        let mut gpu = Gpu::new(emu);
        let ctx = setup(&mut gpu, 0).expect("setup");
        let out = measured(&mut gpu, ctx, &cfg, fake_clock);
        (gpu, out)
    }

    const SMALL: Config = Config { iters: 3, elems: 1000 };

    #[test]
    fn every_hypothesis_passes_on_a_correct_driver() {
        let (gpu, out) = run(Emu::default(), SMALL);
        assert!(out.error.is_none(), "{:?}", out.error);
        assert!(out.all_pass(), "{out:#?}");
        assert_eq!(out.invalid_ptx_result, Some(218));
        assert!(out.window_end_ns > out.window_start_ns);
        assert_eq!(out.iterations_done, 3);
        assert!(gpu.driver().live_contexts() == 0);
    }

    #[test]
    fn the_ledger_counts_exactly_what_the_driver_saw() {
        let (gpu, _) = run(Emu::default(), SMALL);
        let emu = gpu.driver();
        // The emulator counts every entry point it is called through, like a perfect observer.
        let seen = emu.calls();
        let mut total = 0;
        for (api, n) in seen {
            assert_eq!(gpu.ledger.calls(api) + gpu.ledger.calls_before(api), *n, "{api}");
            total += n;
        }
        assert_eq!(total, gpu.ledger.total_calls() + 4);
        for (api, n) in expected_calls(3) {
            assert_eq!(gpu.ledger.calls(api), n, "{api}");
        }
        assert_eq!(
            gpu.ledger.total_calls(),
            expected_calls(3).iter().map(|x| x.1).sum::<u64>()
        );
        for api in [
            sym::INIT,
            sym::DEVICE_GET,
            sym::PRIMARY_CTX_RETAIN,
            sym::CTX_SET_CURRENT,
        ] {
            assert_eq!(gpu.ledger.calls_before(api), 1, "{api}");
            assert_eq!(gpu.ledger.calls(api), 0, "{api}");
        }
    }

    #[test]
    fn bytes_kernels_copies_and_the_leak() {
        let (gpu, _) = run(Emu::default(), SMALL);
        let l = &gpu.ledger;
        let b = 4000u64;
        assert_eq!(l.bytes(sym::MEM_ALLOC), 3 * b);
        assert_eq!(l.bytes(sym::MEM_ALLOC_HOST), b);
        assert_eq!(l.bytes(sym::MEM_FREE), 2 * b);
        assert_eq!(l.bytes(sym::MEM_FREE_HOST), b);
        assert_eq!(l.bytes(sym::MEMCPY_HTOD), 4 * b);
        assert_eq!(l.bytes(sym::MEMCPY_DTOH), b);
        assert_eq!(l.bytes(sym::MEMCPY_DTOH_ASYNC), 3 * b);
        assert_eq!(l.bytes(sym::MEMCPY), 9 * b);
        assert_eq!(l.bytes(sym::MEMSET_D32), 3 * b);
        for (k, _) in ptx::KERNELS {
            assert_eq!(l.kernel_launches(k), 3, "{k}");
        }
        let leaks = l.leaks();
        assert_eq!(leaks.len(), 1);
        assert_eq!((leaks[0].api, leaks[0].count, leaks[0].bytes), (sym::MEM_ALLOC, 1, b));
        assert_eq!(gpu.driver().live_device_allocations(), vec![b as usize]);

        let v = l.to_json(&ptx::KERNELS);
        let g = v["generic_copies"].as_array().unwrap();
        let dirs: Vec<(&str, Option<&str>, u64)> = g
            .iter()
            .map(|r| {
                (
                    r["direction"].as_str().unwrap(),
                    r["host_memory"].as_str(),
                    r["count"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            dirs,
            vec![
                ("cpu_to_gpu", Some("pinned"), 3),
                ("gpu_to_cpu", Some("pinned"), 3),
                ("gpu_to_gpu", None, 3)
            ]
        );
        assert_eq!(
            v["kernel_names"][ptx::SCALE_VEC],
            "scale_vec(float*, float, unsigned int)"
        );
    }

    #[test]
    fn a_wrong_kernel_falsifies_h2_only_and_counts_stay_exact() {
        let emu = Emu::new(Faults {
            wrong_kernel: Some(ptx::SCALE_VEC),
            ..Default::default()
        });
        let (gpu, out) = run(emu, SMALL);
        assert!(out.error.is_none());
        assert!(!out.h2.pass);
        assert!(out.h2.detail.contains("add_one+scale_vec"), "{}", out.h2.detail);
        assert!(out.h1.pass && out.h3.pass && out.h9.pass);
        assert!(!out.all_pass());
        assert_eq!(gpu.ledger.calls(sym::LAUNCH_KERNEL), 9);
    }

    #[test]
    fn a_lossy_copy_falsifies_h3() {
        let emu = Emu::new(Faults {
            corrupt_dtoh: true,
            ..Default::default()
        });
        let (_, out) = run(emu, SMALL);
        assert!(!out.h3.pass, "{:?}", out.h3);
        assert!(out.h2.pass);
    }

    #[test]
    fn accepting_invalid_ptx_falsifies_h9_and_the_module_is_unloaded() {
        let emu = Emu::new(Faults {
            accept_anything: true,
            ..Default::default()
        });
        let (gpu, out) = run(emu, SMALL);
        assert!(!out.h9.pass);
        assert_eq!(gpu.ledger.calls(sym::MODULE_UNLOAD), 2);
        assert_eq!(gpu.driver().loaded_modules(), 0);
    }

    #[test]
    fn a_failing_call_stops_the_sequence_with_its_name() {
        let emu = Emu::new(Faults {
            fail: Some((sym::MEM_ALLOC_HOST, 2)),
            ..Default::default()
        });
        let (gpu, out) = run(emu, SMALL);
        let err = out.error.clone().unwrap();
        assert!(
            err.contains("cuMemAllocHost_v2") && err.contains("CUDA_ERROR_OUT_OF_MEMORY"),
            "{err}"
        );
        assert!(!out.all_pass());
        assert!(out.h1.pass && out.h9.pass);
        assert_eq!(out.h2.detail, "not reached");
        assert_eq!(gpu.ledger.calls(sym::MEM_ALLOC_HOST), 1);
        let failed = &gpu.ledger.to_json(&[])["failed_calls"];
        assert_eq!(failed.as_array().unwrap().len(), 2, "{failed}");
        assert_eq!(failed[0]["api"], "cuMemAllocHost_v2");
        assert_eq!(failed[0]["result"], 2);
        assert_eq!(gpu.ledger.calls(sym::LAUNCH_KERNEL), 0);
    }

    #[test]
    fn setup_reports_a_missing_device() {
        let emu = Emu::new(Faults {
            fail: Some((sym::INIT, 100)),
            ..Default::default()
        });
        let mut gpu = Gpu::new(emu);
        let err = setup(&mut gpu, 0).err().unwrap();
        assert_eq!(err.to_string(), "cuInit failed: CUDA_ERROR_NO_DEVICE (100)");
    }

    #[test]
    fn grid_covers_every_element() {
        assert_eq!(Config::default().grid(), 4096);
        assert_eq!(SMALL.grid(), 4);
        assert_eq!(Config { iters: 1, elems: 256 }.grid(), 1);
        assert_eq!(Config::default().bytes(), 4 << 20);
    }
}
