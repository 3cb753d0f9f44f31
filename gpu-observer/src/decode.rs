//! Decode: ring-buffer records → typed events, arguments read by the API table.

use gpu_observer_common::{
    api::{self, ApiSpec, Direction, Family, MemKind, NO_ARG},
    event::{CallEvent, EventHeader, EventKind, IoctlEvent, LaunchEvent, read_record},
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
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub function: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub stream: u64,
    pub read_errors: u32,
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
}

#[derive(Clone, Debug)]
pub struct Ioctl {
    pub fd: u32,
    pub cmd: u32,
    pub arg: u64,
    pub duration_ns: u64,
    pub ret: i64,
    pub parent: Option<&'static ApiSpec>,
}

impl Event {
    pub fn comm(&self) -> &str {
        let end = self
            .comm
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.comm.len());
        std::str::from_utf8(&self.comm[..end]).unwrap_or("?")
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
            })
        }
        EventKind::ProcessExit => Body::ProcessExit,
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
    (n != NO_ARG)
        .then(|| r.args.get(usize::from(n)).copied())
        .flatten()
}

/// Reads a call's interesting arguments by its API's layout.
pub fn decode_call(spec: &ApiSpec, r: &CallEvent) -> Call {
    let ok = r.result == 0;
    let (bytes, address) = match spec.family {
        Family::Memcpy => (arg(r, spec.bytes_arg), None),
        Family::Memset => {
            let n = arg(r, spec.bytes_arg).unwrap_or(0);
            let rows = arg(r, spec.height_arg).unwrap_or(1);
            (
                Some(
                    n.saturating_mul(rows)
                        .saturating_mul(u64::from(spec.elem_size)),
                ),
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
            (bytes, ok.then_some(r.out[0]))
        }
        Family::Free => (None, arg(r, spec.dst_arg)),
        _ => (None, None),
    };
    let copy_ptrs = matches!(spec.family, Family::Memcpy);
    Call {
        bytes,
        direction: spec.direction,
        mem: spec.mem,
        stream: arg(r, spec.stream_arg),
        dst: if copy_ptrs {
            arg(r, spec.dst_arg)
        } else {
            None
        },
        src: if copy_ptrs {
            arg(r, spec.src_arg)
        } else {
            None
        },
        address,
        duration_ns: r.duration_ns,
        result: r.result,
        ioctl_count: r.ioctl_count,
        ioctl_ns: r.ioctl_ns,
        nested: r.nested,
        read_errors: r.read_errors,
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
        let (ev, c) = call(
            "cuMemcpyDtoHAsync_v2_ptsz",
            [0x1000, 0x2000, 4096, 0x77, 0, 0],
            [0; 2],
        );
        assert_eq!(ev.comm(), "worker");
        assert_eq!(
            (c.bytes, c.stream, c.direction),
            (Some(4096), Some(0x77), Direction::GpuToCpu)
        );
        assert_eq!((c.dst, c.src), (Some(0x1000), Some(0x2000)));
        let (_, c) = call(
            "cuMemcpyPeerAsync",
            [0xa, 0xc1, 0xb, 0xc2, 12345, 0x99],
            [0; 2],
        );
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
        let (_, c) = call(
            "cuMemsetD2D16_v2_ptds",
            [0x1000, 8192, 7, 100, 10, 0],
            [0; 2],
        );
        assert_eq!((c.bytes, c.stream), (Some(2000), None));
    }

    #[test]
    fn allocations_take_address_and_pitch_from_out_pointers() {
        let (_, c) = call(
            "cuMemAlloc_v2",
            [0x7ffd0000, 65536, 0, 0, 0, 0],
            [0x7f1000000000, 0],
        );
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
        let (_, c) = call(
            "cuMemFreeAsync_ptsz",
            [0x7f1000000000, 0x42, 0, 0, 0, 0],
            [0; 2],
        );
        assert_eq!(
            (c.bytes, c.address, c.stream),
            (None, Some(0x7f1000000000), Some(0x42))
        );
    }

    #[test]
    fn truncated_and_unknown_records_are_errors() {
        assert_eq!(decode(&[0u8; 8]).unwrap_err(), DecodeError::Short);
        let mut hdr = [0u8; 40];
        hdr[0] = 99;
        assert_eq!(decode(&hdr).unwrap_err(), DecodeError::UnknownKind(99));
    }
}
