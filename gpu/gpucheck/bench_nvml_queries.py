"""Wall and CPU time of each NVML query the observer could use, called directly (ctypes,
standard library only), on every GPU: the measurements behind the sampler's tiers
(src/sample/mod.rs). Prints a markdown table and writes JSON.

usage (from gpu/, or with gpu/ on PYTHONPATH):
  python3 -m gpucheck.bench_nvml_queries [--iters N] [--json OUT.json] [--lib libnvidia-ml.so.1]
"""
import argparse
import ctypes as C
import json
import sys
import time

LIBS = ["libnvidia-ml.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "/usr/local/nvidia/lib64/libnvidia-ml.so.1"]


class Memory(C.Structure):
    _fields_ = [("total", C.c_ulonglong), ("free", C.c_ulonglong), ("used", C.c_ulonglong)]


class MemoryV2(C.Structure):
    _fields_ = [("version", C.c_uint), ("total", C.c_ulonglong), ("reserved", C.c_ulonglong),
                ("free", C.c_ulonglong), ("used", C.c_ulonglong)]


class Util(C.Structure):
    _fields_ = [("gpu", C.c_uint), ("memory", C.c_uint)]


class Value(C.Union):
    _fields_ = [("d", C.c_double), ("ui", C.c_uint), ("ul", C.c_ulong), ("ull", C.c_ulonglong),
                ("sll", C.c_longlong)]


class FieldValue(C.Structure):
    _fields_ = [("fieldId", C.c_uint), ("scopeId", C.c_uint), ("timestamp", C.c_longlong),
                ("latencyUsec", C.c_longlong), ("valueType", C.c_int), ("nvmlReturn", C.c_int),
                ("value", Value)]


class ProcDetail(C.Structure):
    _fields_ = [("pid", C.c_uint), ("usedGpuMemory", C.c_ulonglong), ("gpuInstanceId", C.c_uint),
                ("computeInstanceId", C.c_uint), ("usedGpuCcProtectedMemory", C.c_ulonglong)]


class ProcDetailList(C.Structure):
    _fields_ = [("version", C.c_uint), ("mode", C.c_uint), ("numProcArrayEntries", C.c_uint),
                ("procArray", C.POINTER(ProcDetail))]


class ProcUtilInfo(C.Structure):
    _fields_ = [("timeStamp", C.c_ulonglong), ("pid", C.c_uint), ("smUtil", C.c_uint),
                ("memUtil", C.c_uint), ("encUtil", C.c_uint), ("decUtil", C.c_uint),
                ("jpgUtil", C.c_uint), ("ofaUtil", C.c_uint)]


class ProcsUtilInfo(C.Structure):
    _fields_ = [("version", C.c_uint), ("processSamplesCount", C.c_uint),
                ("lastSeenTimeStamp", C.c_ulonglong), ("procUtilArray", C.POINTER(ProcUtilInfo))]


class ProcUtilSample(C.Structure):
    _fields_ = [("pid", C.c_uint), ("timeStamp", C.c_ulonglong), ("smUtil", C.c_uint),
                ("memUtil", C.c_uint), ("encUtil", C.c_uint), ("decUtil", C.c_uint)]


FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES = 197, 198
FI_POWER_INSTANT = 186
FI_PCIE_LINK_GEN, FI_PCIE_LINK_WIDTH = 175, 176  # NVML_FI_DEV_PCIE_LINK_GEN_CURRENT? (best effort)


def main():
    ap = argparse.ArgumentParser(prog="python3 -m gpucheck.bench_nvml_queries")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument("--lib")
    ap.add_argument("--spaced-ms", type=float, default=0,
                    help="sleep this long before each call (the sampler's situation: a cold call "
                         "every interval) instead of calling back to back")
    a = ap.parse_args()
    nvml = None
    for path in ([a.lib] if a.lib else LIBS):
        try:
            nvml = C.CDLL(path)
            break
        except OSError:
            continue
    if nvml is None:
        sys.exit("no libnvidia-ml")
    assert nvml.nvmlInit_v2() == 0
    n = C.c_uint()
    nvml.nvmlDeviceGetCount_v2(C.byref(n))
    results = []
    for i in range(n.value):
        dev = C.c_void_p()
        nvml.nvmlDeviceGetHandleByIndex_v2(i, C.byref(dev))
        m1, m2, u = Memory(), MemoryV2(), Util()
        m2.version = C.sizeof(MemoryV2) | (2 << 24)
        pcie = (FieldValue * 2)()
        pcie[0].fieldId, pcie[1].fieldId = FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES
        one = (FieldValue * 1)()
        one[0].fieldId = FI_POWER_INSTANT
        procs = (ProcDetail * 64)()
        plist = ProcDetailList()
        samples = (ProcUtilSample * 512)()
        val = C.c_uint()
        ull = C.c_ulonglong()

        def detail():
            plist.version = C.sizeof(ProcDetailList) | (1 << 24)
            plist.mode, plist.numProcArrayEntries, plist.procArray = 0, 64, procs
            return nvml.nvmlDeviceGetRunningProcessDetailList(dev, C.byref(plist))

        def putil():
            cnt = C.c_uint(512)
            since = int(time.time() * 1e6) - 1_000_000
            r = nvml.nvmlDeviceGetProcessUtilization(dev, samples, C.byref(cnt), C.c_ulonglong(since))
            return 0 if r == 6 else r  # NOT_FOUND: no samples

        infos = (ProcUtilInfo * 512)()
        pinfo = ProcsUtilInfo()

        def putil_info():
            pinfo.version = C.sizeof(ProcsUtilInfo) | (1 << 24)
            pinfo.processSamplesCount = 512
            pinfo.lastSeenTimeStamp = int(time.time() * 1e6) - 1_000_000
            pinfo.procUtilArray = infos
            r = nvml.nvmlDeviceGetProcessesUtilizationInfo(dev, C.byref(pinfo))
            return 0 if r == 6 else r

        queries = {
            "nvmlDeviceGetMemoryInfo (v1)": lambda: nvml.nvmlDeviceGetMemoryInfo(dev, C.byref(m1)),
            "nvmlDeviceGetMemoryInfo_v2": lambda: nvml.nvmlDeviceGetMemoryInfo_v2(dev, C.byref(m2)),
            "nvmlDeviceGetUtilizationRates": lambda: nvml.nvmlDeviceGetUtilizationRates(dev, C.byref(u)),
            "nvmlDeviceGetPowerUsage": lambda: nvml.nvmlDeviceGetPowerUsage(dev, C.byref(val)),
            "nvmlDeviceGetClockInfo(sm)": lambda: nvml.nvmlDeviceGetClockInfo(dev, 1, C.byref(val)),
            "nvmlDeviceGetTemperature": lambda: nvml.nvmlDeviceGetTemperature(dev, 0, C.byref(val)),
            "nvmlDeviceGetCurrPcieLinkWidth": lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(dev, C.byref(val)),
            "nvmlDeviceGetCurrPcieLinkGeneration": lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(dev, C.byref(val)),
            "nvmlDeviceGetTotalEccErrors": lambda: nvml.nvmlDeviceGetTotalEccErrors(dev, 0, 0, C.byref(ull)),
            "nvmlDeviceGetFieldValues(pcie tx+rx bytes)": lambda: nvml.nvmlDeviceGetFieldValues(dev, 2, pcie),
            "nvmlDeviceGetFieldValues(power instant)": lambda: nvml.nvmlDeviceGetFieldValues(dev, 1, one),
            "nvmlDeviceGetRunningProcessDetailList": detail,
            "nvmlDeviceGetProcessUtilization": putil,
            "nvmlDeviceGetProcessesUtilizationInfo": putil_info,
        }
        for name, f in queries.items():
            iters = a.iters if "ProcessUtilization" not in name else max(10, a.iters // 10)
            rc = f()
            w = c = 0
            if a.spaced_ms:
                iters = min(iters, 20)
            for _ in range(iters):
                if a.spaced_ms:
                    time.sleep(a.spaced_ms / 1e3)
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                f()
                w, c = w + time.perf_counter_ns() - w0, c + time.thread_time_ns() - c0
            results.append({"device": i, "query": name, "rc": rc, "iters": iters,
                            "wall_ns": w // iters, "cpu_ns": c // iters})
        # The PCIe throughput call: a few only (it blocks ~20 ms).
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        rc = 0
        for _ in range(5):
            rc = nvml.nvmlDeviceGetPcieThroughput(dev, 0, C.byref(val))
        results.append({"device": i, "query": "nvmlDeviceGetPcieThroughput(tx)", "rc": rc, "iters": 5,
                        "wall_ns": (time.perf_counter_ns() - w0) // 5,
                        "cpu_ns": (time.thread_time_ns() - c0) // 5})
    nvml.nvmlShutdown()
    print("| GPU | NVML query | rc | wall µs | CPU µs |")
    print("|---|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['device']} | `{r['query']}` | {r['rc']} | {r['wall_ns'] / 1e3:.1f} | {r['cpu_ns'] / 1e3:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
