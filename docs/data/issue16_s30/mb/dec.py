import sys, time, random, cProfile, pstats
import torch
from pymooncake.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
cfg = EngineConfig(num_kv_blocks=2048, max_model_len=8192, role="decode")
e = Engine.from_model_name("tiny", cfg)
rng = random.Random(0)
B = int(sys.argv[1]); L = int(sys.argv[2])
def go(n, prof=None):
    for i in range(B):
        e.add_request([rng.randrange(1, 250) for _ in range(L)], SamplingParams(max_tokens=n, ignore_eos=True) if 'ignore_eos' in SamplingParams.__dataclass_fields__ else SamplingParams(max_tokens=n), f"r{time.time()}-{i}")
    e.step()  # prefill
    ts = []
    while e.requests:
        t = time.thread_time(); e.step(); ts.append(time.thread_time() - t)
    return ts
go(20)
ts = go(200)
ts.sort(); print(f"B={B} L={L}: median decode step {ts[len(ts)//2]*1e3:.3f} ms over {len(ts)}")
if len(sys.argv) > 3:
    pr = cProfile.Profile(); pr.enable(); go(200); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
