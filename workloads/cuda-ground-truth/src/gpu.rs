//! The safe layer: typed handles and buffers over a [`Driver`], and a [`Ledger`] entry for
//! every driver call made (exact symbol name, bytes, kernel names, copy directions).

use std::ffi::{CString, c_void};
use std::fmt;

use crate::driver::{CuDevice, CuDevicePtr, CuResult, Driver, Handle, error_name, sym};
use crate::ledger::{Dir, HostMem, Ledger};

/// A failed step: a driver call that returned an error, or a check of this layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GtError {
    Cuda { api: &'static str, code: CuResult },
    Check(String),
}

impl fmt::Display for GtError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GtError::Cuda { api, code } => write!(f, "{api} failed: {} ({code})", error_name(*code)),
            GtError::Check(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for GtError {}

pub type GtResult<T> = Result<T, GtError>;

/// The primary context of a device, retained.
pub struct Context {
    dev: CuDevice,
    raw: Handle,
}

pub struct Module(Handle);

pub struct Function {
    raw: Handle,
    /// Entry name, as in the PTX.
    name: &'static str,
}

impl Function {
    pub fn name(&self) -> &'static str {
        self.name
    }
}

pub struct Stream(Handle);

/// A device allocation of `bytes` bytes.
#[derive(Debug)]
pub struct DevBuf {
    ptr: CuDevicePtr,
    bytes: usize,
}

impl DevBuf {
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// Page-locked host memory from `cuMemAllocHost_v2`, viewed as 32-bit words.
#[derive(Debug)]
pub struct Pinned {
    ptr: *mut c_void,
    bytes: usize,
}

impl Pinned {
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn as_u32(&self) -> &[u32] {
        // SAFETY: `ptr` is a live, 4-byte-aligned allocation of `bytes` bytes (checked at
        // allocation) that no device operation writes while `self` is borrowed: asynchronous
        // copies into it are followed by a synchronize before it is read.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u32>(), self.bytes / 4) }
    }

    pub fn as_u32_mut(&mut self) -> &mut [u32] {
        // SAFETY: as in `as_u32`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u32>(), self.bytes / 4) }
    }

    pub fn as_f32(&self) -> &[f32] {
        // SAFETY: as in `as_u32`; every bit pattern is a valid f32.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<f32>(), self.bytes / 4) }
    }

    pub fn as_f32_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `as_u32_mut`; every bit pattern is a valid f32.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<f32>(), self.bytes / 4) }
    }

    fn addr(&self) -> CuDevicePtr {
        self.ptr as CuDevicePtr
    }
}

/// One kernel argument.
#[derive(Clone, Copy)]
pub enum Arg<'a> {
    Buf(&'a DevBuf),
    U32(u32),
    F32(f32),
}

/// One parameter value, 8-byte aligned, its bytes at the start (the driver reads the
/// parameter's size from the pointer it is given).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct Slot([u8; 8]);

impl Slot {
    fn new(a: &Arg<'_>) -> Self {
        let mut s = [0u8; 8];
        match a {
            Arg::Buf(b) => s.copy_from_slice(&b.ptr.to_ne_bytes()),
            Arg::U32(v) => s[..4].copy_from_slice(&v.to_ne_bytes()),
            Arg::F32(v) => s[..4].copy_from_slice(&v.to_ne_bytes()),
        }
        Slot(s)
    }
}

/// The driver plus the ledger of every call made through it.
pub struct Gpu<D: Driver> {
    drv: D,
    pub ledger: Ledger,
}

/// Evaluates a driver call, then records its CUresult if it failed (see [`Gpu::done`]).
macro_rules! call {
    ($gpu:ident, $api:expr, $r:expr) => {{
        let r = $r;
        $gpu.done($api, r)
    }};
}

fn need(cond: bool, what: impl FnOnce() -> String) -> GtResult<()> {
    if cond { Ok(()) } else { Err(GtError::Check(what())) }
}

impl<D: Driver> Gpu<D> {
    pub fn new(drv: D) -> Self {
        Self {
            drv,
            ledger: Ledger::new(),
        }
    }

    pub fn driver(&self) -> &D {
        &self.drv
    }

    fn note(&mut self, api: &'static str) {
        self.ledger.call(api);
    }

