"""Checks a `--perfetto` trace against the JSON lines of the same run (issue 16, on a GPU).

Inputs: the JSON summary of tests/perfetto/decode.py (Perfetto's own protos decoded the trace),
the run's `--trace-all` JSON lines, and the run's folded flamegraph. Checked, per process:
- the trace decodes with no sequence or interning error, and every slice is closed in order;
- per thread: one slice per returned CUDA call and per ioctl, one instant per launch, and one
  slice per NVTX thread range, the same names and counts as the JSON lines;
- the GPU stream tracks hold one slice per gpu_kernel/gpu_memcpy/gpu_memset line, kernel names
  and counts equal, and every GPU record joined to its launch ends a flow from that launch;
- the NVTX ranges (thread ranges on their thread, process ranges on the process's track) and
  the kernels that carry a stack of them;
- the flamegraph's GPU time equals the gpu_* lines' total.
Prints a JSON report; exits 1 when a check fails.

usage: python3 -m gpucheck.compare_timeline DECODED.json RUN.jsonl FOLDED [--pid PID]
"""

import collections
import json
import sys

CALL_TYPES = {"init", "memcpy", "memset", "alloc", "free", "sync", "module", "symbol", "host_func"}
GPU_TYPES = {"gpu_kernel", "gpu_memcpy", "gpu_memset"}


def load_lines(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def main(argv):
    decoded_path, jsonl_path, folded_path = argv[:3]
    pid = int(argv[argv.index("--pid") + 1]) if "--pid" in argv else None
    d = json.load(open(decoded_path))
    lines = load_lines(jsonl_path)
    if pid is None:
        pids = collections.Counter(l["pid"] for l in lines if l.get("type") in GPU_TYPES)
        pid = pids.most_common(1)[0][0]
    mine = [l for l in lines if l.get("pid") == pid]
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)

    check(d["errors"] == [], f"decode errors: {d['errors'][:5]}")
    tracks = d["tracks"]
    for t in tracks.values():
        check(t.get("unmatched_ends", 0) == 0, f"track {t.get('name')}: {t.get('unmatched_ends')} unmatched ends")
    proc = [u for u, t in tracks.items() if t.get("kind") == "process" and t.get("pid") == pid]
    check(len(proc) == 1, f"{len(proc)} process tracks for pid {pid}")
    children = [t for t in tracks.values() if proc and t.get("parent") == proc[0]]

    # Threads: calls, ioctls, NVTX thread ranges (slices); launches and marks (instants).
    report = {"pid": pid, "threads": {}}
    for t in (t for t in tracks.values() if t.get("kind") == "thread" and t.get("pid") == pid):
        tid = t["tid"]
        slices, instants = collections.Counter(), collections.Counter()
        for l in mine:
            if l.get("tid") != tid:
                continue
            ty = l.get("type")
            if ty == "launch":
                instants[l["api"]] += 1
            elif ty in CALL_TYPES and not l.get("abandoned"):
                slices[l["api"]] += 1
            elif ty == "ioctl":
                slices[l.get("name") or f"ioctl {l['cmd']}"] += 1
            elif ty == "nvtx_range" and l["kind"] == "thread":
                slices[l["name"] if l["domain"] is None else f"{l['domain']}: {l['name']}"] += 1
            elif ty == "nvtx_range" and l["kind"] == "mark":
                instants[l["name"]] += 1
        got_slices = collections.Counter(t.get("names", {}))
        got_instants = collections.Counter({k: v for k, v in t.get("instants", {}).items() if not k.startswith("anomaly")})
        check(got_slices == slices, f"thread {tid} slices differ: {dict((got_slices - slices) + (slices - got_slices))}")
        check(got_instants == instants, f"thread {tid} instants differ: {dict((got_instants - instants) + (instants - got_instants))}")
        report["threads"][tid] = {"slices": sum(slices.values()), "instants": sum(instants.values())}

    # GPU stream tracks: one slice per GPU record, same kernel names.
    streams = {u for u, t in tracks.items() if proc and t.get("parent") == proc[0]
               and (t.get("name") or "").startswith("GPU ") and "stream" in (t.get("name") or "")}
    # A stream's overlap lanes are tracks under it.
    streams |= {u for u, t in tracks.items() if t.get("parent") in streams}
    gpu = [tracks[u] for u in streams]
    gpu_lines = [l for l in mine if l.get("type") in GPU_TYPES]
    got = sum(t.get("slices", 0) for t in gpu)
    check(got == len(gpu_lines), f"GPU slices {got} != gpu_* lines {len(gpu_lines)}")
    got_kernels = collections.Counter()
    for t in gpu:
        got_kernels.update(t.get("names", {}))
    want_kernels = collections.Counter(l.get("kernel") for l in gpu_lines if l["type"] == "gpu_kernel")
    check(all(got_kernels[k] == n for k, n in want_kernels.items()),
          f"kernel slices differ: {[(k, n, got_kernels[k]) for k, n in want_kernels.items() if got_kernels[k] != n][:5]}")
    joined = sum(1 for l in gpu_lines if l.get("launch_ts_ns") is not None)
    flows = d["flows"]
    check(flows["terminated"] + flows["steps"] == joined,
          f"flows ended or stepped {flows['terminated'] + flows['steps']} != joined GPU records {joined}")
    check(flows["unmatched_terminations"] == 0, f"{flows['unmatched_terminations']} flows end with no start")

    # NVTX: process ranges on the process's own track; kernels with a stack.
    nvtx = [l for l in mine if l.get("type") == "nvtx_range"]
    proc_ranges = collections.Counter(l["name"] for l in nvtx if l["kind"] == "process")
    got_proc = collections.Counter()
    for t in children:
        if (t.get("name") or "").startswith("NVTX"):
            got_proc.update(t.get("names", {}))
    check(got_proc == proc_ranges, f"process ranges differ: {dict(got_proc)} vs {dict(proc_ranges)}")
    kernels = [l for l in gpu_lines if l["type"] == "gpu_kernel"]
    with_stack = [l for l in kernels if l.get("nvtx")]
    stacks = collections.Counter(" / ".join(l["nvtx"][:2]) for l in with_stack)

    # The flamegraph weighs the same GPU time.
    folded = 0
    for line in open(folded_path):
        if line.strip():
            folded += int(line.rsplit(" ", 1)[1])
    gpu_ns = sum(l["gpu_duration_ns"] for l in gpu_lines)
    check(folded == gpu_ns, f"flamegraph total {folded} ns != gpu_* lines {gpu_ns} ns")

    report.update({
        "packets": d["packets"], "tracks": len(tracks), "gpu_tracks": len(gpu),
        "gpu_slices": got, "gpu_lines": len(gpu_lines), "kernels": len(kernels), "joined": joined,
        "flows": flows, "nvtx_ranges": collections.Counter(l["kind"] for l in nvtx),
        "kernels_with_nvtx": len(with_stack), "top_stacks": stacks.most_common(6),
        "flamegraph_ns": folded, "failures": failures, "ok": not failures,
    })
    json.dump(report, sys.stdout, indent=1, default=str)
    print()
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
