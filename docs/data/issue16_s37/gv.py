import time, torch
from pymooncake.engine import kernels as K
torch.set_num_threads(1)
# the tiny model's 4 layers: qkv 384x256, o 256x256, gu 1376x256, down 256x688
shapes = [(384,256),(256,256),(1376,256),(256,688)]*4
ws = [torch.randn(o,k) for o,k in shapes]
for m in [1,2,3,4,8]:
    xs = [torch.randn(m,k) for o,k in shapes]
    for rep in range(3):
        t0=time.thread_time_ns(); N=300
        for _ in range(N):
            for w,x in zip(ws,xs): K.gemv(x,w)
        dt=(time.thread_time_ns()-t0)/N/1e6
    print(m, "rows: all 16 gemv ms", round(dt,3), "per row", round(dt/m,3))
