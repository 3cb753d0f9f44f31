//! Userspace-only helpers for the CUPTI record ABI.

use super::GpuRecord;

// SAFETY: #[repr(C)] struct of integers and integer arrays: every bit pattern is valid.
unsafe impl aya::Pod for GpuRecord {}
