//! CUPTI activity records → [`GpuRecord`]s.
//!
//! Fields are read at the offsets of CUPTI's structs (`CUpti_ActivityAPI`,
//! `CUpti_ActivityKernel4`..`10`, `CUpti_ActivityMemcpy6`, `CUpti_ActivityMemset4`,
//! `CUpti_ActivityMarker2`): every
//! version of a record keeps the fields read here at the same place, so one reader serves the
//! CUPTI of CUDA 12 and 13 alike. Offsets were measured with `offsetof` against CUDA 13.0's
//! `cupti_activity.h`.

use gpu_observer_common::cupti::{self, GpuRecord, GpuRecordKind};

/// `CUpti_ActivityKind` values this library enables and reads.
pub mod kind {
    pub const MEMCPY: u32 = 1;
    pub const MEMSET: u32 = 2;
    pub const KERNEL: u32 = 3;
    pub const DRIVER: u32 = 4;
    pub const RUNTIME: u32 = 5;
    pub const CONCURRENT_KERNEL: u32 = 10;
    pub const MARKER: u32 = 12;
}

/// Bytes of each record kind read here (the smallest version's size; a read never goes past it).
pub fn readable_len(kind_value: u32) -> usize {
    match kind_value {
        kind::DRIVER | kind::RUNTIME => 40,
        kind::KERNEL | kind::CONCURRENT_KERNEL => 160,
        kind::MEMCPY => 76,
        kind::MEMSET => 76,
        kind::MARKER => 56,
        _ => 4,
    }
}

fn u8_at(r: &[u8], off: usize) -> u8 {
    r[off]
}
fn u16_at(r: &[u8], off: usize) -> u16 {
    u16::from_ne_bytes([r[off], r[off + 1]])
}
fn u32_at(r: &[u8], off: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&r[off..off + 4]);
    u32::from_ne_bytes(b)
}
fn i32_at(r: &[u8], off: usize) -> i32 {
    u32_at(r, off) as i32
}
fn u64_at(r: &[u8], off: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&r[off..off + 8]);
    u64::from_ne_bytes(b)
}

/// The fields `CUpti_ActivityMemcpy6` and `CUpti_ActivityMemset4` keep at the same offsets.
fn transfer(r: &[u8], kind: GpuRecordKind) -> GpuRecord {
    GpuRecord {
        kind: kind as u32,
        bytes: u64_at(r, 8),
        start_ns: u64_at(r, 16),
        end_ns: u64_at(r, 24),
        device: u32_at(r, 32),
        context: u32_at(r, 36),
        stream: u32_at(r, 40),
        correlation_id: u32_at(r, 44),
        graph_id: u32_at(r, 72),
        ..Default::default()
    }
}

/// What a CUPTI record becomes.
#[derive(Debug, PartialEq, Eq)]
pub enum Converted {
    Record(GpuRecord),
    /// A kernel record and the name it carries (CUPTI's pointer, the key of the name).
    Kernel(GpuRecord, u64),
    /// An NVTX marker and the pointers to its name and domain (NULL when it has none);
    /// valid while CUPTI's buffer is.
    Marker(GpuRecord, u64, u64),
    /// A record of a kind or API we do not forward.
    Skip,
}

