"""Bad input to the engine and ``pymooncake generate``: one clear error naming what is wrong.

Corrupt safetensors files, malformed ``config.json`` fields, NaN/infinite sampling values,
empty stop strings, out-of-range prompt ids, an empty prompt; and the plain output of
``pymooncake generate`` (ids on one line, text with non-UTF-8 bytes escaped on the next).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pymooncake.cli.engine import display_text  # noqa: E402
from pymooncake.cli.main import main  # noqa: E402
from pymooncake.engine import Engine, SamplingParams  # noqa: E402
from pymooncake.engine.model.export import save_hf_dir  # noqa: E402
from pymooncake.engine.model.loader import ModelLoadError, load_model, read_model_config  # noqa: E402


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "good"
    save_hf_dir(Engine.from_model_name("tiny").model, d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- corrupt weight files (item 1) ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_is_one_line_naming_the_file(hf_dir, tmp_path, capsys,
                                                         kind) -> None:
    d = _copy(hf_dir, tmp_path / kind)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[:len(data) // 2], "garbage": b"not a safetensors file",
                   "empty": b""}[kind])
    with pytest.raises(ModelLoadError) as ei:
        load_model(d)
    assert str(f) in str(ei.value) and "\n" not in str(ei.value)
    rc, out, err = _run(capsys, "generate", "--model", str(d), "--prompt-ids", "1",
                        "--max-tokens", "2")
    assert (rc, out) == (1, "")
    assert err.count("\n") == 1 and str(f) in err and "Traceback" not in err


def test_truncated_tensor_data_after_a_valid_header(hf_dir, tmp_path) -> None:
    """Header intact, data cut: the header's offsets point past the end of the file."""
    d = _copy(hf_dir, tmp_path / "cut")
    f = d / "model.safetensors"
    data = f.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    f.write_bytes(data[:8 + header_len + 100])
    with pytest.raises(ModelLoadError, match=str(f)):
        load_model(d)


# -- malformed config.json (item 2) --------------------------------------------------------

def _config_error(hf_dir: Path, tmp_path: Path, edit) -> str:
    d = tmp_path / "cfg"
    d.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    raw = edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg if raw is None else raw))
    with pytest.raises(ModelLoadError) as ei:
        read_model_config(d)
    msg = str(ei.value)
    assert msg.startswith(f"{d / 'config.json'}: "), msg
    return msg.removeprefix(f"{d / 'config.json'}: ")


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda c: [1, 2], "must hold a JSON object, got list"),
    (lambda c: "text", "must hold a JSON object, got str"),
    (lambda c: c.update(num_hidden_layers="two"), "num_hidden_layers must be an int, got 'two'"),
    (lambda c: c.update(num_hidden_layers=2.5), "num_hidden_layers must be an int, got 2.5"),
    (lambda c: c.update(hidden_size=True), "hidden_size must be an int, got True"),
    (lambda c: c.update(num_attention_heads=0), "num_attention_heads must be positive, got 0"),
    (lambda c: c.update(num_key_value_heads=3),
     "num_attention_heads (8) must be a multiple of num_key_value_heads (3)"),
    (lambda c: c.update(vocab_size=-1), "vocab_size must be positive, got -1"),
    (lambda c: c.update(rms_norm_eps="small"), "rms_norm_eps must be a number, got 'small'"),
    (lambda c: c.update(tie_word_embeddings="no"),
     "tie_word_embeddings must be true or false, got 'no'"),
    (lambda c: c.pop("intermediate_size") and None, "missing field 'intermediate_size'"),
    (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": "two"}),
     "rope_scaling.factor must be a number, got 'two'"),
    (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 0}),
     "rope_scaling.factor must be positive, got 0.0"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
     "rope_scaling.rope_type 'yarn' is not supported; supported: default, linear, llama3"),
    (lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "missing field rope_scaling.low_freq_factor (needed by rope_type 'llama3')"),
    (lambda c: c.update(rope_scaling="abc"), "rope_scaling must be an object, got 'abc'"),
])
def test_config_errors_name_the_file_and_field(hf_dir, tmp_path, edit, expected) -> None:
    assert _config_error(hf_dir, tmp_path, edit) == expected


