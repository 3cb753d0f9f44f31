//! The code a borrowed thread runs to load the library, and the data it works on.
//!
//! The thread is stopped inside a blocking system call and sent here; from then on it needs
//! nobody: if the observer dies at any moment, the thread still finishes (or gives up) and goes
//! back exactly where it was. So the code restores everything itself — every general register
//! and the flags from the save area, the x87/SSE/AVX/AVX-512 state with `xsave`/`xrstor` —
//! and re-issues the interrupted system call (as the kernel would have restarted it). It:
//!
//! 1. saves the vector state; creates a memfd (`memfd_create`, close-on-exec) and puts its
//!    number in `FD`, `STATE = 1`;
//! 2. waits (1 ms sleeps, at most [`WAIT_ITERS`]) for the observer to fill the memfd and set
//!    `GO` to 1 (or 2: give up);
//! 3. `dlopen("/proc/self/fd/N", RTLD_NOW)` (the path written by the observer), the handle in
//!    `HANDLE`, and on failure `dlerror()`'s message in `ERR`; closes the memfd (the mapping
//!    stays);
//! 4. restores the vector state and the registers, sets `STATE = 3` as its last write, and
//!    jumps back.
//!
//! The data block lies on the thread's own stack, below its red zone (dead stack: nothing
//! there is live), and the code in the unused bytes after the end of a code segment (a private
//! copy of that page once written; no code ever jumps there).

/// Layout of the data block (from its base, 64-byte aligned).
pub mod data {
    /// `xsave` area (zeroed: a clean header), 64-byte aligned; 4 KiB holds x87, SSE, AVX and
    /// AVX-512 ([`XSAVE_MASK`]).
    pub const XSAVE: u64 = 0;
    /// The general registers and flags, in the order the epilogue pops them ([`SAVED`]).
    pub const SAVE: u64 = 0x1000;
    pub const STATE: u64 = 0x1100;
    pub const GO: u64 = 0x1104;
    pub const FD: u64 = 0x1108;
    pub const HANDLE: u64 = 0x1110;
    pub const ERR: u64 = 0x1118;
    /// `struct timespec` of one wait (1 ms).
    pub const SLEEP: u64 = 0x1120;
    pub const NAME: u64 = 0x1140;
    pub const PATH: u64 = 0x1180;
    /// Room for the path (`/proc/self/fd/` and a number).
    pub const PATH_LEN: u64 = 64;
    pub const LEN: u64 = 0x1200;
}

/// `STATE` values.
pub mod state {
    pub const STARTED: u32 = 0;
    pub const MEMFD: u32 = 1;
    /// Gone back to its own code.
    pub const RETURNED: u32 = 3;
}

/// `GO` values.
pub mod go {
    pub const LOAD: u32 = 1;
    pub const ABORT: u32 = 2;
}

/// Components saved and restored: x87, SSE, AVX, AVX-512 (opmask, ZMM_Hi256, Hi16_ZMM).
/// AMX tiles are left out (the loader never touches them, and saving them needs the
/// process's permission); MPX and PKRU likewise.
const XSAVE_MASK: u32 = 0xe7;
/// 1 ms waits for the observer to fill the memfd: ~2 s before the thread gives up.
pub const WAIT_ITERS: u32 = 2000;
/// Bytes of code and slots at most (checked by a test).
pub const CODE_MAX: u64 = 320;

/// `SAVE` order: r15 r14 r13 r12 r11 r10 r9 r8 rbp rdi rsi rdx rcx rbx rax rflags.
pub fn saved(r: &libc::user_regs_struct, rax: u64) -> [u64; 16] {
    [
        r.r15, r.r14, r.r13, r.r12, r.r11, r.r10, r.r9, r.r8, r.rbp, r.rdi, r.rsi, r.rdx, r.rcx, r.rbx, rax, r.eflags,
    ]
}

