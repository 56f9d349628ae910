"""Prefill CPU for the same prompts: steps of up to BUDGET tokens (several prompts at once).
Usage: prefill_steps.py BUDGET PER [CHUNK]"""
import random, sys, time
import torch
from pymooncake.engine import Engine, EngineConfig
from pymooncake.engine.sampling import SamplingParams
budget = int(sys.argv[1]); per = int(sys.argv[2])
# optional CHUNK (session 22): prefill_chunk_tokens, default the engine's 512
chunk = {"prefill_chunk_tokens": int(sys.argv[3])} if len(sys.argv) > 3 else {}
torch.set_num_threads(1)
eng = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=4096, max_model_len=8192,
                             max_num_batched_tokens=budget, enable_prefix_caching=False,
                             **chunk))
random.seed(0)
prompts = [[random.randrange(3, 250) for _ in range(random.randrange(200, 700))] for _ in range(120)]
def run(ps):
    for i in range(0, len(ps), per):
        for p in ps[i:i + per]:
            eng.add_request(p, SamplingParams(max_tokens=1, temperature=0.0))
        while eng.has_unfinished():
            eng.step()
run(prompts[:20])  # warm: oneDNN shapes
t0 = time.thread_time(); run(prompts[20:]); t1 = time.thread_time()
print(f"budget {budget} per {per}: {t1 - t0:.3f} CPU-s for {sum(map(len, prompts[20:]))} tokens")
