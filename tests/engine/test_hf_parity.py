"""Engine logits equal Hugging Face ``transformers`` logits (Llama, Qwen2, Qwen3; random
weights saved to a temporary directory, no download), and loader errors name the fault."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pymooncake.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from pymooncake.engine.model.loader import ModelLoadError, load_model  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _save(tmp_path, kind: str, dtype=torch.float32, shard: str | None = None,
          tie: bool = False):
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **COMMON, tie_word_embeddings=tie,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                          "rope_theta": 500000.0})
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, tie_word_embeddings=tie)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=tie)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(1)
    model = cls(cfg)
    with torch.no_grad():  # larger than HF's init so attention and logits are not flat
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model = model.to(dtype)
    d = tmp_path / kind
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(d, **kw)
    # the reference reads the saved files back in float32 (as the engine does)
    ref = cls.from_pretrained(d, dtype=torch.float32)
    return d, ref.eval()


def _engine_logits(d, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    eng = Engine.from_model_name(str(d), EngineConfig(block_size=4, num_kv_blocks=64))
    (out,) = eng.generate([prompt], SamplingParams(max_tokens=n, return_logits=True))
    return list(out.output_token_ids), torch.stack(list(out.logits))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_logits_equal_transformers(tmp_path, kind: str) -> None:
    d, hf = _save(tmp_path, kind)
    prompt = [int(x) for x in torch.randint(0, 97, (23,), generator=torch.Generator()
                                            .manual_seed(2))]
    tokens, logits = _engine_logits(d, prompt, 6)
    # teacher-force HF on the engine's tokens: logits at the last prompt position and at
    # each generated position (prefill + 5 decode steps through the paged cache)
    full = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        ref = hf(full).logits[0, len(prompt) - 1:]
    assert ref.shape == logits.shape
    assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4), (logits - ref).abs().max()
    assert tokens == ref.argmax(-1).tolist()


def test_sharded_bf16_checkpoint_tied_embeddings(tmp_path) -> None:
    d, hf = _save(tmp_path, "qwen2", dtype=torch.bfloat16, shard="20KB", tie=True)
    assert (d / "model.safetensors.index.json").is_file()
    prompt = list(range(5, 30))
    tokens, logits = _engine_logits(d, prompt, 3)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4), (logits - ref).abs().max()


def test_loader_errors_name_the_fault(tmp_path) -> None:
    d, _ = _save(tmp_path, "llama")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path / "nowhere")
    cfg = json.loads((d / "config.json").read_text())
    bad = tmp_path / "bad_arch"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(bad)
    shape = tmp_path / "bad_shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    (shape / "model.safetensors").symlink_to(d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj"):
        load_model(shape)
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    (missing / "model.safetensors").symlink_to(d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\..*missing"):
        load_model(missing)
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(empty)


def test_tokenizer_and_chat_template_from_the_model_directory(tmp_path, capsys) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from pymooncake.cli.main import main
    from pymooncake.engine.model.tokenizer import HFTokenizer
    d, _ = _save(tmp_path, "llama")
    words = ["<s>", "</s>", "<unk>", "hello", "world", "user", "assistant", ":"]
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")
    fast.save_pretrained(d)
    tok = HFTokenizer(d)
    assert tok.encode("hello world") == [3, 4]
    assert tok.eos_token_ids == (1,)
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == [5, 7, 3, 6, 7]
    eng = Engine.from_model_name(str(d), EngineConfig())
    assert eng.namespace.tokenizer_fingerprint == tok.fingerprint
    assert main(["generate", "--model", str(d), "--prompt", "hello", "--chat",
                 "--max-tokens", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prompt_token_ids"] == [5, 7, 3, 6, 7] and len(doc["token_ids"]) <= 3
