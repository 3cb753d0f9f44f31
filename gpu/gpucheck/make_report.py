"""Environment capture and VALIDATION.md assembly for gpu/validate.sh.

usage:
  python3 -m gpucheck.make_report env --out ENV.json [--observer PATH] [--nvcc PATH] [--python PATH]
      Gather date, GPU, driver, CUDA, nvcc, torch, kernel, observer commit
      (env GIT_COMMIT) and print a short summary.  Never fails on a missing
      tool: the field says "unavailable".

  python3 -m gpucheck.make_report assemble --env ENV.json --out VALIDATION.md --dir RUNDIR
                                           [--results-json R.json] [--status-file S.tsv] NAME...
      Build the report from RUNDIR/NAME.result.json and RUNDIR/NAME.section.md
      (written by gpucheck.compare, compare_ground_truth or compare_cupti), in the
      order given.  A run without result gets a row with its status from S.tsv
      ("NAME<TAB>STATUS" lines from validate.sh).  CUPTI runs (results of kind
      "cupti", or names starting with "cupti_") get their own summary table and
      section.  R.json receives env + all results + statuses in one object.
"""

import argparse
import datetime as dt
import glob
import hashlib
import json
import os
import platform
import re
import shutil
import sys

from .common import ns_txt, run_cmd
from .jsonl import load_json

NA = "unavailable"


def run(cmd, timeout=60):
    """(rc, stdout and stderr together, stripped); rc != 0 if the command cannot run."""
    rc, out, _ = run_cmd(cmd, timeout, merge=True)
    return rc, out.strip()


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


def find_libcupti(python):
    """Where libcupti can be found on this machine (CUDA toolkit, the Python wheels): the
    injection library needs one at run time."""
    pats = ["/usr/local/cuda*/extras/CUPTI/lib64/libcupti.so*", "/usr/local/cuda*/lib64/libcupti.so*",
            "/usr/lib/x86_64-linux-gnu/libcupti.so*", "/opt/nvidia/*/lib*/libcupti.so*"]
    if python:
        rc, out = run([python, "-c", "import site,sys;print('\\n'.join(site.getsitepackages()))"])
        if rc == 0:
            for sp in out.splitlines():
                pats.append(os.path.join(sp.strip(), "nvidia", "*", "lib", "libcupti.so*"))
                pats.append(os.path.join(sp.strip(), "nvidia", "*", "*", "lib", "libcupti.so*"))
    found = []
    for pat in pats:
        for f in sorted(glob.glob(pat)):
            if f not in found and not os.path.islink(f):
                found.append(f)
    return found[:6] or NA


def cmd_env(a):
    env = gather_env(a.observer, a.nvcc, a.python)
    if a.cupti_lib is not None:
        env["cupti_lib"] = a.cupti_lib or NA
        env["cupti_lib_sha256"] = sha256(a.cupti_lib) if a.cupti_lib else NA
        env["libcupti"] = find_libcupti(a.python)
        env["observer_run"] = a.observer_run or NA
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(env, f, indent=1)
        f.write("\n")
    for k in ("date_utc", "gpu", "compute_cap", "driver", "cuda_driver_api", "nvcc", "python",
              "torch", "torch_cuda", "kernel", "observer_commit", "observer_sha256", "cupti_lib",
              "libcupti", "observer_run"):
        if k in env:
            print(f"  {k:<16} {env.get(k)}")
    return 0


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


def is_cupti(name, res):
    if isinstance(res, dict):
        return res.get("kind") == "cupti"
    return name.startswith("cupti_") and not name.endswith("_uprobes")


def cupti_row(title, win):
    m = win.get("metrics") or {}
    st = win.get("status", "?")
    d = m.get("delta_abs_ns") or {}
    q = m.get("queue_delay_ns") or {}
    n = m.get("gpu_kernels", 0)
    if win.get("key") == "run":
        launches = f"{n} / state {m.get('cupti_state') or 'none'}"
        copies = "-"
    else:
        launches = f"{n} / {m.get('launch_events', '?')}"
        copies = f"{m.get('gpu_memcpy', '?')} / {m.get('memcpy_events', '?')}"
    return (f"| {title} | {win.get('key')} | {'PASS' if st == 'PASS' else '**' + st + '**'} | "
            f"{launches} | {m.get('joined', '?')} ({m.get('joined_pct', '?')}%) | "
            f"{m.get('delta_within_tol', '?')}/{m.get('joined', '?')} | "
            f"{ns_txt(d.get('median'))} / {ns_txt(d.get('p99'))} / {ns_txt(d.get('max'))} | "
            f"{copies} | {ns_txt(q.get('median'))} / {ns_txt(q.get('p99'))} |")


