import torch, time, resource, random
torch.set_num_threads(1)
shapes = ((384, 256), (256, 256), (1376, 256), (256, 688))
Wp = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k)) for n, k in shapes]
x = {k: torch.randn(2100, k) for k in (256, 688)}
random.seed(0); ms = [random.randrange(200, 2048) for _ in range(150)]
def run(seq):
    for m in seq:
        for w in Wp: torch.ops.mkldnn._linear_pointwise(x[w.shape[1]][:m], w, None, "none", [], "")
run(ms)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t = time.thread_time()
run(ms)
print(f"{time.thread_time()-t:.3f} s faults {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}")
