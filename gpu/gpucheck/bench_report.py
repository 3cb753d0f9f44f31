"""Write BENCH.md from the three launch_bench runs of gpu/bench.sh.

usage: python3 -m gpucheck.bench_report --base1 B1.json --with W.json --base2 B2.json
                                        --events OBSERVER.jsonl --out BENCH.md
                                        [--env ENV.json] [--summary-json S.json]

Reports ns/launch (median over rounds) without / with / again without the
observer, the ratio with / mean(baselines), the overhead in microseconds per
launch, the same for the batched submit-only measurement when present, the observer's summary (events, dropped) and how many of the
benchmark's timed launches the observer captured for its pid.
"""

import argparse
import json
import os
import sys
from collections import Counter

from .common import as_int
from .jsonl import ReadCounts, read_json, read_jsonl


def scan_events(path, pid, windows):
    """Return (summary, launches captured in windows for pid, total lines,
    launch APIs for pid in windows)."""
    summary = None
    captured = 0
    apis = Counter()
    pid_seen = False
    if not path or not os.path.exists(path):
        return None, None, 0, apis, False
    counts = ReadCounts()
    # cheap pre-filter: only launch and summary lines matter
    for ev in read_jsonl(path, counts, want=('"launch"', '"summary"')):
        typ = ev.get("type")
        if typ == "summary":
            summary = ev
            continue
        if typ != "launch" or as_int(ev.get("pid")) != pid:
            continue
        pid_seen = True
        ts = as_int(ev.get("ts_ns"))
        if ts is None:
            continue
        for s, e in windows:
            if s <= ts <= e:
                captured += 1
                apis[str(ev.get("api"))] += 1
                break
    return summary, captured, counts.read, apis, pid_seen


