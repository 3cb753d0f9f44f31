"""The one reader of JSON lines (the observer's --format jsonl output, and the nvidia-smi
captures of compare_nvml), and the JSON-file helpers.

read_jsonl() streams a file (gzipped if its name ends in .gz), one line at a time:
  - a line is at most `max_line` characters (MAX_LINE, 16 Mi: the observer's longest lines,
    per-process summaries with their top kernels, are a few KiB); a longer one is skipped
    without being held in memory, in chunks, and counted as bad (and as oversize);
  - a line that is not JSON (a torn last line of an observer that was killed, garbage) is
    counted as bad and skipped; reading goes on with the next line;
  - a JSON value that is not an object is counted (not_object) and skipped;
  - blank lines are counted apart (blank), never parsed;
  - with `want` (substrings), a line containing none of them is counted but not parsed: a
    cheap pre-filter for the big JSONL of a benchmark where only some lines matter;
  - undecodable bytes are replaced (U+FFFD), never an error; an unreadable file or a truncated
    gzip stream raises (OSError, EOFError) as the callers expect.
Only the JSON objects are yielded; the counts are in the ReadCounts passed in.
"""

import gzip
import json

MAX_LINE = 16 << 20  # characters


def open_text(path):
    """A text file, or a gzipped one when the name ends in .gz (bad bytes replaced)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, "r", encoding="utf-8", errors="replace")


class ReadCounts:
    """What read_jsonl saw. `lines`: non-blank lines (every line except blank ones, oversize and
    pre-filtered ones included); `bad`: lines that are not JSON or are over the bound;
    `oversize`: lines over the bound (also in `bad`); `not_object`: JSON values that are not
    objects; `blank`: blank lines; `filtered`: lines the pre-filter left unparsed."""

    def __init__(self):
        self.lines = 0
        self.blank = 0
        self.bad = 0
        self.oversize = 0
        self.not_object = 0
        self.filtered = 0

    @property
    def read(self):
        """Every line of the file, blank ones included."""
        return self.lines + self.blank

    @property
    def unusable(self):
        """Non-blank lines that gave no object: not JSON, over the bound, or not an object."""
        return self.bad + self.not_object


def read_jsonl(path, counts=None, want=None, max_line=MAX_LINE):
    """Yield the JSON objects of the JSON-lines file `path` (see the module doc); `counts`
    (a ReadCounts) receives what was seen; `want`: substrings a line must contain to be parsed."""
    counts = ReadCounts() if counts is None else counts
    limit = max_line + 1
    with open_text(path) as f:
        readline = f.readline
        while True:
            line = readline(limit)
            if not line:
                break
            if len(line) == limit and line[-1] != "\n":
                # over the bound: drop the rest of the line, a chunk at a time
                while line and line[-1] != "\n":
                    line = readline(limit)
                counts.lines += 1
                counts.bad += 1
                counts.oversize += 1
                continue
            text = line.strip()
            if not text:
                counts.blank += 1
                continue
            counts.lines += 1
            if want is not None and not any(w in line for w in want):
                counts.filtered += 1
                continue
            try:
                ev = json.loads(text)
            except ValueError:
                counts.bad += 1
                continue
            if not isinstance(ev, dict):
                counts.not_object += 1
                continue
            yield ev


def read_json(path):
    """The JSON value in a file; raises OSError / ValueError."""
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


def load_json(path):
    """The JSON value in a file, or None if no path is given, it cannot be read or is not JSON."""
    if not path:
        return None
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None
