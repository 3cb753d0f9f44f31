//! Names for NVIDIA driver ioctls.
//!
//! An ioctl record carries only a raw command number such as `0xc020462a`. Naming it
//! (`NV_ESC_RM_CONTROL`) says what the process asked the driver to do: allocate an object,
//! map memory, register a GPU with UVM. Numbers the tables do not know stay unnamed (`None`),
//! so the caller can still show the raw value.
//!
//! Two encodings reach the observer:
//!
//! - `/dev/nvidiactl` and `/dev/nvidiaN` take `_IOWR('F', nr, size)` commands: the type byte
//!   (bits 8..16) is `'F'` (0x46) and the escape number is `_IOC_NR` (bits 0..8). The size field
//!   varies with the parameter struct and plays no part in the name.
//! - `/dev/nvidia-uvm` takes plain numbers, not `_IOC`-encoded: `UVM_IOCTL_BASE(i)` is `i` on
//!   Linux, plus `UVM_INITIALIZE` / `UVM_DEINITIALIZE` at 0x30000001 / 0x30000002.
//!
//! Source of the numbers: NVIDIA open-gpu-kernel-modules, release 590.48.01 (commit 877fd23c)
//! unless noted:
//!
//! - `src/nvidia/arch/nvalloc/unix/include/nv_escape.h`: RM escapes, 0x27..=0x5f;
//! - `kernel-open/common/inc/nv-ioctl-numbers.h`: OS escapes at `NV_IOCTL_BASE` (200) + n,
//!   read at 595.44.02 (commit 2c7bfb47), same list as 550.40.07;
//! - `kernel-open/common/inc/nv-ioctl-numa.h`: `NV_ESC_NUMA_INFO` and `NV_ESC_SET_NUMA_STATUS`;
//! - `kernel-open/nvidia-uvm/uvm_ioctl.h` and `kernel-open/nvidia-uvm/uvm_linux_ioctl.h`.
//!
//! `NV_ESC_IOCTL_XFER_CMD` wraps another escape whose number sits in its argument struct;
//! this module names only the outer command.

/// `NV_IOCTL_MAGIC`: the `_IOC` type byte of every nvidia RM ioctl.
const NV_IOCTL_MAGIC: u32 = b'F' as u32;

/// Escape numbers (`_IOC_NR`) of the RM driver, sorted by number for binary search.
const NV_ESCAPES: &[(u8, &str)] = &[
    // nv_escape.h: RM API escapes, shared with other OSes.
    (0x27, "NV_ESC_RM_ALLOC_MEMORY"),
    (0x28, "NV_ESC_RM_ALLOC_OBJECT"),
    (0x29, "NV_ESC_RM_FREE"),
    (0x2a, "NV_ESC_RM_CONTROL"),
    (0x2b, "NV_ESC_RM_ALLOC"),
    (0x32, "NV_ESC_RM_CONFIG_GET"),
    (0x33, "NV_ESC_RM_CONFIG_SET"),
    (0x34, "NV_ESC_RM_DUP_OBJECT"),
    (0x35, "NV_ESC_RM_SHARE"),
    (0x37, "NV_ESC_RM_CONFIG_GET_EX"),
    (0x38, "NV_ESC_RM_CONFIG_SET_EX"),
    (0x39, "NV_ESC_RM_I2C_ACCESS"),
    (0x41, "NV_ESC_RM_IDLE_CHANNELS"),
    (0x4a, "NV_ESC_RM_VID_HEAP_CONTROL"),
    (0x4d, "NV_ESC_RM_ACCESS_REGISTRY"),
    (0x4e, "NV_ESC_RM_MAP_MEMORY"),
    (0x4f, "NV_ESC_RM_UNMAP_MEMORY"),
    (0x52, "NV_ESC_RM_GET_EVENT_DATA"),
    (0x54, "NV_ESC_RM_ALLOC_CONTEXT_DMA2"),
    (0x56, "NV_ESC_RM_ADD_VBLANK_CALLBACK"),
    (0x57, "NV_ESC_RM_MAP_MEMORY_DMA"),
    (0x58, "NV_ESC_RM_UNMAP_MEMORY_DMA"),
    (0x59, "NV_ESC_RM_BIND_CONTEXT_DMA"),
    (0x5c, "NV_ESC_RM_EXPORT_OBJECT_TO_FD"),
    (0x5d, "NV_ESC_RM_IMPORT_OBJECT_FROM_FD"),
    (0x5e, "NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO"),
    (0x5f, "NV_ESC_RM_LOCKLESS_DIAGNOSTIC"),
    // nv-ioctl-numbers.h: Linux-level escapes at NV_IOCTL_BASE (200) + n.
    (200, "NV_ESC_CARD_INFO"),
    (201, "NV_ESC_REGISTER_FD"),
    (206, "NV_ESC_ALLOC_OS_EVENT"),
    (207, "NV_ESC_FREE_OS_EVENT"),
    (209, "NV_ESC_STATUS_CODE"),
    (210, "NV_ESC_CHECK_VERSION_STR"),
    (211, "NV_ESC_IOCTL_XFER_CMD"),
    (212, "NV_ESC_ATTACH_GPUS_TO_FD"),
    (213, "NV_ESC_QUERY_DEVICE_INTR"),
    (214, "NV_ESC_SYS_PARAMS"),
    // nv-ioctl-numa.h.
    (215, "NV_ESC_NUMA_INFO"),
    (216, "NV_ESC_SET_NUMA_STATUS"),
    // nv-ioctl-numbers.h again.
    (217, "NV_ESC_EXPORT_TO_DMABUF_FD"),
    (218, "NV_ESC_WAIT_OPEN_COMPLETE"),
];

