//! C++ kernel names as the CUDA tools print them.
//!
//! torch.profiler (Kineto), Nsight Systems and `c++filt` all render names with the GNU
//! demangler (libstdc++'s `__cxa_demangle`). `cpp_demangle` reads the same names but prints
//! them in another style (`(unsigned long)1` for `1ul`, a return type on a local name's
//! enclosing function), so a user comparing our names with the profiler's would see two
//! spellings of one kernel. We therefore print with libstdc++ when the host has it (looked
//! up once, at run time: no link-time dependency), and fall back to `cpp_demangle`.
//!
//! Names come from the memory of observed processes, so they are untrusted input to a root
//! agent: a name reaches libstdc++ only after `cpp_demangle`, which bounds its recursion,
//! has parsed it, and only up to [`MAX_GNU_LEN`] bytes.

use std::{
    ffi::{CStr, CString, c_char, c_int},
    sync::OnceLock,
};

/// Longest name handed to libstdc++; longer ones (none seen in practice: PyTorch's longest
/// are ~1 KiB) are printed by `cpp_demangle`.
const MAX_GNU_LEN: usize = 16 * 1024;

type CxaDemangle = unsafe extern "C" fn(*const c_char, *mut c_char, *mut usize, *mut c_int) -> *mut c_char;

struct Gnu {
    demangle: CxaDemangle,
    /// Keeps the library mapped for as long as `demangle` may be called.
    _lib: libloading::Library,
}

fn gnu() -> Option<&'static Gnu> {
    static GNU: OnceLock<Option<Gnu>> = OnceLock::new();
    GNU.get_or_init(|| {
        // SAFETY: libstdc++ is the system C++ runtime; loading it runs only its own
        // initializers, which have no preconditions.
        let lib = unsafe { libloading::Library::new("libstdc++.so.6") }.ok()?;
        // SAFETY: `__cxa_demangle` has this signature in the Itanium C++ ABI.
        let demangle = unsafe { lib.get::<CxaDemangle>(b"__cxa_demangle\0") }.ok()?;
        let demangle = *demangle;
        Some(Gnu { demangle, _lib: lib })
    })
    .as_ref()
}

fn gnu_demangle(g: &Gnu, mangled: &str) -> Option<String> {
    let c = CString::new(mangled).ok()?;
    let mut status: c_int = -1;
    // SAFETY: a NUL-terminated input, a null buffer (libstdc++ mallocs the result) and a valid
    // status pointer, as the ABI requires; `__cxa_demangle` is thread-safe.
    let out = unsafe { (g.demangle)(c.as_ptr(), std::ptr::null_mut(), std::ptr::null_mut(), &mut status) };
    if out.is_null() {
        return None;
    }
    // SAFETY: on success `out` is a NUL-terminated string that libstdc++ malloc'ed for us.
    let s = (status == 0).then(|| unsafe { CStr::from_ptr(out) }.to_string_lossy().into_owned());
    // SAFETY: `out` came from malloc in `__cxa_demangle` and is freed once, here.
    unsafe { libc::free(out.cast()) };
    s
}

/// Which demangler prints names on this host (for the summary and the logs).
pub fn style() -> &'static str {
    if gnu().is_some() { "gnu" } else { "cpp_demangle" }
}

/// Demangles an Itanium C++ name; anything else (`extern "C"` kernels such as cuBLAS's
/// `sm80_xmma_*`) is returned as it is.
pub fn demangle(mangled: &str) -> String {
    let Ok(sym) = cpp_demangle::Symbol::new(mangled) else {
        return mangled.to_string();
    };
    if mangled.len() <= MAX_GNU_LEN
        && let Some(s) = gnu().and_then(|g| gnu_demangle(g, mangled))
    {
        return s;
    }
    sym.demangle(&cpp_demangle::DemangleOptions::default())
        .unwrap_or_else(|_| mangled.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real PyTorch 2.11 kernels (H100 run) and the names torch.profiler printed for them.
    const TORCH: [(&str, &str); 2] = [
        (
            "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_",
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
        ),
        (
            "_ZN2at6native18elementwise_kernelILi128ELi2EZNS0_22gpu_kernel_impl_nocastIZZZNS0_24mse_backward_cuda_kernelERNS_14TensorIteratorERKN3c106ScalarEENKUlvE_clEvENKUlvE0_clEvEUlfffE_EEvRNS_18TensorIteratorBaseERKT_EUliE_EEviT1_",
            "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::mse_backward_cuda_kernel(at::TensorIterator&, c10::Scalar const&)::{lambda()#1}::operator()() const::{lambda()#2}::operator()() const::{lambda(float, float, float)#1}>(at::TensorIteratorBase&, at::native::mse_backward_cuda_kernel(at::TensorIterator&, c10::Scalar const&)::{lambda()#1}::operator()() const::{lambda()#2}::operator()() const::{lambda(float, float, float)#1} const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::mse_backward_cuda_kernel(at::TensorIterator&, c10::Scalar const&)::{lambda()#1}::operator()() const::{lambda()#2}::operator()() const::{lambda(float, float, float)#1}>(at::TensorIteratorBase&, at::native::mse_backward_cuda_kernel(at::TensorIterator&, c10::Scalar const&)::{lambda()#1}::operator()() const::{lambda()#2}::operator()() const::{lambda(float, float, float)#1} const&)::{lambda(int)#1})",
        ),
    ];

    #[test]
    fn names_match_the_profilers_spelling() {
        // The build and CI machines have libstdc++ (gcc is a set-up dependency).
        assert_eq!(style(), "gnu");
        for (mangled, profiler) in TORCH {
            assert_eq!(demangle(mangled), profiler);
        }
    }

    #[test]
    fn cpp_demangle_alone_differs_only_in_style() {
        // Documents why libstdc++ is preferred: the fallback spells the literal differently.
        let fallback = cpp_demangle::Symbol::new(TORCH[0].0)
            .unwrap()
            .demangle(&cpp_demangle::DemangleOptions::default())
            .unwrap();
        assert!(fallback.contains("std::array<char*, (unsigned long)1>"), "{fallback}");
    }

    #[test]
    fn c_names_and_garbage_pass_through() {
        let cublas = "sm80_xmma_gemm_f32f32_f32f32_f32_nt_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4_alignc4_execute_kernel__5x_cublas";
        assert_eq!(demangle(cublas), cublas);
        assert_eq!(demangle("add_one"), "add_one");
        assert_eq!(demangle("_Z"), "_Z");
        assert_eq!(demangle("_Z9scale_vecPffj"), "scale_vec(float*, float, unsigned int)");
        // Deep nesting is refused by cpp_demangle's limits and never reaches libstdc++.
        let deep = format!("_Z1f{}i{}", "PFv".repeat(5000), "E".repeat(5000));
        assert_eq!(demangle(&deep).len(), deep.len());
    }
}
