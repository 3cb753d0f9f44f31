//! uprobe-multi links (Linux 6.6+): one BPF link puts a program on every probed offset of a
//! library file, each with its cookie, and releases them all with a single RCU wait.
//!
//! Perf-event uprobes (what aya 0.14 attaches) each wait for RCU grace periods under the
//! kernel's `event_mutex` when detached: ~85 ms a probe, ~12 s for one libcuda, during which no
//! other uprobe can be attached on the machine. aya 0.14 cannot load programs for uprobe-multi
//! (they need `expected_attach_type = BPF_TRACE_UPROBE_MULTI` at load), so the seven uprobe
//! programs are loaded here from the same object, with aya-obj's relocations against the maps
//! aya created; aya keeps loading the maps and the tracepoints. Kernels without uprobe-multi
//! fall back to aya's perf-event attach.

use std::{
    collections::{HashMap, HashSet},
    ffi::{CStr, CString},
    io,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd},
};

use anyhow::{Context, Result, anyhow, bail};
use aya::{Ebpf, maps::Map};
use aya_obj::generated::{
    BPF_F_UPROBE_MULTI_RETURN, bpf_attach_type::BPF_TRACE_UPROBE_MULTI, bpf_attr, bpf_cmd, bpf_insn,
    bpf_prog_type::BPF_PROG_TYPE_KPROBE,
};

/// The uprobe programs, loaded for uprobe-multi attach.
pub struct MultiPrograms {
    fds: HashMap<&'static str, OwnedFd>,
}

fn map_fd(map: &Map) -> Option<RawFd> {
    let data = match map {
        Map::Array(d)
        | Map::HashMap(d)
        | Map::LruHashMap(d)
        | Map::PerCpuArray(d)
        | Map::PerCpuHashMap(d)
        | Map::PerCpuLruHashMap(d)
        | Map::RingBuf(d) => d,
        _ => return None,
    };
    Some(data.fd().as_fd().as_raw_fd())
}

fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<OwnedFd> {
    // SAFETY: attr is a fully initialized bpf_attr of the size we pass; the kernel reads
    // (and for logs writes) only the buffers it points to, which outlive the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr as *mut bpf_attr,
            size_of::<bpf_attr>(),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: on success these commands return a new file descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as RawFd) })
}

impl MultiPrograms {
    /// Loads `names` from the eBPF object, relocated against the maps of `ebpf`.
    pub fn load(ebpf: &Ebpf, object: &[u8], names: &[&'static str]) -> Result<Self> {
        let mut obj = aya_obj::Object::parse(object).context("parse the eBPF object")?;
        let text_sections: HashSet<usize> = obj.functions.keys().map(|(s, _)| *s).collect();
        let obj_maps = obj.maps.clone();
        let fds: Vec<(String, RawFd)> = ebpf
            .maps()
            .filter_map(|(n, m)| map_fd(m).map(|fd| (n.to_string(), fd)))
            .collect();
        obj.relocate_maps(
            fds.iter()
                .filter_map(|(n, fd)| obj_maps.get(n).map(|m| (n.as_str(), *fd, m))),
            &text_sections,
        )
        .map_err(|e| anyhow!("relocate maps: {e}"))?;
        obj.relocate_calls(&text_sections)
            .map_err(|e| anyhow!("relocate calls: {e}"))?;
        let license = obj.license.clone();
        let mut out = HashMap::new();
        for &name in names {
            let prog = obj
                .programs
                .get(name)
                .ok_or_else(|| anyhow!("program {name} not in the object"))?;
            let func = obj
                .functions
                .get(&prog.function_key())
                .ok_or_else(|| anyhow!("code of {name} missing"))?;
            let fd = load_program(name, &func.instructions, &license)?;
            out.insert(name, fd);
        }
        Ok(Self { fds: out })
    }

    /// One link for `name` at every offset of `path`; `pid` 0 means every process. With
    /// `ref_ctr_offsets` (one per offset), the kernel raises the u16 at each of those file
    /// offsets in every process mapping `path` while the link lives (USDT semaphores).
    #[allow(clippy::too_many_arguments)]
    pub fn attach(
        &self,
        name: &str,
        path: &CStr,
        offsets: &[u64],
        cookies: &[u64],
        ref_ctr_offsets: Option<&[u64]>,
        ret: bool,
        pid: u32,
    ) -> io::Result<OwnedFd> {
        if ref_ctr_offsets.is_some_and(|r| r.len() != offsets.len()) {
            return Err(io::Error::other("one reference counter per offset"));
        }
        let prog = self
            .fds
            .get(name)
            .ok_or_else(|| io::Error::other(format!("program {name} not loaded")))?;
        // SAFETY: all-zero is a valid bpf_attr.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the link_create member of the zeroed union.
        unsafe {
            let lc = &mut attr.link_create;
            lc.__bindgen_anon_1.prog_fd = prog.as_raw_fd() as u32;
            lc.attach_type = BPF_TRACE_UPROBE_MULTI as u32;
            let um = &mut lc.__bindgen_anon_3.uprobe_multi;
            um.path = path.as_ptr() as u64;
            um.offsets = offsets.as_ptr() as u64;
            um.cookies = cookies.as_ptr() as u64;
            um.ref_ctr_offsets = ref_ctr_offsets.map_or(0, |r| r.as_ptr() as u64);
            um.cnt = offsets.len() as u32;
            um.flags = if ret { BPF_F_UPROBE_MULTI_RETURN } else { 0 };
            um.pid = pid;
        }
        bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr)
    }
}

fn load_program(name: &str, insns: &[bpf_insn], license: &CStr) -> Result<OwnedFd> {
    let mut log = vec![0u8; 0];
    for attempt in 0..2 {
        // SAFETY: all-zero is a valid bpf_attr.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // Program names are the object's constants, without NUL; the kernel's name field is
        // only a label (15 bytes), so an empty one would lose nothing but the label.
        let cname = CString::new(&name.as_bytes()[..name.len().min(15)]).unwrap_or_default();
        // SAFETY: writing the prog-load member of the zeroed union.
        unsafe {
            let p = &mut attr.__bindgen_anon_3;
            p.prog_type = BPF_PROG_TYPE_KPROBE as u32;
            p.expected_attach_type = BPF_TRACE_UPROBE_MULTI as u32;
            p.insns = insns.as_ptr() as u64;
            p.insn_cnt = insns.len() as u32;
            p.license = license.as_ptr() as u64;
            for (d, s) in p.prog_name.iter_mut().zip(cname.as_bytes()) {
                *d = *s as libc::c_char;
            }
            if attempt == 1 {
                p.log_level = 1;
                p.log_buf = log.as_mut_ptr() as u64;
                p.log_size = log.len() as u32;
            }
        }
        match bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr) {
            Ok(fd) => return Ok(fd),
            Err(e) if attempt == 0 && e.raw_os_error() != Some(libc::EPERM) => log = vec![0u8; 1 << 20],
            Err(e) => {
                let text = String::from_utf8_lossy(&log);
                let tail: String = text
                    .trim_end_matches('\0')
                    .lines()
                    .rev()
                    .take(20)
                    .collect::<Vec<_>>()
                    .join("\n");
                bail!("load {name} for uprobe-multi: {e}\n{tail}");
            }
        }
    }
    unreachable!("the second attempt returns")
}
