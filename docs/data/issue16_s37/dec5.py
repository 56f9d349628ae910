import sys, time, random, torch
from pymooncake.engine.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
from pymooncake.engine.kernels.decode_layers import DecodeLayers
st = {"dl": 0, "n": 0}
orig = DecodeLayers.run
def run(self, *a):
    c0 = time.thread_time_ns(); r = orig(self, *a); st["dl"] += time.thread_time_ns() - c0; st["n"] += 1; return r
DecodeLayers.run = run
e = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=2048, max_model_len=8192, num_threads=int(sys.argv[1])))
rnd = random.Random(1)
steps = 0; c0 = time.thread_time_ns()
for r in range(40):
    e.add_request([rnd.randrange(3, 250) for _ in range(448)], SamplingParams(max_tokens=12, ignore_eos=True))
    while e.has_unfinished(): e.step(); steps += 1
    if r == 9: st["dl"] = 0; st["n"] = 0; c0 = time.thread_time_ns(); steps = 0
print("per request: DL ms", round(st["dl"] / 30 / 1e6, 2), "layer calls", st["n"] / 30, "total step cpu ms", round((time.thread_time_ns() - c0) / 30 / 1e6, 2))
