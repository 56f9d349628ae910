import ctypes, importlib, torch
build = importlib.import_module("pymooncake.engine.kernels.build")
cc = build.compiler()
V, I = ctypes.c_void_p, ctypes.c_int64
outs = {}
for name, ex in (("avx512", ()), ("avx2", ("-mno-avx512f",)), ("avx2-nopf", ("-mno-avx512f", "-DPMK_GEMV_NO_PREFETCH")), ("avx512-nopf", ("-DPMK_GEMV_NO_PREFETCH",))):
    lib = ctypes.CDLL(str(build.build(cc, build.OPENMP_FLAGS + ex)))
    lib.pmk_gemv_f32.argtypes = (V, V, I, I, V, V, V); lib.pmk_gemv_f32.restype = None
    g = torch.Generator().manual_seed(0)
    worst = 0.0; res = []
    for n_out, k in ((1, 1), (7, 13), (8, 256), (13, 688), (1376, 256), (259, 256), (33, 1000)):
        w = torch.randn(n_out, k, generator=g); x = torch.randn(k, generator=g); b = torch.randn(n_out, generator=g); rr = torch.randn(n_out, generator=g)
        y = torch.empty(n_out)
        lib.pmk_gemv_f32(w.data_ptr(), x.data_ptr(), n_out, k, b.data_ptr(), rr.data_ptr(), y.data_ptr())
        ref = (w.double() @ x.double() + b.double() + rr.double())
        worst = max(worst, ((y.double() - ref).abs() / (ref.abs() + 1)).max().item()); res.append(y.clone())
    outs[name] = res
    print(name, "worst rel err", worst)
for a, b in (("avx2", "avx2-nopf"), ("avx512", "avx512-nopf")):
    print(a, "==", b, all(torch.equal(p, q) for p, q in zip(outs[a], outs[b])))
