import os, random, torch
from pymooncake.engine import Engine, EngineConfig
from pymooncake.engine.sampling import SamplingParams
from pymooncake.engine.model import layers
torch.set_num_threads(1)
calls = []
orig = layers._padded_rows
def spy(x, rows):
    calls.append((x.shape[0], rows)); return orig(x, rows)
layers._padded_rows = spy
random.seed(1)
prompts = {300: [256] + [random.randrange(256) for _ in range(299)],
           1100: [256] + [random.randrange(256) for _ in range(1099)],
           77: [256] + [random.randrange(256) for _ in range(76)]}
res = {}
for flag in ("0", "1"):
    os.environ["PYMOONCAKE_ONEDNN_ROW_BUCKETS"] = flag
    eng = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=512, max_model_len=4096,
                                 max_num_batched_tokens=2048, prefill_chunk_tokens=2048,
                                 enable_prefix_caching=False))
    print("fused", eng.model.use_fused_path)
    n0 = len(calls)
    for L, p in prompts.items():
        (out,) = eng.generate([p], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, return_logits=True))
        res[(flag, L)] = (list(out.output_token_ids), torch.stack(list(out.logits)))
    # batched: 3 prompts together (row count 1477)
    outs = eng.generate(list(prompts.values()), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_logits=True))
    res[(flag, "batch")] = ([list(o.output_token_ids) for o in outs], torch.cat([torch.stack(list(o.logits)) for o in outs]))
    print("flag", flag, "padded calls", len(calls) - n0, sorted(set(calls[n0:]))[:12])
for k in list(prompts) + ["batch"]:
    t0, l0 = res[("0", k)]; t1, l1 = res[("1", k)]
    print(k, "tokens equal", t0 == t1, "max|dlogit|", (l0 - l1).abs().max().item(), "max|logit|", l0.abs().max().item(), "bitwise", torch.equal(l0, l1))
