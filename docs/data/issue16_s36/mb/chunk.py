import sys, time, random, resource
import torch
from pymooncake.engine.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
def cpu(): r=resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime+r.ru_stime
L=int(sys.argv[1]); reps=int(sys.argv[2]) if len(sys.argv)>2 else 5
res={}
for chunk in (512, 1024, 2048):
    cfg=EngineConfig(num_kv_blocks=4096, max_num_batched_tokens=max(2048,chunk), prefill_chunk_tokens=chunk, max_model_len=8192, enable_prefix_caching=False, num_threads=1)
    e=Engine.from_model_name("tiny", cfg)
    rnd=random.Random(0)
    ts=[]
    for r in range(reps+1):
        p=[rnd.randrange(3,250) for _ in range(L)]
        c0=cpu()
        e.generate([p], SamplingParams(max_tokens=1))
        if r: ts.append(cpu()-c0)
    ts.sort(); res[chunk]=ts[len(ts)//2]
    print(chunk, f"{ts[len(ts)//2]*1e3:.1f} ms cpu, {ts[len(ts)//2]/L*1e3:.3f} ms/token", [round(t*1e3,1) for t in ts], flush=True)
