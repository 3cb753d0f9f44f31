//! Our own CUDA driver FFI: the few entry points this workload calls, resolved with `dlsym`
//! from `libcuda.so.1` at run time (no CUDA crate, no link-time dependency).
//!
//! [`Driver`] is the raw interface (one method per driver entry point, CUresult codes as
//! errors); [`LibCuda`] implements it with the real library. The symbol names in [`sym`] are
//! the exact ones resolved: where `cuda.h` `#define`s a plain name to a `_v2` symbol, the `_v2`
//! symbol is the one called, as a program compiled against the headers would.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::fmt;

use libloading::Library;

/// `CUresult`.
pub type CuResult = c_int;
/// `CUdevice`.
pub type CuDevice = c_int;
/// `CUdeviceptr` (64-bit since the `_v2` API).
pub type CuDevicePtr = u64;
/// Opaque handles (`CUcontext`, `CUmodule`, `CUfunction`, `CUstream`), as an address.
pub type Handle = usize;

pub const CUDA_SUCCESS: CuResult = 0;

/// Exact symbol names, as resolved with `dlsym` and as the observer reports them in `api`.
pub mod sym {
    pub const INIT: &str = "cuInit";
    pub const DEVICE_GET: &str = "cuDeviceGet";
    pub const PRIMARY_CTX_RETAIN: &str = "cuDevicePrimaryCtxRetain";
    pub const PRIMARY_CTX_RELEASE: &str = "cuDevicePrimaryCtxRelease_v2";
    pub const CTX_SET_CURRENT: &str = "cuCtxSetCurrent";
    pub const CTX_SYNCHRONIZE: &str = "cuCtxSynchronize";
    pub const MODULE_LOAD_DATA: &str = "cuModuleLoadData";
    pub const MODULE_GET_FUNCTION: &str = "cuModuleGetFunction";
    pub const MODULE_UNLOAD: &str = "cuModuleUnload";
    pub const STREAM_CREATE: &str = "cuStreamCreate";
    pub const STREAM_SYNCHRONIZE: &str = "cuStreamSynchronize";
    pub const STREAM_DESTROY: &str = "cuStreamDestroy_v2";
    pub const MEM_ALLOC: &str = "cuMemAlloc_v2";
    pub const MEM_ALLOC_HOST: &str = "cuMemAllocHost_v2";
    pub const MEM_FREE: &str = "cuMemFree_v2";
    pub const MEM_FREE_HOST: &str = "cuMemFreeHost";
    pub const MEMCPY_HTOD: &str = "cuMemcpyHtoD_v2";
    pub const MEMCPY_DTOH: &str = "cuMemcpyDtoH_v2";
    pub const MEMCPY_DTOH_ASYNC: &str = "cuMemcpyDtoHAsync_v2";
    pub const MEMCPY: &str = "cuMemcpy";
    pub const MEMSET_D32: &str = "cuMemsetD32_v2";
    pub const LAUNCH_KERNEL: &str = "cuLaunchKernel";
}

/// The name of a CUresult, for messages. A local table: calling `cuGetErrorName` would be
/// one more driver call inside the measured window.
pub fn error_name(code: CuResult) -> String {
    let name = match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        218 => "CUDA_ERROR_INVALID_PTX",
        221 => "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
        222 => "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        223 => "CUDA_ERROR_JIT_COMPILATION_DISABLED",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        500 => "CUDA_ERROR_NOT_FOUND",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return format!("CUresult {code}"),
    };
    name.to_string()
}

fn check(code: CuResult) -> Result<(), CuResult> {
    if code == CUDA_SUCCESS { Ok(()) } else { Err(code) }
}