/// `/dev/nvidia-uvm` commands, sorted by number for binary search.
///
/// Numbers retired from uvm_ioctl.h stay in, marked, so a trace from an older driver still
/// gets names; up to 590.48.01 none of them has been given to another command.
///
/// Left out: `UVM_REGION_SET_BACKING` (21) and `UVM_REGION_UNSET_BACKING` (22), which
/// uvm_ioctl.h defines only for Windows, and the `UVM_TEST_*` commands of uvm_test_ioctl.h,
/// which only a driver built with its test ioctls enabled accepts.
const UVM_IOCTLS: &[(u32, &str)] = &[
    // uvm_ioctl.h, 590.48.01.
    (1, "UVM_RESERVE_VA"),
    (2, "UVM_RELEASE_VA"),
    (3, "UVM_REGION_COMMIT"),
    (4, "UVM_REGION_DECOMMIT"),
    (5, "UVM_REGION_SET_STREAM"),
    (6, "UVM_SET_STREAM_RUNNING"),
    (7, "UVM_SET_STREAM_STOPPED"),
    // Retired: in 575.51.02, not in 590.48.01.
    (9, "UVM_RUN_TEST"),
    (10, "UVM_ADD_SESSION"),
    // Retired: in 575.51.02, not in 590.48.01.
    (11, "UVM_REMOVE_SESSION"),
    (12, "UVM_ENABLE_COUNTERS"),
    (13, "UVM_MAP_COUNTER"),
    (14, "UVM_CREATE_EVENT_QUEUE"),
    (15, "UVM_REMOVE_EVENT_QUEUE"),
    (16, "UVM_MAP_EVENT_QUEUE"),
    (17, "UVM_EVENT_CTRL"),
    // Retired, both: in 575.51.02, not in 590.48.01.
    (18, "UVM_REGISTER_MPS_SERVER"),
    (19, "UVM_REGISTER_MPS_CLIENT"),
    (20, "UVM_GET_GPU_UUID_TABLE"),
    (23, "UVM_CREATE_RANGE_GROUP"),
    (24, "UVM_DESTROY_RANGE_GROUP"),
    (25, "UVM_REGISTER_GPU_VASPACE"),
    (26, "UVM_UNREGISTER_GPU_VASPACE"),
    (27, "UVM_REGISTER_CHANNEL"),
    (28, "UVM_UNREGISTER_CHANNEL"),
    (29, "UVM_ENABLE_PEER_ACCESS"),
    (30, "UVM_DISABLE_PEER_ACCESS"),
    (31, "UVM_SET_RANGE_GROUP"),
    (33, "UVM_MAP_EXTERNAL_ALLOCATION"),
    (34, "UVM_FREE"),
    (35, "UVM_MEM_MAP"),
    // Retired: in 515.43.04, not in 575.51.02 or later.
    (36, "UVM_DEBUG_ACCESS_MEMORY"),
    (37, "UVM_REGISTER_GPU"),
    (38, "UVM_UNREGISTER_GPU"),
    (39, "UVM_PAGEABLE_MEM_ACCESS"),
    (40, "UVM_PREVENT_MIGRATION_RANGE_GROUPS"),
    (41, "UVM_ALLOW_MIGRATION_RANGE_GROUPS"),
    (42, "UVM_SET_PREFERRED_LOCATION"),
    (43, "UVM_UNSET_PREFERRED_LOCATION"),
    (44, "UVM_ENABLE_READ_DUPLICATION"),
    (45, "UVM_DISABLE_READ_DUPLICATION"),
    (46, "UVM_SET_ACCESSED_BY"),
    (47, "UVM_UNSET_ACCESSED_BY"),
    (51, "UVM_MIGRATE"),
    (53, "UVM_MIGRATE_RANGE_GROUP"),
    (54, "UVM_ENABLE_SYSTEM_WIDE_ATOMICS"),
    (55, "UVM_DISABLE_SYSTEM_WIDE_ATOMICS"),
    (56, "UVM_TOOLS_INIT_EVENT_TRACKER"),
    (57, "UVM_TOOLS_SET_NOTIFICATION_THRESHOLD"),
    (58, "UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS"),
    (59, "UVM_TOOLS_EVENT_QUEUE_DISABLE_EVENTS"),
    (60, "UVM_TOOLS_ENABLE_COUNTERS"),
    (61, "UVM_TOOLS_DISABLE_COUNTERS"),
    (62, "UVM_TOOLS_READ_PROCESS_MEMORY"),
    (63, "UVM_TOOLS_WRITE_PROCESS_MEMORY"),
    (64, "UVM_TOOLS_GET_PROCESSOR_UUID_TABLE"),
    (65, "UVM_MAP_DYNAMIC_PARALLELISM_REGION"),
    (66, "UVM_UNMAP_EXTERNAL"),
    (67, "UVM_TOOLS_FLUSH_EVENTS"),
    (68, "UVM_ALLOC_SEMAPHORE_POOL"),
    (69, "UVM_CLEAN_UP_ZOMBIE_RESOURCES"),
    (70, "UVM_PAGEABLE_MEM_ACCESS_ON_GPU"),
    (71, "UVM_POPULATE_PAGEABLE"),
    (72, "UVM_VALIDATE_VA_RANGE"),
    (73, "UVM_CREATE_EXTERNAL_RANGE"),
    (74, "UVM_MAP_EXTERNAL_SPARSE"),
    (75, "UVM_MM_INITIALIZE"),
    (76, "UVM_TOOLS_INIT_EVENT_TRACKER_V2"),
    (77, "UVM_TOOLS_GET_PROCESSOR_UUID_TABLE_V2"),
    (78, "UVM_ALLOC_DEVICE_P2P"),
    (79, "UVM_CLEAR_ALL_ACCESS_COUNTERS"),
    (80, "UVM_DISCARD"),
    (2047, "UVM_IS_8_SUPPORTED"),
    // uvm_linux_ioctl.h.
    (0x3000_0001, "UVM_INITIALIZE"),
    (0x3000_0002, "UVM_DEINITIALIZE"),
];

