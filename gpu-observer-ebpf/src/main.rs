//! gpu-observer's eBPF programs, one module per probe family.
//!
//! Launch probes are entry-only (a return probe would double their cost on the real driver);
//! copies, memsets, allocations, frees, syncs and init calls get an entry probe that saves the
//! arguments per thread and a return probe that emits one record with the duration and the
//! ioctls issued inside. Records go to one ring buffer, submitted without wakeup unless the ring
//! is half full; every record that does not fit is counted per CPU and per process.
#![no_std]
#![no_main]

mod calls;
mod cupti;
mod emit;
mod ioctl;
mod launch;
mod maps;
mod process;

// Only for the BPF target: host-side `cargo clippy --workspace` links std through dependencies.
#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
