import sys, time, random
import torch
from pymooncake.engine.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
e = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=4096, max_model_len=8192, num_threads=1))
rnd = random.Random(0)
for B in [int(x) for x in (sys.argv[1].split(",") if len(sys.argv) > 1 else "1,2,4,8".split(","))]:
    for _ in range(B):
        e.add_request([rnd.randrange(3, 250) for _ in range(448)], SamplingParams(max_tokens=2000, ignore_eos=True))
    # prefill steps
    while any(len(r.output_token_ids) == 0 for r in e.requests.values()):
        e.step()
    ts = []
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 40):
        c0 = time.thread_time_ns(); e.step(); ts.append(time.thread_time_ns() - c0)
    ts.sort()
    print(B, "rows: step cpu ms", round(ts[20] / 1e6, 3), flush=True)
    while e.has_unfinished(): e.step()