/// Where the code goes, what it calls, and where it returns to.
pub struct Plan {
    /// Address of the code.
    pub code: u64,
    /// Base of the data block.
    pub data: u64,
    pub dlopen: u64,
    /// 0 when the target has none to call.
    pub dlerror: u64,
    /// `dlopen`'s mode (`RTLD_NOW`, plus `__RTLD_DLOPEN` for glibc's internal entry point).
    pub mode: u32,
    /// The stack pointer and instruction to go back to.
    pub rsp: u64,
    pub rip: u64,
}

const SYS_CLOSE: u32 = 3;
const SYS_NANOSLEEP: u32 = 35;
const SYS_MEMFD_CREATE: u32 = 319;
const MFD_CLOEXEC: u32 = 1;
const MFD_EXEC: u32 = 0x10;
const EINVAL: i32 = 22;

/// A tiny x86-64 assembler: exactly the instructions the code uses, with rel32 jumps to
/// labels.
#[derive(Default)]
struct Asm {
    b: Vec<u8>,
    labels: Vec<Option<usize>>,
    fixups: Vec<(usize, usize)>,
}

#[derive(Clone, Copy)]
struct Label(usize);

impl Asm {
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.b.extend_from_slice(b);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    fn label(&mut self) -> Label {
        self.labels.push(None);
        Label(self.labels.len() - 1)
    }
    fn here(&mut self, l: Label) {
        self.labels[l.0] = Some(self.b.len());
    }
    /// `op` then a rel32 to `l`.
    fn jump(&mut self, op: &[u8], l: Label) {
        self.bytes(op);
        self.fixups.push((self.b.len(), l.0));
        self.u32(0);
    }
    /// `[rbx + disp32]` operand with `reg` in ModRM.reg.
    fn rbx_disp(&mut self, op: &[u8], reg: u8, disp: u64) -> &mut Self {
        self.bytes(op).bytes(&[0x80 | (reg << 3) | 3]).u32(disp as u32)
    }
    fn finish(mut self) -> Vec<u8> {
        for (at, l) in std::mem::take(&mut self.fixups) {
            let target = self.labels[l].unwrap_or(at + 4);
            let rel = target as i64 - (at as i64 + 4);
            self.b[at..at + 4].copy_from_slice(&(rel as i32).to_le_bytes());
        }
        self.b
    }
}