def cmd_assemble(a):
    env = load_json(a.env) or {}
    lines = ["# gpu-observer validation on a real GPU", ""]
    lines.append("Generated by `gpu/validate.sh`: each workload runs while `gpu-observer` "
                 "traces all processes (`--format jsonl`); `gpu/gpucheck/compare.py` counts the "
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
                       ("Observer sha256", "observer_sha256"),
                       ("CUPTI injection library", "cupti_lib"),
                       ("Injection library sha256", "cupti_lib_sha256"),
                       ("libcupti found", "libcupti")):
        if key not in env and key in ("cupti_lib", "cupti_lib_sha256", "libcupti"):
            continue
        val = env.get(key, NA)
        if key.endswith("sha256") and val != NA:
            val = f"`{val[:16]}…`"
        if isinstance(val, list):
            val = ", ".join(f"`{v}`" for v in val)
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
    cupti = [(n, r) for n, r in results if is_cupti(n, r)]
    results_u = [(n, r) for n, r in results if not is_cupti(n, r)]

    lines.append("## Summary")
    lines.append("")
    lines.append("| workload | window | result | launches exp / cap | copies exp / cap | kernel names |")
    lines.append("|---|---|---|---:|---:|---|")
    any_fail = False
    for name, res in results_u:
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
    if cupti:
        lines.append("CUPTI runs (`gpu-observer run --trace-all`, GPU-side records joined to the "
                     "uprobe launches; Δ = abs(launch_ts_ns − cupti_api_start_ns)):")
        lines.append("")
        lines.append("| workload | window | result | gpu_kernel / launches | joined | Δ ≤ tol | "
                     "Δ median / p99 / max | gpu_memcpy / memcpy | queue delay median / p99 |")
        lines.append("|---|---|---|---:|---:|---:|---|---:|---|")
        for name, res in cupti:
            if res is None:
                any_fail = True
                why = statuses.get(name, "NOT RUN / ERROR")
                lines.append(f"| {name} | - | **{why}** (see `{name}.log`, `{name}.err`) | | | | | | |")
                continue
            for win in res.get("windows", []):
                st = win.get("status", "?")
                any_fail = any_fail or st != "PASS"
                lines.append(cupti_row(res.get("title", name), win))
        lines.append("")
    lines.append(f"Overall: **{'FAIL' if any_fail else 'PASS'}**")
    lines.append("")

    def section(name, why):
        """A run's own section (they start at ###), or why it has none."""
        sec = os.path.join(a.dir, f"{name}.section.md")
        if os.path.exists(sec):
            with open(sec, "r", encoding="utf-8") as f:
                lines.append(f.read().rstrip())
        else:
            lines.append(f"### {name}")
            lines.append("")
            lines.append(f"No comparison for this run ({why}; see `{name}.log` / `{name}.err`).")
        lines.append("")

    lines.append("## Workloads")
    lines.append("")
    for name, res in results_u:
        section(name, "workload or observer failed")
    if cupti:
        lines.append("## CUPTI: GPU-side records (`gpu-observer run`)")
        lines.append("")
        for name, res in cupti:
            section(name, statuses.get(name, "workload or observer failed"))

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
                 "report, and the workload's own checks (H1-H3, H9).")
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
    if cupti:
        lines.append("- CUPTI runs: the workload runs as `gpu-observer run --format jsonl --trace-all "
                     "-- CMD` (the observer attaches first, then starts CMD with "
                     "`CUDA_INJECTION64_PATH` set to its CUPTI injection library); `torch_loop` runs "
                     "with `TORCH_LOOP_NO_PROFILER=1` (one CUPTI subscriber per process: the "
                     "injection library holds it), so phase B is checked against the uprobe launch "
                     "counts. `gpu/gpucheck/compare_cupti.py`, per window and strict: every `gpu_kernel` "
                     "line joined to its launch (`launch_ts_ns` set); the uprobe stamp precedes "
                     "CUPTI's API start by at most 5 µs, 0 ≤ `cupti_api_start_ns` − `launch_ts_ns` "
                     "≤ 5 µs, for at least 99 % of the joined lines (where CUPTI timed the runtime "
                     "call the driver call was made from, `cudaLaunchKernel`, |Δ| ≤ 5 µs); "
                     "`gpu_kernel` lines (graphs "
                     "aside) = uprobe launch events, and = the launches the workload knows it made "
                     "(phase A, ground truth); `gpu_memcpy` lines = uprobe memcpy events (and the "
                     "workload's copies); the ground truth's kernel names with their counts; over "
                     "the whole run every `gpu_kernel` line joined and the process's CUPTI state "
                     "`active`. Informational: queue delay (`gpu_start_ns − launch_ts_ns`) and GPU "
                     "duration distributions, memsets, bytes, copy kinds, CUPTI names vs uprobe "
                     "names, the summary's CUPTI counters. `cupti_ground_truth_uprobes` is "
                     "`compare_ground_truth.py` on the same CUPTI run: the uprobe side must stay "
                     "exact with the injection library loaded.")
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
    ap = argparse.ArgumentParser(prog="python3 -m gpucheck.make_report",
                                 description="validation report helper")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("--out", required=True)
    e.add_argument("--observer", default=None)
    e.add_argument("--nvcc", default=None)
    e.add_argument("--python", default=None)
    e.add_argument("--cupti-lib", default=None,
                   help="the CUPTI injection library (empty: not found); adds libcupti paths")
    e.add_argument("--observer-run", default=None,
                   help="whether the observer has the run subcommand (text for the report)")
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
