"""Helpers shared by the gpucheck modules: value conversion, commands, percentiles, number
formats and Markdown tables.  Two percentile definitions and several number formats exist on
purpose: each keeps the definition its report has always used."""

import statistics
import subprocess
import sys


def eprint(*a):
    print(*a, file=sys.stderr, flush=True)


def as_int(v, default=None):
    """An int from an int, bool, float or (decimal, 0x-hex or float) string; `default` otherwise."""
    if v is None:
        return default
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        try:
            return int(v)
        except (ValueError, OverflowError):  # nan, inf
            return default
    if isinstance(v, str):
        try:
            return int(v, 0)
        except ValueError:
            try:
                return int(float(v))
            except (ValueError, OverflowError):
                return default
    return default


def is_num(v):
    """An int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def run_cmd(cmd, timeout, merge=False):
    """(rc, stdout, stderr) of a command; stderr into stdout with `merge`. A command that cannot
    start gives rc 127, one past its timeout rc 124; the reason is in stderr."""
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True,
                           timeout=timeout, check=False)
        return p.returncode, p.stdout, p.stderr or ""
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout} s"
    except (OSError, subprocess.SubprocessError) as exc:
        return 127, "", str(exc)


# ---------------------------------------------------------------- percentiles


def percentile(sorted_vals, q):
    """Nearest-rank percentile of an ascending list (q in 0..100); None if empty."""
    if not sorted_vals:
        return None
    k = max(0, min(len(sorted_vals) - 1, int(-(-q * len(sorted_vals) // 100)) - 1))
    return sorted_vals[k]


def pctl(vals, q):
    """Percentile as the element at round(q/100 * (n-1)) of the sorted values; None if empty."""
    if not vals:
        return None
    v = sorted(vals)
    k = max(0, min(len(v) - 1, int(round(q / 100.0 * (len(v) - 1)))))
    return v[k]


def median(vals):
    """statistics.median of the values that are not None; None if there are none."""
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def dist(vals):
    """n, min, median, p90, p99 and max (nearest rank) of the values."""
    v = sorted(vals)
    if not v:
        return {"n": 0, "min": None, "median": None, "p90": None, "p99": None, "max": None}
    return {"n": len(v), "min": v[0], "median": percentile(v, 50), "p90": percentile(v, 90),
            "p99": percentile(v, 99), "max": v[-1]}


# ---------------------------------------------------------------- formats


def short(s, n=90):
    s = str(s)
    return s if len(s) <= n else s[:n - 1] + "…"


def share(n, total):
    return 100.0 * n / total if total else 0.0


def fmt_ns(v):
    """ns below 10 µs, µs (1 decimal) below 10 ms, else ms."""
    if v is None:
        return "-"
    a = abs(v)
    if a >= 10_000_000:
        return f"{v / 1e6:.1f} ms"
    if a >= 10_000:
        return f"{v / 1e3:.1f} µs"
    return f"{v} ns"


def ns_txt(v):
    """ns below 1 µs, else µs (1 decimal)."""
    if v is None:
        return "-"
    return f"{v / 1000:.1f} µs" if abs(v) >= 1000 else f"{v} ns"


def us(ns):
    return "-" if ns is None else f"{ns / 1e3:.1f} µs"


def f1(v, nd=2):
    """A float with nd decimals, anything else as str, None as '-'."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def f3(v, nd=3):
    """A number with nd decimals, None as '-'."""
    return "-" if v is None else f"{v:.{nd}f}"


def table_lines(headers, rows, align=None, escape=False):
    """A Markdown table (also readable on a console) as a list of lines; `escape`: a `|` in a
    cell is written `\\|`."""
    align = align or ["---"] * len(headers)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        cells = (str(c).replace("|", "\\|") if escape else str(c) for c in r)
        out.append("| " + " | ".join(cells) + " |")
    return out


def fmt_table(headers, rows, align=None):
    """table_lines as one string (cells as they are)."""
    return "\n".join(table_lines(headers, rows, align))
