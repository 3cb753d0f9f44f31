#!/usr/bin/env python3
"""Environment capture and VALIDATION.md assembly for gpu/validate.sh.

usage:
  make_report.py env --out ENV.json [--observer PATH] [--nvcc PATH] [--python PATH]
      Gather date, GPU, driver, CUDA, nvcc, torch, kernel, observer commit
      (env GIT_COMMIT) and print a short summary.  Never fails on a missing
      tool: the field says "unavailable".

  make_report.py assemble --env ENV.json --out VALIDATION.md --dir RUNDIR
                          [--results-json R.json] [--status-file S.tsv] NAME...
      Build the report from RUNDIR/NAME.result.json and RUNDIR/NAME.section.md
      (written by compare.py), in the order given.  A run without result gets a
      row with its status from S.tsv ("NAME<TAB>STATUS" lines from validate.sh).
      R.json receives env + all results + statuses in one object.
"""

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys

NA = "unavailable"


def run(cmd, timeout=60):
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout, check=False)
        return p.returncode, p.stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return -1, str(exc)


def sha256(path):
    try:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return NA


def gather_env(observer, nvcc, python):
    env = {"date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
           "kernel": platform.release(), "gpu": NA, "driver": NA, "compute_cap": NA,
           "gpu_memory": NA, "cuda_driver_api": NA, "nvcc": NA, "torch": NA,
           "torch_cuda": NA, "python": NA,
           "observer_commit": os.environ.get("GIT_COMMIT") or "not given (set GIT_COMMIT)",
           "observer_path": observer or NA,
           "observer_sha256": sha256(observer) if observer else NA}
    if shutil.which("nvidia-smi"):
        rc, out = run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total",
                       "--format=csv,noheader"])
        if rc == 0 and out:
            first = out.splitlines()[0]
            parts = [p.strip() for p in first.split(",")]
            if len(parts) >= 4:
                env["gpu"], env["driver"], env["compute_cap"], env["gpu_memory"] = parts[:4]
            n = len(out.splitlines())
            if n > 1:
                env["gpu"] += f" (x{n}, first used)"
        rc, out = run(["nvidia-smi"])
        m = re.search(r"CUDA Version:\s*([0-9.]+)", out or "")
        if m:
            env["cuda_driver_api"] = m.group(1)
    if nvcc and (os.path.exists(nvcc) or shutil.which(nvcc)):
        rc, out = run([nvcc, "--version"])
        m = re.search(r"release\s+([^\s,]+),\s*(V[^\s]+)", out or "")
        if m:
            env["nvcc"] = f"{m.group(1)} ({m.group(2)})"
        elif rc == 0:
            env["nvcc"] = out.splitlines()[-1] if out else NA
    if python:
        rc, out = run([python, "-c",
                       "import sys,torch;print(sys.version.split()[0]);print(torch.__version__);"
                       "print(torch.version.cuda)"], timeout=120)
        lines = out.splitlines() if out else []
        if rc == 0 and len(lines) >= 3:
            env["python"], env["torch"], env["torch_cuda"] = lines[-3:]
        else:
            rc2, out2 = run([python, "-c", "import sys;print(sys.version.split()[0])"])
            if rc2 == 0:
                env["python"] = out2
            env["torch"] = "not importable"
    return env


def cmd_env(a):
    env = gather_env(a.observer, a.nvcc, a.python)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(env, f, indent=1)
        f.write("\n")
    for k in ("date_utc", "gpu", "compute_cap", "driver", "cuda_driver_api", "nvcc", "python",
              "torch", "torch_cuda", "kernel", "observer_commit", "observer_sha256"):
        print(f"  {k:<16} {env.get(k)}")
    return 0


def load_json(path):
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def check_value(win, prefix):
    for c in win.get("checks", []):
        if c["metric"].startswith(prefix):
            return c
    return None


def names_cell(win):
    """Kernel-name coverage of a window: named launches, and the profiler match if any."""
    parts = []
    c = check_value(win, "launches with a kernel name")
    if c:
        cap, exp = c["captured"], c["expected"]
        parts.append(f"named {cap}" if isinstance(cap, str) else f"named {cap}/{exp}")
    m = check_value(win, "launch names = profiler")
    if m and isinstance(m.get("captured"), str):
        parts.append(f"= profiler {m['captured']}")
    return "; ".join(parts) or "-"


