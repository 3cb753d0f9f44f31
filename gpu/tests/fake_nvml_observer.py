#!/usr/bin/env python3
"""Fakes of gpu-observer's NVML sampling, nvidia-smi and nvml_alloc.py, for testing
gpu/validate_nvml.sh and gpu/gpucheck/compare_nvml.py without a GPU.  One file, chosen by the name
it is called by (symlink it) or its first argument:

  fake_nvml_observer.py devices [--format json]     the observer's device list
  fake_nvml_observer.py --format jsonl --output F [--duration S] [--nvml-interval-ms N]
      prints "gpu-observer: ready", writes `nvml` device lines every interval per fake GPU
      and process lines for the registered workloads, then (at --duration or SIGINT) the
      device summaries and the total summary with its `nvml` block
  nvidia-smi (a symlink)  -q | (no args) | --query-gpu=... | --query-compute-apps=...
      --format=csv,noheader[,nounits]; the same fake GPUs and workloads
  *alloc*.py (a symlink)  nvml_alloc.py's CLI: registers its pid/uuid/bytes, writes the
      ready file, waits for the stop file, writes the result file
  fake_nvml_observer.py synth DIR [--gpus N] [--workloads-per-gpu N] [--fault K=V ...]
      offline scenario for compare_nvml.py report: DIR/{smi_static.json, devices.json,
      devices.txt, run.jsonl, run.captures.jsonl, wl*.result.json, idle.jsonl}

Environment: FAKE_GPUS (1), FAKE_NVML_STATE (directory of registered workloads; needed by
the online fakes), FAKE_NVML_FAULTS ("k=v,k=v": faults for the online fakes),
FAKE_NO_TORCH=1 (the workload exits 3), FAKE_SMI_NO_RESERVED=1 (nvidia-smi rejects the
memory.reserved field, as an older one does).

Faults (synth --fault K=V, or FAKE_NVML_FAULTS): mem_off_mib=X (observer's device and
process memory X MiB above the truth), wrong_device=1 (process lines of GPU 0's workloads
on the last GPU), drop_key=KEY (KEY absent from every other sample), absent_key=KEY (absent
from every sample; both apply to device and process lines), percent=1
(ratios written as percent), interval_ms=N (actual sampling interval), state=S
(nvml.state), cpu_ratio=R, query_mean_ns=N, dev_field=FIELD:VALUE (devices output),
dev_drop=FIELD (devices output without it), unstable=1 (device memory changes every sample),
no_dev_summary=1, smi_proc_na=1 (nvidia-smi per-process used_memory [N/A]).
"""

import argparse
import glob
import json
import os
import signal
import sys
import time

MIB = 1 << 20
CTX_BYTES = 500 * MIB        # a workload's usage beyond its allocation (context, cuBLAS)
BASE_BYTES = 512 * 1024      # an idle GPU's usage


def parse_faults(items):
    out = {}
    for it in items or []:
        for kv in it.split(","):
            if "=" in kv:
                k, v = kv.split("=", 1)
                out[k.strip()] = v.strip()
    return out


def env_faults():
    return parse_faults([os.environ.get("FAKE_NVML_FAULTS", "")])


def gpu(i):
    return {"index": i, "uuid": f"GPU-00000000-fake-4000-8000-{i:012d}", "name": "NVIDIA H100 80GB HBM3",
            "total_mib": 81559, "pci": f"00000000:{0x1B + 0x10 * i:02X}:00.0", "driver": "580.159.04",
            "cap": "9.0", "cuda": "13.0", "power_limit": 700.0, "clk_graphics": 1980, "clk_sm": 1980,
            "clk_memory": 2619, "sm_count": 132}


