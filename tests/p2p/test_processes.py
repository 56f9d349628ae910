"""The P2P Store as real processes on loopback (``pymooncake p2p ...``, etcd metadata):
1 seed -> 3 receivers with every byte compared, a holder killed mid-pull, no holder left,
a corrupt holder, bad inputs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pymooncake.metadata import open_metadata
from pymooncake.p2p.manifest import Holder, holders_prefix

from .conftest import assert_same_tree, finish, start_p2p, wait_ready

pytestmark = pytest.mark.integration
SHARD_MIB = "0.25"


def _error_line(err: str) -> str:
    """The one ``pymooncake: error:`` line (no traceback, and no asyncio "Task was destroyed
    but it is pending": every metadata loop reaps its grpc tasks before it closes)."""
    lines = [ln for ln in err.splitlines() if ln.startswith("pymooncake: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "Task was destroyed" not in err, err
    return lines[0]


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    src = tmp_path / "model"
    src.mkdir()
    (src / "model-00001-of-00002.safetensors").write_bytes(os.urandom(3 * 1024 * 1024 + 7))
    (src / "model-00002-of-00002.safetensors").write_bytes(os.urandom(1024 * 1024))
    (src / "config.json").write_text('{"model_type": "llama"}')
    return src




def test_one_seed_three_receivers_every_byte(etcd_url, procs, model, tmp_path) -> None:
    wait_ready(start_p2p(procs, etcd_url, "register", "m1", str(model), "--shard-size", SHARD_MIB))
    getters = [start_p2p(procs, etcd_url, "get", "m1", str(tmp_path / f"r{i}"), "--json")
               for i in range(3)]
    total = sum(f.stat().st_size for f in model.iterdir())
    for i, g in enumerate(getters):
        rc, out, err = finish(g)
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["bytes"] == total and doc["checksum_failures"] == 0
        assert_same_tree(model, tmp_path / f"r{i}")
    ls = start_p2p(procs, etcd_url, "list", "--json")
    rc, out, _ = finish(ls)
    [info] = [i for i in json.loads(out) if i["name"] == "m1"]
    assert info["total_bytes"] == total and info["complete_holders"] >= 1


def _records(etcd: str, name: str) -> list[Holder]:
    """Every holder record of ``name`` in the metadata service (what pullers publish)."""
    async def go() -> list[Holder]:
        md = open_metadata(etcd)
        try:
            return [Holder.decode(kv.value) for kv in
                    await md.get_prefix(holders_prefix(name))]
        finally:
            await md.close()
    return asyncio.run(go())


def _wait_pulled_from(etcd: str, name: str, known: set[str], seg: str, b: subprocess.Popen,
                      timeout_s: float = 60.0) -> Holder:
    """Poll the new puller's holder record (the one not in ``known``) until a shard it
    fetched while it had a pull in flight from ``seg`` is verified: every shard of that
    record's ``fetching`` is in a later record's ``have`` (a record is published after each
    verified shard). Returns that later record."""
    deadline = time.monotonic() + timeout_s
    fetching = 0
    while time.monotonic() < deadline:
        assert b.poll() is None, "the puller ended before it was seen pulling from the seed"
        for h in _records(etcd, name):
            if h.segment in known:
                continue
            if fetching and h.have & fetching == fetching:
                return h
            if not fetching and h.pulling.get(seg, 0) > 0:
                fetching = sum(1 << i for i in h.fetching)
        time.sleep(0.05)
    raise AssertionError(f"the puller was not seen pulling from {seg} in {timeout_s} s")


def test_holder_killed_mid_pull_still_completes(etcd_url, procs, model, tmp_path) -> None:
    seed = start_p2p(procs, etcd_url, "register", "m2", str(model), "--shard-size", SHARD_MIB)
    seed_seg = wait_ready(seed)["segment"]
    a_seg = wait_ready(start_p2p(procs, etcd_url, "get", "m2", str(tmp_path / "a"),
                                 "--hold"))["segment"]
    # ~4 s at 1 MiB/s: the seed dies once b has verified a shard pulled from it, mid-pull
    b = start_p2p(procs, etcd_url, "get", "m2", str(tmp_path / "b"), "--json", "--max-rate", "1",
                  "--parallel", "2")
    seen = _wait_pulled_from(etcd_url, "m2", {seed_seg, a_seg}, seed_seg, b)
    seed.send_signal(signal.SIGKILL)
    num_shards = sum(-(-f.stat().st_size // (256 * 1024)) for f in model.iterdir())  # 17
    assert bin(seen.have).count("1") < num_shards      # b was still pulling at the kill
    rc, out, err = finish(b)
    assert rc == 0, err
    assert_same_tree(model, tmp_path / "b")
    doc = json.loads(out)
    assert len(doc["bytes_from"]) == 2          # it had pulled from the seed and from a


def test_no_holder_left_is_one_line_error(etcd_url, procs, model, tmp_path) -> None:
    seed = start_p2p(procs, etcd_url, "register", "m3", str(model), "--ttl", "1")
    wait_ready(seed)
    seed.send_signal(signal.SIGKILL)
    rc, out, err = finish(start_p2p(procs, etcd_url, "get", "m3", str(tmp_path / "x"),
                                "--stall-timeout", "1.5"))
    assert rc == 1 and out == ""
    assert _error_line(err).startswith("pymooncake: error: payload 'm3': no holder could serve")
    assert not [p for p in (tmp_path / "x").rglob("*") if p.is_file()]


def test_corrupt_holder_repulled_elsewhere(etcd_url, procs, model, tmp_path) -> None:
    wait_ready(start_p2p(procs, etcd_url, "register", "m4", str(model), "--shard-size", SHARD_MIB))
    wait_ready(start_p2p(procs, etcd_url, "get", "m4", str(tmp_path / "a"), "--hold"))
    for f in (tmp_path / "a").iterdir():         # a serves its (shared) file mapping
        with open(f, "r+b") as fh:
            for off in range(0, f.stat().st_size, 65536):
                fh.seek(off)
                byte = fh.read(1)
                fh.seek(off)
                fh.write(bytes([byte[0] ^ 0x5A]))
    rc, out, err = finish(start_p2p(procs, etcd_url, "get", "m4", str(tmp_path / "b"), "--json"))
    assert rc == 0, err
    assert_same_tree(model, tmp_path / "b")
    assert json.loads(out)["checksum_failures"] >= 1


def test_bad_inputs(etcd_url, procs, model, tmp_path, capsys) -> None:
    from pymooncake.cli.main import main

    def in_proc(*argv: str) -> tuple[int, str]:   # the first one below runs the entry point
        rc = main(["p2p", *argv, "--metadata", etcd_url])
        return rc, capsys.readouterr().err
    rc, out, err = finish(start_p2p(procs, etcd_url, "get", "ghost", str(tmp_path / "g")))
    assert (rc, out) == (1, "")
    assert _error_line(err) == "pymooncake: error: no payload named 'ghost' is registered"
    rc, _, err = finish(start_p2p(procs, etcd_url, "register", "x", str(tmp_path / "missing")))
    assert rc == 1 and "no such file or directory" in _error_line(err)
    rc, err = in_proc("register", "x", str(model), "--shard-size", "0")
    assert rc == 2 and "--shard-size" in err
    rc, err = in_proc("unregister", "ghost")
    assert rc == 1 and "ghost" in err
