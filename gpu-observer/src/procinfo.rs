//! Everything the agent reads about other processes from /proc, in one place, given a proc
//! root (tests point it at a directory of their own): command names, command lines, the
//! executable's name, the device behind an fd, and the container/pod a process runs in.
//!
//! Every read is bounded: these files belong to processes the agent does not trust
//! (docs/SECURITY.md), and any of them can make its command line megabytes long.

use std::{
    io::Read,
    path::{Path, PathBuf},
    sync::Arc,
};

/// The longest command line kept (bytes read from /proc/PID/cmdline); longer ones are cut,
/// end with `…`, and say so.
pub const MAX_COMMAND_LINE: usize = 4096;
/// A comm is at most 16 bytes (TASK_COMM_LEN); a little more is read so a bad file is cut.
const MAX_COMM: usize = 64;
/// A cgroup file names a few hierarchies; more than this is not a container's.
const MAX_CGROUP: usize = 16 << 10;
/// `/proc/PID/stat` is one line of a few hundred bytes (the command name is at most 16).
const MAX_STAT: usize = 4096;
/// Descendants followed from /proc at start (the BPF map holds as many processes).
const MAX_DESCENDANTS: usize = gpu_observer_common::limits::MAX_PROCESSES as usize;
/// Log links looked at in the kubelet's directory to name a container's pod.
const MAX_LOG_ENTRIES: usize = 16_384;

/// Where a process runs, for Kubernetes: its container and, when the kubelet's log links are
/// mounted, its pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Container {
    pub id: String,
    /// (pod, namespace, container) from `/var/log/containers/<pod>_<ns>_<container>-<id>.log`.
    pub pod: Option<(String, String, String)>,
}

/// A proc file system (the host's, or a test's directory) and the kubelet's log directory.
#[derive(Clone, Debug)]
pub struct ProcInfo {
    root: PathBuf,
    log_dir: PathBuf,
}

impl ProcInfo {
    /// The host's `/proc`, and the kubelet's `/var/log/containers` (mounted into the DaemonSet).
    pub fn host() -> Self {
        Self::new("/proc", "/var/log/containers")
    }

