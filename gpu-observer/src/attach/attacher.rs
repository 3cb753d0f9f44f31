//! Which libcuda files are attached, and which processes are known to map one: the rescan
//! every `--interval-ms` and what it says about each file.

use std::{collections::HashSet, path::Path};

use crate::{
    attach::{
        FileKey, Probes,
        discover::{self, LibKind},
    },
    say,
};

/// Tracks which libcuda files are attached and which processes are known to map one.
pub struct Attacher {
    pub probes: Probes,
    pub pid: Option<u32>,
    pub known_pids: HashSet<u32>,
    /// Files that could not be attached: said once, not retried every rescan.
    pub failed: HashSet<FileKey>,
}

impl Attacher {
    pub fn attach(&mut self, path: &Path, key: FileKey, seen_in: Option<u32>) {
        match self.probes.attach_library(path, key) {
            Ok(Some(r)) => {
                let whose = seen_in.map(|p| format!(", mapped by pid {p}")).unwrap_or_default();
                say(format_args!(
                    "attached {} ({} entry points, {} probes{whose})",
                    path.display(),
                    r.entry_points,
                    r.probes
                ));
                if !r.missing_required.is_empty() {
                    say(format_args!(
                        "warning: {} does not export {}: it may not be a real libcuda (its other entry points are still probed)",
                        path.display(),
                        r.missing_required.join(", ")
                    ));
                }
                for (name, err) in &r.failed {
                    say(format_args!(
                        "warning: could not probe {name} in {}: {err}",
                        path.display()
                    ));
                }
            }
            Ok(None) => {}
            Err(e) => {
                self.failed.insert(key);
                say(format_args!("warning: cannot attach {}: {e:#}", path.display()));
            }
        }
    }

    /// Probes the hooks of a CUPTI injection library file.
    pub fn attach_hooks(&mut self, path: &Path, key: FileKey, seen_in: Option<u32>) {
        match self.probes.attach_hooks(path, key) {
            Ok(true) => {
                let whose = seen_in.map(|p| format!(", mapped by pid {p}")).unwrap_or_default();
                say(format_args!("attached CUPTI hooks {}{whose}", path.display()));
            }
            Ok(false) => {}
            Err(e) => {
                self.failed.insert(key);
                say(format_args!("warning: cannot attach {}: {e:#}", path.display()));
            }
        }
    }

    /// Finds libcuda in the observed processes; attaches new files, marks new processes.
    pub fn rescan(&mut self) -> usize {
        let libs = match self.pid {
            Some(pid) => discover::scan_pid(pid),
            None => discover::scan_all(),
        };
        let mut now = HashSet::with_capacity(self.known_pids.len());
        for lib in &libs {
            if !self.probes.is_attached(&lib.key) && !self.failed.contains(&lib.key) {
                match lib.kind {
                    LibKind::Cuda => self.attach(&lib.host_path, lib.key, Some(lib.pid)),
                    LibKind::Hooks => self.attach_hooks(&lib.host_path, lib.key, Some(lib.pid)),
                }
            }
            if !self.known_pids.contains(&lib.pid)
                && !now.contains(&lib.pid)
                && let Err(e) = self.probes.observe_pid(lib.pid)
            {
                say(format_args!("warning: cannot observe ioctls of pid {}: {e:#}", lib.pid));
            }
            now.insert(lib.pid);
        }
        // Only processes mapping libcuda now: bounded, and a reused pid is marked again.
        self.known_pids = now;
        libs.len()
    }
}
