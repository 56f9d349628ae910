"""``pymooncake profile``: measured prefill times and the estimator the Conductor fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_profile_writes_samples_the_conductor_can_fit(tmp_path):
    out = tmp_path / "p.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "pymooncake", "profile", "--model", "tiny",
                        "--lengths", "32,256",
                        "--prefix-fractions", "0,0.5", "--repeats", "1", "--out", str(out),
                        "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert json.loads(r.stdout)["samples"] == doc["samples"]
    pts = {(s["num_tokens"], s["num_prefix_tokens"]): s["seconds"] for s in doc["samples"]}
    # block size 16: a half-length prefix is whole blocks, all reused
    assert set(pts) == {(32, 0), (32, 16), (256, 0), (256, 128)}
    assert pts[(256, 0)] > pts[(32, 0)]        # 8x the tokens
    from pymooncake.cli.conductor import load_profile
    est = load_profile(str(out))
    assert est.prefill_s(256) > est.prefill_s(32) > 0


def test_profile_bad_arguments_exit_2():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([sys.executable, "-m", "pymooncake", "profile", "--lengths", "a,b"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "comma-separated" in r.stderr
