//! Decode: ring-buffer records → typed events, arguments read by the API table.

pub mod demangle;

use std::sync::Arc;

use gpu_observer_common::{
    api::{self, ApiSpec, Direction, Family, Flags, MemKind, NO_ARG},
    cupti::{GpuRecord, marker},
    event::{
        CallEvent, EventHeader, EventKind, GpuEvent, GpuNameEvent, IoctlEvent, LaunchEvent, NameEvent, call_flags,
        read_record,
    },
};

/// One decoded record. Borrowing nothing: it is copied out of the ring.
#[derive(Clone, Debug)]
pub struct Event {
    pub ts_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub comm: [u8; 16],
    pub api: Option<&'static ApiSpec>,
    pub body: Body,
}

#[derive(Clone, Debug)]
pub enum Body {
    Launch(Launch),
    Call(Call),
    Ioctl(Ioctl),
    ProcessExit,
    /// A record from the CUPTI injection library (joined by correlate).
    Gpu(GpuRecord),
    /// A kernel name CUPTI reported, under its name pointer.
    GpuName {
        key: u64,
        name: Arc<KernelName>,
    },
    /// An NVTX marker's name (and domain), sent before its record (`id`: the marker id).
    MarkerName {
        id: u32,
        name: Arc<str>,
        domain: Option<Arc<str>>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub function: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub stream: u64,
    pub read_errors: u32,
    /// Set by correlate when the handle's name is known.
    pub kernel: Option<Arc<KernelName>>,
    /// Set by correlate: the launch waits for CUPTI to name its handle
    /// (correlate/late_names.rs); the serial of the process it was observed in, which is the
    /// one its name is counted in when it goes out.
    pub held: Option<u64>,
}

#[cfg(test)]
impl Launch {
    /// The tests' plain launch: `function` on one thread of one block, the default stream,
    /// not named.
    pub fn of(function: u64) -> Self {
        Self {
            function,
            grid: [1; 3],
            block: [1; 3],
            shared_mem_bytes: 0,
            stream: 0,
            read_errors: 0,
            kernel: None,
            held: None,
        }
    }
}

/// A kernel's name as loaded and as people read it.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct KernelName {
    pub mangled: Box<str>,
    pub demangled: Box<str>,
}

impl KernelName {
    /// Demangles C++ (Itanium) names; `extern "C"` names stay as they are.
    pub fn new(mangled: &str) -> Self {
        let demangled = demangle::demangle(mangled);
        Self {
            mangled: mangled.into(),
            demangled: demangled.into(),
        }
    }
}

/// Where the host side of a copy lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostMemory {
    /// Page-locked: allocated or registered with the driver (DMA straight from it).
    Pinned,
    /// Ordinary memory: the driver stages it through a pinned buffer.
    Pageable,
}

