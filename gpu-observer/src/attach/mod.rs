//! Attach: load the eBPF object, hook the tracepoints, and put uprobes on every libcuda file the
//! observed processes map (each file once, every probed variant it exports).

pub mod discover;
pub mod symbols;

use std::{collections::HashMap, num::NonZeroU32, path::Path};

use anyhow::{Context, Result, anyhow};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{
        TracePoint, UProbe,
        uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope},
    },
};
use gpu_observer_common::{
    api::{self, Family},
    config,
    event::EventKind,
    names,
};

pub use discover::FileKey;

/// The eBPF object of gpu-observer, built by build.rs.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/gpu-observer"));

/// What attaching one library file did.
#[derive(Debug)]
pub struct AttachReport {
    pub entry_points: usize,
    pub probes: usize,
    pub missing_required: Vec<&'static str>,
    /// Entry points whose attach failed (name, error).
    pub failed: Vec<(&'static str, String)>,
}

/// Loaded programs and the set of library files they are attached to.
pub struct Probes {
    ebpf: Ebpf,
    scope: UProbeScope,
    attached: HashMap<FileKey, String>,
}

impl Probes {
    /// Loads and verifies the programs and hooks the tracepoints; no uprobe is attached yet.
    pub fn load(ring_bytes: u32, pid_filter: Option<u32>) -> Result<Self> {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(names::EVENTS, ring_bytes)
            .load(EBPF_OBJECT)
            .map_err(crate::preflight::explain_load_error)?;
        {
            let mut cfg: Array<_, u32> = Array::try_from(map_mut(&mut ebpf, names::CONFIG)?)?;
            cfg.set(config::FILTER_TGID, pid_filter.unwrap_or(0), 0)?;
            cfg.set(config::AGENT_TGID, std::process::id(), 0)?;
        }
        for name in [
            names::PROG_LAUNCH_KERNEL,
            names::PROG_LAUNCH_KERNEL_EX,
            names::PROG_GRAPH_LAUNCH,
            names::PROG_API_ENTER,
            names::PROG_API_EXIT,
        ] {
            uprobe(&mut ebpf, name)?
                .load()
                .map_err(crate::preflight::explain_program_error(name))?;
        }
        for (name, category, event) in [
            (names::PROG_IOCTL_ENTER, "syscalls", "sys_enter_ioctl"),
            (names::PROG_IOCTL_EXIT, "syscalls", "sys_exit_ioctl"),
            (names::PROG_PROCESS_EXIT, "sched", "sched_process_exit"),
        ] {
            let prog: &mut TracePoint = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("program {name} missing from the eBPF object"))?
                .try_into()?;
            prog.load()
                .map_err(crate::preflight::explain_program_error(name))?;
            prog.attach(category, event).with_context(|| {
                format!("attach tracepoint {category}/{event}: is tracefs mounted (/sys/kernel/tracing)?")
            })?;
        }
        let scope = match pid_filter.and_then(NonZeroU32::new) {
            Some(pid) => UProbeScope::OneProcess(pid),
            None => UProbeScope::AllProcesses,
        };
        Ok(Self {
            ebpf,
            scope,
            attached: HashMap::new(),
        })
    }

    /// Library files attached so far.
    pub fn attached_count(&self) -> usize {
        self.attached.len()
    }

    pub fn is_attached(&self, key: &FileKey) -> bool {
        self.attached.contains_key(key)
    }