class Model:
    def __init__(self, n_gpus, faults, workloads):
        self.gpus = [gpu(i) for i in range(n_gpus)]
        self.f = faults
        self.workloads = workloads  # [{"pid", "uuid", "bytes", "comm"}]
        self.samples = 0

    def used(self, g):
        return BASE_BYTES + sum(w["bytes"] for w in self.workloads if w["uuid"] == g["uuid"])

    def off(self):
        return int(float(self.f.get("mem_off_mib", 0)) * MIB)

    def ratio(self, r):
        return r * 100 if self.f.get("percent") else r

    def keep(self, key, k):
        if self.f.get("absent_key") == key:
            return False
        if self.f.get("drop_key") == key and k % 2 == 1:
            return False
        return True

    def device_line(self, g, ts, k):
        busy = any(w["uuid"] == g["uuid"] for w in self.workloads)
        used = self.used(g) + self.off()
        if self.f.get("unstable"):
            used += (k % 5) * 4 * MIB
        total = g["total_mib"] * MIB
        reserved = 455 * MIB
        o = {"type": "nvml", "scope": "device", "ts_ns": ts, "pid": None, "tid": None, "comm": None,
             "device": g["index"], "uuid": g["uuid"], "name": g["name"],
             "hw.gpu.utilization": {"general": self.ratio(0.97 if busy else 0.0),
                                    "encoder": 0.0, "decoder": 0.0},
             "hw.gpu.memory.utilization": self.ratio(0.41 if busy else 0.0),
             "hw.gpu.memory.usage": used, "hw.gpu.memory.free": total - reserved - used,
             "hw.gpu.memory.reserved": reserved, "hw.gpu.memory.limit": total,
             "hw.power": 512.5 if busy else 71.2, "hw.gpu.power.limit": g["power_limit"],
             "hw.temperature": 41 + (k % 3),
             "hw.gpu.clock": {"graphics": 1980, "sm": 1980, "memory": 2619},
             "hw.gpu.pcie.throughput": {"transmit": 1024 * k, "receive": 2048},
             "hw.gpu.pcie.link": {"generation": 5, "width": 16},
             "hw.gpu.throttle_reasons": [] if busy else ["gpu_idle"],
             "hw.errors": {"ecc_corrected": 0, "ecc_uncorrected": 0, "xid": 0}}
        for key in list(o):
            if key.startswith("hw.") and not self.keep(key, k):
                del o[key]
        return o

    def process_lines(self, ts, k):
        out = []
        last = self.gpus[-1]
        for w in self.workloads:
            g = next((x for x in self.gpus if x["uuid"] == w["uuid"]), None)
            if g is None:
                continue
            if self.f.get("wrong_device") and g["index"] == 0:
                g = last
            o = {"type": "nvml", "scope": "process", "ts_ns": ts, "pid": w["pid"], "tid": None,
                 "comm": w.get("comm", "python3"), "device": g["index"], "uuid": g["uuid"],
                 "hw.gpu.memory.usage": w["bytes"] + self.off(),
                 "hw.gpu.utilization": {"general": self.ratio(0.95 if k % 3 else 0.0),
                                        "encoder": 0.0, "decoder": 0.0},
                 "hw.gpu.memory.utilization": self.ratio(0.4)}
            if k % 4 == 3:  # NVML had no sample of the pid in this interval
                del o["hw.gpu.utilization"], o["hw.gpu.memory.utilization"]
            for key in list(o):
                if key.startswith("hw.") and (self.f.get("absent_key") == key
                                              or (self.f.get("drop_key") == key and k % 2 == 1)):
                    del o[key]
            out.append(o)
        return out

    def summaries(self, counts, ts, wall_ns):
        out = []
        if not self.f.get("no_dev_summary"):
            for g in self.gpus:
                out.append({"type": "summary", "scope": "device", "ts_ns": ts, "device": g["index"],
                            "uuid": g["uuid"], "name": g["name"], "samples": counts.get(g["uuid"], 0)})
        ratio = float(self.f.get("cpu_ratio", 0.00021))
        qm = float(self.f.get("query_mean_ns", 25000))
        n = sum(counts.values())
        q = {name: {"count": n, "mean": int(qm * m), "max": int(qm * m * 4)}
             for name, m in (("nvmlDeviceGetUtilizationRates", 1.0), ("nvmlDeviceGetMemoryInfo_v2", 0.5),
                             ("nvmlDeviceGetPowerUsage", 0.8), ("nvmlDeviceGetProcessUtilization", 0.9),
                             ("nvmlDeviceGetComputeRunningProcesses_v3", 0.7))}
        out.append({"type": "summary", "scope": "total", "pid": None, "ts_ns": ts, "events": 0,
                    "dropped": 0,
                    "nvml": {"state": self.f.get("state", "active"), "devices": len(self.gpus),
                             "samples": n, "sampler_cpu_ns": int(ratio * wall_ns),
                             "sampler_wall_ns": wall_ns, "sampler_cpu_ratio": ratio, "query_ns": q}})
        return out

    def devices(self):
        out = []
        for g in self.gpus:
            d = {"index": g["index"], "name": g["name"], "uuid": g["uuid"], "vendor": "NVIDIA",
                 "memory_total_bytes": g["total_mib"] * MIB, "compute_capability": g["cap"],
                 "driver_version": g["driver"], "cuda_driver_version": g["cuda"],
                 "pci_bus_id": g["pci"].lower() if g["index"] % 2 else g["pci"][4:],
                 "sm_count": g["sm_count"],
                 "max_clocks_mhz": {"graphics": g["clk_graphics"], "sm": g["clk_sm"],
                                    "memory": g["clk_memory"]},
                 "power_limit_watts": g["power_limit"]}
            if self.f.get("dev_field"):
                k, v = self.f["dev_field"].split(":", 1)
                d[k] = v
            if self.f.get("dev_drop"):
                d.pop(self.f["dev_drop"], None)
            out.append(d)
        return out

    def smi_field(self, g, fld, units):
        def u(v, unit):
            return f"{v} {unit}" if units else str(v)
        vals = {"index": g["index"], "uuid": g["uuid"], "name": g["name"],
                "memory.total": u(g["total_mib"], "MiB"),
                "memory.used": u(self.used(g) // MIB, "MiB"), "memory.reserved": u(455, "MiB"),
                "pci.bus_id": g["pci"], "driver_version": g["driver"], "compute_cap": g["cap"],
                "power.limit": u(f"{g['power_limit']:.2f}", "W"),
                "enforced.power.limit": u(f"{g['power_limit']:.2f}", "W"),
                "clocks.max.graphics": u(g["clk_graphics"], "MHz"), "clocks.max.sm": u(g["clk_sm"], "MHz"),
                "clocks.max.memory": u(g["clk_memory"], "MHz")}
        return vals.get(fld)

    def smi_apps(self, units):
        rows = []
        for w in self.workloads:
            mem = "[N/A]" if self.f.get("smi_proc_na") else (
                f"{w['bytes'] // MIB} MiB" if units else str(w["bytes"] // MIB))
            rows.append(f"{w['pid']}, {w['uuid']}, {mem}")
        return rows


# ------------------------------------------------------------------ online state

def state_dir():
    d = os.environ.get("FAKE_NVML_STATE")
    if not d:
        print("fake: FAKE_NVML_STATE is not set", file=sys.stderr)
        sys.exit(2)
    os.makedirs(d, exist_ok=True)
    return d


def registered():
    out = []
    for p in glob.glob(os.path.join(state_dir(), "*.json")):
        try:
            with open(p, "r", encoding="utf-8") as f:
                w = json.load(f)
            if os.path.exists(f"/proc/{w['pid']}"):
                out.append(w)
        except (OSError, ValueError, KeyError):
            pass
    return sorted(out, key=lambda w: w["pid"])


def online_model():
    return Model(int(os.environ.get("FAKE_GPUS", "1")), env_faults(), registered())


# ------------------------------------------------------------------ nvidia-smi

def smi_main(argv):
    if os.environ.get("FAKE_SMI_FAIL") == "1":
        print("NVIDIA-SMI has failed (fake)", file=sys.stderr)
        return 9
    m = online_model()
    if not argv:
        print("| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |")
        return 0
    if argv == ["-q"]:
        print(f"Driver Version                            : {m.gpus[0]['driver']}")
        print(f"CUDA Version                              : {m.gpus[0]['cuda']}")
        print(f"Attached GPUs                             : {len(m.gpus)}")
        return 0
    fmt = next((x.split("=", 1)[1] for x in argv if x.startswith("--format=")), "csv")
    units = "nounits" not in fmt
    header = "noheader" not in fmt
    q = next((x for x in argv if x.startswith("--query-")), None)
    if q is None:
        print(f"fake nvidia-smi: unsupported arguments {argv}", file=sys.stderr)
        return 2
    kind, fields = q[2:].split("=", 1)
    fields = fields.split(",")
    if kind == "query-gpu":
        for fld in fields:
            rejected = fld == "memory.reserved" and os.environ.get("FAKE_SMI_NO_RESERVED") == "1"
            if rejected or m.smi_field(m.gpus[0], fld, units) is None:
                print(f'Field "{fld}" is not a valid field to query.', file=sys.stdout)
                return 2
        if header:
            print(", ".join(fields))
        for g in m.gpus:
            print(", ".join(str(m.smi_field(g, fld, units)) for fld in fields))
        return 0
    if kind == "query-compute-apps":
        if header:
            print(", ".join(fields))
        for r in m.smi_apps(units):
            print(r)
        return 0
    print(f"fake nvidia-smi: unsupported query {q}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------ workload

def alloc_main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ready", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--smi-index", type=int, default=None)
    ap.add_argument("--expect-uuid", default=None)
    ap.add_argument("--alloc-mib", type=int, default=2048)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--max-seconds", type=float, default=120)
    a = ap.parse_args(argv)
    if os.environ.get("FAKE_NO_TORCH") == "1":
        print("nvml_alloc: import torch failed: ModuleNotFoundError('torch') (fake)", file=sys.stderr)
        return 3
    pid = os.getpid()
    nbytes = a.alloc_mib * MIB
    reg = os.path.join(state_dir(), f"{pid}.json")
    with open(reg, "w", encoding="utf-8") as f:
        json.dump({"pid": pid, "uuid": a.expect_uuid, "bytes": nbytes + CTX_BYTES, "comm": "python3"}, f)
    time.sleep(0.2)
    info = {"pid": pid, "device": a.device, "smi_index": a.smi_index, "expect_uuid": a.expect_uuid,
            "torch_uuid": a.expect_uuid, "name": "NVIDIA H100 80GB HBM3",
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "alloc_bytes": nbytes,
            "torch_allocated_bytes": nbytes + 384 * MIB, "torch_reserved_bytes": nbytes + 400 * MIB,
            "matmul_n": a.matmul_n, "dtype": "bfloat16", "ready_ns": time.monotonic_ns(),
            "torch_version": "0.0-fake", "torch_cuda": "13.0", "python": sys.version.split()[0]}
    with open(a.ready + ".tmp", "w", encoding="utf-8") as f:
        json.dump(info, f)
    os.replace(a.ready + ".tmp", a.ready)
    print(f"nvml_alloc: ready pid {pid} (fake), {a.alloc_mib} MiB", flush=True)
    deadline = time.monotonic() + a.max_seconds
    stopped = "max_seconds"
    while time.monotonic() < deadline:
        if os.path.exists(a.stop_file):
            stopped = "stop_file"
            break
        time.sleep(0.05)
    info.update({"iterations": 1, "end_ns": time.monotonic_ns(), "stopped_by": stopped})
    with open(a.result, "w", encoding="utf-8") as f:
        json.dump(info, f)
    os.unlink(reg)
    return 0


# ------------------------------------------------------------------ observer

def devices_main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="terminal")
    a, _ = ap.parse_known_args(argv)
    m = online_model()
    if os.environ.get("FAKE_DEVICES_FAIL") == "1":
        print("gpu-observer: NVML unavailable (fake)", file=sys.stderr)
        return 1
    if a.format == "json":
        print(json.dumps(m.devices(), indent=1))
    else:
        print(f"{'#':<3} {'name':<24} {'uuid':<44} memory")
        for d in m.devices():
            print(f"{d['index']:<3} {d['name']:<24} {d['uuid']:<44} {d['memory_total_bytes'] >> 30} GiB")
    return 0


def observer_main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="jsonl")
    ap.add_argument("--output", required=True)
    ap.add_argument("--duration", type=float, default=None)
    ap.add_argument("--nvml-interval-ms", type=float, default=1000)
    ap.add_argument("--trace-all", action="store_true")
    ap.add_argument("--pid", type=int, default=None)
    a = ap.parse_args(argv)
    faults = env_faults()
    if faults.get("die_early"):
        print("gpu-observer: error: cannot attach (fake)", file=sys.stderr, flush=True)
        return 3
    stop = {"flag": False}

    def on_sig(_s, _f):
        stop["flag"] = True

    signal.signal(signal.SIGINT, on_sig)
    signal.signal(signal.SIGTERM, on_sig)
    out = open(a.output, "w", encoding="utf-8")
    time.sleep(0.2)
    print("gpu-observer: NVML: 1 device(s) (fake)", file=sys.stderr, flush=True)
    print("gpu-observer: ready", file=sys.stderr, flush=True)
    step = float(faults.get("interval_ms", a.nvml_interval_ms)) / 1000.0
    t_start = time.monotonic()
    t_end = t_start + a.duration if a.duration else None
    counts = {}
    k = 0
    nxt = time.monotonic()
    while not stop["flag"] and (t_end is None or time.monotonic() < t_end):
        m = online_model()
        ts = time.monotonic_ns()
        for g in m.gpus:
            out.write(json.dumps(m.device_line(g, ts, k)) + "\n")
            counts[g["uuid"]] = counts.get(g["uuid"], 0) + 1
        for o in m.process_lines(ts, k):
            out.write(json.dumps(o) + "\n")
        out.flush()
        k += 1
        nxt += step
        time.sleep(max(0.0, nxt - time.monotonic()))
    m = online_model()
    for o in m.summaries(counts, time.monotonic_ns(), int((time.monotonic() - t_start) * 1e9)):
        out.write(json.dumps(o) + "\n")
    out.close()
    print(f"gpu-observer: stopped, {sum(counts.values())} NVML samples (fake)", file=sys.stderr, flush=True)
    return 0


# ------------------------------------------------------------------ offline scenario

def synth_main(argv):
    ap = argparse.ArgumentParser(prog="fake_nvml_observer.py synth")
    ap.add_argument("dir")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--workloads-per-gpu", type=int, default=1)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--fault", action="append", default=[])
    a = ap.parse_args(argv)
    f = parse_faults(a.fault)
    os.makedirs(a.dir, exist_ok=True)
    p = lambda n: os.path.join(a.dir, n)  # noqa: E731
    wls = []
    pid = 4242
    for i in range(a.gpus):
        for j in range(a.workloads_per_gpu):
            nbytes = (2048 + 512 * i + 256 * j) * MIB
            wls.append({"pid": pid, "uuid": gpu(i)["uuid"], "bytes": nbytes + CTX_BYTES, "comm": "python3",
                        "alloc": nbytes, "index": i})
            pid += 1
    m = Model(a.gpus, f, wls)
    # nvidia-smi static data, as `compare_nvml.py smi-static` writes it
    fields = ["index", "uuid", "name", "memory.total", "memory.used", "memory.reserved", "pci.bus_id",
              "driver_version", "compute_cap", "power.limit", "enforced.power.limit",
              "clocks.max.graphics", "clocks.max.sm", "clocks.max.memory"]
    smi = {"smi": "synth", "fields": fields, "unsupported": {}, "errors": [],
           "gpus": [{fld: str(m.smi_field(g, fld, False)) for fld in fields} for g in m.gpus],
           "cuda_version": "13.0", "q_driver_version": "580.159.04"}
    with open(p("smi_static.json"), "w", encoding="utf-8") as fh:
        json.dump(smi, fh, indent=1)
    with open(p("devices.json"), "w", encoding="utf-8") as fh:
        json.dump(m.devices(), fh, indent=1)
    with open(p("devices.txt"), "w", encoding="utf-8") as fh:
        for d in m.devices():
            fh.write(f"{d['index']}  {d['name']}  {d['uuid']}\n")
    for n, w in enumerate(wls):
        with open(p(f"wl{n}.result.json"), "w", encoding="utf-8") as fh:
            json.dump({"pid": w["pid"], "device": 0, "smi_index": w["index"], "expect_uuid": w["uuid"],
                       "torch_uuid": w["uuid"], "alloc_bytes": w["alloc"],
                       "torch_reserved_bytes": w["alloc"] + 400 * MIB, "torch_version": "0.0-synth"}, fh)

    def observer_run(name, model, with_caps):
        t0 = 10_000_000_000
        step = int(float(f.get("interval_ms", 100)) * 1e6)
        n = int(a.duration * 1e9 // step)
        counts = {}
        with open(p(f"{name}.jsonl"), "w", encoding="utf-8") as fh:
            fh.write(json.dumps({"type": "launch", "ts_ns": t0 - 5, "pid": 1, "api": "cuLaunchKernel",
                                 "kernel": "not_a_summary"}) + "\n")
            for k in range(n):
                ts = t0 + k * step + (k % 3) * 1000
                for g in model.gpus:
                    fh.write(json.dumps(model.device_line(g, ts, k)) + "\n")
                    counts[g["uuid"]] = counts.get(g["uuid"], 0) + 1
                for o in model.process_lines(ts, k):
                    fh.write(json.dumps(o) + "\n")
            for o in model.summaries(counts, t0 + n * step, n * step):
                fh.write(json.dumps(o) + "\n")
        if not with_caps:
            return
        with open(p(f"{name}.captures.jsonl"), "w", encoding="utf-8") as fh:
            seq = 0
            tc = t0 + 300_000_000
            while tc + 200_000_000 < t0 + n * step:
                seq += 1
                gpu_csv = "".join(f"{g['index']}, {g['uuid']}, {model.used(g) // MIB}\n" for g in model.gpus)
                apps_csv = "".join(r + "\n" for r in model.smi_apps(False))
                fh.write(json.dumps({"seq": seq, "query": "gpu", "t0_ns": tc, "t1_ns": tc + 60_000_000,
                                     "rc": 0, "csv": gpu_csv, "err": ""}) + "\n")
                fh.write(json.dumps({"seq": seq, "query": "apps", "t0_ns": tc + 70_000_000,
                                     "t1_ns": tc + 130_000_000, "rc": 0, "csv": apps_csv, "err": ""}) + "\n")
                tc += 500_000_000

    observer_run("run", m, True)
    observer_run("idle", Model(a.gpus, f, []), False)
    print(f"synth: {a.gpus} GPU(s), {len(wls)} workload(s), faults {f or 'none'} -> {a.dir}")
    return 0


def main():
    base = os.path.basename(sys.argv[0])
    argv = sys.argv[1:]
    if base == "nvidia-smi":
        return smi_main(argv)
    if "alloc" in base:
        return alloc_main(argv)
    if argv and argv[0] == "synth":
        return synth_main(argv[1:])
    if argv and argv[0] == "devices":
        return devices_main(argv[1:])
    return observer_main(argv)


if __name__ == "__main__":
    sys.exit(main())
