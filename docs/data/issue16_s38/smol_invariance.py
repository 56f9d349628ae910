"""SmolLM2-135M, N prompts (argv, default 6) decoded greedily in one batch, twice: through DecodeLayers' C
rows (up to 8 sequences a step on AVX-512 since session 38), and with each decode step's
rows run one by one through the one-row C call (tests/engine/test_kernels.py's
decode_row_by_row; run from the repository root). Token ids and logits must be equal bit for bit (the rows path is
batch-invariant); it prints the most rows the first run stepped at once, which should
be N. Session 39 ran N = 4 on an AVX2 build, whose bound is 4 rows."""
import random, sys, torch
from pymooncake.engine.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.model import fused as fused_step
from pymooncake.engine.sampling import SamplingParams
sys.path.insert(0, ".")  # the repository root: tests/ is a package
from tests.engine.test_kernels import decode_row_by_row as row_by_row

def eng():
    return Engine.from_model_name("smollm2", EngineConfig(num_kv_blocks=1024, max_model_len=4096,
                                                          num_threads=1))
batched = fused_step._forward_decode
seen = []
def spy(model, dl, x, *rest):
    seen.append(x.shape[0])
    return batched(model, dl, x, *rest)
rnd = random.Random(3)
prompts = [[rnd.randrange(300, 20000) for _ in range(rnd.randrange(20, 120))]
           for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6)]
p = SamplingParams(max_tokens=8, ignore_eos=True, return_logits=True)
fused_step._forward_decode = spy
e = eng(); a = e.generate(prompts, p)
print("max_rows", e.model.__dict__["_decode_layers"].max_rows, "rows a decode step", max(seen))
fused_step._forward_decode = row_by_row
b = eng().generate(prompts, p)
print("token ids equal:", all(x.output_token_ids == y.output_token_ids for x, y in zip(a, b)),
      "logits equal:", all(torch.equal(torch.stack(list(x.logits)), torch.stack(list(y.logits)))
                           for x, y in zip(a, b)))
