import time, torch, statistics
from pymooncake.engine.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.model import fused
e = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=2048, max_model_len=8192, num_threads=1))
m = e.model
dl = fused._decode_layers(m, e.kv.layer_caches)
pos = torch.tensor([300]); tables = torch.zeros(1, 32, dtype=torch.int64)
cos_t, sin_t = fused.rope_tables(m, pos, torch.float32)
def old_rope():
    m._cos_sin(pos, torch.float32); c, s = m._rope_table
    return c.view(c.shape[0], -1), s.view(s.shape[0], -1)
def new_rope(): return fused.rope_tables(m, pos, torch.float32)
def old_set():
    positions, slots, ctx = [300], [4000], [301]
    base, stride = tables.data_ptr(), tables.stride(0) * 8
    c, s = cos_t.data_ptr(), sin_t.data_ptr()
    max(positions); tables.shape[1] * int(dl.plan[0, 14]) < max(ctx)
    dl.step[:1] = torch.tensor([[positions[r], slots[r], base + r * stride, ctx[r], c, s] for r in range(1)], dtype=torch.int64)
def new_set(): dl.set_step([300], [4000], tables, [301], cos_t, sin_t)
for name, a, b in (("rope", old_rope, new_rope), ("set_step", old_set, new_set)):
    ra, rb = [], []
    for rep in range(20):
        for f, acc in ((a, ra), (b, rb)):
            c0 = time.thread_time_ns()
            for _ in range(2000): f()
            acc.append((time.thread_time_ns() - c0) / 2000 / 1e3)
    print(name, "old %.2f us, new %.2f us (medians of 20 x 2000)" % (statistics.median(ra), statistics.median(rb)))
