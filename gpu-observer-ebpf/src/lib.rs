//! Host-side placeholder so the agent can depend on this crate and be rebuilt when it changes;
//! the programs are in the `gpu-observer` binary, built for bpfel-unknown-none.
#![no_std]
