import time, sys, torch
torch.set_num_threads(1)
kind = sys.argv[1]
a = torch.randn(256, 256); b = torch.randn(256, 256)
c0 = time.thread_time(); t0 = time.time(); n = 0
while time.time() - t0 < 4:
    if kind == "py":
        s = 0
        for i in range(10000): s += i
    else:
        torch.mm(a, b)
    n += 1
print(kind, "ops per cpu-s", round(n / (time.thread_time() - c0)))
