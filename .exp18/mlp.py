# Launch-bound training step: 8 x Linear(256), batch 32, SGD. Prints one JSON line.
import json, os, sys, time
import torch
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
torch.manual_seed(0)
layers = []
for _ in range(8):
    layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
m = torch.nn.Sequential(*layers).cuda()
opt = torch.optim.SGD(m.parameters(), lr=1e-3)
x = torch.randn(32, 256, device="cuda")
y = torch.randn(32, 256, device="cuda")
def step():
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    return loss
for _ in range(300):
    step()
torch.cuda.synchronize()
def cpu():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])
def sched():
    out = {}
    try:
        for l in open("/proc/self/sched"):
            if ":" in l:
                k, v = l.split(":", 1)
                k = k.strip()
                if k in ("se.nr_migrations", "nr_switches", "nr_voluntary_switches", "nr_involuntary_switches"):
                    out[k] = float(v)
    except OSError:
        pass
    return out
s0 = sched()
cpus = []
chunks = []
t0 = time.perf_counter()
for c in range(steps // 100):
    a = time.perf_counter()
    for _ in range(100):
        loss = step()
    torch.cuda.synchronize()
    chunks.append((time.perf_counter() - a) / 100 * 1e6)
    cpus.append(cpu())
us = (time.perf_counter() - t0) / (steps // 100 * 100) * 1e6
s1 = sched()
chunks_sorted = sorted(chunks)
print(json.dumps({"us_per_step": round(us, 1), "chunk_min": round(chunks_sorted[0], 1),
                  "chunk_med": round(chunks_sorted[len(chunks) // 2], 1), "chunk_max": round(chunks_sorted[-1], 1),
                  "cpus": sorted(set(cpus)), "sched": {k: s1.get(k, 0) - s0.get(k, 0) for k in s1},
                  "loss": float(loss)}))
