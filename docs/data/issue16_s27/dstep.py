import time, sys, torch
from pymooncake.engine.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
cfg = EngineConfig(num_kv_blocks=2048, max_model_len=8192, num_threads=int(sys.argv[2]) if len(sys.argv)>2 else 0)
e = Engine.from_model_name("tiny", cfg)
B = int(sys.argv[1])
import random
for i in range(B):
    e.add_request([random.randrange(1, 250) for _ in range(int(sys.argv[4]) if len(sys.argv)>4 else 300)], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
e.step()  # prefill
while any(r.num_computed_tokens < 0 for r in e.requests.values()) if hasattr(list(e.requests.values())[0], "num_computed_tokens") else False:
    e.step()
for _ in range(20): e.step()
t0=time.perf_counter(); c0=time.process_time(); n=200
for _ in range(n): e.step()
print(f"B={B} threads={torch.get_num_threads()} step wall {1e3*(time.perf_counter()-t0)/n:.3f} ms cpu {1e3*(time.process_time()-c0)/n:.3f} ms")
if len(sys.argv) > 3:
    import cProfile, pstats
    cProfile.run("for _ in range(100): e.step()", "/tmp/s27/dstep.prof")
    pstats.Stats("/tmp/s27/dstep.prof").sort_stats("tottime").print_stats(25)
