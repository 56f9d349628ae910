"""``serve --p2p-model NAME``: the checkpoint directory is pulled from the P2P Store and
loaded as ``--model`` (the pull itself is ``cli.p2p.apply_p2p_model``)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pymooncake.cli.p2p import apply_p2p_model
from pymooncake.p2p import P2PStore


def _args(**kw: object) -> argparse.Namespace:
    base = {"p2p_model": None, "p2p_metadata": None, "p2p_dir": None,
            "p2p_host": "127.0.0.1", "metadata": None, "model": "smollm2"}
    return argparse.Namespace(**{**base, **kw})


def test_pulls_the_model_dir_and_points_model_at_it(etcd_url: str, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from pymooncake.engine import Engine
    from pymooncake.engine.model.export import save_hf_dir
    from pymooncake.engine.model.loader import load_model

    src = tmp_path / "tiny-hf"
    save_hf_dir(Engine.from_model_name("tiny").model, src)
    # apply_p2p_model checks the payload has config, weights and a tokenizer file (names)
    (src / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    name = f"tiny-hf-{uuid.uuid4().hex[:6]}"
    with P2PStore(etcd_url) as seed:
        seed.register(name, [src], shard_bytes=64 * 1024)
        args = _args(p2p_model=name, p2p_metadata=etcd_url, p2p_dir=str(tmp_path / "pulled"))
        holder = apply_p2p_model(args)
        try:
            assert args.model == str(tmp_path / "pulled")
            for f in src.iterdir():
                assert (tmp_path / "pulled" / f.name).read_bytes() == f.read_bytes()
            a = load_model(src).state_dict()
            b = load_model(args.model).state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            full = (1 << len(seed.manifest(name).shards)) - 1
            assert sorted(h.have == full for h in seed.holders(name)) == [True, True]
        finally:
            holder.terminate()
            assert holder.wait(timeout=15) == 0
    assert apply_p2p_model(_args()) is None


def test_serve_with_an_unknown_p2p_model_is_one_line_before_any_child(etcd_url) -> None:
    r = subprocess.run([sys.executable, "-m", "pymooncake", "serve", "--p2p-model", "ghost",
                        "--p2p-metadata", etcd_url, "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("pymooncake: error:")]
    assert lines == ["pymooncake: error: --p2p-model ghost: no payload named 'ghost' is "
                     "registered"], r.stderr


def test_serve_with_a_payload_that_is_not_a_model_is_one_line_after_the_pull(
        etcd_url, tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not a model\n")
    name = f"junk-{uuid.uuid4().hex[:6]}"
    pulled = tmp_path / "pulled"
    with P2PStore(etcd_url) as seed:
        seed.register(name, [junk])
        r = subprocess.run([sys.executable, "-m", "pymooncake", "serve", "--p2p-model", name,
                            "--p2p-metadata", etcd_url, "--p2p-dir", str(pulled),
                            "--port", "0"], capture_output=True, text=True, timeout=90)
        assert (pulled / "notes.txt").read_text() == "not a model\n"   # it was pulled
        # the holder child was stopped: only the seed still holds it
        deadline = time.monotonic() + 15
        while len(seed.holders(name)) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(seed.holders(name)) == 1
    assert (r.returncode, r.stdout) == (1, ""), r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("pymooncake: error:")]
    assert lines == [f"pymooncake: error: --p2p-model {name}: the payload pulled into "
                     f"{pulled} is not a model directory: no config.json, no tokenizer file "
                     "(tokenizer.json, tokenizer_config.json, ...), no *.safetensors weights "
                     "(register a HF model directory under that name)"], r.stderr
    assert "Traceback" not in r.stderr and "(P2P Store)" not in r.stderr   # no "serving it"
