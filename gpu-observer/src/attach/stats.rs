//! What the attacher did with the library files it found: attached, released, refused (by
//! reason). Every refusal is counted here and said once on stderr.

use std::{collections::BTreeMap, fmt};

/// Why a library file was not attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// The path could not be opened inside the process's root (gone, a symlink leading nowhere
    /// inside it, a loop, no permission).
    Unreachable,
    /// A FIFO, device, socket or directory where the library should be.
    NotRegularFile,
    /// Larger than [`super::open::MAX_LIBRARY_BYTES`].
    TooLarge,
    /// The path names another inode than the one the process maps.
    Changed,
    /// Not a 64-bit ELF file, truncated, or malformed.
    BadElf,
    /// More symbols than [`super::symbols::MAX_SYMBOLS`].
    TooManySymbols,
    /// Symbol and string tables larger than [`super::symbols::MAX_TABLE_BYTES`].
    TablesTooLarge,
    /// Parsing took longer than [`super::symbols::PARSE_TIMEOUT`].
    ParseTimeout,
    /// A `libcuda.so*` that lacks the entry points every libcuda exports (`api::REQUIRED`).
    NotLibcuda,
    /// A `libgpu_observer_cupti.so` without the hooks.
    NotHookLibrary,
    /// The user of the mapping process has `--max-libraries-per-user` files attached already.
    UserLimit,
    /// The kernel refused every uprobe.
    AttachFailed,
}

impl Reason {
    pub const ALL: [Reason; 12] = [
        Reason::Unreachable,
        Reason::NotRegularFile,
        Reason::TooLarge,
        Reason::Changed,
        Reason::BadElf,
        Reason::TooManySymbols,
        Reason::TablesTooLarge,
        Reason::ParseTimeout,
        Reason::NotLibcuda,
        Reason::NotHookLibrary,
        Reason::UserLimit,
        Reason::AttachFailed,
    ];

    /// The name in the summary JSON and on stderr.
    pub fn name(self) -> &'static str {
        match self {
            Reason::Unreachable => "unreachable",
            Reason::NotRegularFile => "not_regular_file",
            Reason::TooLarge => "too_large",
            Reason::Changed => "changed",
            Reason::BadElf => "bad_elf",
            Reason::TooManySymbols => "too_many_symbols",
            Reason::TablesTooLarge => "tables_too_large",
            Reason::ParseTimeout => "parse_timeout",
            Reason::NotLibcuda => "not_libcuda",
            Reason::NotHookLibrary => "not_hook_library",
            Reason::UserLimit => "user_limit",
            Reason::AttachFailed => "attach_failed",
        }
    }
}

/// Counts of what happened to library files over the run.
#[derive(Clone, Debug, Default)]
pub struct AttachStats {
    /// Files attached (each time: a file released and mapped again counts again).
    pub attached: u64,
    /// Files detached because no observed process maps them any more.
    pub released: u64,
    /// Files attached now.
    pub attached_now: u64,
    /// Refusals by reason: each file once while it stays mapped.
    pub refused: BTreeMap<Reason, u64>,
}

impl AttachStats {
    pub fn refuse(&mut self, reason: Reason) {
        *self.refused.entry(reason).or_default() += 1;
    }

    pub fn refused_total(&self) -> u64 {
        self.refused.values().sum()
    }

    /// For the summary JSON; its caller is export/jsonl (`JsonlWriter::summary`).
    /// `{"attached":N,"attached_now":N,"released":N,"refused":N,"refused_by_reason":{...}}`,
    /// every reason present (0 when none), for the summary.
    pub fn json(&self) -> serde_json::Value {
        let by_reason: serde_json::Map<String, serde_json::Value> = Reason::ALL
            .iter()
            .map(|r| (r.name().to_string(), self.refused.get(r).copied().unwrap_or(0).into()))
            .collect();
        serde_json::json!({
            "attached": self.attached,
            "attached_now": self.attached_now,
            "released": self.released,
            "refused": self.refused_total(),
            "refused_by_reason": by_reason,
        })
    }
}

/// `libraries: 9 attached (8 now), 1 released, 292 refused (user_limit 292)`.
impl fmt::Display for AttachStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "libraries: {} attached ({} now), {} released, {} refused",
            self.attached,
            self.attached_now,
            self.released,
            self.refused_total()
        )?;
        if !self.refused.is_empty() {
            let parts: Vec<String> = self.refused.iter().map(|(r, n)| format!("{} {n}", r.name())).collect();
            write!(f, " ({})", parts.join(", "))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_in_the_json_and_the_text_names_those_seen() {
        let mut s = AttachStats {
            attached: 9,
            released: 1,
            attached_now: 8,
            ..Default::default()
        };
        for _ in 0..3 {
            s.refuse(Reason::UserLimit);
        }
        s.refuse(Reason::NotRegularFile);
        let j = s.json();
        assert_eq!(j["refused"], 4);
        assert_eq!(j["refused_by_reason"]["user_limit"], 3);
        assert_eq!(j["refused_by_reason"]["parse_timeout"], 0);
        assert_eq!(j["refused_by_reason"].as_object().unwrap().len(), Reason::ALL.len());
        assert_eq!(
            s.to_string(),
            "libraries: 9 attached (8 now), 1 released, 4 refused (not_regular_file 1, user_limit 3)"
        );
    }
}