    /// A call's result: failures are counted in the ledger (the observer reports `result`).
    fn done<T>(&mut self, api: &'static str, r: Result<T, CuResult>) -> GtResult<T> {
        r.map_err(|code| {
            self.ledger.failed(api, code);
            GtError::Cuda { api, code }
        })
    }

    pub fn init(&mut self) -> GtResult<()> {
        self.note(sym::INIT);
        call!(self, sym::INIT, self.drv.init(0))
    }

    /// cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxSetCurrent.
    pub fn primary_context(&mut self, ordinal: i32) -> GtResult<Context> {
        self.note(sym::DEVICE_GET);
        let dev = call!(self, sym::DEVICE_GET, self.drv.device_get(ordinal))?;
        self.note(sym::PRIMARY_CTX_RETAIN);
        let raw = call!(self, sym::PRIMARY_CTX_RETAIN, self.drv.primary_ctx_retain(dev))?;
        self.note(sym::CTX_SET_CURRENT);
        // SAFETY: `raw` was just returned by cuDevicePrimaryCtxRetain.
        call!(self, sym::CTX_SET_CURRENT, unsafe { self.drv.ctx_set_current(raw) })?;
        Ok(Context { dev, raw })
    }

    pub fn context_handle(ctx: &Context) -> Handle {
        ctx.raw
    }

    pub fn release_context(&mut self, ctx: Context) -> GtResult<()> {
        self.note(sym::PRIMARY_CTX_RELEASE);
        call!(self, sym::PRIMARY_CTX_RELEASE, self.drv.primary_ctx_release(ctx.dev))
    }

    pub fn ctx_synchronize(&mut self) -> GtResult<()> {
        self.note(sym::CTX_SYNCHRONIZE);
        call!(self, sym::CTX_SYNCHRONIZE, self.drv.ctx_synchronize())
    }

    /// cuModuleLoadData; the error is the raw CUresult (H9 expects one).
    pub fn load_module(&mut self, ptx: &str) -> Result<Module, CuResult> {
        // A NUL inside would cut the image short: hand the driver an empty one instead.
        let image = CString::new(ptx).unwrap_or_default();
        self.note(sym::MODULE_LOAD_DATA);
        let r = self.drv.module_load_data(&image);
        if let Err(code) = r {
            self.ledger.failed(sym::MODULE_LOAD_DATA, code);
        }
        Ok(Module(r?))
    }

    pub fn module_handle(m: &Module) -> Handle {
        m.0
    }

    pub fn get_function(&mut self, m: &Module, name: &'static str) -> GtResult<Function> {
        let cname = CString::new(name).map_err(|_| GtError::Check(format!("kernel name {name:?} has a NUL")))?;
        self.note(sym::MODULE_GET_FUNCTION);
        // SAFETY: `m` is a module loaded through this driver and not yet unloaded (unload
        // consumes it).
        let raw = call!(self, sym::MODULE_GET_FUNCTION, unsafe {
            self.drv.module_get_function(m.0, &cname)
        })?;
        need(raw != 0, || {
            format!("cuModuleGetFunction({name}) returned a null handle")
        })?;
        Ok(Function { raw, name })
    }

    pub fn unload_module(&mut self, m: Module) -> GtResult<()> {
        self.note(sym::MODULE_UNLOAD);
        // SAFETY: `m` is loaded and consumed here.
        call!(self, sym::MODULE_UNLOAD, unsafe { self.drv.module_unload(m.0) })
    }

    pub fn stream_handle(s: &Stream) -> Handle {
        s.0
    }

    pub fn create_stream(&mut self) -> GtResult<Stream> {
        self.note(sym::STREAM_CREATE);
        Ok(Stream(call!(self, sym::STREAM_CREATE, self.drv.stream_create(0))?))
    }

    pub fn stream_synchronize(&mut self, s: &Stream) -> GtResult<()> {
        self.note(sym::STREAM_SYNCHRONIZE);
        // SAFETY: `s` is a live stream (destroy consumes it).
        call!(self, sym::STREAM_SYNCHRONIZE, unsafe {
            self.drv.stream_synchronize(s.0)
        })
    }

    pub fn destroy_stream(&mut self, s: Stream) -> GtResult<()> {
        self.note(sym::STREAM_DESTROY);
        // SAFETY: `s` is live and consumed here.
        call!(self, sym::STREAM_DESTROY, unsafe { self.drv.stream_destroy(s.0) })
    }

