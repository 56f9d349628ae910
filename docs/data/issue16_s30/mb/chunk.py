# CPU of computing prompts of L tokens in one step vs chunks of C tokens (tiny model, engine thread)
import sys, time, random
import torch
from pymooncake.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
def run(L, chunk, reps=6):
    cfg = EngineConfig(num_kv_blocks=2048, max_num_batched_tokens=2048, prefill_chunk_tokens=chunk,
                       max_model_len=8192, enable_prefix_caching=False, max_num_seqs=1, role="prefill")
    e = Engine.from_model_name("tiny", cfg)
    rng = random.Random(0)
    ts = []
    for r in range(reps + 1):
        p = [rng.randrange(1, 250) for _ in range(L)]
        e.add_request(p, SamplingParams(max_tokens=1), f"r{r}")
        t = time.thread_time()
        n = 0
        while e.has_unfinished_requests() if hasattr(e, "has_unfinished_requests") else e.requests:
            e.step(); n += 1
        if r: ts.append(time.thread_time() - t)
    ts.sort()
    return ts[len(ts)//2], n
torch.set_num_threads(1)
for L in [int(x) for x in sys.argv[1].split(",")]:
    out = []
    for c in (2048, 1024, 512, 256):
        if c > L * 2 and c != 2048: continue
        s, n = run(L, c)
        out.append(f"chunk {c}: {s*1e3:.1f} ms ({n} steps, {s/L*1e3:.3f} ms/tok)")
    print(L, " | ".join(out), flush=True)
