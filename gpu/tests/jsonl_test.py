"""Cases for gpucheck.jsonl.read_jsonl, the one JSON-lines reader (run by selftest.sh, which
compares each printed line with what the comparers did before they shared it).

usage: python3 gpu/tests/jsonl_test.py CASE DIR     (gpu/ on PYTHONPATH)
Prints one line: what was yielded (the "n" field of each object, or a count) and the counts.
"""

import gzip
import json
import os
import sys

from gpucheck.jsonl import ReadCounts, read_jsonl


def obj(n, **kw):
    return json.dumps(dict({"type": "launch", "n": n}, **kw)) + "\n"


def result(path, **kw):
    c = ReadCounts()
    got = [ev.get("n") for ev in read_jsonl(path, c, **kw)]
    shown = ",".join(str(g) for g in got) if len(got) <= 10 else f"{len(got)} objects"
    return (f"yield {shown}; lines {c.lines} bad {c.bad} oversize {c.oversize} "
            f"not_object {c.not_object} blank {c.blank} filtered {c.filtered}")


def write(path, text, gz=False):
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return path


def main():
    case, d = sys.argv[1], sys.argv[2]
    p = os.path.join(d, f"jsonl_{case}.jsonl")
    torn = '{"type": "launch", "n": 9, "ts_n'  # an observer killed mid-line: no newline
    if case == "torn":
        print(result(write(p, obj(1) + obj(2) + obj(3) + torn)))
    elif case == "torn_gz":
        print(result(write(p + ".gz", obj(1) + obj(2) + torn, gz=True)))
    elif case == "not_json":
        print(result(write(p, obj(1) + "not json\n" + '{"type": "summary", "n": \n' + obj(2))))
    elif case == "not_object":
        print(result(write(p, obj(1) + "[1, 2]\n" + "42\n" + '"launch"\n' + obj(2))))
    elif case == "blank":
        print(result(write(p, "\n" + obj(1) + "   \n\n" + obj(2))))
    elif case == "oversize":
        # bound 1000 characters: a 5000-character line is dropped (a chunk at a time) and
        # counted; the line after it is read; a line of exactly 1000 characters is not over
        big = json.dumps({"type": "launch", "n": 5, "pad": "x" * 5000}) + "\n"
        pad = 1000 - len(json.dumps({"type": "launch", "n": 6, "pad": ""}))
        edge = json.dumps({"type": "launch", "n": 6, "pad": "y" * pad}) + "\n"
        assert len(edge) == 1001
        print(result(write(p, obj(1) + big + obj(2) + edge + big.rstrip("\n")), max_line=1000))
    elif case == "long":
        # the default bound: a 3 MiB line (far longer than any observer line) is read as before
        print(result(write(p, obj(1) + json.dumps({"n": 2, "pad": "z" * (3 << 20)}) + "\n" + obj(3))))
    elif case == "filter":
        text = obj(1) + json.dumps({"type": "ioctl", "n": 2}) + "\n" + "garbage\n" \
            + '{"type": "launch", "n": \n' + obj(3)
        print(result(write(p, text), want=('"launch"',)))
    elif case == "bad_bytes":
        with open(p, "wb") as f:
            f.write(obj(1).encode() + b'{"type": "launch", "n": 2, "kernel": "k\xff\xfe"}\n' + obj(3).encode())
        got = list(read_jsonl(p))
        print(result(p), "| kernel", ascii(got[1].get("kernel")))
    elif case == "truncated_gz":
        raw = gzip.compress((obj(1) * 2000).encode())
        with open(p + ".gz", "wb") as f:
            f.write(raw[: len(raw) // 2])
        try:
            n = sum(1 for _ in read_jsonl(p + ".gz"))
            print(f"no error ({n} objects)")
        except EOFError:
            print("EOFError")
    elif case == "missing":
        try:
            list(read_jsonl(os.path.join(d, "no-such.jsonl")))
            print("no error")
        except OSError as exc:
            print(type(exc).__name__)
    else:
        sys.exit(f"unknown case {case}")


if __name__ == "__main__":
    main()