/// The driver entry points this workload uses, one method each; errors are CUresult codes.
///
/// Every method that takes a handle, a device address or a host pointer is `unsafe`: the
/// driver dereferences them. The safe layer above ([`crate::gpu::Gpu`]) only passes values it
/// obtained from the same driver.
pub trait Driver {
    fn init(&mut self, flags: u32) -> Result<(), CuResult>;
    fn device_get(&mut self, ordinal: i32) -> Result<CuDevice, CuResult>;
    fn primary_ctx_retain(&mut self, dev: CuDevice) -> Result<Handle, CuResult>;
    /// # Safety
    /// `ctx` must be a live context of this driver.
    unsafe fn ctx_set_current(&mut self, ctx: Handle) -> Result<(), CuResult>;
    fn ctx_synchronize(&mut self) -> Result<(), CuResult>;
    fn primary_ctx_release(&mut self, dev: CuDevice) -> Result<(), CuResult>;
    fn module_load_data(&mut self, image: &CStr) -> Result<Handle, CuResult>;
    /// # Safety
    /// `module` must be a loaded module of this driver.
    unsafe fn module_get_function(&mut self, module: Handle, name: &CStr) -> Result<Handle, CuResult>;
    /// # Safety
    /// `module` must be a loaded module of this driver, not used afterwards.
    unsafe fn module_unload(&mut self, module: Handle) -> Result<(), CuResult>;
    fn stream_create(&mut self, flags: u32) -> Result<Handle, CuResult>;
    /// # Safety
    /// `stream` must be a live stream of this driver.
    unsafe fn stream_synchronize(&mut self, stream: Handle) -> Result<(), CuResult>;
    /// # Safety
    /// `stream` must be a live stream of this driver, not used afterwards.
    unsafe fn stream_destroy(&mut self, stream: Handle) -> Result<(), CuResult>;
    fn mem_alloc(&mut self, bytes: usize) -> Result<CuDevicePtr, CuResult>;
    fn mem_alloc_host(&mut self, bytes: usize) -> Result<*mut c_void, CuResult>;
    /// # Safety
    /// `ptr` must be a live allocation of [`Driver::mem_alloc`], not used afterwards.
    unsafe fn mem_free(&mut self, ptr: CuDevicePtr) -> Result<(), CuResult>;
    /// # Safety
    /// `ptr` must be a live allocation of [`Driver::mem_alloc_host`], not used afterwards.
    unsafe fn mem_free_host(&mut self, ptr: *mut c_void) -> Result<(), CuResult>;
    /// # Safety
    /// `dst` must hold `bytes` bytes of device memory and `src` must be readable for `bytes`.
    unsafe fn memcpy_htod(&mut self, dst: CuDevicePtr, src: *const c_void, bytes: usize) -> Result<(), CuResult>;
    /// # Safety
    /// `dst` must be writable for `bytes` and `src` must hold `bytes` bytes of device memory.
    unsafe fn memcpy_dtoh(&mut self, dst: *mut c_void, src: CuDevicePtr, bytes: usize) -> Result<(), CuResult>;
    /// # Safety
    /// As [`Driver::memcpy_dtoh`], with `dst` page-locked, `stream` live, and `dst` left alone
    /// until the stream is synchronized.
    unsafe fn memcpy_dtoh_async(
        &mut self,
        dst: *mut c_void,
        src: CuDevicePtr,
        bytes: usize,
        stream: Handle,
    ) -> Result<(), CuResult>;
    /// Generic (unified addressing) copy.
    ///
    /// # Safety
    /// `dst` and `src` must be device or page-locked host addresses valid for `bytes`.
    unsafe fn memcpy(&mut self, dst: CuDevicePtr, src: CuDevicePtr, bytes: usize) -> Result<(), CuResult>;
    /// # Safety
    /// `dst` must hold `n` 32-bit words of device memory.
    unsafe fn memset_d32(&mut self, dst: CuDevicePtr, value: u32, n: usize) -> Result<(), CuResult>;
    /// # Safety
    /// `function` and `stream` must be live handles of this driver and `params` must point to
    /// one value per kernel parameter, each of the parameter's size.
    unsafe fn launch_kernel(
        &mut self,
        function: Handle,
        grid: [u32; 3],
        block: [u32; 3],
        shared_mem_bytes: u32,
        stream: Handle,
        params: &mut [*mut c_void],
    ) -> Result<(), CuResult>;
}

