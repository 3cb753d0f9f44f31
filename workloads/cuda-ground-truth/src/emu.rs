//! Test-only emulated driver: device memory in host vectors, the three kernels run on the CPU,
//! asynchronous work done at once. It counts every entry point it is called through (what a
//! perfect observer would report), and can be told to misbehave.

use std::collections::BTreeMap;
use std::ffi::{CStr, c_void};

use crate::driver::{CuDevice, CuDevicePtr, CuResult, Driver, Handle, sym};
use crate::ptx;

const INVALID_VALUE: CuResult = 1;
const INVALID_PTX: CuResult = 218;
const INVALID_HANDLE: CuResult = 400;
const NOT_FOUND: CuResult = 500;

/// How the emulator misbehaves (nothing by default).
#[derive(Default)]
pub struct Faults {
    /// This kernel computes a wrong result.
    pub wrong_kernel: Option<&'static str>,
    /// cuMemcpyDtoH_v2 flips a byte.
    pub corrupt_dtoh: bool,
    /// cuModuleLoadData accepts any image.
    pub accept_anything: bool,
    /// The first call of this API fails with this CUresult.
    pub fail: Option<(&'static str, CuResult)>,
}

#[derive(Default)]
pub struct Emu {
    faults: Faults,
    calls: BTreeMap<&'static str, u64>,
    dev: BTreeMap<u64, Vec<u8>>,
    next_dev: u64,
    pinned: BTreeMap<u64, Vec<u64>>,
    modules: BTreeMap<Handle, Vec<String>>,
    functions: BTreeMap<Handle, String>,
    streams: BTreeMap<Handle, ()>,
    next_handle: Handle,
    contexts: u32,
}

impl Emu {
    pub fn new(faults: Faults) -> Self {
        Self {
            faults,
            ..Default::default()
        }
    }

    pub fn calls(&self) -> &BTreeMap<&'static str, u64> {
        &self.calls
    }

    pub fn live_contexts(&self) -> u32 {
        self.contexts
    }

    pub fn loaded_modules(&self) -> usize {
        self.modules.len()
    }

    pub fn live_device_allocations(&self) -> Vec<usize> {
        self.dev.values().map(Vec::len).collect()
    }

    /// Counts the call; `Err` when this call is the one told to fail.
    fn enter(&mut self, api: &'static str) -> Result<(), CuResult> {
        let n = self.calls.entry(api).or_default();
        *n += 1;
        match self.faults.fail {
            Some((a, code)) if a == api && *n == 1 => Err(code),
            _ => Ok(()),
        }
    }

    fn handle(&mut self) -> Handle {
        self.next_handle += 0x100;
        0x5000_0000 + self.next_handle
    }

    /// A host pointer to `n` bytes at `addr`, device or page-locked memory of this emulator.
    fn locate(&mut self, addr: u64, n: usize) -> Option<*mut u8> {
        if let Some((base, v)) = self.dev.range_mut(..=addr).next_back() {
            let off = (addr - *base) as usize;
            if off + n <= v.len() {
                return Some(v[off..].as_mut_ptr());
            }
        }
        if let Some((base, v)) = self.pinned.range_mut(..=addr).next_back() {
            let off = (addr - *base) as usize;
            if off + n <= v.len() * 8 {
                return Some(v.as_mut_ptr().cast::<u8>().wrapping_add(off));
            }
        }
        None
    }

    fn dev_slice(&mut self, addr: u64, n: usize) -> Result<&mut [u8], CuResult> {
        let (base, v) = self.dev.range_mut(..=addr).next_back().ok_or(INVALID_VALUE)?;
        let off = (addr - *base) as usize;
        v.get_mut(off..off + n).ok_or(INVALID_VALUE)
    }
}

fn words(b: &mut [u8]) -> impl Iterator<Item = &mut [u8]> {
    b.chunks_exact_mut(4)
}

/// Reads kernel parameter `i` as `T`.
///
/// # Safety
/// `params[i]` must point to a readable value of at least `size_of::<T>()` bytes.
unsafe fn param<T: Copy>(params: &[*mut c_void], i: usize) -> Result<T, CuResult> {
    let p = *params.get(i).ok_or(INVALID_VALUE)?;
    // SAFETY: guaranteed by the caller; unaligned read to make no assumption.
    Ok(unsafe { std::ptr::read_unaligned(p.cast::<T>()) })
}

impl Driver for Emu {
    fn init(&mut self, _flags: u32) -> Result<(), CuResult> {
        self.enter(sym::INIT)
    }

    fn device_get(&mut self, ordinal: i32) -> Result<CuDevice, CuResult> {
        self.enter(sym::DEVICE_GET)?;
        if ordinal == 0 { Ok(0) } else { Err(101) }
    }

