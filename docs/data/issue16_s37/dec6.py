import sys, time, random, statistics
from pymooncake.engine.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
e = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=2048, max_model_len=8192, num_threads=1))
rnd = random.Random(1)
res = {}
for B in (1, 2):
    ts = []
    for r in range(30):
        for _ in range(B):
            e.add_request([rnd.randrange(3, 250) for _ in range(200)], SamplingParams(max_tokens=24, ignore_eos=True))
        while any(len(q.output_token_ids) == 0 for q in e.requests.values()): e.step()
        while e.has_unfinished():
            c0 = time.thread_time_ns(); e.step(); ts.append(time.thread_time_ns() - c0)
    res[B] = statistics.median(ts) / 1e3
print(" ".join(f"B{b} {v:.1f}us" for b, v in res.items()))
