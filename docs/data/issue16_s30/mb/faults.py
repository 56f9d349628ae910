# minor faults + CPU of a prefill engine over a sequence of prompts of random lengths (like the replay)
import sys, time, random, resource, os
import torch
from pymooncake.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
from pymooncake.engine.malloc_tuning import tune_malloc
tune_malloc()
chunk = int(sys.argv[1]); maxlen = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
cfg = EngineConfig(num_kv_blocks=2048, max_num_batched_tokens=2048, prefill_chunk_tokens=chunk,
                   max_model_len=8192, enable_prefix_caching=False, max_num_seqs=1, role="prefill")
e = Engine.from_model_name("tiny", cfg)
rng = random.Random(1)
def flt():
    return int(open(f"/proc/thread-self/stat").read().rsplit(")",1)[1].split()[7])
for rnd in range(3):
    f0, t0 = flt(), time.thread_time(); tok = 0
    for i in range(60):
        L = int(min(maxlen, max(20, rng.lognormvariate(5.5, 1.0))))
        tok += L
        e.add_request([rng.randrange(1, 250) for _ in range(L)], SamplingParams(max_tokens=1), f"r{rnd}-{i}")
        while e.requests:
            e.step()
    print(f"chunk {chunk} round {rnd}: {tok} tokens, {time.thread_time()-t0:.2f} s, {flt()-f0} faults", flush=True)
