import time, torch, ctypes, statistics, sys
import importlib; build = importlib.import_module("pymooncake.engine.kernels.build")
cc = build.compiler()
variants = {"off": ("-DPMK_GEMV_NO_PREFETCH",), **{str(d): (f"-DPMK_GEMV_PF_LEAD={d}",) for d in (8192, 16384, 32768, 65536)}}
libs = {}
for n, ex in variants.items():
    path = build.build(cc, build.OPENMP_FLAGS + ex)
    libs[n] = ctypes.CDLL(str(path))
    V, I = ctypes.c_void_p, ctypes.c_int64
    libs[n].pmk_gemv_f32.argtypes = (V, V, I, I, V, V, V)
    libs[n].pmk_gemv_f32.restype = None
def mk(n_out, k, nmat):
    return [torch.randn(n_out, k) for _ in range(nmat)], torch.randn(k), torch.empty(n_out)
shapes = [(1376, 256, 64), (256, 688, 64), (3072, 576, 30), (576, 1536, 60), (49152, 576, 2)]
data = {s: mk(*s) for s in shapes}
res = {(s, n): [] for s in shapes for n in libs}
for rnd in range(5):
    for s in shapes:
        ws, x, y = data[s]
        for n, lib in libs.items():
            f = lib.pmk_gemv_f32
            t0 = time.perf_counter_ns()
            for r in range(64):
                f(ws[r % len(ws)].data_ptr(), x.data_ptr(), s[0], s[1], None, None, y.data_ptr())
            res[(s, n)].append((time.perf_counter_ns() - t0) / 64 / 1e3)
for s in shapes:
    mb = s[0] * s[1] * 4 / 1e6
    print(s, f"{mb:.2f} MB x {s[2]}", "  ".join(f"{n}: {statistics.median(res[(s, n)]):.1f}us" for n in libs))
