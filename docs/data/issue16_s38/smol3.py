"""In-process A/B, SmolLM2 decode ms a step with ROWS sequences: DecodeLayers.max_rows 2
(more rows go to oneDNN's GEMM; the old bound for weights over 32 MB) against 8 (C rows),
alternated every round in one process.
argv: rows rounds [threads]. Without threads: one torch thread, CPU ms of this thread
(results.txt's first table). With threads: wall ms (oneDNN's GEMM runs on all of them)."""
import sys, time, random, statistics
rows, rounds = int(sys.argv[1]), int(sys.argv[2])
threads = int(sys.argv[3]) if len(sys.argv) > 3 else None
clock = time.thread_time_ns if threads is None else time.perf_counter_ns
from pymooncake.engine.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
e = Engine.from_model_name("smollm2", EngineConfig(num_kv_blocks=2048, max_model_len=4096,
                                                   num_threads=threads or 1))
model = e.runner.model
rnd = random.Random(1)
res = {2: [], 8: []}
for rep in range(rounds):
    for mr in (2, 8) if rep % 2 == 0 else (8, 2):
        for _ in range(rows):
            e.add_request([rnd.randrange(300, 20000) for _ in range(200)], SamplingParams(max_tokens=12, ignore_eos=True))
        e.step(); e.step()
        model.__dict__["_decode_layers"].max_rows = mr
        n = 0; c0 = clock()
        while e.has_unfinished(): e.step(); n += 1
        res[mr].append((clock() - c0) / n / 1e6)
if threads is None:
    for mr, v in res.items():
        print(f"smollm2 rows {rows} max_rows {mr}: median {statistics.median(v):.2f} ms a step, all {[round(x, 1) for x in v]}")
else:
    print(f"smollm2 rows {rows} threads {threads} wall ms a step, median: max_rows 2 {statistics.median(res[2]):.1f}  max_rows 8 {statistics.median(res[8]):.1f}")
