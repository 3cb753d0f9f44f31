"""A PyTorch job with a hostile process name, for a capture of what the observer shows on a
terminal (docs/SECURITY.md): it renames itself (comm) with terminal control sequences, prints
"ready", waits for a line on stdin, runs 50 small matmuls with a copy back, and exits."""
import ctypes
import sys

import torch

ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b"\x1b]0;pwn\x07\x1b[2J"), 0, 0, 0)
x = torch.ones(256, 256, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
for _ in range(50):
    x = (x @ x).clamp_(max=1.0)
print(float(x.sum().item()), flush=True)