def test_config_error_through_the_cli(hf_dir, tmp_path, capsys) -> None:
    d = _copy(hf_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = "two"
    (d / "config.json").write_text(json.dumps(cfg))
    rc, _, err = _run(capsys, "generate", "--model", str(d), "--prompt-ids", "1",
                      "--max-tokens", "2")
    assert rc == 1
    assert err == (f"pymooncake: error: {d / 'config.json'}: num_hidden_layers must be an int, "
                   "got 'two'\n")


# -- sampling values (items 3 and 6) -------------------------------------------------------

@pytest.mark.parametrize(("kw", "field"), [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": -math.inf}, "temperature"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": math.nan}, "top_p"), ({"top_p": math.inf}, "top_p"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": 2.5}, "top_k"), ({"top_k": -1}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    ({"seed": 1.5}, "seed"), ({"stop": ("",)}, "stop"), ({"stop": ("ok", "")}, "stop"),
])
def test_sampling_params_refuse_non_finite_and_empty(kw, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_keep_valid_values() -> None:
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["ab"])
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (0.7, 0.9, 5, 3, ("ab",))
    assert SamplingParams(stop="xy").stop == ("xy",)


@pytest.mark.parametrize(("flag", "value"), [
    ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"),
    ("--top-p", "nan"), ("--top-p", "inf"), ("--top-p", "1.5"), ("--top-k", "-2"),
    ("--max-tokens", "0"),
])
def test_cli_refuses_bad_sampling_flags(capsys, flag, value) -> None:
    rc, out, err = _run(capsys, "generate", "--model", "tiny", "--prompt-ids", "1",
                        "--max-tokens", "2",
                        flag, value)
    assert (rc, out) == (2, "")
    assert err.count("\n") == 1 and flag in err and value.lstrip("-") in err


def test_cli_out_of_range_prompt_ids_name_the_flag(capsys) -> None:
    rc, _, err = _run(capsys, "generate", "--model", "tiny", "--prompt-ids", "1,259,3",
                       "--max-tokens", "2")
    assert rc == 2
    assert err == ("pymooncake: error: --prompt-ids: token ids [259] outside the model's "
                   "vocabulary [0, 259)\n")
    rc, _, err = _run(capsys, "generate", "--model", "tiny", "--prompt-ids", "-1",
                       "--max-tokens", "2")
    assert rc == 2 and "--prompt-ids" in err and "[-1]" in err


def test_cli_refuses_an_empty_prompt(capsys) -> None:
    rc, out, err = _run(capsys, "generate", "--model", "tiny", "--prompt", "",
                          "--max-tokens", "2")
    assert (rc, out) == (2, "")
    assert "--prompt is empty" in err


# -- plain output (item 5) -----------------------------------------------------------------

def test_plain_output_prints_ids_then_escaped_text(capsys) -> None:
    prompt = [256, 1, 2]
    (ref,) = Engine.from_model_name("tiny").generate([prompt], SamplingParams(max_tokens=8))
    ids = list(ref.output_token_ids)
    rc, out, _ = _run(capsys, "generate", "--model", "tiny", "--prompt-ids", "256,1,2",
                        "--max-tokens", "8")
    assert rc == 0
    id_line, text_line = out.rstrip("\n").split("\n")
    assert id_line == " ".join(map(str, ids))
    # independent rendering: each byte < 0x20, 0x7f or >= 0x80 (this output is not valid
    # UTF-8 at any of its high bytes, checked below) as \xNN, printable ASCII as itself
    raw = bytes(t for t in ids if t < 256)
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")
    assert all(b >= 0x80 or b < 0x20 or 0x20 <= b < 0x7f for b in raw)
    expected = "".join(chr(b) if 0x20 <= b < 0x7f and b != 0x5c else
                       ("\\\\" if b == 0x5c else f"\\x{b:02x}") for b in raw)
    # printable multi-byte UTF-8 characters would stay as they are; this prompt yields none
    assert text_line == expected


def test_display_text_escapes() -> None:
    bad = b"a\xffb\xe2\x82".decode("utf-8", errors="surrogateescape")
    assert display_text(bad) == "a\\xffb\\xe2\\x82"
    assert display_text("x\ny\t\x1bz\\") == "x\\ny\\t\\x1bz\\\\"
    assert display_text("caf\u00e9 \u20ac \ufffd") == "caf\u00e9 \u20ac \\ufffd"


def test_corrupt_tokenizer_file_is_named_not_silently_dropped(hf_dir, tmp_path,
                                                                capsys) -> None:
    d = _copy(hf_dir, tmp_path / "tok")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": garbage')
    rc, out, err = _run(capsys, "generate", "--model", str(d), "--prompt-ids", "1",
                        "--max-tokens", "2")
    assert (rc, out) == (1, "")
    assert err.startswith(f"pymooncake: error: {d}: cannot load the tokenizer from "
                          "tokenizer.json (") and err.count("\n") == 1
    # without any tokenizer file the directory still loads (ids-only use)
    assert Engine.from_model_name(str(hf_dir)).tokenizer is None
