//! Text an observed process controls, made safe for a terminal.
//!
//! Process names (comm), kernel names, library paths and CUPTI messages come from other users'
//! processes. Written raw, a name holding `ESC ] 0 ;` retitles root's terminal, `ESC [ H` moves
//! its cursor and a newline forges a row (docs/SECURITY.md). Everything such a process supplies
//! goes through [`Printable`] before it reaches the terminal view, the final summary or stderr;
//! JSON lines need nothing (serde_json escapes control characters).

use std::fmt::{self, Write};

/// Whether `c` must not reach a terminal as itself: C0 and C1 controls, DEL, and the Unicode
/// format characters that reorder or break lines (bidi overrides and isolates, line and
/// paragraph separators), with which a name could make a row read differently than it is.
pub(crate) fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{200e}' | '\u{200f}' | '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Displays text with every unsafe character escaped: `\x1b`, `\n`, `\u{202e}`. The escape is
/// visible, so a hostile name is shown for what it is rather than dropped.
pub struct Printable<'a>(pub &'a str);

impl fmt::Display for Printable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        if !s.chars().any(unsafe_char) {
            // The common case, and the one that keeps width/alignment flags working.
            return f.pad(s);
        }
        let mut out = String::with_capacity(s.len() + 8);
        for c in s.chars() {
            if !unsafe_char(c) {
                out.push(c);
            } else if (c as u32) < 0x80 {
                let _ = write!(out, "\\x{:02x}", c as u32);
            } else {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
        }
        f.pad(&out)
    }
}

/// [`Printable`] as an owned string (for code that builds strings rather than formatting).
pub fn printable(s: &str) -> String {
    Printable(s).to_string()
}

/// [`Printable`] cut to at most `max` characters as shown (escapes included, never split),
/// then `…`: a name an observed process chose (up to 1 KiB, and four times that once escaped)
/// takes one bounded stretch of a line.
pub fn printable_cut(s: &str, max: usize) -> String {
    let mut out = String::new();
    let mut shown = 0;
    let mut one = String::new();
    for c in s.chars() {
        one.clear();
        let _ = write!(one, "{}", Printable(c.encode_utf8(&mut [0; 4])));
        let n = one.chars().count();
        if shown + n > max {
            out.push('…');
            return out;
        }
        out.push_str(&one);
        shown += n;
    }
    out
}

/// A message for stderr: untrusted parts should already be [`Printable`]; this escapes what is
/// left except line breaks and tabs the agent's own messages use.
pub fn message(s: &str) -> String {
    if !s.chars().any(|c| unsafe_char(c) && c != '\n' && c != '\t') {
        return s.to_string();
    }
    s.split('\n').map(printable_keep_tabs).collect::<Vec<_>>().join("\n")
}

fn printable_keep_tabs(line: &str) -> String {
    line.split('\t').map(printable).collect::<Vec<_>>().join("\t")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bidi_are_escaped_visibly() {
        assert_eq!(printable("python3"), "python3");
        assert_eq!(printable("\x1b]0;pwn\x07"), "\\x1b]0;pwn\\x07");
        assert_eq!(printable("a\nb\r\t"), "a\\x0ab\\x0d\\x09");
        assert_eq!(printable("x\u{7f}\u{9b}2J"), "x\\x7f\\u{9b}2J");
        assert_eq!(printable("gemm\u{202e}txt.exe"), "gemm\\u{202e}txt.exe");
        assert_eq!(printable("void k<float>(int*)"), "void k<float>(int*)");
        assert_eq!(printable("ядро_µs"), "ядро_µs");
    }

    #[test]
    fn a_cut_name_is_bounded_as_shown_and_never_splits_an_escape() {
        assert_eq!(printable_cut("gemm", 4), "gemm");
        assert_eq!(printable_cut("gemm_x", 4), "gemm…");
        // "ab" then "\x1b" (4 characters shown) does not fit in 5: cut before it.
        assert_eq!(printable_cut("ab\x1b[2J", 5), "ab…");
        assert_eq!(printable_cut("ab\x1b[2J", 6), "ab\\x1b…");
        assert_eq!(printable_cut("\u{202e}x", 8), "\\u{202e}…");
        let long = "\x1b]0;pwn\x07".repeat(200);
        let cut = printable_cut(&long, 80);
        // 14 characters shown a repetition: five, then "\x1b]0;pwn" (10), then the ellipsis.
        assert_eq!(cut.chars().count(), 5 * 14 + 10 + 1, "{cut}");
        assert!(cut.ends_with("\\x1b]0;pwn…"), "{cut}");
        assert!(cut.starts_with("\\x1b]0;pwn\\x07\\x1b]0;pwn\\x07"), "{cut}");
        assert!(!cut.chars().any(|c| c.is_control()), "{cut}");
    }

    #[test]
    fn width_flags_still_apply() {
        assert_eq!(format!("{:<6}|", Printable("ab")), "ab    |");
        assert_eq!(format!("{:<6}|", Printable("\x1b")), "\\x1b  |");
    }

    #[test]
    fn messages_keep_their_own_line_breaks_only() {
        assert_eq!(message("one\ntwo"), "one\ntwo");
        assert_eq!(message("pid 1 (\x1b[2J): x\nnext"), "pid 1 (\\x1b[2J): x\nnext");
    }
}
