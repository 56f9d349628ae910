import sys, time, ctypes, random
import torch
from pymooncake.engine import kernels
libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; libc.malloc.argtypes=[ctypes.c_size_t]
junk = [int(x) for x in sys.argv[1].split(',')] if len(sys.argv) > 1 and sys.argv[1] else []
n = int(sys.argv[2]) if len(sys.argv) > 2 else 448
torch.manual_seed(0); torch.set_num_threads(1)
cache = torch.randn(2, 2, 2048, 16, 32)
qkv = torch.randn(n, 12, 32).contiguous()
q = qkv[:, :8] * float(sys.argv[3]) if len(sys.argv) > 3 else qkv[:, :8]
if len(sys.argv) > 4: torch.set_flush_denormal(True)
out = torch.empty(n, 8, 32)
blocks = torch.arange(100, 100 + (n + 15) // 16, dtype=torch.int64)
for j in junk: libc.malloc(j)
kernels.prefill_attention(q, cache, blocks, n, 0.17, out)
ts = []
for r in range(15):
    t0 = time.thread_time_ns()
    for _ in range(10): kernels.prefill_attention(q, cache, blocks, n, 0.17, out)
    ts.append((time.thread_time_ns() - t0) / 10)
ts.sort(); pairs = (n * (n + 1) // 2) * 8
print(f"junk {junk} {ts[7]/1e6:.3f} ms  {ts[7]/pairs:.3f} ns/pair-head")
