"""``pymooncake generate`` and ``pymooncake bench engine`` (run in-process through main())."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from pymooncake.cli.main import main  # noqa: E402
from pymooncake.engine import Engine, SamplingParams  # noqa: E402
from pymooncake.engine.model.export import save_hf_dir  # noqa: E402
from pymooncake.engine.model.tokenizer import ByteTokenizer  # noqa: E402


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_model_defaults_to_the_registry_default() -> None:
    from pymooncake.cli.main import build_parser
    from pymooncake.engine.model.registry import default_model
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "x"]).model == default_model()
    assert parser.parse_args(["bench", "engine"]).model == default_model()


def test_generate_prompt_ids_json_matches_engine(capsys) -> None:
    rc, out, _ = _run(capsys, "generate", "--model", "tiny", "--prompt-ids", "256,1,2,3",
                      "--max-tokens", "6", "--json")
    assert rc == 0
    doc = json.loads(out)
    (ref,) = Engine.from_model_name("tiny").generate([[256, 1, 2, 3]],
                                                     SamplingParams(max_tokens=6))
    assert doc["token_ids"] == list(ref.output_token_ids)
    assert doc["text"] == ByteTokenizer().decode(list(ref.output_token_ids))


def test_generate_text_prompt_chat_and_sampling(capsys) -> None:
    rc, out, _ = _run(capsys, "generate", "--model", "tiny", "--prompt", "Hello",
                      "--max-tokens", "4", "--json")
    assert rc == 0
    assert json.loads(out)["prompt_token_ids"] == [256, *b"Hello"]
    rc, out, _ = _run(capsys, "generate", "--model", "tiny", "--prompt", "Hi", "--chat",
                      "--max-tokens", "3", "--temperature", "0.7", "--seed", "1", "--top-k", "5",
                      "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["prompt_token_ids"] == [256, *b"<|user|>\nHi\n<|assistant|>\n"]
    assert len(doc["token_ids"]) == 3


def test_generate_from_a_model_directory(tmp_path, capsys) -> None:
    engine = Engine.from_model_name("tiny")
    save_hf_dir(engine.model, tmp_path / "m")
    rc, out, _ = _run(capsys, "generate", "--model", str(tmp_path / "m"), "--prompt-ids",
                      "256,5,6,7", "--max-tokens", "5", "--json")
    assert rc == 0
    (ref,) = engine.generate([[256, 5, 6, 7]], SamplingParams(max_tokens=5))
    assert json.loads(out)["token_ids"] == list(ref.output_token_ids)


def test_generate_errors_are_one_line(tmp_path, capsys) -> None:
    rc, _, err = _run(capsys, "generate", "--model", "tiny", "--prompt-ids", "1,x",
                      "--max-tokens", "2")
    assert rc == 2 and "--prompt-ids" in err
    rc, _, err = _run(capsys, "generate", "--model", str(tmp_path / "none"), "--prompt-ids",
                      "1", "--max-tokens", "2")
    assert rc == 1 and "not 'tiny' and not a directory" in err
    rc, _, err = _run(capsys, "generate", "--model", "tiny", "--prompt-ids", "1,999",
                      "--max-tokens", "2")
    assert rc == 2 and "outside" in err


def test_bench_engine_json_keys(capsys) -> None:
    rc, out, err = _run(capsys, "bench", "engine", "--model", "tiny", "--batch", "2",
                        "--input-len", "16", "--output-len", "3", "--cached-input-len", "64",
                        "--repeats", "3", "--json")
    assert rc == 0
    assert "Loading weights" not in err and "%|" not in err  # no progress bar on stderr
    doc = json.loads(out)
    # the two decode ratios, recomputed from the reported figures
    per = doc["decode_speedup_vs_hf_per_repeat"]
    assert len(per) == 3
    assert doc["decode_speedup_vs_hf_median_of_ratios"] == sorted(per)[1]
    assert doc["decode_speedup_vs_hf_ratio_of_medians"] == pytest.approx(
        doc["decode_tokens_per_s"] / doc["hf_decode_tokens_per_s"], rel=1e-12)
    cpu = doc["decode_cpu_speedup_vs_hf_per_repeat"]
    assert doc["decode_cpu_speedup_vs_hf_median_of_ratios"] == sorted(cpu)[1]
    assert doc["decode_cpu_speedup_vs_hf_ratio_of_medians"] == pytest.approx(
        doc["hf_decode_cpu_s"] / doc["decode_cpu_s"], rel=1e-12)
    assert "decode_speedup_vs_hf" not in doc  # the ambiguous single key is gone
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "hf_decode_tokens_per_s",
                "ttft_s", "tbt_s", "cached_prefill_time_ratio"):
        assert doc[key] > 0, key
    assert doc["cached_fraction"] == 0.75
