//! The CUPTI entry points this library uses, resolved at run time.
//!
//! libcupti is opened with dlopen (never linked): a baked-in RPATH breaks in containers, and
//! a process without CUPTI must still run, only without GPU timestamps.

use std::ffi::{CStr, c_char, c_int, c_void};

use libloading::Library;

pub type CuptiResult = c_int;
pub const SUCCESS: CuptiResult = 0;
/// `CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED`: another profiler holds CUPTI.
pub const MULTIPLE_SUBSCRIBERS: CuptiResult = 39;
/// `CUPTI_ERROR_NOT_SUPPORTED`.
pub const NOT_SUPPORTED: CuptiResult = 27;
/// `CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM`: thread ids are gettid() values.
pub const THREAD_ID_TYPE_SYSTEM: c_int = 1;
/// `CUPTI_ACTIVITY_FLAG_FLUSH_FORCED`.
pub const FLUSH_FORCED: u32 = 1;

pub type BufferRequested = extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
pub type BufferCompleted = extern "C" fn(*mut c_void, u32, *mut u8, usize, usize);
pub type TimestampFn = extern "C" fn() -> u64;
/// NVTX's export-table getter (`NvtxGetExportTableFunc_t`).
pub type NvtxGetExportTable = unsafe extern "C" fn(u32) -> *const c_void;
/// `NvtxInitializeInjectionNvtxFunc_t`: returns 0 when the tool cannot take NVTX's calls.
pub type NvtxInit = unsafe extern "C" fn(Option<NvtxGetExportTable>) -> c_int;
/// `CUpti_CallbackFunc` (cupti_callbacks.h).
pub type CallbackFunc = extern "C" fn(*mut c_void, u32, u32, *const c_void);
pub type Subscribe = unsafe extern "C" fn(*mut *mut c_void, CallbackFunc, *mut c_void) -> CuptiResult;
pub type Unsubscribe = unsafe extern "C" fn(*mut c_void) -> CuptiResult;

/// The resolved entry points. The library handle is kept for the life of the process.
pub struct Cupti {
    _lib: Library,
    pub register_timestamp: unsafe extern "C" fn(TimestampFn) -> CuptiResult,
    pub set_thread_id_type: unsafe extern "C" fn(c_int) -> CuptiResult,
    pub register_callbacks: unsafe extern "C" fn(BufferRequested, BufferCompleted) -> CuptiResult,
    pub enable: unsafe extern "C" fn(u32) -> CuptiResult,
    pub disable: unsafe extern "C" fn(u32) -> CuptiResult,
    pub flush_all: unsafe extern "C" fn(u32) -> CuptiResult,
    pub next_record: unsafe extern "C" fn(*mut u8, usize, *mut *mut u8) -> CuptiResult,
    pub dropped: unsafe extern "C" fn(*mut c_void, u32, *mut usize) -> CuptiResult,
    /// Per-API activity records (CUDA 12.?+): only the calls that launch GPU work.
    pub enable_driver_api: Option<unsafe extern "C" fn(u32, u8) -> CuptiResult>,
    pub enable_runtime_api: Option<unsafe extern "C" fn(u32, u8) -> CuptiResult>,
    /// CUPTI as the process's NVTX tool (`InitializeInjectionNvtx2`, nvtxTypes.h).
    pub nvtx_init: Option<NvtxInit>,
    /// The callback API's subscription, only to ask whether another tool holds CUPTI.
    subscribe: Option<(Subscribe, Unsubscribe)>,
    result_string: Option<unsafe extern "C" fn(CuptiResult, *mut *const c_char) -> CuptiResult>,
}

/// Where libcupti is looked for: the override, the sonames, then the toolkit's usual places.
fn candidates(override_path: Option<&str>) -> Vec<String> {
    let mut out: Vec<String> = override_path.map(str::to_string).into_iter().collect();
    out.extend(["libcupti.so.13", "libcupti.so.12", "libcupti.so"].map(String::from));
    let homes = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .chain(["/usr/local/cuda".to_string()]);
    for home in homes {
        for sub in ["extras/CUPTI/lib64", "targets/x86_64-linux/lib", "lib64"] {
            out.push(format!("{home}/{sub}/libcupti.so"));
        }
    }
    out
}