/// Why the driver library could not be used.
#[derive(Debug)]
pub enum LoadError {
    Open {
        path: String,
        reason: String,
    },
    Symbol {
        path: String,
        symbol: &'static str,
        reason: String,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Open { path, reason } => write!(
                f,
                "cannot load the CUDA driver library {path}: {reason} (is the NVIDIA driver installed? \
                 pass --libcuda PATH to use another file)"
            ),
            LoadError::Symbol { path, symbol, reason } => {
                write!(
                    f,
                    "{path} lacks the driver entry point {symbol}: {reason} (driver too old, or not libcuda?)"
                )
            }
        }
    }
}

impl std::error::Error for LoadError {}

/// Declares the function-pointer table: field name, symbol constant, C prototype (from cuda.h).
macro_rules! table {
    ($( $field:ident = $sym:path : fn($($arg:ty),*); )*) => {
        struct Table {
            $( $field: unsafe extern "C" fn($($arg),*) -> CuResult, )*
        }

        impl Table {
            fn resolve(lib: &Library, path: &str) -> Result<Self, LoadError> {
                Ok(Self {
                    $( $field: {
                        // SAFETY: the prototype declared here is the one cuda.h gives this symbol.
                        let s = unsafe { lib.get::<unsafe extern "C" fn($($arg),*) -> CuResult>($sym.as_bytes()) };
                        *s.map_err(|e| LoadError::Symbol { path: path.to_string(), symbol: $sym, reason: e.to_string() })?
                    }, )*
                })
            }
        }
    };
}

table! {
    init = sym::INIT: fn(c_uint);
    device_get = sym::DEVICE_GET: fn(*mut CuDevice, c_int);
    primary_ctx_retain = sym::PRIMARY_CTX_RETAIN: fn(*mut *mut c_void, CuDevice);
    primary_ctx_release = sym::PRIMARY_CTX_RELEASE: fn(CuDevice);
    ctx_set_current = sym::CTX_SET_CURRENT: fn(*mut c_void);
    ctx_synchronize = sym::CTX_SYNCHRONIZE: fn();
    module_load_data = sym::MODULE_LOAD_DATA: fn(*mut *mut c_void, *const c_void);
    module_get_function = sym::MODULE_GET_FUNCTION: fn(*mut *mut c_void, *mut c_void, *const c_char);
    module_unload = sym::MODULE_UNLOAD: fn(*mut c_void);
    stream_create = sym::STREAM_CREATE: fn(*mut *mut c_void, c_uint);
    stream_synchronize = sym::STREAM_SYNCHRONIZE: fn(*mut c_void);
    stream_destroy = sym::STREAM_DESTROY: fn(*mut c_void);
    mem_alloc = sym::MEM_ALLOC: fn(*mut CuDevicePtr, usize);
    mem_alloc_host = sym::MEM_ALLOC_HOST: fn(*mut *mut c_void, usize);
    mem_free = sym::MEM_FREE: fn(CuDevicePtr);
    mem_free_host = sym::MEM_FREE_HOST: fn(*mut c_void);
    memcpy_htod = sym::MEMCPY_HTOD: fn(CuDevicePtr, *const c_void, usize);
    memcpy_dtoh = sym::MEMCPY_DTOH: fn(*mut c_void, CuDevicePtr, usize);
    memcpy_dtoh_async = sym::MEMCPY_DTOH_ASYNC: fn(*mut c_void, CuDevicePtr, usize, *mut c_void);
    memcpy = sym::MEMCPY: fn(CuDevicePtr, CuDevicePtr, usize);
    memset_d32 = sym::MEMSET_D32: fn(CuDevicePtr, c_uint, usize);
    launch_kernel = sym::LAUNCH_KERNEL: fn(
        *mut c_void, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, *mut c_void,
        *mut *mut c_void, *mut *mut c_void
    );
}

/// The real driver, loaded with `dlopen`.
pub struct LibCuda {
    table: Table,
    path: String,
    // Last: the function pointers in `table` are valid only while the library stays loaded.
    _lib: Library,
}

