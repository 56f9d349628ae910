import torch, time, resource, ctypes
torch.set_num_threads(1)
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI
def inuse(): m = libc.mallinfo2(); return (m.uordblks + m.hblkhd) >> 20
W = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k)) for n, k in ((384, 256), (256, 256), (1376, 256), (256, 688))]
x = {k: torch.randn(2100, k) for k in (256, 688)}
def lin(m):
    for w in W: torch.ops.mkldnn._linear_pointwise(x[w.shape[1]][:m], w, None, "none", [], "")
lin(7)
for label, rng in (("new M", range(1000, 1200)), ("seen M", range(1000, 1200)), ("same M", [1050] * 200)):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t = time.thread_time(); i0 = inuse()
    for m in rng: lin(m)
    print(f"{label}: {time.thread_time()-t:.3f} s, faults {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}, in-use {i0} -> {inuse()} MiB")