    pub fn new(root: impl Into<PathBuf>, log_dir: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            log_dir: log_dir.into(),
        }
    }

    fn path(&self, pid: u32, file: &str) -> PathBuf {
        self.root.join(pid.to_string()).join(file)
    }

    /// Whether the process still exists.
    pub fn exists(&self, pid: u32) -> bool {
        self.root.join(pid.to_string()).exists()
    }

    /// The process's command name (`comm`), without its newline.
    pub fn comm(&self, pid: u32) -> Option<String> {
        let b = read_bounded(&self.path(pid, "comm"), MAX_COMM)?.0;
        Some(String::from_utf8_lossy(&b).trim_end().to_string())
    }

    /// The file name of the process's executable.
    pub fn exe_name(&self, pid: u32) -> Option<String> {
        let p = std::fs::read_link(self.path(pid, "exe")).ok()?;
        p.file_name().map(|n| n.to_string_lossy().into_owned())
    }

    /// The command line, arguments joined by spaces, read up to [`MAX_COMMAND_LINE`] bytes;
    /// `true` when it was cut there (and then ends with `…`).
    pub fn command_line(&self, pid: u32) -> Option<(String, bool)> {
        command_line(&self.path(pid, "cmdline"))
    }

    /// What an fd of the process points at (a device path such as `/dev/nvidia0`).
    pub fn fd_target(&self, pid: u32, fd: u32) -> Option<Arc<str>> {
        let p = std::fs::read_link(self.root.join(format!("{pid}/fd/{fd}"))).ok()?;
        Some(Arc::from(p.to_string_lossy().as_ref()))
    }

    /// The container the process runs in (from its cgroup path), and its pod when the
    /// kubelet's log links say.
    pub fn container(&self, pid: u32) -> Option<Container> {
        let (cg, _) = read_bounded(&self.path(pid, "cgroup"), MAX_CGROUP)?;
        let id = container_id(&String::from_utf8_lossy(&cg))?;
        let pod = self.pod_of(&id);
        Some(Container { id, pod })
    }

    fn pod_of(&self, id: &str) -> Option<(String, String, String)> {
        let suffix = format!("-{id}.log");
        let dir = std::fs::read_dir(&self.log_dir).ok()?;
        for e in dir.flatten().take(MAX_LOG_ENTRIES) {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(stem) = name.strip_suffix(&suffix) else {
                continue;
            };
            let mut parts = stem.splitn(3, '_');
            if let (Some(pod), Some(ns), Some(container)) = (parts.next(), parts.next(), parts.next()) {
                return Some((pod.to_string(), ns.to_string(), container.to_string()));
            }
            return None;
        }
        None
    }

    /// The process's parent (from `/proc/PID/stat`: the field after the command name, which
    /// may itself hold spaces and parentheses, so it is found after the last `)`).
    pub fn ppid(&self, pid: u32) -> Option<u32> {
        let (stat, _) = read_bounded(&self.path(pid, "stat"), MAX_STAT)?;
        let stat = String::from_utf8_lossy(&stat);
        let after = &stat[stat.rfind(')')? + 1..];
        after.split_whitespace().nth(1)?.parse().ok()
    }

    /// Every process now running below `root` (children, their children, …), each with its
    /// parent, at most [`MAX_DESCENDANTS`].
    pub fn descendants(&self, root: u32) -> Vec<(u32, u32)> {
        let Ok(dir) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut children: std::collections::HashMap<u32, Vec<u32>> = std::collections::HashMap::new();
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(ppid) = self.ppid(pid) {
                children.entry(ppid).or_default().push(pid);
            }
        }
        let mut out = Vec::new();
        let mut todo = vec![root];
        while let Some(p) = todo.pop() {
            for &c in children.get(&p).map_or(&[][..], Vec::as_slice) {
                if out.len() >= MAX_DESCENDANTS || c == root {
                    return out;
                }
                out.push((c, p));
                todo.push(c);
            }
        }
        out
    }

    /// CPU time (user + system) of one thread of a process, in ns, from
    /// `/proc/PID/task/TID/stat` (fields 14 and 15, in clock ticks).
    pub fn thread_cpu_ns(&self, pid: u32, tid: u32) -> Option<u64> {
        self.thread_times(pid, tid).map(|(user, sys)| user.saturating_add(sys))
    }

    /// System time of one thread, in ns (field 15 of its stat): where a uprobe's trap and
    /// program are charged (observe/capture.rs measures the probes' cost with it).
    pub fn thread_sys_ns(&self, pid: u32, tid: u32) -> Option<u64> {
        self.thread_times(pid, tid).map(|(_, sys)| sys)
    }

    /// (user, system) time of one thread, in ns.
    fn thread_times(&self, pid: u32, tid: u32) -> Option<(u64, u64)> {
        let (stat, _) = read_bounded(&self.root.join(format!("{pid}/task/{tid}/stat")), MAX_STAT)?;
        stat_times(&String::from_utf8_lossy(&stat))
    }

    /// CPU time of the whole process (all its threads, live and exited), in ns.
    pub fn process_cpu_ns(&self, pid: u32) -> Option<u64> {
        let (stat, _) = read_bounded(&self.path(pid, "stat"), MAX_STAT)?;
        cpu_ns_of_stat(&String::from_utf8_lossy(&stat))
    }

    /// The host's name (UTS namespace of the agent).
    pub fn hostname(&self) -> String {
        read_bounded(&self.root.join("sys/kernel/hostname"), 256)
            .map(|(b, _)| String::from_utf8_lossy(&b).trim().to_string())
            .unwrap_or_default()
    }

    /// The agent's own resident set, in bytes (0 when /proc cannot say).
    pub fn own_resident_bytes(&self) -> u64 {
        let pages = read_bounded(&self.root.join("self/statm"), 256)
            .and_then(|(b, _)| {
                String::from_utf8_lossy(&b)
                    .split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
            })
            .unwrap_or(0);
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        pages.saturating_mul(u64::try_from(page).unwrap_or(4096))
    }
}

/// utime + stime of a `stat` line, in ns: the 12th and 13th fields after the command name
/// (which may hold spaces and parentheses, so fields are counted after the last `)`).
fn cpu_ns_of_stat(stat: &str) -> Option<u64> {
    stat_times(stat).map(|(user, sys)| user.saturating_add(sys))
}

/// (user, system) time in ns from a stat line (fields 14 and 15, in clock ticks).
fn stat_times(stat: &str) -> Option<(u64, u64)> {
    let mut f = stat[stat.rfind(')')? + 1..].split_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .unwrap_or(100)
        .max(1);
    let ns = 1_000_000_000 / hz;
    Some((utime.saturating_mul(ns), stime.saturating_mul(ns)))
}

/// Up to `max` bytes of a file; `true` when it had more.
fn read_bounded(path: &Path, max: usize) -> Option<(Vec<u8>, bool)> {
    let f = std::fs::File::open(path).ok()?;
    let mut b = Vec::with_capacity(max.min(4096) + 1);
    f.take(max as u64 + 1).read_to_end(&mut b).ok()?;
    let more = b.len() > max;
    b.truncate(max);
    Some((b, more))
}

fn command_line(path: &Path) -> Option<(String, bool)> {
    let (c, truncated) = read_bounded(path, MAX_COMMAND_LINE)?;
    let args: Vec<String> = c
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let mut line = args.join(" ");
    if truncated {
        line.push('…');
    }
    Some((line, truncated))
}

