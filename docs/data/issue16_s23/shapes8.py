import torch, time, resource, random, sys
torch.set_num_threads(1)
shapes = {"tiny": ((384, 256), (256, 256), (1376, 256), (256, 688)), "smollm2": ((960, 576), (576, 576), (3072, 576), (576, 1536))}[sys.argv[1]]
Wd = [torch.randn(n, k) for n, k in shapes]
Wp = [torch.ops.mkldnn._reorder_linear_weight(w) for w in Wd]
x = {k: torch.randn(2100, k) for k in {s[1] for s in shapes}}
stage = {k: torch.zeros(8192, k) for k in x}
def bucket(m):
    if m <= 64: return m
    g = 1 << max(3, (m - 1).bit_length() - 4)
    return -(-m // g) * g
def packed(m):
    for w in Wp: torch.ops.mkldnn._linear_pointwise(x[w.shape[1]][:m], w, None, "none", [], "")
def bucketed(m):
    mb = bucket(m)
    for w in Wp:
        xi = x[w.shape[1]][:m]; s = stage[w.shape[1]]
        s[:m].copy_(xi)
        torch.ops.mkldnn._linear_pointwise(s[:mb], w, None, "none", [], "")[:m]
def bucketed_nocopy(m):
    mb = bucket(m)
    for w in Wp:
        torch.ops.mkldnn._linear_pointwise(stage[w.shape[1]][:mb], w, None, "none", [], "")[:m]
def packed_b(m):
    packed(bucket(m))
def flin(m):
    for w in Wd: torch.nn.functional.linear(x[w.shape[1]][:m], w)
random.seed(int(sys.argv[2]) if len(sys.argv) > 2 else 0); ms = [random.randrange(200, 2048) for _ in range(300)]
for name, fn, seq in (("packed same", packed, [1124] * 300), ("F.linear", flin, ms), ("bucketed", bucketed, ms), ("packed", packed, ms), ("bucketed", bucketed, ms), ("b-nocopy", bucketed_nocopy, ms), ("packed at bucket M", packed_b, ms), ("packed at bucket M", packed_b, ms), ("packed same", packed, [1124] * 300)):
    fn(7)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t = time.thread_time()
    for m in seq: fn(m)
    t1 = time.thread_time() - t; f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print(f"{name:12}: {t1:.3f} s, faults {f1 - f0}")
print(len({bucket(m) for m in ms}), "buckets")
