"""OTLP-EXPORT.md for gpu/otlp_export.sh: the spans and metrics otlp-sink decoded from a
`gpu-observer run` export (SINK.json) against the observer's own JSON lines of the same run
(RUN.jsonl): spans per API = the API's lines, ioctl spans, gpu_kernel / gpu_memcpy spans, the
summary's otlp counters, the launches metric and the kernel-duration histogram.  The report goes
to stdout; exit 0 only if every check matched and the observer exited 0 (RC).

usage: python3 -m gpucheck.otlp_report SINK.json RUN.jsonl RC
"""

import collections
import json
import sys

from .jsonl import read_json, read_jsonl


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    sink, jsonl, rc = read_json(argv[0]), argv[1], int(argv[2])
    ev = list(read_jsonl(jsonl))
    total = ev[-1]
    pid = max((e for e in ev if e.get("type") == "summary" and e.get("scope") == "process"),
              key=lambda e: e.get("launches", 0))["pid"]
    mine = [e for e in ev if e.get("pid") == pid]
    count = collections.Counter()
    for e in mine:
        t = e.get("type")
        if t in ("launch", "memcpy", "memset", "alloc", "free", "sync", "init", "module", "symbol"):
            count[e["api"]] += 1
        elif t == "ioctl":
            count["<ioctl>"] += 1
        elif t == "gpu_kernel":
            count["gpu_kernel <name>" if e.get("kernel") else "gpu_kernel"] += 1
        elif t in ("gpu_memcpy", "gpu_memset"):
            count[t] += 1
    spans = dict(sink["spans_by_name"])
    ioctl_spans = sum(v for k, v in spans.items() if k.startswith(("NV_", "UVM_", "ioctl")))
    rows, ok = [], True

    def check(what, want, got):
        nonlocal ok
        good = want == got
        ok &= good
        rows.append(f"| {what} | {want} | {got} | {'ok' if good else '**MISMATCH**'} |")

    for api in sorted(k for k in count if k.startswith("cu")):
        check(f"`{api}` spans = the observer's `{api}` lines", count[api], spans.get(api, 0))
    check("ioctl spans = ioctl lines", count["<ioctl>"], ioctl_spans)
    check("`gpu_kernel <name>` spans = named gpu_kernel lines", count["gpu_kernel <name>"], spans.get("gpu_kernel <name>", 0))
    check("`gpu_memcpy` spans = gpu_memcpy lines", count["gpu_memcpy"], spans.get("gpu_memcpy", 0))
    o = total.get("otlp") or {}
    check("summary otlp.spans_exported = spans decoded", o.get("spans_exported"), sink["spans"])
    check("summary otlp.spans_dropped", 0, o.get("spans_dropped"))
    ps = next(e for e in ev if e.get("type") == "summary" and e.get("scope") == "process" and e["pid"] == pid)
    launch_pts = [p for p in sink["metrics"].get("gpu.cuda.launches", {}).get("points", [])
                  if p["attributes"].get("process.pid") == str(pid)]
    check("metric gpu.cuda.launches = summary launches", ps["launches"], launch_pts[0]["value"] if launch_pts else None)
    kd = sink["metrics"].get("gpu.cuda.kernel.duration", {}).get("points", [])
    check("kernel GPU-time histogram: kernels counted = gpu_kernel lines",
          sum(1 for e in mine if e.get("type") == "gpu_kernel"), int(sum(p.get("count", 0) for p in kd)))
    print("# OTLP export of a PyTorch run, decoded\n")
    print(f"gpu-observer run (CUPTI) of torch_loop.py, pid {pid}, exporting over gRPC to otlp-sink; observer exit {rc}. "
          f"{sink['spans']} spans in {sink['traces']} traces ({sink['trace_requests']} requests), "
          f"{sink['metric_requests']} metric requests decoded.\n")
    print("| check | observer's JSON lines | decoded from OTLP | |\n|---|---:|---:|---|")
    print("\n".join(rows))
    print(f"\nResource: {json.dumps(sink['resource'])}\n")
    print("Sample spans:\n\n```\n" + json.dumps(sink["sample_spans"][:3], indent=1) + "\n```")
    kl = sorted(kd, key=lambda p: -p.get("sum", 0))[:5]
    print("\nKernel GPU time (histogram, top 5 labels):\n")
    for p in kl:
        print(f"- {p['attributes'].get('gpu.kernel')}: {p['count']} kernels, {p['sum'] * 1e3:.3f} ms")
    print(f"\nOverall: {'PASS' if ok and rc == 0 else 'FAIL'}")
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