    /// Attaches every probed entry point that `path` exports. `Ok(None)` if that file already is.
    pub fn attach_library(&mut self, path: &Path, key: FileKey) -> Result<Option<AttachReport>> {
        if self.attached.contains_key(&key) {
            return Ok(None);
        }
        let syms = symbols::resolve(path)?;
        let mut report = AttachReport {
            entry_points: 0,
            probes: 0,
            missing_required: syms.missing_required.clone(),
            failed: Vec::new(),
        };
        for (&id, &offset) in &syms.offsets {
            let spec = api::by_id(id).expect("ids come from the table");
            let entry_prog = match spec.family {
                Family::Launch => names::PROG_LAUNCH_KERNEL,
                Family::LaunchEx => names::PROG_LAUNCH_KERNEL_EX,
                Family::GraphLaunch => names::PROG_GRAPH_LAUNCH,
                _ => names::PROG_API_ENTER,
            };
            let mut progs = vec![entry_prog];
            if spec.family.has_return_probe() {
                progs.push(names::PROG_API_EXIT);
            }
            let mut ok = true;
            for prog in progs {
                let point = UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(offset),
                    cookie: Some(api::cookie(id)),
                };
                match uprobe(&mut self.ebpf, prog)?.attach(point, path, self.scope) {
                    Ok(_) => report.probes += 1,
                    Err(e) => {
                        ok = false;
                        report.failed.push((spec.name, format!("{e:#}")));
                    }
                }
            }
            if ok {
                report.entry_points += 1;
            }
        }
        self.attached.insert(key, path.display().to_string());
        Ok(Some(report))
    }

    /// Stops every program (they return at their first instruction) without detaching.
    pub fn disable(&mut self) -> Result<()> {
        let mut cfg: Array<_, u32> = Array::try_from(map_mut(&mut self.ebpf, names::CONFIG)?)?;
        cfg.set(config::DISABLED, 1, 0)?;
        Ok(())
    }

    /// Detaches everything after this process has exited, so exit is immediate.
    ///
    /// Each uprobe detach waits for RCU grace periods under the kernel's `event_mutex`
    /// (~85 ms each, measured here): the ~140 probes of one libcuda take ~12 s, in parallel or
    /// not. Kernel uprobe-multi links release all offsets with one wait, but aya 0.14 cannot
    /// create them. So a child process inherits the probe descriptors and releases them in the
    /// background after we exit; the programs are disabled first, so the probes left for those
    /// seconds cost the observed processes only the uprobe trap.
    pub fn release_in_background(mut self) {
        if self.disable().is_err() {
            return; // keep the probes in this process: dropping them detaches, slowly but surely
        }
        let parent = std::process::id() as i32;
        // SAFETY: the child only calls async-signal-safe functions (setsid, open, dup2, getppid,
        // nanosleep, _exit).
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: as above. The child holds the last references once the parent is gone;
            // its exit then releases the probes.
            unsafe {
                libc::setsid();
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                if null >= 0 {
                    for fd in 0..3 {
                        libc::dup2(null, fd);
                    }
                }
                let tick = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 10_000_000,
                };
                let mut waited = 0;
                while libc::getppid() == parent && waited < 6000 {
                    libc::nanosleep(&tick, std::ptr::null_mut());
                    waited += 1;
                }
                libc::_exit(0);
            }
        }
        // Parent (or fork failed): our copies close fast while the child holds the probes.
        if pid > 0 {
            std::mem::forget(self);
        }
    }

    /// Records a process's ioctls from now on (it maps libcuda, but may not have called it yet).
    pub fn observe_pid(&mut self, pid: u32) -> Result<()> {
        let mut observed: BpfHashMap<_, u32, u32> =
            BpfHashMap::try_from(map_mut(&mut self.ebpf, names::OBSERVED)?)?;
        observed.insert(pid, 1, 0)?;
        Ok(())
    }

    /// The ring buffer, moved out to the reader thread.
    pub fn take_ring(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map(names::EVENTS)
            .ok_or_else(|| anyhow!("map {} missing", names::EVENTS))?;
        Ok(RingBuf::try_from(map)?)
    }

    /// Records dropped because the ring was full, by kind and by process.
    pub fn drops(&self) -> Result<Drops> {
        let per_kind: PerCpuArray<_, u64> = PerCpuArray::try_from(
            self.ebpf
                .map(names::DROPS)
                .ok_or_else(|| anyhow!("map DROPS missing"))?,
        )?;
        let mut drops = Drops::default();
        for kind in 1..EventKind::COUNT {
            let n: u64 = per_kind.get(&kind, 0)?.iter().sum();
            drops.by_kind.push((kind, n));
            drops.total += n;
        }
        let per_pid: PerCpuHashMap<_, u32, u64> = PerCpuHashMap::try_from(
            self.ebpf
                .map(names::DROPS_BY_PID)
                .ok_or_else(|| anyhow!("map DROPS_BY_PID missing"))?,
        )?;
        for item in per_pid.iter() {
            let (pid, values) = item?;
            drops.by_pid.insert(pid, values.iter().sum());
        }
        Ok(drops)
    }
}

/// Ring-buffer overflow counts.
#[derive(Clone, Debug, Default)]
pub struct Drops {
    pub total: u64,
    pub by_kind: Vec<(u32, u64)>,
    pub by_pid: HashMap<u32, u64>,
}

fn map_mut<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut aya::maps::Map> {
    ebpf.map_mut(name)
        .ok_or_else(|| anyhow!("map {name} missing from the eBPF object"))
}

fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    Ok(ebpf
        .program_mut(name)
        .ok_or_else(|| anyhow!("program {name} missing from the eBPF object"))?
        .try_into()?)
}
