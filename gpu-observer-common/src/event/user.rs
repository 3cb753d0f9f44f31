//! Userspace-only helpers for the event ABI.

use super::*;

/// Marks integer-only `#[repr(C)]` records as `aya::Pod`.
macro_rules! pod {
    ($($t:ty),*) => {$(
        // SAFETY: #[repr(C)] struct of integers and integer arrays: every bit pattern is valid.
        unsafe impl aya::Pod for $t {}
    )*};
}
pod!(
    EventHeader,
    LaunchEvent,
    CallEvent,
    NameEvent,
    IoctlEvent,
    GpuEvent,
    GpuNameEvent,
    Inflight,
    TailCall,
    IoctlStart
);

/// Reads a `T` from the start of a ring-buffer record, if it is long enough.
///
/// Records are only 8-byte aligned in the ring, so this copies with `read_unaligned`.
pub fn read_record<T: aya::Pod>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < core::mem::size_of::<T>() {
        return None;
    }
    // SAFETY: length checked above; T: Pod is valid for any bit pattern.
    Some(unsafe { core::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}