/// The machine code for `plan` (position-dependent: `plan.code` is where it runs).
pub fn assemble(plan: &Plan) -> Vec<u8> {
    use data::*;
    let mut a = Asm::default();
    let (wait, waited, close, done) = (a.label(), a.label(), a.label(), a.label());
    // rbx = data block (kept across calls: callee-saved).
    a.bytes(&[0x48, 0xbb]).u64(plan.data);
    a.bytes(&[0xfc]); // cld (the ABI wants DF clear at a call)
    a.bytes(&[0xb8]).u32(XSAVE_MASK).bytes(&[0x31, 0xd2]); // mov eax, mask; xor edx, edx
    a.bytes(&[0x48, 0x0f, 0xae, 0x23]); // xsave64 [rbx]
    // fd = memfd_create(NAME, MFD_CLOEXEC | MFD_EXEC): executable even where
    // vm.memfd_noexec = 1 makes memfds non-executable by default; kernels before 6.3 do not
    // know MFD_EXEC (EINVAL): again without it.
    let created = a.label();
    a.rbx_disp(&[0x48, 0x8d], 7, NAME); // lea rdi, [rbx+NAME]
    a.bytes(&[0xbe]).u32(MFD_CLOEXEC | MFD_EXEC); // mov esi, imm
    a.bytes(&[0xb8]).u32(SYS_MEMFD_CREATE).bytes(&[0x0f, 0x05]);
    a.bytes(&[0x83, 0xf8, (-EINVAL) as i8 as u8]); // cmp eax, -EINVAL
    a.jump(&[0x0f, 0x85], created); // jne created
    a.rbx_disp(&[0x48, 0x8d], 7, NAME);
    a.bytes(&[0xbe]).u32(MFD_CLOEXEC);
    a.bytes(&[0xb8]).u32(SYS_MEMFD_CREATE).bytes(&[0x0f, 0x05]);
    a.here(created);
    a.rbx_disp(&[0x89], 0, FD); // mov [rbx+FD], eax
    a.bytes(&[0x85, 0xc0]); // test eax, eax
    a.jump(&[0x0f, 0x88], done); // js done
    a.rbx_disp(&[0xc7], 0, STATE).u32(state::MEMFD);
    a.bytes(&[0x41, 0xbc]).u32(WAIT_ITERS); // mov r12d, n
    a.here(wait);
    a.rbx_disp(&[0x8b], 0, GO); // mov eax, [rbx+GO]
    a.bytes(&[0x85, 0xc0]);
    a.jump(&[0x0f, 0x85], waited); // jnz waited
    a.bytes(&[0x41, 0xff, 0xcc]); // dec r12d
    a.jump(&[0x0f, 0x84], waited); // jz waited
    a.rbx_disp(&[0x48, 0x8d], 7, SLEEP); // lea rdi, [rbx+SLEEP]
    a.bytes(&[0x31, 0xf6]); // xor esi, esi
    a.bytes(&[0xb8]).u32(SYS_NANOSLEEP).bytes(&[0x0f, 0x05]);
    a.jump(&[0xe9], wait);
    a.here(waited);
    a.rbx_disp(&[0x83], 7, GO).bytes(&[go::LOAD as u8]); // cmp dword [rbx+GO], LOAD
    a.jump(&[0x0f, 0x85], close); // jne close
    a.rbx_disp(&[0x48, 0x8d], 7, PATH); // lea rdi, [rbx+PATH]
    a.bytes(&[0xbe]).u32(plan.mode);
    a.bytes(&[0x48, 0xb8]).u64(plan.dlopen).bytes(&[0xff, 0xd0]); // call dlopen
    a.rbx_disp(&[0x48, 0x89], 0, HANDLE); // mov [rbx+HANDLE], rax
    if plan.dlerror != 0 {
        a.bytes(&[0x48, 0x85, 0xc0]); // test rax, rax
        a.jump(&[0x0f, 0x85], close);
        a.bytes(&[0x48, 0xb8]).u64(plan.dlerror).bytes(&[0xff, 0xd0]);
        a.rbx_disp(&[0x48, 0x89], 0, ERR);
    }
    a.here(close);
    a.rbx_disp(&[0x8b], 7, FD); // mov edi, [rbx+FD]
    a.bytes(&[0xb8]).u32(SYS_CLOSE).bytes(&[0x0f, 0x05]);
    a.here(done);
    a.bytes(&[0xb8]).u32(XSAVE_MASK).bytes(&[0x31, 0xd2]);
    a.bytes(&[0x48, 0x0f, 0xae, 0x2b]); // xrstor64 [rbx]
    // The registers, from the save area: r15 … rbx (rax and the flags last).
    a.bytes(&[0x48, 0xbc]).u64(plan.data + SAVE); // mov rsp, save area
    a.bytes(&[
        0x41, 0x5f, 0x41, 0x5e, 0x41, 0x5d, 0x41, 0x5c, 0x41, 0x5b, 0x41, 0x5a, 0x41, 0x59, 0x41, 0x58, // r15..r8
        0x5d, 0x5f, 0x5e, 0x5a, 0x59, 0x5b, // rbp rdi rsi rdx rcx rbx
    ]);
    // STATE = RETURNED, through eax (restored next) and an absolute address.
    a.bytes(&[0xb8]).u32(state::RETURNED);
    a.bytes(&[0xa3]).u64(plan.data + STATE);
    a.bytes(&[0x58, 0x9d]); // pop rax; popfq
    let slots_at = |len: usize| (len + 7) & !7;
    // mov rsp, [rip + slot]; jmp [rip + slot + 8]
    let after_mov = a.b.len() + 7;
    let after_jmp = after_mov + 6;
    let slots = slots_at(after_jmp);
    a.bytes(&[0x48, 0x8b, 0x25]).u32((slots - after_mov) as u32);
    a.bytes(&[0xff, 0x25]).u32((slots + 8 - after_jmp) as u32);
    while a.b.len() < slots {
        a.bytes(&[0xcc]);
    }
    a.u64(plan.rsp).u64(plan.rip);
    a.finish()
}

