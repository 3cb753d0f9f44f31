//! Which library files are attached, and which processes are known to map one: the rescan
//! every `--interval-ms` and what it says about each file.
//!
//! The files come from other users' processes, so (docs/SECURITY.md):
//! - each is opened inside its process's root, never blocking, and parsed with bounded reads
//!   and a deadline ([`super::open`], [`super::symbols`]);
//! - only a plausible libcuda is attached (it exports every entry point of `api::REQUIRED`);
//! - a user's processes hold at most `--max-libraries-per-user` attached files;
//! - a file is released (its links closed) as soon as no observed process maps it, except the
//!   files attached up front (the driver's usual paths, `--libcuda`, `run`'s injection library),
//!   so that new processes are seen from their first call;
//! - every refusal is counted by reason ([`AttachStats`]) and said once per file.

use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    path::Path,
    time::{Duration, Instant},
};

use crate::{
    attach::{
        FileKey, Probes, Scope,
        discover::{self, LibKind, MappedLibrary, MappingId},
        open::{self, Opened, Refused},
        stats::{AttachStats, Reason},
        symbols,
    },
    say,
};

/// Default of `--max-libraries-per-user`.
pub const DEFAULT_MAX_PER_USER: u32 = 8;

/// Time one rescan may spend opening and parsing new files; the rest wait for the next rescan
/// (taken in turns by user, so one user's many files do not hold back another user's one).
const RESCAN_BUDGET: Duration = Duration::from_secs(1);

/// Who an attached file is charged to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    /// Attached up front: kept until the agent exits, charged to nobody.
    UpFront,
    /// Attached because a process of this user (real uid) mapped it.
    User(u32),
}

struct FileInfo {
    owner: Owner,
    path: String,
}

/// What became of a mapping (by its maps device:inode) the first time it was seen.
#[derive(Clone, Copy, Debug)]
enum Seen {
    File(FileKey),
    Refused(Reason),
}

/// Tracks which libcuda files are attached and which processes are known to map one.
pub struct Attacher {
    pub probes: Probes,
    /// Whose mappings are scanned.
    pub scope: Scope,
    pub known_pids: HashSet<u32>,
    max_per_user: usize,
    files: HashMap<FileKey, FileInfo>,
    /// Mappings seen in the last rescan and what they resolved to: a mapping is opened once
    /// while it stays mapped. Only mappings of the last rescan are kept (bounded).
    mappings: HashMap<MappingId, Seen>,
    stats: AttachStats,
}

