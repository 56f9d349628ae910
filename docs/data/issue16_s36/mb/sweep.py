import sys, time
import torch
from pymooncake.engine import kernels
torch.set_num_threads(1); torch.manual_seed(0)
n = 448
cache = torch.randn(2, 2, 2048, 16, 32)
blocks = torch.arange(100, 128, dtype=torch.int64)
big = torch.randn(4 << 20)   # floats
big2 = torch.zeros(4 << 20)
base = (-big.data_ptr() % 4096) // 4
base2 = (-big2.data_ptr() % 4096) // 4
def tm(oq, oo):
    qs = big[base + oq // 4: base + oq // 4 + n * 384].view(n, 12, 32)[:, :8]
    out = big2[base2 + oo // 4: base2 + oo // 4 + n * 256].view(n, 8, 32)
    kernels.prefill_attention(qs, cache, blocks, n, 0.17, out)
    ts = []
    for _ in range(5):
        t0 = time.thread_time_ns(); kernels.prefill_attention(qs, cache, blocks, n, 0.17, out); ts.append(time.thread_time_ns() - t0)
    ts.sort(); return ts[2] / 1e6
res = {}
for oq in range(0, 4096, 256):
    row = []
    for oo in range(0, 4096, 512):
        row.append(tm(oq, oo))
    print(f"q {oq:4d}", " ".join(f"{x:5.2f}" for x in row), flush=True)