def cmd_assemble(a):
    env = load_json(a.env) or {}
    lines = ["# gpu-observer validation on a real GPU", ""]
    lines.append("Generated by `gpu/validate.sh`: each workload runs while `gpu-observer` "
                 "traces all processes (`--format jsonl`); `gpu/compare.py` counts the "
                 "observer's events for the workload's pid inside the workload's own "
                 "CLOCK_MONOTONIC window and compares them with the counts the workload "
                 "knows it issued (or, for the training loop, with what torch.profiler/CUPTI "
                 "recorded).")
    lines.append("")
    lines.append("| | |")
    lines.append("|---|---|")
    for label, key in (("Date", "date_utc"), ("GPU", "gpu"), ("Compute capability", "compute_cap"),
                       ("Driver", "driver"), ("CUDA (driver API)", "cuda_driver_api"),
                       ("nvcc", "nvcc"), ("Python", "python"), ("PyTorch", "torch"),
                       ("PyTorch CUDA", "torch_cuda"), ("Linux kernel", "kernel"),
                       ("Observer commit", "observer_commit"),
                       ("Observer sha256", "observer_sha256")):
        val = env.get(key, NA)
        if key == "observer_sha256" and val != NA:
            val = f"`{val[:16]}…`"
        lines.append(f"| {label} | {val} |")
    lines.append("")

    statuses = {}
    if a.status_file and os.path.exists(a.status_file):
        with open(a.status_file, "r", encoding="utf-8") as f:
            for line in f:
                if "\t" in line:
                    k, v = line.rstrip("\n").split("\t", 1)
                    statuses[k] = v
    results = []
    for name in a.names:
        res = load_json(os.path.join(a.dir, f"{name}.result.json"))
        results.append((name, res))

    lines.append("## Summary")
    lines.append("")
    lines.append("| workload | window | result | launches exp / cap | copies exp / cap | kernel names |")
    lines.append("|---|---|---|---:|---:|---|")
    any_fail = False
    for name, res in results:
        if res is None:
            any_fail = True
            why = statuses.get(name, "NOT RUN / ERROR")
            lines.append(f"| {name} | - | **{why}** (see `{name}.log`, `{name}.err`) | | | |")
            continue
        for win in res.get("windows", []):
            st = win.get("status", "?")
            any_fail = any_fail or st != "PASS"
            lc = check_value(win, "kernel launches")
            if win["key"] == "phaseB":
                cc = check_value(win, "memcpy")
                copies = f"{cc['expected']} / {cc['captured']}" if cc else "?"
            else:
                h = check_value(win, "HtoD copies")
                d = check_value(win, "DtoH copies")
                copies = (f"{h['expected'] + d['expected']} / {h['captured'] + d['captured']}"
                          if h and d and h["expected"] is not None and d["expected"] is not None
                          else "?")
            launches = f"{lc['expected']} / {lc['captured']}" if lc else "?"
            lines.append(f"| {res.get('title', name)} | {win['key']} | "
                         f"{'PASS' if st == 'PASS' else '**' + st + '**'} | {launches} | {copies} | "
                         f"{names_cell(win)} |")
    lines.append("")
    lines.append(f"Overall: **{'FAIL' if any_fail else 'PASS'}**")
    lines.append("")

    lines.append("## Workloads")
    lines.append("")
    for name, res in results:
        sec = os.path.join(a.dir, f"{name}.section.md")
        if os.path.exists(sec):
            with open(sec, "r", encoding="utf-8") as f:
                # demote nothing; sections start at ###
                lines.append(f.read().rstrip())
        else:
            lines.append(f"### {name}")
            lines.append("")
            lines.append(f"No comparison for this run (workload or observer failed; "
                         f"see `{name}.log` / `{name}.err`).")
        lines.append("")

    lines.append("## Method")
    lines.append("")
    lines.append("- `ground_truth` (`cuda-ground-truth`, Rust, its own driver FFI through `dlopen`): "
                 "creates its context, waits until the observer is attached, then makes an "
                 "exactly known set of driver calls (invalid and valid PTX `cuModuleLoadData`, "
                 "3 `cuModuleGetFunction`, per iteration 3 `cuLaunchKernel` of named kernels "
                 "(one C++-mangled), `cuMemcpyHtoD_v2`, `cuMemcpyDtoHAsync_v2`, 3 generic "
                 "`cuMemcpy` (DtoD, pinned HtoD, pinned DtoH), 2 `cuStreamSynchronize`, "
                 "`cuMemsetD32_v2`) and leaves one 4 MiB `cuMemAlloc_v2` unfreed. Strict: every "
                 "probed API's count and bytes, every launch's kernel name, grid and stream, the "
                 "generic copies' inferred direction and host memory, the failed call, the leak "
                 "report, and the workload's own seed-004 checks (H1-H3, H9).")
    lines.append("- `copies_kernels` (nvcc, cudart static): per iteration one `cudaMemcpy` HtoD "
                 "(1 MiB, pinned), one `<<<>>>` launch, one `cudaMemcpyAsync` DtoH on a created "
                 "stream and one `cudaStreamSynchronize`; built once with the legacy default "
                 "stream and once with `--default-stream per-thread` (expects `*_ptsz`/`*_ptds` "
                 "driver entry points).")
    lines.append("- `torch_loop` phase A: per iteration one pinned HtoD `copy_`, one `add_` "
                 "kernel, one pinned DtoH `copy_`, one stream synchronize. Phase B: "
                 "Linear-ReLU-Linear training steps under `torch.profiler` (CPU+CUDA); the "
                 "expected numbers are the profiler's kernel / gpu_memcpy / gpu_memset activity "
                 "counts.")
    lines.append("- Strict checks (fail the run): launches, HtoD/DtoH counts and bytes, "
                 "phase B launches and memcpys; kernel names: every `copies_kernels` launch "
                 "carries `add_k`'s demangled name, and in phase B at least 99% of launches are "
                 "named and at least 99% of names equal a profiler (CUPTI) kernel name, as a "
                 "multiset, after whitespace normalisation (unmatched names are listed). Syncs, "
                 "memsets, phase A names and the `_ptsz` API check are informational.")
    lines.append("")
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    if a.results_json:
        with open(a.results_json, "w", encoding="utf-8") as f:
            json.dump({"overall": "FAIL" if any_fail else "PASS", "env": env,
                       "statuses": statuses, "runs": {n: r for n, r in results}},
                      f, indent=1, default=str)
            f.write("\n")
    print(f"report: {a.out} (overall {'FAIL' if any_fail else 'PASS'})")
    return 0


def main():
    ap = argparse.ArgumentParser(description="validation report helper")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("--out", required=True)
    e.add_argument("--observer", default=None)
    e.add_argument("--nvcc", default=None)
    e.add_argument("--python", default=None)
    s = sub.add_parser("assemble")
    s.add_argument("--env", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--dir", required=True)
    s.add_argument("--results-json", default=None)
    s.add_argument("--status-file", default=None)
    s.add_argument("names", nargs="+")
    a = ap.parse_args()
    return cmd_env(a) if a.cmd == "env" else cmd_assemble(a)


if __name__ == "__main__":
    sys.exit(main())