/// The real uid of a process; None if it is gone.
fn uid_of(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A parsed library, ready to attach.
enum Parsed {
    Cuda(symbols::LibrarySymbols),
    Hooks(symbols::HookSymbols),
}

/// Opens nothing: parses `opened` as `kind`, on a time-boxed thread.
fn parse(kind: LibKind, opened: Opened, shown: &str) -> Result<(Opened, Parsed), Refused> {
    let shown = shown.to_string();
    symbols::time_boxed(&shown.clone(), move || {
        let parsed = match kind {
            LibKind::Cuda => Parsed::Cuda(symbols::resolve(&opened, &shown)?),
            LibKind::Hooks => Parsed::Hooks(symbols::resolve_hooks(&opened, &shown)?),
        };
        Ok((opened, parsed))
    })
}

impl Attacher {
    pub fn new(probes: Probes, scope: Scope, max_per_user: u32) -> Self {
        Self {
            probes,
            scope,
            known_pids: HashSet::new(),
            max_per_user: max_per_user as usize,
            files: HashMap::new(),
            mappings: HashMap::new(),
            stats: AttachStats::default(),
        }
    }

    /// What happened to library files so far.
    pub fn stats(&self) -> AttachStats {
        AttachStats {
            attached_now: self.probes.attached_count() as u64,
            ..self.stats.clone()
        }
    }

    fn charged_to(&self, uid: u32) -> usize {
        self.files.values().filter(|f| f.owner == Owner::User(uid)).count()
    }

    /// Attaches a parsed file; the error is a refusal (the kernel refused every probe).
    fn attach_parsed(&mut self, opened: &Opened, parsed: &Parsed, shown: &str, whose: &str) -> Result<(), Refused> {
        let attached = match parsed {
            Parsed::Cuda(syms) => self.probes.attach_library(opened, syms).map(|r| {
                r.map(|r| {
                    say(format_args!(
                        "attached {shown} ({} entry points, {} probes{whose})",
                        r.entry_points, r.probes
                    ));
                    for (name, err) in &r.failed {
                        say(format_args!("warning: could not probe {name} in {shown}: {err}"));
                    }
                })
            }),
            Parsed::Hooks(hooks) => self
                .probes
                .attach_hooks(opened, hooks)
                .map(|new| new.then(|| say(format_args!("attached CUPTI hooks {shown}{whose}")))),
        };
        match attached {
            Ok(Some(())) => {
                self.stats.attached += 1;
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) => Err(Refused::new(Reason::AttachFailed, format!("{shown}: {e:#}"))),
        }
    }

    fn refuse(&mut self, r: &Refused, whose: &str) {
        self.stats.refuse(r.reason);
        say(format_args!("refused {}{whose} [{}]", r.detail, r.reason.name()));
    }

    /// Attaches a file this agent's user named (`--libcuda`, a driver path, the injection
    /// library of `run`), kept until exit. A refusal is counted and returned for the caller to
    /// say (an error for `--libcuda`, a warning otherwise).
    pub fn attach_up_front(&mut self, path: &Path, kind: LibKind) -> Result<(), Refused> {
        let shown = path.display().to_string();
        let p = path.to_path_buf();
        let attached = symbols::time_boxed(&shown, move || open::open_host(&p))
            .and_then(|opened| parse(kind, opened, &shown))
            .and_then(|(opened, parsed)| {
                self.attach_parsed(&opened, &parsed, &shown, "")?;
                Ok(opened.key)
            });
        match attached {
            Ok(key) => {
                // Up front wins: a file a process mapped first is no longer released.
                self.files.insert(
                    key,
                    FileInfo {
                        owner: Owner::UpFront,
                        path: shown,
                    },
                );
                Ok(())
            }
            Err(r) => {
                self.stats.refuse(r.reason);
                Err(r)
            }
        }
    }

    /// Opens, checks and attaches a mapped file for its process's user. `quiet`: a retry of a
    /// file refused for the user's limit, refused again for it: not counted or said again.
    fn attach_mapped(&mut self, lib: &MappedLibrary, uid: u32, quiet: bool) -> Seen {
        let whose = format!(", mapped by pid {} of uid {uid}", lib.pid);
        let (pid, path, ino, range) = (lib.pid, lib.path.clone(), lib.mapping.ino, lib.range);
        let attempt = symbols::time_boxed(&lib.path, move || match range {
            Some((start, end)) => open::open_map_file(pid, start, end, ino, &path),
            None => open::open_mapped(pid, &path, ino),
        })
        .and_then(|opened| {
            if self.probes.is_attached(&opened.key) {
                return Ok(opened.key);
            }
            let charged = self.charged_to(uid);
            if charged >= self.max_per_user {
                return Err(Refused::new(
                    Reason::UserLimit,
                    format!(
                        "{}: uid {uid} has {charged} libraries attached, the --max-libraries-per-user limit",
                        lib.path
                    ),
                ));
            }
            let (opened, parsed) = parse(lib.kind, opened, &lib.path)?;
            self.attach_parsed(&opened, &parsed, &lib.path, &whose)?;
            self.files.insert(
                opened.key,
                FileInfo {
                    owner: Owner::User(uid),
                    path: lib.path.clone(),
                },
            );
            Ok(opened.key)
        });
        match attempt {
            Ok(key) => Seen::File(key),
            Err(r) => {
                if !(quiet && r.reason == Reason::UserLimit) {
                    self.refuse(&r, &format!(" ({})", whose.trim_start_matches(", ")));
                }
                Seen::Refused(r.reason)
            }
        }
    }

    /// Finds libcuda in the observed processes: attaches new files, releases files no process
    /// maps any more, marks new processes. Returns how many mappings it found.
    pub fn rescan(&mut self) -> usize {
        let libs = match self.scope {
            Scope::One(pid) => discover::scan_pid(pid),
            Scope::Tree(root) => std::iter::once(root)
                .chain(self.probes.followed())
                .flat_map(discover::scan_pid)
                .collect(),
            Scope::All => discover::scan_all(),
        };
        let mut now = HashSet::with_capacity(self.known_pids.len());
        // Mappings to open, in turns by user.
        let mut todo: BTreeMap<u32, VecDeque<(&MappedLibrary, bool)>> = BTreeMap::new();
        for lib in &libs {
            match self.mappings.get(&lib.mapping) {
                Some(Seen::File(_)) => {}
                Some(Seen::Refused(Reason::UserLimit)) => {
                    if let Some(uid) = uid_of(lib.pid)
                        && self.charged_to(uid) < self.max_per_user
                    {
                        todo.entry(uid).or_default().push_back((lib, true));
                    }
                }
                Some(Seen::Refused(_)) => {}
                None => {
                    if let Some(uid) = uid_of(lib.pid) {
                        todo.entry(uid).or_default().push_back((lib, false));
                    }
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
        let start = Instant::now();
        let mut tried: HashSet<&MappingId> = HashSet::new();
        'turns: while !todo.is_empty() {
            let uids: Vec<u32> = todo.keys().copied().collect();
            for uid in uids {
                if start.elapsed() > RESCAN_BUDGET {
                    break 'turns;
                }
                let Some((lib, retry)) = todo.get_mut(&uid).and_then(VecDeque::pop_front) else {
                    todo.remove(&uid);
                    continue;
                };
                // Two processes can map one file: the first one decides.
                if tried.insert(&lib.mapping) {
                    let seen = self.attach_mapped(lib, uid, retry);
                    self.mappings.insert(lib.mapping.clone(), seen);
                }
            }
        }
        // Only processes mapping libcuda now: bounded, and a reused pid is marked again.
        self.known_pids = now;
        // Forget mappings gone (bounded; a file mapped again later is looked at again), then
        // release the files no mapping holds.
        let current: HashSet<&MappingId> = libs.iter().map(|l| &l.mapping).collect();
        self.mappings.retain(|m, _| current.contains(m));
        let live: HashSet<FileKey> = self
            .mappings
            .values()
            .filter_map(|s| match s {
                Seen::File(k) => Some(*k),
                Seen::Refused(_) => None,
            })
            .collect();
        let gone: Vec<FileKey> = self
            .files
            .iter()
            .filter(|(k, f)| f.owner != Owner::UpFront && !live.contains(k))
            .map(|(k, _)| *k)
            .collect();
        if !gone.is_empty() {
            self.probes.release(&gone);
            for key in gone {
                let Some(info) = self.files.remove(&key) else { continue };
                self.stats.released += 1;
                say(format_args!(
                    "released {} (no observed process maps it any more)",
                    info.path
                ));
            }
        }
        libs.len()
    }
}