/// The 64-hex container id in a cgroup file (`cri-containerd-<id>.scope`, `docker-<id>.scope`,
/// `crio-<id>.scope`, or a bare `/<id>` path element).
fn container_id(cgroup: &str) -> Option<String> {
    for line in cgroup.lines() {
        let path = line.rsplit(':').next()?;
        for part in path.rsplit('/') {
            let part = part.strip_suffix(".scope").unwrap_or(part);
            let id = part.rsplit(['-', ':']).next().unwrap_or(part);
            if id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Some(id.to_string());
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpu-observer-procinfo-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn container_ids_come_from_the_runtimes_cgroup_paths() {
        let id = "0123456789abcdef".repeat(4);
        for cg in [
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-{id}.scope\n"
            ),
            format!("0::/system.slice/docker-{id}.scope\n"),
            format!("12:memory:/kubepods/besteffort/pod99/{id}\n"),
            format!("0::/kubepods.slice/crio-{id}.scope\n"),
        ] {
            assert_eq!(container_id(&cg).as_deref(), Some(id.as_str()), "{cg}");
        }
        assert_eq!(container_id("0::/user.slice/user-0.slice/session-1.scope\n"), None);
    }

    #[test]
    fn pods_are_named_from_the_kubelets_log_links() {
        let dir = scratch("k8s");
        let (procs, logs) = (dir.join("proc"), dir.join("containers"));
        let id = "ab".repeat(32);
        std::fs::create_dir_all(procs.join("42")).unwrap();
        std::fs::create_dir_all(&logs).unwrap();
        std::fs::write(
            procs.join("42/cgroup"),
            format!("0::/kubepods/pod7/cri-containerd-{id}.scope\n"),
        )
        .unwrap();
        std::fs::write(logs.join(format!("trainer-0_ml_pytorch-{id}.log")), "").unwrap();
        std::fs::write(logs.join(format!("other_ns_c-{}.log", "cd".repeat(32))), "").unwrap();
        let info = ProcInfo::new(&procs, &logs);
        assert_eq!(
            info.container(42),
            Some(Container {
                id,
                pod: Some(("trainer-0".into(), "ml".into(), "pytorch".into()))
            })
        );
        // Not in a container: nothing.
        std::fs::create_dir_all(procs.join("43")).unwrap();
        std::fs::write(procs.join("43/cgroup"), "0::/user.slice\n").unwrap();
        assert_eq!(info.container(43), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn command_lines_are_cut_at_4_kib_and_marked() {
        // A /proc/PID/cmdline as `sleep 30 aaaa…` writes it: the cut falls inside the long
        // argument.
        let dir = scratch("cmdline");
        std::fs::create_dir_all(dir.join("7")).unwrap();
        let info = ProcInfo::new(&dir, &dir);
        std::fs::write(
            dir.join("7/cmdline"),
            format!("sleep\x0030\x00{}\x00", "a".repeat(100_000)),
        )
        .unwrap();
        let (line, truncated) = info.command_line(7).expect("cmdline");
        assert!(truncated);
        let want = format!("sleep 30 {}…", "a".repeat(MAX_COMMAND_LINE - "sleep 30 ".len()));
        assert_eq!(line, want);
        std::fs::write(dir.join("7/cmdline"), b"sleep\x0030\x00").unwrap();
        assert_eq!(info.command_line(7), Some(("sleep 30".to_string(), false)));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_comm_is_read_bounded_and_without_its_newline() {
        let dir = scratch("comm");
        std::fs::create_dir_all(dir.join("9")).unwrap();
        let info = ProcInfo::new(&dir, &dir);
        std::fs::write(dir.join("9/comm"), "python3\n").unwrap();
        assert_eq!(info.comm(9).as_deref(), Some("python3"));
        std::fs::write(dir.join("9/comm"), "x".repeat(10_000)).unwrap();
        assert_eq!(info.comm(9).map(|c| c.len()), Some(MAX_COMM));
        assert_eq!(info.comm(10), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn descendants_follow_the_parent_links_down_from_the_root() {
        let dir = scratch("tree");
        // 10 → 11 → 13, 10 → 12; 20 is not below 10; a command name with ") (" in it.
        for (pid, ppid, comm) in [
            (10, 1, "root"),
            (11, 10, "a) (b"),
            (12, 10, "c"),
            (13, 11, "d"),
            (20, 1, "x"),
        ] {
            std::fs::create_dir_all(dir.join(pid.to_string())).unwrap();
            std::fs::write(
                dir.join(format!("{pid}/stat")),
                format!("{pid} ({comm}) S {ppid} {pid} 0 0"),
            )
            .unwrap();
        }
        let info = ProcInfo::new(&dir, &dir);
        assert_eq!(info.ppid(11), Some(10));
        let mut d = info.descendants(10);
        d.sort_unstable();
        assert_eq!(d, [(11, 10), (12, 10), (13, 11)]);
        assert!(info.descendants(13).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cpu_time_is_utime_plus_stime_after_the_command_name() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        let stat = "42 (a) b) R 1 42 42 0 -1 0 0 0 0 0 250 50 0 0";
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        assert_eq!(cpu_ns_of_stat(stat), Some(300 * (1_000_000_000 / hz)));
        let me = std::process::id();
        assert!(ProcInfo::host().process_cpu_ns(me).is_some());
        assert!(ProcInfo::host().thread_cpu_ns(me, me).is_some());
    }

    #[test]
    fn the_real_proc_knows_this_process() {
        let info = ProcInfo::host();
        let me = std::process::id();
        assert!(info.exists(me));
        assert!(info.own_resident_bytes() > 0);
        assert!(info.fd_target(me, 0).is_some() || info.fd_target(me, 1).is_some() || info.fd_target(me, 2).is_some());
    }
}
