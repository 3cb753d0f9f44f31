"""BENCH-NVML.md for gpu/bench_nvml.sh: per NVML sampling interval, the sampler's rounds, its CPU
time (share of a core and per round) and the slowest query, from the total summary of each
interval's observer JSONL (OUTDIR/nvml-MS.jsonl).  The table goes to stdout.

usage: python3 -m gpucheck.bench_nvml_report OUTDIR INTERVAL_MS...
"""

import sys

from .jsonl import read_jsonl


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out, intervals = argv[0], argv[1:]
    print("| interval | rounds | sampler CPU (% of a core) | CPU per round | slowest query (mean) |")
    print("|---:|---:|---:|---:|---|")
    for ms in intervals:
        total = None
        for o in read_jsonl(f"{out}/nvml-{ms}.jsonl"):
            if o.get("type") == "summary" and o.get("scope") == "total":
                total = o
        if not total or "nvml" not in total:
            print(f"| {ms} ms | - | no summary | - | - |")
            continue
        n = total["nvml"]
        q = n.get("query_ns", {})
        worst = max(q.items(), key=lambda kv: kv[1]["mean"], default=("-", {"mean": 0}))
        per_round = n["sampler_cpu_ns"] / max(n["samples"], 1)
        print(f"| {ms} ms | {n['samples']} | {n['sampler_cpu_ratio'] * 100:.3f} % | {per_round / 1e3:.0f} µs | "
              f"`{worst[0]}` {worst[1]['mean'] / 1e3:.0f} µs |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
