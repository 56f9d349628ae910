"""Per-step CPU of decode-only steps at batch B (tiny model, in-process engine)."""
import sys, time
import torch
from pymooncake.engine import Engine, EngineConfig
from pymooncake.engine.sampling import SamplingParams
B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
N = int(sys.argv[2]) if len(sys.argv) > 2 else 400
torch.set_num_threads(1)
eng = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=2048, max_model_len=8192))
import random
random.seed(0)
for b in range(B):
    eng.add_request([random.randrange(3, 250) for _ in range(450)], SamplingParams(max_tokens=N + 5, temperature=0.0, ignore_eos=True) if 'ignore_eos' in SamplingParams.__dataclass_fields__ else SamplingParams(max_tokens=N + 5, temperature=0.0))
eng.step()  # prefill
for _ in range(5): eng.step()
t0 = time.thread_time(); w0 = time.perf_counter()
for _ in range(N):
    eng.step()
t1 = time.thread_time(); w1 = time.perf_counter()
print(f"B={B} decode step: {1000*(t1-t0)/N:.3f} ms CPU, {1000*(w1-w0)/N:.3f} ms wall")
