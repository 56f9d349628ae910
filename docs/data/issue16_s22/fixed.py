import random, sys, time
import torch
from pymooncake.engine import Engine, EngineConfig
from pymooncake.engine.sampling import SamplingParams
torch.set_num_threads(1)
eng = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=4096, max_model_len=8192, enable_prefix_caching=False))
random.seed(0)
def run(L, n):
    t0 = time.thread_time()
    for _ in range(n):
        eng.add_request([random.randrange(3, 250) for _ in range(L)], SamplingParams(max_tokens=1, temperature=0.0))
        while eng.has_unfinished(): eng.step()
    return (time.thread_time() - t0) / n * 1e3
for L in (16, 64, 256, 512):
    run(L, 5)
    print(L, "same M: %.2f ms/prompt" % run(L, 50))
# new M every time
Ls = list(range(100, 300, 2)); random.shuffle(Ls)
t0 = time.thread_time()
for L in Ls:
    eng.add_request([random.randrange(3, 250) for _ in range(L)], SamplingParams(max_tokens=1, temperature=0.0))
    while eng.has_unfinished(): eng.step()
a = (time.thread_time() - t0) / len(Ls) * 1e3
t0 = time.thread_time()
for L in Ls:
    eng.add_request([random.randrange(3, 250) for _ in range(L)], SamplingParams(max_tokens=1, temperature=0.0))
    while eng.has_unfinished(): eng.step()
b = (time.thread_time() - t0) / len(Ls) * 1e3
print("100-300 tokens: new M %.2f ms/prompt, seen M %.2f" % (a, b))