impl LibCuda {
    /// `dlopen`s `path` (a bare name such as `libcuda.so.1` goes through the loader's search)
    /// and resolves every entry point, or says which one is missing.
    pub fn load(path: &str) -> Result<Self, LoadError> {
        // SAFETY: loading runs the library's initializers; the file is trusted to be the CUDA
        // driver (or the path the user named with --libcuda).
        let lib = unsafe { Library::new(path) }.map_err(|e| LoadError::Open {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
        let table = Table::resolve(&lib, path)?;
        Ok(Self {
            table,
            path: path.to_string(),
            _lib: lib,
        })
    }

    pub fn path(&self) -> &str {
        &self.path
    }
}

fn h(ptr: *mut c_void) -> Handle {
    ptr as Handle
}

fn p(handle: Handle) -> *mut c_void {
    handle as *mut c_void
}

impl Driver for LibCuda {
    fn init(&mut self, flags: u32) -> Result<(), CuResult> {
        // SAFETY: cuInit takes a plain integer.
        check(unsafe { (self.table.init)(flags) })
    }

    fn device_get(&mut self, ordinal: i32) -> Result<CuDevice, CuResult> {
        let mut dev: CuDevice = 0;
        // SAFETY: `dev` is a valid out-pointer for the call's duration.
        check(unsafe { (self.table.device_get)(&mut dev, ordinal) })?;
        Ok(dev)
    }

    fn primary_ctx_retain(&mut self, dev: CuDevice) -> Result<Handle, CuResult> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer for the call's duration.
        check(unsafe { (self.table.primary_ctx_retain)(&mut ctx, dev) })?;
        Ok(h(ctx))
    }

    unsafe fn ctx_set_current(&mut self, ctx: Handle) -> Result<(), CuResult> {
        // SAFETY: the caller passes a live context (trait contract).
        check(unsafe { (self.table.ctx_set_current)(p(ctx)) })
    }

    fn ctx_synchronize(&mut self) -> Result<(), CuResult> {
        // SAFETY: no arguments.
        check(unsafe { (self.table.ctx_synchronize)() })
    }

    fn primary_ctx_release(&mut self, dev: CuDevice) -> Result<(), CuResult> {
        // SAFETY: takes a device ordinal handle; the driver validates it.
        check(unsafe { (self.table.primary_ctx_release)(dev) })
    }

    fn module_load_data(&mut self, image: &CStr) -> Result<Handle, CuResult> {
        let mut module = std::ptr::null_mut();
        // SAFETY: `module` is a valid out-pointer and `image` a NUL-terminated PTX text that
        // outlives the call.
        check(unsafe { (self.table.module_load_data)(&mut module, image.as_ptr().cast()) })?;
        Ok(h(module))
    }

    unsafe fn module_get_function(&mut self, module: Handle, name: &CStr) -> Result<Handle, CuResult> {
        let mut f = std::ptr::null_mut();
        // SAFETY: valid out-pointer, NUL-terminated name, live module (trait contract).
        check(unsafe { (self.table.module_get_function)(&mut f, p(module), name.as_ptr()) })?;
        Ok(h(f))
    }

    unsafe fn module_unload(&mut self, module: Handle) -> Result<(), CuResult> {
        // SAFETY: live module, not used afterwards (trait contract).
        check(unsafe { (self.table.module_unload)(p(module)) })
    }

    fn stream_create(&mut self, flags: u32) -> Result<Handle, CuResult> {
        let mut s = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-pointer for the call's duration.
        check(unsafe { (self.table.stream_create)(&mut s, flags) })?;
        Ok(h(s))
    }

    unsafe fn stream_synchronize(&mut self, stream: Handle) -> Result<(), CuResult> {
        // SAFETY: live stream (trait contract).
        check(unsafe { (self.table.stream_synchronize)(p(stream)) })
    }

    unsafe fn stream_destroy(&mut self, stream: Handle) -> Result<(), CuResult> {
        // SAFETY: live stream, not used afterwards (trait contract).
        check(unsafe { (self.table.stream_destroy)(p(stream)) })
    }

    fn mem_alloc(&mut self, bytes: usize) -> Result<CuDevicePtr, CuResult> {
        let mut d: CuDevicePtr = 0;
        // SAFETY: `d` is a valid out-pointer for the call's duration.
        check(unsafe { (self.table.mem_alloc)(&mut d, bytes) })?;
        Ok(d)
    }

    fn mem_alloc_host(&mut self, bytes: usize) -> Result<*mut c_void, CuResult> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer for the call's duration.
        check(unsafe { (self.table.mem_alloc_host)(&mut ptr, bytes) })?;
        Ok(ptr)
    }