    pub fn alloc(&mut self, bytes: usize) -> GtResult<DevBuf> {
        self.note(sym::MEM_ALLOC);
        let r = self.drv.mem_alloc(bytes);
        match r {
            Ok(ptr) => self.ledger.alloc(sym::MEM_ALLOC, ptr, bytes as u64),
            Err(_) => self.ledger.add_bytes(sym::MEM_ALLOC, bytes as u64),
        }
        let ptr = call!(self, sym::MEM_ALLOC, r)?;
        need(ptr != 0, || "cuMemAlloc_v2 returned a null pointer".into())?;
        Ok(DevBuf { ptr, bytes })
    }

    pub fn free(&mut self, b: DevBuf) -> GtResult<()> {
        self.note(sym::MEM_FREE);
        self.ledger.free(sym::MEM_FREE, b.ptr);
        // SAFETY: `b` is a live allocation of this driver, consumed here.
        call!(self, sym::MEM_FREE, unsafe { self.drv.mem_free(b.ptr) })
    }

    pub fn alloc_host(&mut self, bytes: usize) -> GtResult<Pinned> {
        self.note(sym::MEM_ALLOC_HOST);
        let r = self.drv.mem_alloc_host(bytes);
        match r {
            Ok(ptr) => self.ledger.alloc(sym::MEM_ALLOC_HOST, ptr as u64, bytes as u64),
            Err(_) => self.ledger.add_bytes(sym::MEM_ALLOC_HOST, bytes as u64),
        }
        let ptr = call!(self, sym::MEM_ALLOC_HOST, r)?;
        need(!ptr.is_null() && (ptr as usize).is_multiple_of(8), || {
            format!("cuMemAllocHost_v2 returned an unusable pointer {ptr:?}")
        })?;
        Ok(Pinned { ptr, bytes })
    }

    pub fn free_host(&mut self, h: Pinned) -> GtResult<()> {
        self.note(sym::MEM_FREE_HOST);
        self.ledger.free(sym::MEM_FREE_HOST, h.addr());
        // SAFETY: `h` is a live page-locked allocation of this driver, consumed here.
        call!(self, sym::MEM_FREE_HOST, unsafe { self.drv.mem_free_host(h.ptr) })
    }

    /// cuMemcpyHtoD_v2 from pageable host memory.
    pub fn htod(&mut self, dst: &DevBuf, src: &[u8]) -> GtResult<()> {
        need(src.len() <= dst.bytes, || {
            format!("HtoD of {} bytes into {}", src.len(), dst.bytes)
        })?;
        self.note(sym::MEMCPY_HTOD);
        let n = src.len();
        self.ledger
            .copy(sym::MEMCPY_HTOD, Dir::CpuToGpu, Some(HostMem::Pageable), n as u64);
        // SAFETY: `dst` holds at least `n` bytes (checked) and `src` is readable for `n`.
        call!(self, sym::MEMCPY_HTOD, unsafe {
            self.drv.memcpy_htod(dst.ptr, src.as_ptr().cast(), n)
        })
    }

    /// cuMemcpyDtoH_v2 into pageable host memory.
    pub fn dtoh(&mut self, dst: &mut [u8], src: &DevBuf) -> GtResult<()> {
        need(dst.len() <= src.bytes, || {
            format!("DtoH of {} bytes from {}", dst.len(), src.bytes)
        })?;
        self.note(sym::MEMCPY_DTOH);
        let n = dst.len();
        self.ledger
            .copy(sym::MEMCPY_DTOH, Dir::GpuToCpu, Some(HostMem::Pageable), n as u64);
        // SAFETY: `src` holds at least `n` bytes (checked); `dst` is writable for `n` and
        // the copy is complete when the call returns.
        call!(self, sym::MEMCPY_DTOH, unsafe {
            self.drv.memcpy_dtoh(dst.as_mut_ptr().cast(), src.ptr, n)
        })
    }