/// Name of an nvidia RM ioctl (`/dev/nvidiactl`, `/dev/nvidiaN`), from its escape number.
///
/// `None` when the `_IOC` type byte is not `'F'` or the escape number is unknown.
pub fn nv_escape_name(cmd: u32) -> Option<&'static str> {
    if (cmd >> 8) & 0xff != NV_IOCTL_MAGIC {
        return None;
    }
    let nr = (cmd & 0xff) as u8;
    NV_ESCAPES
        .binary_search_by_key(&nr, |&(n, _)| n)
        .ok()
        .map(|i| NV_ESCAPES[i].1)
}

/// Name of a `/dev/nvidia-uvm` ioctl. `None` when the number is unknown.
pub fn uvm_name(cmd: u32) -> Option<&'static str> {
    UVM_IOCTLS
        .binary_search_by_key(&cmd, |&(n, _)| n)
        .ok()
        .map(|i| UVM_IOCTLS[i].1)
}

/// Name of an ioctl issued on `/dev/nvidia-uvm` when `uvm_fd`, else on an nvidia RM device.
pub fn name(cmd: u32, uvm_fd: bool) -> Option<&'static str> {
    if uvm_fd {
        return uvm_name(cmd);
    }
    nv_escape_name(cmd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_strictly_sorted() {
        assert!(NV_ESCAPES.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(UVM_IOCTLS.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn every_entry_is_found() {
        for &(nr, want) in NV_ESCAPES {
            let cmd = 0xc000_0000 | (0x10 << 16) | (NV_IOCTL_MAGIC << 8) | u32::from(nr);
            assert_eq!(nv_escape_name(cmd), Some(want));
        }
        for &(cmd, want) in UVM_IOCTLS {
            assert_eq!(uvm_name(cmd), Some(want));
        }
    }

    #[test]
    fn rm_escapes() {
        assert_eq!(nv_escape_name(0xc020_462a), Some("NV_ESC_RM_CONTROL"));
        assert_eq!(nv_escape_name(0xc030_462b), Some("NV_ESC_RM_ALLOC"));
        assert_eq!(nv_escape_name(0xc038_464e), Some("NV_ESC_RM_MAP_MEMORY"));
        assert_eq!(nv_escape_name(0xc028_4629), Some("NV_ESC_RM_FREE"));
        // The size field does not matter, only type and number.
        assert_eq!(nv_escape_name(0x0000_464f), Some("NV_ESC_RM_UNMAP_MEMORY"));
    }

    #[test]
    fn os_escapes() {
        // NV_IOCTL_BASE + 0, + 1, + 14, + 15.
        assert_eq!(nv_escape_name(0xc000_46c8), Some("NV_ESC_CARD_INFO"));
        assert_eq!(nv_escape_name(0xc004_46c9), Some("NV_ESC_REGISTER_FD"));
        assert_eq!(nv_escape_name(0xc008_46d6), Some("NV_ESC_SYS_PARAMS"));
        assert_eq!(nv_escape_name(0xc000_46d7), Some("NV_ESC_NUMA_INFO"));
    }

    #[test]
    fn not_an_rm_ioctl() {
        // Type byte 'T' (a tty ioctl, TCGETS) and type byte 0 (a UVM number).
        assert_eq!(nv_escape_name(0x0000_5401), None);
        assert_eq!(nv_escape_name(0x3000_0001), None);
        // Right escape number, wrong type byte.
        assert_eq!(nv_escape_name(0xc020_472a), None);
    }

    #[test]
    fn unknown_numbers() {
        // Gaps in nv_escape.h and nv-ioctl-numbers.h.
        assert_eq!(nv_escape_name(0xc000_4600), None);
        assert_eq!(nv_escape_name(0xc000_462c), None);
        assert_eq!(nv_escape_name(0xc000_46ca), None);
        assert_eq!(nv_escape_name(0xc000_46ff), None);
        assert_eq!(uvm_name(0), None);
        assert_eq!(uvm_name(8), None);
        assert_eq!(uvm_name(81), None);
        assert_eq!(uvm_name(0x3000_0003), None);
    }

    #[test]
    fn uvm_ioctls() {
        assert_eq!(uvm_name(0x3000_0001), Some("UVM_INITIALIZE"));
        assert_eq!(uvm_name(0x3000_0002), Some("UVM_DEINITIALIZE"));
        assert_eq!(uvm_name(1), Some("UVM_RESERVE_VA"));
        assert_eq!(uvm_name(33), Some("UVM_MAP_EXTERNAL_ALLOCATION"));
        assert_eq!(uvm_name(37), Some("UVM_REGISTER_GPU"));
        assert_eq!(uvm_name(75), Some("UVM_MM_INITIALIZE"));
        assert_eq!(uvm_name(2047), Some("UVM_IS_8_SUPPORTED"));
    }

    #[test]
    fn name_dispatches_on_fd() {
        assert_eq!(name(0x3000_0001, true), Some("UVM_INITIALIZE"));
        assert_eq!(name(37, true), Some("UVM_REGISTER_GPU"));
        assert_eq!(name(0xc020_462a, false), Some("NV_ESC_RM_CONTROL"));
        // Each number means nothing on the other kind of fd.
        assert_eq!(name(0xc020_462a, true), None);
        assert_eq!(name(0x3000_0001, false), None);
        assert_eq!(name(37, false), None);
    }
}