/// The data block's initial bytes: a zeroed `xsave` area, the registers to restore, the memfd
/// name and the 1 ms wait.
pub fn data_block(saved: &[u64; 16], memfd_name: &str) -> Vec<u8> {
    let mut d = vec![0u8; data::LEN as usize];
    for (i, v) in saved.iter().enumerate() {
        let at = data::SAVE as usize + i * 8;
        d[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
    let name = memfd_name.as_bytes();
    let n = name.len().min(63);
    d[data::NAME as usize..data::NAME as usize + n].copy_from_slice(&name[..n]);
    let sleep = data::SLEEP as usize;
    d[sleep + 8..sleep + 16].copy_from_slice(&1_000_000u64.to_le_bytes());
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        Plan {
            code: 0x7f00_0000_1000,
            data: 0x7ffc_0000_0000,
            dlopen: 0x7f00_1234_5678,
            dlerror: 0x7f00_1234_9999,
            mode: 2,
            rsp: 0x7ffc_0000_2345,
            rip: 0x7f00_2222_3333,
        }
    }

    #[test]
    fn code_fits_and_ends_with_its_return_slots() {
        let code = assemble(&plan());
        assert!(code.len() as u64 <= CODE_MAX, "{} bytes", code.len());
        let n = code.len();
        assert_eq!(&code[n - 16..n - 8], &0x7ffc_0000_2345u64.to_le_bytes());
        assert_eq!(&code[n - 8..], &0x7f00_2222_3333u64.to_le_bytes());
        // mov rsp,[rip+d]; jmp [rip+d]: both land on the slots.
        let mov = code.windows(3).rposition(|w| w == [0x48, 0x8b, 0x25]).unwrap_or(0);
        let disp = |at: usize| i32::from_le_bytes(code[at..at + 4].try_into().unwrap_or_default()) as i64;
        assert_eq!(mov as i64 + 7 + disp(mov + 3), n as i64 - 16);
        assert_eq!(&code[mov + 7..mov + 9], &[0xff, 0x25]);
        assert_eq!(mov as i64 + 13 + disp(mov + 9), n as i64 - 8);
        assert_eq!(code.len() % 8, 0);
    }

    #[test]
    fn jumps_land_on_their_labels() {
        let code = assemble(&plan());
        // js done → the xrstor prologue (mov eax, mask) of `done`.
        let js = code.windows(2).position(|w| w == [0x0f, 0x88]).unwrap_or(0);
        let rel = i32::from_le_bytes(code[js + 2..js + 6].try_into().unwrap_or_default()) as i64;
        let target = (js as i64 + 6 + rel) as usize;
        assert_eq!(&code[target..target + 5], &[0xb8, 0xe7, 0, 0, 0]);
        assert_eq!(&code[target + 7..target + 11], &[0x48, 0x0f, 0xae, 0x2b]);
    }

    #[test]
    fn data_block_holds_registers_name_and_wait() {
        let saved: [u64; 16] = std::array::from_fn(|i| i as u64 + 100);
        let d = data_block(&saved, "gpu-observer-cupti");
        assert_eq!(d.len() as u64, data::LEN);
        assert!(d[..0x1000].iter().all(|&b| b == 0));
        assert_eq!(&d[0x1000 + 14 * 8..0x1000 + 15 * 8], &114u64.to_le_bytes());
        assert_eq!(&d[0x1140..0x1140 + 19], b"gpu-observer-cupti\0");
        assert_eq!(&d[0x1128..0x1130], &1_000_000u64.to_le_bytes());
    }
}
