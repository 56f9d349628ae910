"""In-process decode CPU per step on MODEL, ROWS sequences, with or without the GEMV prefetch
(argv: model rows nopf)."""
import sys, time, random, importlib
model, rows, nopf = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
build = importlib.import_module("pymooncake.engine.kernels.build")
if nopf:
    build.CFLAGS = build.CFLAGS + ("-DPMK_GEMV_NO_PREFETCH",)
from pymooncake.engine.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
e = Engine.from_model_name(model, EngineConfig(num_kv_blocks=1024, max_model_len=4096, num_threads=1))
rnd = random.Random(1)
def rnd_prompt(): return [rnd.randrange(300, 20000 if model != "tiny" else 250) for _ in range(200)]
res = []
for rep in range(3):
    for _ in range(rows):
        e.add_request(rnd_prompt(), SamplingParams(max_tokens=17, ignore_eos=True))
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in e.scheduler.running + list(e.scheduler.waiting)) if hasattr(e, "scheduler") else False:
        e.step()
    e.step(); e.step()
    n = 0; c0 = time.thread_time_ns()
    while e.has_unfinished(): e.step(); n += 1
    res.append((time.thread_time_ns() - c0) / n / 1e6)
print(model, rows, "nopf" if nopf else "pf", "ms a decode step", [round(x, 2) for x in res])
