import sys, time, random
import torch
from pymooncake.engine import Engine, EngineConfig
from pymooncake.engine.sampling import SamplingParams
torch.set_num_threads(1)
budget = int(sys.argv[1]); n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
rng = random.Random(0)
lens = [max(16, int(rng.lognormvariate(5.8, 0.7))) for _ in range(n)]
def run():
    e = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=4096, max_model_len=8192, max_num_batched_tokens=budget, role="prefill", enable_prefix_caching=False))
    for i, L in enumerate(lens):
        e.add_request([256] + [rng.randrange(256) for _ in range(L)], SamplingParams(max_tokens=1))
    t0 = time.process_time(); steps = 0
    while e.has_unfinished():
        e.step(); steps += 1
    return time.process_time() - t0, steps
run()
res = [run() for _ in range(3)]
print(f"budget {budget}: tokens {sum(lens)} cpu {[round(r[0],3) for r in res]} steps {res[0][1]}")