impl Cupti {
    /// Loads libcupti and resolves every entry point, or says why it could not. A libcupti the
    /// process already loaded comes first (a PyTorch wheel's, say): two CUPTIs in one process
    /// would each see part of the work.
    pub fn load(override_path: Option<&str>) -> Result<Self, String> {
        for soname in ["libcupti.so.13", "libcupti.so.12", "libcupti.so"] {
            let flags = libc::RTLD_NOW | libc::RTLD_NOLOAD;
            // SAFETY: RTLD_NOLOAD only finds a library already loaded (its initializers ran).
            let loaded = unsafe { libloading::os::unix::Library::open(Some(soname), flags) };
            if let Ok(lib) = loaded {
                return Self::resolve(soname.to_string(), lib.into());
            }
        }
        let mut errors = Vec::new();
        for path in candidates(override_path) {
            // SAFETY: loading CUPTI runs its initializers, which is what loading it is for;
            // it is NVIDIA's library for exactly this (an injection library in a CUDA process).
            match unsafe { Library::new(&path) } {
                Ok(lib) => return Self::resolve(path, lib),
                Err(e) => errors.push(format!("{path}: {e}")),
            }
        }
        Err(format!("libcupti not found ({})", errors.join("; ")))
    }

    fn resolve(path: String, lib: Library) -> Result<Self, String> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol has this C signature in CUPTI's headers (cupti_activity.h).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("{path} lacks {}: {e}", $name))?
            };
        }
        Ok(Self {
            register_timestamp: sym!("cuptiActivityRegisterTimestampCallback"),
            set_thread_id_type: sym!("cuptiSetThreadIdType"),
            register_callbacks: sym!("cuptiActivityRegisterCallbacks"),
            enable: sym!("cuptiActivityEnable"),
            disable: sym!("cuptiActivityDisable"),
            flush_all: sym!("cuptiActivityFlushAll"),
            next_record: sym!("cuptiActivityGetNextRecord"),
            dropped: sym!("cuptiActivityGetNumDroppedRecords"),
            // SAFETY: as above (cupti_result.h); optional, only for messages.
            result_string: unsafe { lib.get(b"cuptiGetResultString\0") }.ok().map(|s| *s),
            // SAFETY: as above (cupti_activity.h); optional, newer CUPTI only.
            enable_driver_api: unsafe { lib.get(b"cuptiActivityEnableDriverApi\0") }.ok().map(|s| *s),
            // SAFETY: as above.
            enable_runtime_api: unsafe { lib.get(b"cuptiActivityEnableRuntimeApi\0") }.ok().map(|s| *s),
            // SAFETY: NVTX's injection entry point, with this signature in nvtxTypes.h; CUPTI
            // exports it to be the NVTX tool.
            nvtx_init: unsafe { lib.get(b"InitializeInjectionNvtx2\0") }.ok().map(|s| *s),
            // SAFETY: as above (cupti_events.h / cupti_callbacks.h signatures).
            subscribe: unsafe { lib.get::<Subscribe>(b"cuptiSubscribe\0") }
                .ok()
                .map(|s| *s)
                // SAFETY: as above.
                .zip(
                    unsafe { lib.get::<Unsubscribe>(b"cuptiUnsubscribe\0") }
                        .ok()
                        .map(|s| *s),
                ),
            _lib: lib,
        })
    }

    /// Whether another tool subscribed to CUPTI's callbacks (CUPTI allows one subscriber): a
    /// subscription is tried and, when it succeeds, dropped at once.
    pub fn another_subscriber(&self) -> bool {
        let Some((subscribe, unsubscribe)) = self.subscribe else {
            return false;
        };
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer and a callback that does nothing (it is never enabled for
        // any domain, and the subscription is dropped before this returns).
        match unsafe { subscribe(&mut handle, ignore_callback, std::ptr::null_mut()) } {
            SUCCESS => {
                // SAFETY: the handle CUPTI just returned.
                unsafe { unsubscribe(handle) };
                false
            }
            r => r == MULTIPLE_SUBSCRIBERS,
        }
    }

    /// CUPTI's own name of a result, for messages.
    pub fn describe(&self, r: CuptiResult) -> String {
        let mut s: *const c_char = std::ptr::null();
        if let Some(f) = self.result_string
            // SAFETY: valid out-pointer; CUPTI returns a static string.
            && unsafe { f(r, &mut s) } == SUCCESS
            && !s.is_null()
        {
            // SAFETY: non-null, NUL-terminated static string from CUPTI.
            return unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
        }
        format!("CUPTI error {r}")
    }
}

extern "C" fn ignore_callback(_: *mut c_void, _: u32, _: u32, _: *const c_void) {}
