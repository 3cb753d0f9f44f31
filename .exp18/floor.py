# Trap floor: kernel uprobes (tracefs, no BPF) on the observer's probe set in libcuda.
# usage: floor.py on LIBCUDA PROBES_FILE | floor.py off
import re, subprocess, sys
T = "/sys/kernel/tracing"
def w(path, s, mode="a"):
    with open(f"{T}/{path}", mode) as f:
        f.write(s)
if sys.argv[1] == "off":
    try: w("events/gpuobs/enable", "0", "w")
    except OSError: pass
    lines = [l for l in open(f"{T}/uprobe_events").read().splitlines() if "gpuobs/" in l]
    for l in lines:
        name = l.split()[0].split(":", 1)[1]
        w("uprobe_events", f"-:{name}\n")
    sys.exit(0)
lib, probes = sys.argv[2], sys.argv[3]
segs = []
for l in subprocess.run(["readelf", "-lW", lib], capture_output=True, text=True).stdout.splitlines():
    p = l.split()
    if p and p[0] == "LOAD":
        segs.append((int(p[1], 16), int(p[2], 16), int(p[4], 16)))
syms = {}
for l in subprocess.run(["readelf", "-sW", "--dyn-syms", lib], capture_output=True, text=True).stdout.splitlines():
    p = l.split()
    if len(p) >= 8 and p[3] == "FUNC" and p[6] != "UND":
        syms[p[7].split("@")[0]] = int(p[1], 16)
n = 0
for l in open(probes):
    name, kind = l.split()
    if name not in syms: continue
    v = syms[name]
    off = next((v - va + fo for fo, va, sz in segs if va <= v < va + sz), None)
    if off is None: continue
    tag = ("r" if kind == "return" else "p")
    w("uprobe_events", f"{tag}:gpuobs/{tag}{n} {lib}:0x{off:x}\n")
    n += 1
w("events/gpuobs/enable", "1", "w")
print(n)