    /// cuMemcpyDtoHAsync_v2 of all of `src` into pinned memory, on `stream`. The caller
    /// synchronizes the stream before reading `dst`.
    pub fn dtoh_async(&mut self, dst: &mut Pinned, src: &DevBuf, stream: &Stream) -> GtResult<()> {
        need(src.bytes <= dst.bytes, || {
            format!("DtoH of {} bytes into {}", src.bytes, dst.bytes)
        })?;
        self.note(sym::MEMCPY_DTOH_ASYNC);
        let n = src.bytes;
        self.ledger
            .copy(sym::MEMCPY_DTOH_ASYNC, Dir::GpuToCpu, Some(HostMem::Pinned), n as u64);
        // SAFETY: sizes checked; `dst` is page-locked and exclusively borrowed, and every
        // caller synchronizes `stream` before the next access to it.
        call!(self, sym::MEMCPY_DTOH_ASYNC, unsafe {
            self.drv.memcpy_dtoh_async(dst.ptr, src.ptr, n, stream.0)
        })
    }

    fn generic(
        &mut self,
        dst: CuDevicePtr,
        src: CuDevicePtr,
        n: usize,
        dir: Dir,
        host: Option<HostMem>,
    ) -> GtResult<()> {
        self.note(sym::MEMCPY);
        self.ledger.copy(sym::MEMCPY, dir, host, n as u64);
        // SAFETY: the three public callers pass addresses of live buffers of this driver,
        // each holding at least `n` bytes.
        call!(self, sym::MEMCPY, unsafe { self.drv.memcpy(dst, src, n) })
    }

    /// cuMemcpy device → device (all of `src`).
    pub fn copy_dtod(&mut self, dst: &DevBuf, src: &DevBuf) -> GtResult<()> {
        need(src.bytes <= dst.bytes, || {
            format!("DtoD of {} bytes into {}", src.bytes, dst.bytes)
        })?;
        self.generic(dst.ptr, src.ptr, src.bytes, Dir::GpuToGpu, None)
    }

    /// cuMemcpy pinned host → device (the pinned pointer passed as a CUdeviceptr).
    pub fn copy_pinned_to_dev(&mut self, dst: &DevBuf, src: &Pinned) -> GtResult<()> {
        need(src.bytes <= dst.bytes, || {
            format!("HtoD of {} bytes into {}", src.bytes, dst.bytes)
        })?;
        self.generic(dst.ptr, src.addr(), src.bytes, Dir::CpuToGpu, Some(HostMem::Pinned))
    }

    /// cuMemcpy device → pinned host (synchronous: done when it returns).
    pub fn copy_dev_to_pinned(&mut self, dst: &mut Pinned, src: &DevBuf) -> GtResult<()> {
        need(src.bytes <= dst.bytes, || {
            format!("DtoH of {} bytes into {}", src.bytes, dst.bytes)
        })?;
        self.generic(dst.addr(), src.ptr, src.bytes, Dir::GpuToCpu, Some(HostMem::Pinned))
    }

    /// cuMemsetD32_v2 of `n` words.
    pub fn memset_d32(&mut self, dst: &DevBuf, value: u32, n: usize) -> GtResult<()> {
        need(n.saturating_mul(4) <= dst.bytes, || {
            format!("memset of {n} words into {} bytes", dst.bytes)
        })?;
        self.note(sym::MEMSET_D32);
        self.ledger.add_bytes(sym::MEMSET_D32, n as u64 * 4);
        // SAFETY: `dst` holds at least `n` words (checked).
        call!(self, sym::MEMSET_D32, unsafe { self.drv.memset_d32(dst.ptr, value, n) })
    }

    /// cuLaunchKernel with a 1-D grid, no shared memory, on `stream`. Buffer arguments are
    /// device allocations only; the kernels bound their indices by their `n` argument.
    pub fn launch(
        &mut self,
        f: &Function,
        grid_x: u32,
        block_x: u32,
        stream: &Stream,
        args: &[Arg<'_>],
    ) -> GtResult<()> {
        let mut slots: Vec<Slot> = args.iter().map(Slot::new).collect();
        let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| (s as *mut Slot).cast::<c_void>()).collect();
        self.note(sym::LAUNCH_KERNEL);
        self.ledger.launch(f.name);
        // SAFETY: `f` and `stream` are live handles of this driver; `params` holds one
        // pointer per argument into `slots`, which outlives the call and gives each
        // parameter at least its size (8 bytes per slot).
        call!(self, sym::LAUNCH_KERNEL, unsafe {
            self.drv
                .launch_kernel(f.raw, [grid_x, 1, 1], [block_x, 1, 1], 0, stream.0, &mut params)
        })
    }
}