    unsafe fn mem_free(&mut self, ptr: CuDevicePtr) -> Result<(), CuResult> {
        // SAFETY: live device allocation, not used afterwards (trait contract).
        check(unsafe { (self.table.mem_free)(ptr) })
    }

    unsafe fn mem_free_host(&mut self, ptr: *mut c_void) -> Result<(), CuResult> {
        // SAFETY: live page-locked allocation, not used afterwards (trait contract).
        check(unsafe { (self.table.mem_free_host)(ptr) })
    }

    unsafe fn memcpy_htod(&mut self, dst: CuDevicePtr, src: *const c_void, bytes: usize) -> Result<(), CuResult> {
        // SAFETY: sizes and pointers are valid (trait contract).
        check(unsafe { (self.table.memcpy_htod)(dst, src, bytes) })
    }

    unsafe fn memcpy_dtoh(&mut self, dst: *mut c_void, src: CuDevicePtr, bytes: usize) -> Result<(), CuResult> {
        // SAFETY: sizes and pointers are valid (trait contract).
        check(unsafe { (self.table.memcpy_dtoh)(dst, src, bytes) })
    }

    unsafe fn memcpy_dtoh_async(
        &mut self,
        dst: *mut c_void,
        src: CuDevicePtr,
        bytes: usize,
        stream: Handle,
    ) -> Result<(), CuResult> {
        // SAFETY: sizes, pointers and stream are valid (trait contract).
        check(unsafe { (self.table.memcpy_dtoh_async)(dst, src, bytes, p(stream)) })
    }

    unsafe fn memcpy(&mut self, dst: CuDevicePtr, src: CuDevicePtr, bytes: usize) -> Result<(), CuResult> {
        // SAFETY: both addresses are valid for `bytes` (trait contract).
        check(unsafe { (self.table.memcpy)(dst, src, bytes) })
    }

    unsafe fn memset_d32(&mut self, dst: CuDevicePtr, value: u32, n: usize) -> Result<(), CuResult> {
        // SAFETY: `dst` holds `n` words (trait contract).
        check(unsafe { (self.table.memset_d32)(dst, value, n) })
    }

    unsafe fn launch_kernel(
        &mut self,
        function: Handle,
        grid: [u32; 3],
        block: [u32; 3],
        shared_mem_bytes: u32,
        stream: Handle,
        params: &mut [*mut c_void],
    ) -> Result<(), CuResult> {
        // SAFETY: live handles and one correctly sized value per parameter (trait contract);
        // `extra` is null.
        check(unsafe {
            (self.table.launch_kernel)(
                p(function),
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                shared_mem_bytes,
                p(stream),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_a_clean_error() {
        let err = LibCuda::load("/nonexistent/dir/libcuda.so.1").err().expect("must fail");
        let msg = err.to_string();
        assert!(matches!(err, LoadError::Open { .. }));
        assert!(msg.contains("/nonexistent/dir/libcuda.so.1"), "{msg}");
        assert!(msg.contains("--libcuda"), "{msg}");
    }

    #[test]
    fn a_file_that_is_not_a_library_is_a_clean_error() {
        let dir = std::env::temp_dir().join(format!("cgt-notlib-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("libcuda.so.1");
        std::fs::write(&f, b"not an ELF file").unwrap();
        let err = LibCuda::load(f.to_str().unwrap()).err().expect("must fail");
        assert!(matches!(err, LoadError::Open { .. }), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_library_without_the_symbols_names_the_first_missing_one() {
        // libc is loaded in every process and exports none of the driver's entry points.
        let err = LibCuda::load("libc.so.6").err().expect("must fail");
        match &err {
            LoadError::Symbol { symbol, .. } => assert_eq!(*symbol, sym::INIT),
            other => panic!("unexpected {other}"),
        }
        assert!(err.to_string().contains("cuInit"));
    }

    #[test]
    fn error_names() {
        assert_eq!(error_name(218), "CUDA_ERROR_INVALID_PTX");
        assert_eq!(error_name(100), "CUDA_ERROR_NO_DEVICE");
        assert_eq!(error_name(12345), "CUresult 12345");
    }
}
