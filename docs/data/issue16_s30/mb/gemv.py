import time, torch
from pymooncake.engine import kernels
lib = kernels._need()
for (n, k) in ((384, 256), (1376, 256), (256, 688)):
    w = torch.randn(n, k); out = {}
    for m in (1, 2, 3, 4):
        x = torch.randn(m, k); y = torch.empty(m, n)
        for _ in range(200): lib.pmk_gemv_rows_f32(w.data_ptr(), x.data_ptr(), m, n, k, None, None, y.data_ptr())
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(500): lib.pmk_gemv_rows_f32(w.data_ptr(), x.data_ptr(), m, n, k, None, None, y.data_ptr())
            ts.append((time.perf_counter() - t) / 500 * 1e6)
        out[m] = sorted(ts)[3]
    print(f"W[{n},{k}]", " ".join(f"m={m}: {v:.1f}us" for m, v in out.items()))
