import numpy as np, time, statistics
N = 4 << 20; B = 8
src = np.ones(N*B, np.uint8); mid = np.zeros_like(src); dst = np.zeros_like(src)
src2 = np.ones(N*B, np.uint8); mid2 = np.zeros_like(src); dst2 = np.zeros_like(src)
def rnd(s, m, d):
    t = time.perf_counter()
    for i in range(B): np.copyto(m[i*N:(i+1)*N], s[i*N:(i+1)*N])
    for i in range(B): np.copyto(d[i*N:(i+1)*N], m[i*N:(i+1)*N])
    return time.perf_counter() - t
A = lambda: rnd(src, mid, dst); Bf = lambda: rnd(src2, mid2, dst2)
def block(f, tmin):
    ts = []; end = time.perf_counter() + tmin
    while len(ts) < 5 or time.perf_counter() < end: ts.append(f())
    return statistics.median(ts)
def q(v):
    v = sorted(v); n = len(v); return round(v[n//4], 3), round(statistics.median(v), 3), round(v[(3*n)//4], 3), round(v[0],3), round(v[-1],3)
seq = []; alt = []
for r in range(9):
    a = block(A, 0.25); b = block(Bf, 0.25); seq.append(b / a)
    ta, tb = [], []
    end = time.perf_counter() + 0.5
    while len(ta) < 5 or time.perf_counter() < end:
        ta.append(A()); tb.append(Bf())
    alt.append(statistics.median(tb) / statistics.median(ta))
print("sequential blocks ratio q1/med/q3/min/max", q(seq))
print("alternating rounds ratio q1/med/q3/min/max", q(alt))
