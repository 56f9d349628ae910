"""Bitwise comparison of pmk_gemv_f32 / pmk_gemv_rows_f32 across builds of the kernels:
with and without the GEMV prefetch, AVX-512 and AVX2 (-mno-avx512f). Written by the
session-38 reviewer (it also compared the parent commit's build); builds its own here."""
import ctypes, importlib, itertools, sys
import numpy as np
build = importlib.import_module("pymooncake.engine.kernels.build")
FLAGS = {"avx512_pf": (), "avx512_nopf": ("-DPMK_GEMV_NO_PREFETCH",), "avx2_pf": ("-mno-avx512f",),
         "avx2_nopf": ("-mno-avx512f", "-DPMK_GEMV_NO_PREFETCH")}
V, I = ctypes.c_void_p, ctypes.c_int64
def load(name):
    lib = ctypes.CDLL(str(build.build(build.compiler(), build.OPENMP_FLAGS + FLAGS[name])))
    lib.pmk_gemv_f32.argtypes = (V, V, I, I, V, V, V); lib.pmk_gemv_f32.restype = None
    lib.pmk_gemv_rows_f32.argtypes = (V, V, I, I, I, V, V, V); lib.pmk_gemv_rows_f32.restype = None
    return lib
groups = {"avx512": ["avx512_pf", "avx512_nopf"], "avx2": ["avx2_pf", "avx2_nopf"]}
P = lambda a: a.ctypes.data
rng = np.random.default_rng(0)
n_outs = [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 15, 16, 17, 31, 33, 259, 1376]
ks = [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 100, 255, 256, 257, 688, 1000]
def arr(shape, off):
    # off floats into a bigger buffer: misaligned starts too
    n = int(np.prod(shape))
    buf = rng.standard_normal(n + off, dtype=np.float32)
    return buf[off:].reshape(shape)
tot = 0; bad = []; maxerr = {}
for g, names in groups.items():
    libs = {n: load(n) for n in names}
    for n_out, k in itertools.product(n_outs, ks):
        off = (n_out * 7 + k) % 3  # 0,1,2 floats misalignment
        w = arr((n_out, k), off)
        b = rng.standard_normal(n_out, dtype=np.float32)
        for m in range(1, 9):
            x = arr((m, k), (m + off) % 2); rr = rng.standard_normal((m, n_out), dtype=np.float32)
            for use_b, use_r in ((False, False), (True, True)):
                outs = {}
                for n, lib in libs.items():
                    yg = np.full((m, n_out), np.nan, np.float32); yr = np.full((m, n_out), np.nan, np.float32)
                    for r in range(m):
                        lib.pmk_gemv_f32(P(w), P(x[r]), n_out, k, P(b) if use_b else None,
                                         P(rr[r]) if use_r else None, P(yg[r]))
                    lib.pmk_gemv_rows_f32(P(w), P(x), m, n_out, k, P(b) if use_b else None,
                                          P(rr) if use_r else None, P(yr))
                    outs[n] = (yg, yr)
                ref = x.astype(np.float64) @ w.astype(np.float64).T + (b if use_b else 0) + (rr if use_r else 0)
                base = outs[names[0]]
                e = float(np.max(np.abs(base[0] - ref) / (np.abs(ref) + 1)))
                maxerr[g] = max(maxerr.get(g, 0.0), e)
                if not np.array_equal(base[0].view(np.uint32), base[1].view(np.uint32)):
                    bad.append((g, "rows!=gemv", n_out, k, m))
                for n in names[1:]:
                    tot += 1
                    for which in (0, 1):
                        if not np.array_equal(base[which].view(np.uint32), outs[n][which].view(np.uint32)):
                            bad.append((g, names[0], "vs", n, ("gemv", "rows")[which], n_out, k, m, use_b))
    print(g, "cases", len(n_outs) * len(ks) * 8 * 2, "variants", names, "max rel err vs f64", maxerr[g])
print("comparisons", tot, "mismatches", len(bad)); print(bad[:20])
