"""smol3 with torch threads: argv rows rounds threads; max_rows 2 vs 8 alternated; wall and CPU."""
import sys, time, random, statistics, torch
rows, rounds, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
from pymooncake.engine.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
e = Engine.from_model_name("smollm2", EngineConfig(num_kv_blocks=2048, max_model_len=4096, num_threads=threads))
model = e.runner.model
rnd = random.Random(1)
res = {2: [], 8: []}
for rep in range(rounds):
    for mr in (2, 8) if rep % 2 == 0 else (8, 2):
        for _ in range(rows):
            e.add_request([rnd.randrange(300, 20000) for _ in range(200)], SamplingParams(max_tokens=12, ignore_eos=True))
        e.step(); e.step()
        model.__dict__["_decode_layers"].max_rows = mr
        n = 0; t0 = time.perf_counter_ns()
        while e.has_unfinished(): e.step(); n += 1
        res[mr].append((time.perf_counter_ns() - t0) / n / 1e6)
print(f"smollm2 rows {rows} threads {threads} wall ms a step, median: max_rows 2 {statistics.median(res[2]):.1f}  max_rows 8 {statistics.median(res[8]):.1f}")
