//! The PTX module this workload loads (hand-written, PTX ISA 7.0 for `sm_70`: any driver of
//! CUDA 11.0 or later JIT-compiles it for the GPU at hand), and a deliberately broken one.

/// `write_value(u32* out, u32 value, u32 n)`: `out[i] = value` for `i < n`.
pub const WRITE_VALUE: &str = "write_value";
/// `add_one(f32* data, u32 n)`: `data[i] += 1.0` for `i < n`.
pub const ADD_ONE: &str = "add_one";
/// `scale_vec(float*, float, unsigned int)` with C++ linkage: `data[i] *= factor` for `i < n`.
pub const SCALE_VEC: &str = "_Z9scale_vecPffj";

/// Every entry of [`MODULE`] with the name a demangler gives it (what the observer reports in
/// a launch's `kernel`); extern "C" names demangle to themselves.
pub const KERNELS: [(&str, &str); 3] = [
    (WRITE_VALUE, "write_value"),
    (ADD_ONE, "add_one"),
    (SCALE_VEC, "scale_vec(float*, float, unsigned int)"),
];

/// Threads per block of every launch.
pub const BLOCK: u32 = 256;

/// Three `.entry` kernels, each guarded by `i < n` with `i = ctaid.x * ntid.x + tid.x`.
pub const MODULE: &str = r#"//
// cuda-ground-truth: three kernels with known names (two extern "C", one C++-mangled).
//
.version 7.0
.target sm_70
.address_size 64

.visible .entry write_value(
    .param .u64 write_value_out,
    .param .u32 write_value_value,
    .param .u32 write_value_n
)
{
    .reg .pred  %p<2>;
    .reg .b32   %r<8>;
    .reg .b64   %rd<5>;

    ld.param.u64    %rd1, [write_value_out];
    ld.param.u32    %r1, [write_value_value];
    ld.param.u32    %r2, [write_value_n];
    mov.u32         %r3, %ctaid.x;
    mov.u32         %r4, %ntid.x;
    mov.u32         %r5, %tid.x;
    mad.lo.s32      %r6, %r3, %r4, %r5;
    setp.ge.u32     %p1, %r6, %r2;
    @%p1 bra        WRITE_VALUE_DONE;
    cvta.to.global.u64  %rd2, %rd1;
    mul.wide.u32    %rd3, %r6, 4;
    add.s64         %rd4, %rd2, %rd3;
    st.global.u32   [%rd4], %r1;
WRITE_VALUE_DONE:
    ret;
}

.visible .entry add_one(
    .param .u64 add_one_data,
    .param .u32 add_one_n
)
{
    .reg .pred  %p<2>;
    .reg .b32   %r<8>;
    .reg .f32   %f<3>;
    .reg .b64   %rd<5>;

    ld.param.u64    %rd1, [add_one_data];
    ld.param.u32    %r2, [add_one_n];
    mov.u32         %r3, %ctaid.x;
    mov.u32         %r4, %ntid.x;
    mov.u32         %r5, %tid.x;
    mad.lo.s32      %r6, %r3, %r4, %r5;
    setp.ge.u32     %p1, %r6, %r2;
    @%p1 bra        ADD_ONE_DONE;
    cvta.to.global.u64  %rd2, %rd1;
    mul.wide.u32    %rd3, %r6, 4;
    add.s64         %rd4, %rd2, %rd3;
    ld.global.f32   %f1, [%rd4];
    add.rn.f32      %f2, %f1, 0f3F800000;
    st.global.f32   [%rd4], %f2;
ADD_ONE_DONE:
    ret;
}

.visible .entry _Z9scale_vecPffj(
    .param .u64 scale_vec_data,
    .param .f32 scale_vec_factor,
    .param .u32 scale_vec_n
)
{
    .reg .pred  %p<2>;
    .reg .b32   %r<8>;
    .reg .f32   %f<4>;
    .reg .b64   %rd<5>;

    ld.param.u64    %rd1, [scale_vec_data];
    ld.param.f32    %f3, [scale_vec_factor];
    ld.param.u32    %r2, [scale_vec_n];
    mov.u32         %r3, %ctaid.x;
    mov.u32         %r4, %ntid.x;
    mov.u32         %r5, %tid.x;
    mad.lo.s32      %r6, %r3, %r4, %r5;
    setp.ge.u32     %p1, %r6, %r2;
    @%p1 bra        SCALE_VEC_DONE;
    cvta.to.global.u64  %rd2, %rd1;
    mul.wide.u32    %rd3, %r6, 4;
    add.s64         %rd4, %rd2, %rd3;
    ld.global.f32   %f1, [%rd4];
    mul.rn.f32      %f2, %f1, %f3;
    st.global.f32   [%rd4], %f2;
SCALE_VEC_DONE:
    ret;
}
"#;

/// Not PTX the JIT can compile (H9: the load must fail with an error code, not crash).
pub const INVALID_MODULE: &str = ".version 7.0\n.target sm_70\n.address_size 64\n\
.visible .entry broken(\n{\n    this is not an instruction;\n    st.global.u32 [%nowhere], 1;\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_declares_each_kernel_once() {
        for (entry, _) in KERNELS {
            let decl = format!(".visible .entry {entry}(");
            assert_eq!(MODULE.matches(&decl).count(), 1, "{entry}");
        }
        assert_eq!(MODULE.matches(".entry").count(), KERNELS.len());
        assert!(!MODULE.contains('\0') && !INVALID_MODULE.contains('\0'));
        assert!(!INVALID_MODULE.contains("ret;"));
    }

    #[test]
    fn braces_balance_in_the_valid_module_only() {
        let bal = |s: &str| s.matches('{').count() as i64 - s.matches('}').count() as i64;
        assert_eq!(bal(MODULE), 0);
        assert_ne!(bal(INVALID_MODULE), 0);
    }
}