def main():
    ap = argparse.ArgumentParser(prog="python3 -m gpucheck.bench_report")
    ap.add_argument("--base1", required=True)
    ap.add_argument("--with", dest="with_", required=True)
    ap.add_argument("--base2", required=True)
    ap.add_argument("--events", default=None)
    ap.add_argument("--env", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--summary-json", default=None)
    a = ap.parse_args()

    b1, w, b2 = read_json(a.base1), read_json(a.with_), read_json(a.base2)
    env = {}
    if a.env and os.path.exists(a.env):
        env = read_json(a.env)
    n1, nw, n2 = (float(x["ns_per_launch_median"]) for x in (b1, w, b2))
    base = (n1 + n2) / 2.0
    ratio = nw / base if base > 0 else float("nan")
    overhead_us = (nw - base) / 1000.0
    L = int(w.get("launches_per_round", 0))
    R = len(w.get("rounds", []))
    LB = int(w.get("batched_launches_per_round", 0))
    windows = list(zip(w.get("window_start_ns", []), w.get("window_end_ns", [])))
    windows += list(zip(w.get("batched_window_start_ns", []), w.get("batched_window_end_ns", [])))
    summary, captured, lines, apis, pid_seen = scan_events(a.events, int(w["pid"]), windows)
    expected = (L + LB) * R
    has_submit = all("submit_ns_per_launch_median" in x for x in (b1, w, b2))
    if has_submit:
        s1, sw, s2 = (float(x["submit_ns_per_launch_median"]) for x in (b1, w, b2))
        sbase = (s1 + s2) / 2.0
        sratio = sw / sbase if sbase > 0 else float("nan")
        s_over_us = (sw - sbase) / 1000.0
    drift = abs(n1 - n2) / base * 100.0 if base > 0 else float("nan")

    def rounds(x, key="rounds"):
        return ", ".join(f"{r:.0f}" for r in x.get(key, []))

    md = ["# gpu-observer launch overhead benchmark", ""]
    md.append(f"Date: {env.get('date_utc', '?')}; GPU: {env.get('gpu', '?')}; "
              f"driver {env.get('driver', '?')}; CUDA {env.get('cuda_driver_api', '?')}; "
              f"nvcc {env.get('nvcc', '?')}; kernel {env.get('kernel', '?')}; "
              f"observer commit {env.get('observer_commit', '?')}.")
    md.append("")
    md.append(f"Workload: `gpu/workloads/launch_bench.cu` (cudart static): {R} rounds of "
              f"{L} back-to-back `empty_kernel<<<1,1>>>()` launches on the default stream, "
              "CLOCK_MONOTONIC around the launch loop only (the draining "
              "`cudaDeviceSynchronize` is outside the timed region); value = median over "
              "rounds of ns per launch. The observer runs in all-process mode writing JSONL to "
              "a file in /tmp.")
    md.append("")
    md.append("| run | ns/launch (median) | rounds (ns/launch) |")
    md.append("|---|---:|---|")
    md.append(f"| without observer (before) | {n1:.1f} | {rounds(b1)} |")
    md.append(f"| **with observer** | **{nw:.1f}** | {rounds(w)} |")
    md.append(f"| without observer (after) | {n2:.1f} | {rounds(b2)} |")
    md.append("")
    if has_submit:
        md.append(f"Submit cost (secondary): each round also launches {LB} kernels in batches of "
                  f"{w.get('batch', '?')} with a synchronize between batches, timing only the "
                  "launch calls, so the queue never fills and the number is the CPU cost of one "
                  "launch call.")
        md.append("")
        md.append("| run | submit ns/launch (median) | rounds |")
        md.append("|---|---:|---|")
        md.append(f"| without observer (before) | {s1:.1f} | {rounds(b1, 'submit_rounds')} |")
        md.append(f"| **with observer** | **{sw:.1f}** | {rounds(w, 'submit_rounds')} |")
        md.append(f"| without observer (after) | {s2:.1f} | {rounds(b2, 'submit_rounds')} |")
        md.append("")
    md.append("| metric | value |")
    md.append("|---|---:|")
    md.append(f"| mean baseline ns/launch | {base:.1f} |")
    md.append(f"| ratio with / mean baseline | {ratio:.2f}x |")
    md.append(f"| overhead per launch | {overhead_us:.3f} µs |")
    md.append(f"| baseline drift (before vs after) | {drift:.1f}% |")
    if has_submit:
        md.append(f"| submit: ratio with / mean baseline | {sratio:.2f}x |")
        md.append(f"| submit: overhead per launch call | {s_over_us:.3f} µs |")
    if summary is not None:
        md.append(f"| observer summary: events (all processes) | {summary.get('events')} |")
        md.append(f"| observer summary: dropped | {summary.get('dropped')} |")
    else:
        md.append("| observer summary | missing (observer not stopped cleanly?) |")
    if captured is not None:
        pctv = f"{100.0 * captured / expected:.2f}%" if expected else "n/a"
        md.append(f"| timed launches captured for the bench pid | {captured} / {expected} ({pctv}) |")
        md.append(f"| observer JSONL lines | {lines} |")
    md.append("")
    if apis:
        md.append("Launch APIs captured in the timed windows: " +
                  ", ".join(f"`{k}` ({v})" for k, v in apis.most_common()) + ".")
        md.append("")
    if captured is not None and not pid_seen:
        md.append("> WARN: no launch event carried the benchmark's pid (PID namespace?).")
        md.append("")
    if drift > 5.0:
        md.append(f"> Note: the two baselines differ by {drift:.1f}%; overheads smaller than that "
                  "are within run-to-run noise.")
        md.append("")
    md.append("Launches are asynchronous: once the launch queue is full the loop is paced by "
              "the GPU, so a small per-launch CPU overhead can be partly hidden; the ratio is "
              "an upper-level, end-to-end number for a launch-bound program.")
    md.append("")
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n".join(md))

    summ = {"ns_per_launch_without_before": n1, "ns_per_launch_with": nw,
            "ns_per_launch_without_after": n2, "ratio": ratio,
            "overhead_us_per_launch": overhead_us,
            "observer_events": summary.get("events") if summary else None,
            "observer_dropped": summary.get("dropped") if summary else None,
            "captured_launches": captured, "expected_launches": expected}
    if has_submit:
        summ.update({"submit_ns_without_before": s1, "submit_ns_with": sw,
                     "submit_ns_without_after": s2, "submit_ratio": sratio,
                     "submit_overhead_us_per_launch": s_over_us})
    if a.summary_json:
        with open(a.summary_json, "w", encoding="utf-8") as f:
            json.dump(summ, f, indent=1)
            f.write("\n")
    print(f"bench: without {n1:.1f} ns/launch, with {nw:.1f}, without again {n2:.1f}; "
          f"ratio {ratio:.2f}x; overhead {overhead_us:.3f} us/launch")
    if has_submit:
        print(f"bench: submit-only (batched) without {s1:.1f}, with {sw:.1f}, without again "
              f"{s2:.1f} ns/launch; ratio {sratio:.2f}x; overhead {s_over_us:.3f} us/launch")
    print(f"bench: observer events={summ['observer_events']} dropped={summ['observer_dropped']}; "
          f"captured {captured}/{expected} timed launches for pid {w['pid']}")
    print(f"bench: wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