impl HostMemory {
    pub const fn name(self) -> &'static str {
        match self {
            HostMemory::Pinned => "pinned",
            HostMemory::Pageable => "pageable",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// Bytes moved, set or allocated (None for frees until correlated, and syncs).
    pub bytes: Option<u64>,
    pub direction: Direction,
    pub mem: MemKind,
    /// Stream (or event/context handle for syncs) when the API takes one.
    pub stream: Option<u64>,
    pub dst: Option<u64>,
    pub src: Option<u64>,
    /// Allocation address (returned through the out-pointer) or the freed pointer.
    pub address: Option<u64>,
    pub duration_ns: u64,
    pub result: u32,
    pub ioctl_count: u32,
    pub ioctl_ns: u64,
    pub nested: u32,
    pub read_errors: u32,
    /// The call never returned (longjmp or an exception out of the driver): `duration_ns` and
    /// `result` are unknown (0) and nothing it would have returned is known.
    pub abandoned: bool,
    /// Module/library/kernel/function handle the call produced or named.
    pub handle: Option<u64>,
    /// What `handle` came from: the module, library or kernel.
    pub owner: Option<u64>,
    /// Kernel name as the caller passed it (mangled), for symbol calls.
    pub name: Option<Box<str>>,
    /// Host side of a copy (set by correlate).
    pub host_memory: Option<HostMemory>,
    /// Whether correlate inferred `direction` from tracked allocations.
    pub direction_inferred: bool,
    /// For symbol calls: the name `handle` now has (set by correlate).
    pub kernel: Option<Arc<KernelName>>,
    /// The anomaly detector flagged it (analyze/anomaly.rs): always written, never sampled out.
    pub anomalous: bool,
}

impl Call {
    /// A call of `spec` that returned success after `duration_ns`, with nothing else read and
    /// nothing filled in yet: the base that tests and replays build calls from.
    pub fn returned(spec: &ApiSpec, duration_ns: u64) -> Self {
        Self {
            bytes: None,
            direction: spec.direction,
            mem: spec.mem,
            stream: None,
            dst: None,
            src: None,
            address: None,
            duration_ns,
            result: 0,
            ioctl_count: 0,
            ioctl_ns: 0,
            nested: 0,
            read_errors: 0,
            abandoned: false,
            handle: None,
            owner: None,
            name: None,
            host_memory: None,
            direction_inferred: false,
            kernel: None,
            anomalous: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Ioctl {
    pub fd: u32,
    pub cmd: u32,
    pub arg: u64,
    pub duration_ns: u64,
    pub ret: i64,
    pub parent: Option<&'static ApiSpec>,
    /// What the driver was asked to do (`NV_ESC_RM_CONTROL`, `UVM_MAP_EXTERNAL_ALLOCATION`), set by correlate.
    pub name: Option<&'static str>,
    /// The device file behind the fd (`/dev/nvidiactl`), set by correlate.
    pub device: Option<Arc<str>>,
}

impl Event {
    pub fn comm(&self) -> std::borrow::Cow<'_, str> {
        crate::rules::comm(&self.comm)
    }
}

/// Why a record could not be decoded (counted, never silently skipped).
#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    Short,
    UnknownKind(u32),
    UnknownApi(u32),
}

pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    let hdr: EventHeader = read_record(bytes).ok_or(DecodeError::Short)?;
    let kind = EventKind::from_u32(hdr.kind).ok_or(DecodeError::UnknownKind(hdr.kind))?;
    let api = match hdr.api {
        0 => None,
        id => Some(api::by_id(id).ok_or(DecodeError::UnknownApi(id))?),
    };
    let body = match kind {
        EventKind::Launch => {
            let r: LaunchEvent = read_record(bytes).ok_or(DecodeError::Short)?;
            Body::Launch(Launch {
                function: r.function,
                grid: r.grid,
                block: r.block,
                shared_mem_bytes: r.shared_mem_bytes,
                stream: r.stream,
                read_errors: r.read_errors,
                kernel: None,
                held: None,
            })
        }
        EventKind::Call => {
            let r: CallEvent = read_record(bytes).ok_or(DecodeError::Short)?;
            let spec = api.ok_or(DecodeError::UnknownApi(0))?;
            Body::Call(decode_call(spec, &r))
        }
        EventKind::Ioctl => {
            let r: IoctlEvent = read_record(bytes).ok_or(DecodeError::Short)?;
            Body::Ioctl(Ioctl {
                fd: r.fd,
                cmd: r.cmd,
                arg: r.arg,
                duration_ns: r.duration_ns,
                ret: r.ret,
                parent: api::by_id(r.parent_api),
                name: None,
                device: None,
            })
        }
        EventKind::Name => {
            let r: NameEvent = read_record(bytes).ok_or(DecodeError::Short)?;
            let spec = api.ok_or(DecodeError::UnknownApi(0))?;
            let mut call = decode_call(spec, &r.call);
            let end = r.name.iter().position(|&b| b == 0).unwrap_or(r.name.len());
            if end > 0 {
                call.name = Some(String::from_utf8_lossy(&r.name[..end]).into());
            }
            Body::Call(call)
        }
        EventKind::ProcessExit => Body::ProcessExit,
        EventKind::Gpu => {
            let r: GpuEvent = read_record(bytes).ok_or(DecodeError::Short)?;
            Body::Gpu(r.rec)
        }
        EventKind::GpuName => {
            let r: GpuNameEvent = read_record(bytes).ok_or(DecodeError::Short)?;
            let end = r.name.iter().position(|&b| b == 0).unwrap_or(r.name.len());
            let bytes = &r.name[..end];
            if r.key & marker::NAME_KEY_BIT != 0 {
                let (domain, name) = match bytes.iter().position(|&b| b == marker::DOMAIN_SEPARATOR) {
                    Some(i) => (Some(&bytes[..i]), &bytes[i + 1..]),
                    None => (None, bytes),
                };
                Body::MarkerName {
                    id: r.key as u32,
                    name: String::from_utf8_lossy(name).into(),
                    domain: domain.map(|d| String::from_utf8_lossy(d).into()),
                }
            } else {
                Body::GpuName {
                    key: r.key,
                    name: Arc::new(KernelName::new(&String::from_utf8_lossy(bytes))),
                }
            }
        }
    };
    Ok(Event {
        ts_ns: hdr.ts_ns,
        pid: hdr.pid,
        tid: hdr.tid,
        comm: hdr.comm,
        api,
        body,
    })
}

fn arg(r: &CallEvent, n: u8) -> Option<u64> {
    (n != NO_ARG).then(|| r.args.get(usize::from(n)).copied()).flatten()
}

/// Reads a call's interesting arguments by its API's layout.
pub fn decode_call(spec: &ApiSpec, r: &CallEvent) -> Call {
    let abandoned = r.flags & call_flags::ABANDONED != 0;
    // An abandoned call returned nothing: no out-pointer values, no result.
    let ok = r.result == 0 && !abandoned;
    let (bytes, address) = match spec.family {
        Family::Memcpy => (arg(r, spec.bytes_arg), None),
        Family::Memset => {
            let n = arg(r, spec.bytes_arg).unwrap_or(0);
            let rows = arg(r, spec.height_arg).unwrap_or(1);
            (
                Some(n.saturating_mul(rows).saturating_mul(u64::from(spec.elem_size))),
                arg(r, spec.dst_arg),
            )
        }
        Family::Alloc => {
            let bytes = if spec.height_arg != NO_ARG {
                // Pitched: the driver chooses the pitch; it is known only at return.
                ok.then(|| r.out[1].saturating_mul(arg(r, spec.height_arg).unwrap_or(0)))
            } else {
                arg(r, spec.bytes_arg)
            };
            // Out-pointer for allocations, the registered pointer for cuMemHostRegister.
            let address = if spec.flags & Flags::DEREF_ARG0 != 0 {
                ok.then_some(r.out[0])
            } else {
                arg(r, spec.dst_arg)
            };
            (bytes, address)
        }
        Family::Free => (None, arg(r, spec.dst_arg)),
        _ => (None, None),
    };
    let copy_ptrs = matches!(spec.family, Family::Memcpy);
    let (handle, owner) = match spec.family {
        Family::Module if spec.flags & Flags::DEREF_ARG0 != 0 => (ok.then_some(r.out[0]), None),
        Family::Module => (arg(r, spec.dst_arg), None),
        Family::Symbol if spec.flags & Flags::NAME_OUT0 != 0 => (arg(r, spec.src_arg), None),
        Family::Symbol => (ok.then_some(r.out[0]), arg(r, spec.src_arg)),
        // The host function's address.
        Family::HostFunc => (arg(r, spec.dst_arg), None),
        _ => (None, None),
    };
    Call {
        bytes,
        direction: spec.direction,
        mem: spec.mem,
        stream: arg(r, spec.stream_arg),
        dst: if copy_ptrs { arg(r, spec.dst_arg) } else { None },
        src: if copy_ptrs { arg(r, spec.src_arg) } else { None },
        address,
        duration_ns: r.duration_ns,
        result: r.result,
        ioctl_count: r.ioctl_count,
        ioctl_ns: r.ioctl_ns,
        nested: r.nested,
        read_errors: r.read_errors,
        abandoned,
        handle,
        owner,
        name: None,
        host_memory: None,
        direction_inferred: false,
        anomalous: false,
        kernel: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: [u64; 6], out: [u64; 2]) -> (Event, Call) {
        let id = api::id_of(name).unwrap();
        let rec = CallEvent {
            hdr: EventHeader {
                kind: EventKind::Call as u32,
                api: id,
                pid: 7,
                tid: 8,
                ts_ns: 100,
                comm: *b"worker\0\0\0\0\0\0\0\0\0\0",
            },
            args,
            out,
            duration_ns: 5_000,
            ioctl_ns: 10,
            ioctl_count: 1,
            result: 0,
            nested: 0,
            read_errors: 0,
            flags: 0,
            _pad: 0,
        };
        // SAFETY: viewing a plain #[repr(C)] record as its bytes, as the ring holds it.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&rec as *const CallEvent).cast::<u8>(),
                std::mem::size_of::<CallEvent>(),
            )
        };
        let ev = decode(bytes).unwrap();
        let Body::Call(c) = ev.body.clone() else {
            panic!("not a call")
        };
        (ev, c)
    }

    #[test]
    fn copies_read_bytes_stream_and_direction_by_layout() {
        let (ev, c) = call("cuMemcpyDtoHAsync_v2_ptsz", [0x1000, 0x2000, 4096, 0x77, 0, 0], [0; 2]);
        assert_eq!(ev.comm(), "worker");
        assert_eq!(
            (c.bytes, c.stream, c.direction),
            (Some(4096), Some(0x77), Direction::GpuToCpu)
        );
        assert_eq!((c.dst, c.src), (Some(0x1000), Some(0x2000)));
        let (_, c) = call("cuMemcpyPeerAsync", [0xa, 0xc1, 0xb, 0xc2, 12345, 0x99], [0; 2]);
        assert_eq!(
            (c.bytes, c.stream, c.direction, c.src),
            (Some(12345), Some(0x99), Direction::Unknown, Some(0xb))
        );
        let (_, c) = call("cuMemcpyHtoD_v2", [1, 2, 3, 0xdead, 0, 0], [0; 2]);
        assert_eq!((c.bytes, c.stream), (Some(3), None));
    }

    #[test]
    fn memsets_multiply_elements_rows_and_element_size() {
        let (_, c) = call("cuMemsetD32Async", [0x1000, 7, 1000, 0x55, 0, 0], [0; 2]);
        assert_eq!((c.bytes, c.stream), (Some(4000), Some(0x55)));
        let (_, c) = call("cuMemsetD2D16_v2_ptds", [0x1000, 8192, 7, 100, 10, 0], [0; 2]);
        assert_eq!((c.bytes, c.stream), (Some(2000), None));
    }

    #[test]
    fn allocations_take_address_and_pitch_from_out_pointers() {
        let (_, c) = call("cuMemAlloc_v2", [0x7ffd0000, 65536, 0, 0, 0, 0], [0x7f1000000000, 0]);
        assert_eq!(
            (c.bytes, c.address, c.mem),
            (Some(65536), Some(0x7f1000000000), MemKind::Device)
        );
        let (_, c) = call(
            "cuMemAllocPitch_v2",
            [0x7ffd0000, 0x7ffd0008, 1000, 4, 4, 0],
            [0x7f1000001000, 1024],
        );
        assert_eq!((c.bytes, c.address), (Some(4096), Some(0x7f1000001000)));
        let (_, c) = call("cuMemFreeAsync_ptsz", [0x7f1000000000, 0x42, 0, 0, 0, 0], [0; 2]);
        assert_eq!((c.bytes, c.address, c.stream), (None, Some(0x7f1000000000), Some(0x42)));
    }

    #[test]
    fn truncated_and_unknown_records_are_errors() {
        assert_eq!(decode(&[0u8; 8]).unwrap_err(), DecodeError::Short);
        let mut hdr = [0u8; 40];
        hdr[0] = 99;
        assert_eq!(decode(&hdr).unwrap_err(), DecodeError::UnknownKind(99));
    }
}
