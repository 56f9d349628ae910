"""GEMV prefetch A/B: pmk_gemv_f32 per variant (build flags), rounds interleaved in a shuffled
order, median us a call. Sets: the tiny model's 4 layers in order (11 MB, cache-resident
in process), the same cycling over 8 model copies (88 MB, from DRAM), and SmolLM2-135M's
layer shapes over 8 layers (from DRAM)."""
import ctypes, importlib, random, statistics, sys, time, torch
build = importlib.import_module("pymooncake.engine.kernels.build")
cc = build.compiler()
V, I = ctypes.c_void_p, ctypes.c_int64
variants = {"nopf": ("-DPMK_GEMV_NO_PREFETCH",)}
for lead in (4096, 8192, 16384, 32768):
    variants[f"T0-{lead}"] = (f"-DPMK_GEMV_PF_LEAD={lead}",)
for lead in (16384, 32768):
    variants[f"T1-{lead}"] = (f"-DPMK_GEMV_PF_LEAD={lead}", "-DPMK_GEMV_PF_HINT=_MM_HINT_T1")
if "avx2" in sys.argv:
    variants = {k + "/avx2": v + ("-mno-avx512f",) for k, v in variants.items() if k in ("nopf", "T0-16384", "T1-16384", "T0-8192")}
    sys.argv.remove("avx2")
libs = {}
for n, ex in variants.items():
    lib = ctypes.CDLL(str(build.build(cc, build.OPENMP_FLAGS + ex)))
    lib.pmk_gemv_f32.argtypes = (V, V, I, I, V, V, V); lib.pmk_gemv_f32.restype = None
    libs[n] = lib
tiny = [(384, 256), (256, 256), (1376, 256), (256, 688)]
smol = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
def layers(shapes, copies):
    return [(torch.randn(n, k), torch.randn(k), torch.empty(n)) for _ in range(copies) for n, k in shapes]
sets = {"tiny-hot": layers(tiny, 4 // 4), "tiny-cold(8 copies)": layers(tiny, 8), "smollm2(8 layers)": layers(smol, 8)}
sets["tiny-hot"] = layers(tiny, 1)
res = {(s, v): [] for s in sets for v in libs}
rnd = random.Random(0)
t_end = time.time() + float(sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "avx2" else 120)
while time.time() < t_end:
    order = [(s, v) for s in sets for v in libs]; rnd.shuffle(order)
    for s, v in order:
        f = libs[v].pmk_gemv_f32; mats = sets[s]
        reps = 40 if s == "tiny-hot" else 2
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            for w, x, y in mats:
                f(w.data_ptr(), x.data_ptr(), w.shape[0], w.shape[1], None, None, y.data_ptr())
        res[(s, v)].append((time.perf_counter_ns() - t0) / reps / 1e3)
for s in sets:
    base = statistics.median(res[(s, list(libs)[0])])
    print(f"{s:22s} rounds {len(res[(s, list(libs)[0])])}: " + "  ".join(
        f"{v} {statistics.median(res[(s, v)]):.0f}us ({statistics.median(res[(s, v)]) / base:.2f})" for v in libs))