    fn primary_ctx_retain(&mut self, _dev: CuDevice) -> Result<Handle, CuResult> {
        self.enter(sym::PRIMARY_CTX_RETAIN)?;
        self.contexts += 1;
        Ok(self.handle())
    }

    unsafe fn ctx_set_current(&mut self, _ctx: Handle) -> Result<(), CuResult> {
        self.enter(sym::CTX_SET_CURRENT)
    }

    fn ctx_synchronize(&mut self) -> Result<(), CuResult> {
        self.enter(sym::CTX_SYNCHRONIZE)
    }

    fn primary_ctx_release(&mut self, _dev: CuDevice) -> Result<(), CuResult> {
        self.enter(sym::PRIMARY_CTX_RELEASE)?;
        self.contexts = self.contexts.checked_sub(1).ok_or(INVALID_HANDLE)?;
        Ok(())
    }

    fn module_load_data(&mut self, image: &CStr) -> Result<Handle, CuResult> {
        self.enter(sym::MODULE_LOAD_DATA)?;
        let text = image.to_str().map_err(|_| INVALID_PTX)?;
        let balanced = text.matches('{').count() == text.matches('}').count();
        if !(self.faults.accept_anything || (text.contains(".version") && balanced)) {
            return Err(INVALID_PTX);
        }
        let entries = text
            .split(".entry ")
            .skip(1)
            .filter_map(|s| s.split('(').next())
            .map(|s| s.trim().to_string())
            .collect();
        let h = self.handle();
        self.modules.insert(h, entries);
        Ok(h)
    }

    unsafe fn module_get_function(&mut self, module: Handle, name: &CStr) -> Result<Handle, CuResult> {
        self.enter(sym::MODULE_GET_FUNCTION)?;
        let name = name.to_str().map_err(|_| NOT_FOUND)?;
        let entries = self.modules.get(&module).ok_or(INVALID_HANDLE)?;
        if !entries.iter().any(|e| e == name) {
            return Err(NOT_FOUND);
        }
        let h = self.handle();
        self.functions.insert(h, name.to_string());
        Ok(h)
    }

    unsafe fn module_unload(&mut self, module: Handle) -> Result<(), CuResult> {
        self.enter(sym::MODULE_UNLOAD)?;
        self.modules.remove(&module).map(|_| ()).ok_or(INVALID_HANDLE)
    }

    fn stream_create(&mut self, _flags: u32) -> Result<Handle, CuResult> {
        self.enter(sym::STREAM_CREATE)?;
        let h = self.handle();
        self.streams.insert(h, ());
        Ok(h)
    }

    unsafe fn stream_synchronize(&mut self, stream: Handle) -> Result<(), CuResult> {
        self.enter(sym::STREAM_SYNCHRONIZE)?;
        self.streams.get(&stream).map(|_| ()).ok_or(INVALID_HANDLE)
    }

    unsafe fn stream_destroy(&mut self, stream: Handle) -> Result<(), CuResult> {
        self.enter(sym::STREAM_DESTROY)?;
        self.streams.remove(&stream).map(|_| ()).ok_or(INVALID_HANDLE)
    }

    fn mem_alloc(&mut self, bytes: usize) -> Result<CuDevicePtr, CuResult> {
        self.enter(sym::MEM_ALLOC)?;
        let addr = 0x7f00_0000_0000 + self.next_dev;
        self.next_dev += (bytes as u64).next_multiple_of(0x10_0000).max(0x10_0000);
        self.dev.insert(addr, vec![0xcd; bytes]);
        Ok(addr)
    }

    fn mem_alloc_host(&mut self, bytes: usize) -> Result<*mut c_void, CuResult> {
        self.enter(sym::MEM_ALLOC_HOST)?;
        let mut v = vec![0u64; bytes.div_ceil(8)];
        let ptr = v.as_mut_ptr().cast::<c_void>();
        self.pinned.insert(ptr as u64, v);
        Ok(ptr)
    }

    unsafe fn mem_free(&mut self, ptr: CuDevicePtr) -> Result<(), CuResult> {
        self.enter(sym::MEM_FREE)?;
        self.dev.remove(&ptr).map(|_| ()).ok_or(INVALID_VALUE)
    }

    unsafe fn mem_free_host(&mut self, ptr: *mut c_void) -> Result<(), CuResult> {
        self.enter(sym::MEM_FREE_HOST)?;
        self.pinned.remove(&(ptr as u64)).map(|_| ()).ok_or(INVALID_VALUE)
    }

