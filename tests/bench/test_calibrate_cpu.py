"""``sim calibrate-cpu``'s harness end to end on the tiny model (a tiny grid): the document
it writes parses as a calibration and carries samples, fits, held-out checks, provenance."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch")

from pymooncake.cli.main import main  # noqa: E402
from pymooncake.sim.calibration import load_calibration  # noqa: E402


@pytest.fixture()
def keep_affinity(monkeypatch):  # noqa: ANN001, ANN201
    cores = os.sched_getaffinity(0)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
    yield min(cores)
    os.sched_setaffinity(0, cores)


def test_calibrate_cpu_tiny(capsys, tmp_path, keep_affinity) -> None:  # noqa: ANN001
    # prompts of 32-256 tokens, the fastest of 3 timings each: at 16-48 tokens a prefill
    # of the tiny model took 1.6-2.9 ms whatever its length on a fast CPU, and with one
    # timing each a loaded machine (pytest -n 2 beside tests/sim) still made the fit's
    # per-token term 0 in 2 of 6 runs (prefill.linear_s must be > 0: refused); 0 in 11
    # with these flags. (64-768 tokens were worse: the tiny model's prefill is then
    # quadratic enough that the fit drops the linear term.)
    out = tmp_path / "cal.json"
    rc = main(["sim", "calibrate-cpu", "--model", "tiny", "--core", str(keep_affinity),
               "--lengths", "32,128,256", "--prefix-fractions", "0,0.5", "--repeats", "3",
               "--statistic", "min",
               "--batches", "1,2", "--contexts", "16,32", "--decode-steps", "2",
               "--holdout", "96:3", "--transfer-bandwidth-gbps", "80", "--label", "test",
               "--out", str(out), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    cal = load_calibration(out)
    assert cal.label == "test" and cal.model.name == "tiny"
    assert cal.transfer.bandwidth_bytes_per_s == 10e9 and cal.transfer_source == "flag"
    assert len(doc["samples"]["prefill"]) == 6 and len(doc["samples"]["decode"]) == 4
    assert doc["fit"]["holdout"][0]["prompt_tokens"] == 96
    prov = doc["provenance"]
    assert prov["core"] == keep_affinity and prov["torch_threads"] == 1
    assert {"onednn", "c_kernels", "fused_step"} <= set(prov["engine_paths"])
    assert prov["versions"]["torch"] and prov["load_average"]["start"]
    assert os.sched_getaffinity(0) == {keep_affinity}   # it pinned this process


def test_calibrate_cpu_bad_flags(capsys) -> None:  # noqa: ANN001
    assert main(["sim", "calibrate-cpu", "--lengths", "64"]) == 2
    assert "--lengths" in capsys.readouterr().err
    assert main(["sim", "calibrate-cpu", "--batches", "4,4"]) == 2
    assert "--batches" in capsys.readouterr().err


def test_calibrate_cpu_threads(capsys, tmp_path, keep_affinity) -> None:  # noqa: ANN001
    """--threads/--cores: the engines run that many torch threads on those cores, and the
    file says so (node.threads, node.cores, provenance) for sim vs-live to pick it."""
    import torch
    cores = sorted(os.sched_getaffinity(0))[:2]
    out = tmp_path / "cal.json"
    before = torch.get_num_threads()
    try:
        rc = main(["sim", "calibrate-cpu", "--model", "tiny", "--cores",
                   ",".join(map(str, cores)), "--threads", "2", "--lengths", "32,128,256",
                   "--prefix-fractions", "0,0.5", "--repeats", "3", "--statistic", "min",
                   "--batches", "1,2",
                   "--contexts", "16,32", "--decode-steps", "2", "--holdout",
                   "--transfer-bandwidth-gbps", "80", "--out", str(out), "--json"])
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert threads == 2 and os.sched_getaffinity(0) == set(cores)
    assert doc["node"]["threads"] == 2 and doc["node"]["cores"] == len(cores)
    assert doc["provenance"]["cores"] == cores and doc["provenance"]["torch_threads"] == 2
    assert load_calibration(out).node["threads"] == 2
    assert main(["sim", "calibrate-cpu", "--threads", "0"]) == 2
    assert main(["sim", "calibrate-cpu", "--cores", "0,0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_calibrate_cpu_refuses_missing_cpus_and_an_unwritable_out_before_measuring(capsys):
    """Checked before the (long) measurement: CPUs outside the affinity, --out's directory."""
    from pymooncake.cli.main import main
    assert main(["sim", "calibrate-cpu", "--cores", "0,4096", "--threads", "2"]) == 2
    assert "--cores: distinct CPUs among this process's" in capsys.readouterr().err
    assert main(["sim", "calibrate-cpu", "--core", "4096"]) == 2
    assert "--core: distinct CPUs" in capsys.readouterr().err
    assert main(["sim", "calibrate-cpu", "--out", "/nonexistent-dir/x.json"]) == 2
    assert "--out /nonexistent-dir/x.json: directory" in capsys.readouterr().err