/// Converts one record; `r` holds at least [`readable_len`] bytes of it.
pub fn convert(r: &[u8]) -> Converted {
    if r.len() < 4 {
        return Converted::Skip;
    }
    let k = u32_at(r, 0);
    if r.len() < readable_len(k) {
        return Converted::Skip;
    }
    match k {
        kind::DRIVER | kind::RUNTIME => {
            let cbid = u32_at(r, 4);
            let record_kind = match k {
                kind::DRIVER if cupti::api_of_cbid(cbid).is_some() => GpuRecordKind::Api,
                kind::RUNTIME if cupti::runtime_api_of_cbid(cbid).is_some() => GpuRecordKind::RuntimeApi,
                _ => return Converted::Skip,
            };
            Converted::Record(GpuRecord {
                kind: record_kind as u32,
                cbid,
                start_ns: u64_at(r, 8),
                end_ns: u64_at(r, 16),
                tid: u32_at(r, 28),
                correlation_id: u32_at(r, 32),
                result: u32_at(r, 36),
                ..Default::default()
            })
        }
        kind::KERNEL | kind::CONCURRENT_KERNEL => {
            let name = u64_at(r, 104);
            let rec = GpuRecord {
                kind: GpuRecordKind::Kernel as u32,
                registers_per_thread: u32::from(u16_at(r, 6)),
                start_ns: u64_at(r, 16),
                end_ns: u64_at(r, 24),
                device: u32_at(r, 40),
                context: u32_at(r, 44),
                stream: u32_at(r, 48),
                grid: [i32_at(r, 52), i32_at(r, 56), i32_at(r, 60)],
                block: [i32_at(r, 64), i32_at(r, 68), i32_at(r, 72)],
                static_shared_mem: u32_at(r, 76),
                dynamic_shared_mem: u32_at(r, 80),
                correlation_id: u32_at(r, 92),
                name_key: name,
                cbid: u32::from(u8_at(r, 136)),
                graph_id: u32_at(r, 156),
                ..Default::default()
            };
            Converted::Kernel(rec, name)
        }
        kind::MEMCPY => Converted::Record(GpuRecord {
            copy_kind: u32::from(u8_at(r, 4)),
            src_kind: u16::from(u8_at(r, 5)),
            dst_kind: u16::from(u8_at(r, 6)),
            ..transfer(r, GpuRecordKind::Memcpy)
        }),
        kind::MEMSET => Converted::Record(GpuRecord {
            copy_kind: u32_at(r, 4),
            dst_kind: u16_at(r, 50),
            ..transfer(r, GpuRecordKind::Memset)
        }),
        kind::MARKER => {
            let object_kind = u32_at(r, 20);
            let id = u32_at(r, 16);
            let name = u64_at(r, 40);
            let rec = GpuRecord {
                kind: GpuRecordKind::Marker as u32,
                cbid: u32_at(r, 4),
                start_ns: u64_at(r, 8),
                correlation_id: id,
                src_kind: object_kind.min(u32::from(u16::MAX)) as u16,
                // A thread's marker names its thread (objectId.pt.threadId); a device's
                // marker its device, context and stream (objectId.dcs).
                tid: if object_kind == u32::from(cupti::marker::OBJECT_THREAD) {
                    u32_at(r, 28)
                } else {
                    0
                },
                name_key: if name != 0 {
                    cupti::marker::NAME_KEY_BIT | u64::from(id)
                } else {
                    0
                },
                ..Default::default()
            };
            Converted::Marker(rec, name, u64_at(r, 48))
        }
        _ => Converted::Skip,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put<const N: usize>(r: &mut [u8], off: usize, v: [u8; N]) {
        r[off..off + N].copy_from_slice(&v);
    }

    #[test]
    fn api_records_of_work_calls_only() {
        let mut r = [0u8; 40];
        put(&mut r, 0, kind::DRIVER.to_ne_bytes());
        put(&mut r, 4, 307u32.to_ne_bytes()); // cuLaunchKernel
        put(&mut r, 8, 1_000u64.to_ne_bytes());
        put(&mut r, 16, 4_000u64.to_ne_bytes());
        put(&mut r, 24, 77u32.to_ne_bytes());
        put(&mut r, 28, 78u32.to_ne_bytes());
        put(&mut r, 32, 9u32.to_ne_bytes());
        let Converted::Record(g) = convert(&r) else { panic!() };
        assert_eq!(
            (g.kind, g.cbid, g.start_ns, g.end_ns, g.tid, g.correlation_id),
            (GpuRecordKind::Api as u32, 307, 1_000, 4_000, 78, 9)
        );
        put(&mut r, 4, 17u32.to_ne_bytes()); // not a work call
        assert_eq!(convert(&r), Converted::Skip);
        // The runtime's launch: same layout, its own callback ids.
        put(&mut r, 0, kind::RUNTIME.to_ne_bytes());
        put(&mut r, 4, 211u32.to_ne_bytes()); // cudaLaunchKernel
        let Converted::Record(g) = convert(&r) else { panic!() };
        assert_eq!((g.kind, g.cbid, g.tid), (GpuRecordKind::RuntimeApi as u32, 211, 78));
        put(&mut r, 4, 307u32.to_ne_bytes()); // a driver id means nothing here
        assert_eq!(convert(&r), Converted::Skip);
    }

    #[test]
    fn kernel_record_fields() {
        let mut r = [0u8; 216];
        put(&mut r, 0, kind::CONCURRENT_KERNEL.to_ne_bytes());
        put(&mut r, 6, 40u16.to_ne_bytes());
        put(&mut r, 16, 5_000u64.to_ne_bytes());
        put(&mut r, 24, 8_000u64.to_ne_bytes());
        put(&mut r, 40, 1u32.to_ne_bytes());
        put(&mut r, 44, 2u32.to_ne_bytes());
        put(&mut r, 48, 13u32.to_ne_bytes());
        for (i, v) in [3i32, 2, 1, 128, 4, 1].iter().enumerate() {
            put(&mut r, 52 + 4 * i, v.to_ne_bytes());
        }
        put(&mut r, 76, 256u32.to_ne_bytes());
        put(&mut r, 80, 1024u32.to_ne_bytes());
        put(&mut r, 92, 55u32.to_ne_bytes());
        put(&mut r, 104, 0xdead_beefu64.to_ne_bytes());
        r[136] = 1;
        put(&mut r, 156, 42u32.to_ne_bytes());
        let Converted::Kernel(g, name) = convert(&r) else {
            panic!()
        };
        assert_eq!(name, 0xdead_beef);
        assert_eq!(
            (
                g.registers_per_thread,
                g.start_ns,
                g.end_ns,
                g.device,
                g.context,
                g.stream
            ),
            (40, 5_000, 8_000, 1, 2, 13)
        );
        assert_eq!((g.grid, g.block), ([3, 2, 1], [128, 4, 1]));
        assert_eq!(
            (
                g.static_shared_mem,
                g.dynamic_shared_mem,
                g.correlation_id,
                g.cbid,
                g.graph_id
            ),
            (256, 1024, 55, 1, 42)
        );
    }

    #[test]
    fn memcpy_and_memset_records() {
        let mut r = [0u8; 96];
        put(&mut r, 0, kind::MEMCPY.to_ne_bytes());
        r[4] = 1;
        r[5] = 2;
        r[6] = 3;
        put(&mut r, 8, 4096u64.to_ne_bytes());
        put(&mut r, 44, 7u32.to_ne_bytes());
        let Converted::Record(g) = convert(&r) else { panic!() };
        assert_eq!(
            (g.kind, g.copy_kind, g.src_kind, g.dst_kind, g.bytes, g.correlation_id),
            (3, 1, 2, 3, 4096, 7)
        );
        let mut m = [0u8; 88];
        put(&mut m, 0, kind::MEMSET.to_ne_bytes());
        put(&mut m, 4, 0xabu32.to_ne_bytes());
        put(&mut m, 8, 64u64.to_ne_bytes());
        put(&mut m, 44, 8u32.to_ne_bytes());
        put(&mut m, 50, 3u16.to_ne_bytes());
        let Converted::Record(g) = convert(&m) else { panic!() };
        assert_eq!(
            (g.kind, g.copy_kind, g.bytes, g.correlation_id, g.dst_kind),
            (4, 0xab, 64, 8, 3)
        );
    }

    #[test]
    fn short_or_unknown_records_are_skipped() {
        assert_eq!(convert(&[1, 0]), Converted::Skip);
        assert_eq!(convert(&kind::CONCURRENT_KERNEL.to_ne_bytes()), Converted::Skip);
        assert_eq!(convert(&[99, 0, 0, 0, 0, 0, 0, 0]), Converted::Skip);
    }

    #[test]
    fn marker_records_name_their_thread_and_name_key() {
        let mut r = [0u8; 56];
        put(&mut r, 0, kind::MARKER.to_ne_bytes());
        put(&mut r, 4, 2u32.to_ne_bytes()); // start
        put(&mut r, 8, 9_000u64.to_ne_bytes());
        put(&mut r, 16, 77u32.to_ne_bytes());
        put(&mut r, 20, 2u32.to_ne_bytes()); // thread
        put(&mut r, 24, 500u32.to_ne_bytes());
        put(&mut r, 28, 501u32.to_ne_bytes());
        put(&mut r, 40, 0x1000u64.to_ne_bytes());
        put(&mut r, 48, 0x2000u64.to_ne_bytes());
        let Converted::Marker(g, name, domain) = convert(&r) else {
            panic!()
        };
        assert_eq!((name, domain), (0x1000, 0x2000));
        assert_eq!(
            (g.kind, g.cbid, g.start_ns, g.correlation_id, g.tid, g.src_kind),
            (GpuRecordKind::Marker as u32, 2, 9_000, 77, 501, 2)
        );
        assert_eq!(g.name_key, cupti::marker::NAME_KEY_BIT | 77);
        // An end has no name; a marker of another object names no thread.
        put(&mut r, 40, 0u64.to_ne_bytes());
        put(&mut r, 20, 5u32.to_ne_bytes());
        let Converted::Marker(g, 0, _) = convert(&r) else {
            panic!()
        };
        assert_eq!((g.name_key, g.tid, g.src_kind), (0, 0, 5));
        // A record cut short is skipped, never read past.
        assert_eq!(convert(&r[..55]), Converted::Skip);
    }
}