    unsafe fn memcpy_htod(&mut self, dst: CuDevicePtr, src: *const c_void, bytes: usize) -> Result<(), CuResult> {
        self.enter(sym::MEMCPY_HTOD)?;
        // SAFETY: the caller guarantees `src` is readable for `bytes` (trait contract).
        let s = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), bytes) };
        self.dev_slice(dst, bytes)?.copy_from_slice(s);
        Ok(())
    }

    unsafe fn memcpy_dtoh(&mut self, dst: *mut c_void, src: CuDevicePtr, bytes: usize) -> Result<(), CuResult> {
        self.enter(sym::MEMCPY_DTOH)?;
        let corrupt = self.faults.corrupt_dtoh;
        let s = self.dev_slice(src, bytes)?;
        // SAFETY: the caller guarantees `dst` is writable for `bytes` (trait contract), and
        // it cannot overlap the emulator's own device vector.
        let d = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), bytes) };
        d.copy_from_slice(s);
        if corrupt && bytes > 0 {
            d[bytes / 2] ^= 0x40;
        }
        Ok(())
    }

    unsafe fn memcpy_dtoh_async(
        &mut self,
        dst: *mut c_void,
        src: CuDevicePtr,
        bytes: usize,
        stream: Handle,
    ) -> Result<(), CuResult> {
        self.enter(sym::MEMCPY_DTOH_ASYNC)?;
        if !self.streams.contains_key(&stream) {
            return Err(INVALID_HANDLE);
        }
        let d = self.locate(dst as u64, bytes).ok_or(INVALID_VALUE)?;
        let s = self.dev_slice(src, bytes)?;
        // SAFETY: `d` points into a page-locked vector of this emulator with `bytes` bytes
        // left (checked by `locate`), distinct from the device vector `s`.
        unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), d, bytes) };
        Ok(())
    }

    unsafe fn memcpy(&mut self, dst: CuDevicePtr, src: CuDevicePtr, bytes: usize) -> Result<(), CuResult> {
        self.enter(sym::MEMCPY)?;
        let s = self.locate(src, bytes).ok_or(INVALID_VALUE)?;
        let tmp = {
            // SAFETY: `locate` checked that `bytes` bytes are readable at `s`.
            unsafe { std::slice::from_raw_parts(s, bytes) }.to_vec()
        };
        let d = self.locate(dst, bytes).ok_or(INVALID_VALUE)?;
        // SAFETY: `locate` checked that `bytes` bytes are writable at `d`; `tmp` is ours.
        unsafe { std::ptr::copy_nonoverlapping(tmp.as_ptr(), d, bytes) };
        Ok(())
    }

    unsafe fn memset_d32(&mut self, dst: CuDevicePtr, value: u32, n: usize) -> Result<(), CuResult> {
        self.enter(sym::MEMSET_D32)?;
        for w in words(self.dev_slice(dst, n * 4)?) {
            w.copy_from_slice(&value.to_ne_bytes());
        }
        Ok(())
    }

    unsafe fn launch_kernel(
        &mut self,
        function: Handle,
        grid: [u32; 3],
        block: [u32; 3],
        _shared_mem_bytes: u32,
        stream: Handle,
        params: &mut [*mut c_void],
    ) -> Result<(), CuResult> {
        self.enter(sym::LAUNCH_KERNEL)?;
        if !self.streams.contains_key(&stream) {
            return Err(INVALID_HANDLE);
        }
        let name = self.functions.get(&function).ok_or(INVALID_HANDLE)?.clone();
        let threads = (grid[0] * block[0]) as usize;
        let wrong = self.faults.wrong_kernel.is_some_and(|k| k == name);
        // SAFETY: the caller passes one pointer per parameter, each to a value of the
        // parameter's size (trait contract); parameter 0 of every kernel is a u64 address.
        let addr: u64 = unsafe { param(params, 0)? };
        match name.as_str() {
            ptx::WRITE_VALUE => {
                // SAFETY: as for `addr`; write_value's parameters 1 and 2 are u32.
                let (value, n): (u32, u32) = unsafe { (param(params, 1)?, param(params, 2)?) };
                let n = (n as usize).min(threads);
                let value = if wrong { value ^ 1 } else { value };
                for w in words(self.dev_slice(addr, n * 4)?) {
                    w.copy_from_slice(&value.to_ne_bytes());
                }
            }
            ptx::ADD_ONE | ptx::SCALE_VEC => {
                let (factor, n): (f32, u32) = if name == ptx::ADD_ONE {
                    // SAFETY: as for `addr`; add_one's parameter 1 is a u32.
                    (1.0, unsafe { param(params, 1)? })
                } else {
                    // SAFETY: as for `addr`; scale_vec's parameters are f32 then u32.
                    unsafe { (param(params, 1)?, param(params, 2)?) }
                };
                let n = (n as usize).min(threads);
                let add = name == ptx::ADD_ONE;
                for w in words(self.dev_slice(addr, n * 4)?) {
                    let x = f32::from_ne_bytes([w[0], w[1], w[2], w[3]]);
                    let mut y = if add { x + 1.0 } else { x * factor };
                    if wrong {
                        y += 0.5;
                    }
                    w.copy_from_slice(&y.to_ne_bytes());
                }
            }
            _ => return Err(NOT_FOUND),
        }
        Ok(())
    }
}