def test_calibrate_cpu_mixed_steps(capsys, tmp_path, keep_affinity) -> None:  # noqa: ANN001
    """--mixed-chunks: whole engine steps of decodes beside one chunk are timed, one sample
    per step with the composition the engine ran, and the file's ``step`` is fitted."""
    out = tmp_path / "cal.json"
    rc = main(["sim", "calibrate-cpu", "--model", "tiny", "--core", str(keep_affinity),
               "--lengths", "32,128,256", "--prefix-fractions", "0,0.5", "--repeats", "3",
               "--statistic", "min",
               "--batches", "1,2", "--contexts", "16,32", "--decode-steps", "2", "--holdout",
               "--transfer-bandwidth-gbps", "80", "--mixed-chunks", "8,64",
               "--mixed-decodes", "0,2", "--mixed-contexts", "40", "--mixed-offsets", "0,40",
               "--mixed-repeats", "1", "--mixed-block-size", "16", "--out", str(out),
               "--json"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    rows = doc["samples"]["step"]
    # B = 0: 2 offsets x 2 chunks; B = 2 (contexts of 40): 2 offsets x (1 decode-only + 2)
    assert len(rows) == 4 + 6
    assert [r[:4] for r in rows[:4]] == [[0, 0, 8, 0], [0, 0, 64, 0], [0, 0, 8, 32],
                                         [0, 0, 64, 32]]     # 40 -> 32: whole blocks
    mixed = rows[4:]
    assert [(r[0], r[2], r[3]) for r in mixed] == [(2, 0, 0), (2, 8, 0), (2, 64, 0),
                                                   (2, 0, 0), (2, 8, 32), (2, 64, 32)]
    # each decode attends its context: 40 prompt tokens + the tokens sampled so far
    assert all(r[1] >= 2 * 41 for r in mixed)
    assert [r[1] for r in mixed] == sorted(r[1] for r in mixed)    # contexts grow
    assert all(r[4] > 0 for r in rows)
    cal = load_calibration(out)
    assert cal.step is not None and cal.step.per_token_s > 0
    assert doc["fit"]["step_terms"] == ["tokens", "pairs", "decode_context", "chunk_prefix"]
    assert doc["fit"]["step_rel_rms"] >= 0 and doc["fit"]["step_engine_form"]["rel_rms"] >= 0
    assert main(["sim", "calibrate-cpu", "--mixed-chunks", "0,8"]) == 2
    assert "--mixed-chunks" in capsys.readouterr().err
    assert main(["sim", "calibrate-cpu", "--mixed-chunks", "8", "--step-terms", "flops"]) == 2
    assert "--step-terms" in capsys.readouterr().err
    # without --mixed-chunks too (it was ignored and the calibration measured anyway)
    assert main(["sim", "calibrate-cpu", "--step-terms", "flops"]) == 2
    assert "--step-terms" in capsys.readouterr().err
