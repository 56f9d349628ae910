# decode step CPU at B rows: the C rows kernel (DecodeLayers, default) vs the batched oneDNN
# path (max_rows forced to 1), alternated in one process per B, 600-token contexts
import sys, time, random
from pymooncake.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
e = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=2048, max_model_len=8192, role="decode"))
rng = random.Random(0)
def go(B, n=120, L=600):
    for i in range(B):
        e.add_request([rng.randrange(1, 250) for _ in range(L)], SamplingParams(max_tokens=n),
                      f"r{time.time()}-{i}")
    e.step()
    ts = []
    while e.requests:
        t = time.thread_time(); e.step(); ts.append(time.thread_time() - t)
    ts.sort(); return ts[len(ts) // 2] * 1e3
model = e.runner.model
go(2)
dl = None
for obj in (model, getattr(model, "model", None)):
    if obj is not None and obj.__dict__.get("_decode_layers") is not None:
        dl = obj.__dict__["_decode_layers"]
print("DecodeLayers found:", dl is not None, "max_rows", getattr(dl, "max_rows", None))
default = dl.max_rows
for B in (2, 3, 4, 8):
    c, o = [], []
    for r in range(3):
        dl.max_rows = default; c.append(go(B))
        dl.max_rows = 1; o.append(go(B))
    dl.max_rows = default
    print(f"B={B}: C rows {sorted(c)[1]:.3f} ms, oneDNN {sorted(o)[1]:.3f} ms (median of 3 runs of step medians)", flush=True)
