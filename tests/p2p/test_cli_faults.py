"""Faults a newcomer found with ``pymooncake p2p`` (real processes, etcd metadata):
holder records left without a lease by plain ``get``s, a traceback for a target that is a
file, grpc "Task was destroyed but it is pending!" noise at exit, directories left behind
by a failed pull."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from pymooncake.metadata import open_metadata
from pymooncake.p2p.manifest import holders_prefix

from .conftest import finish, start_p2p, wait_ready

pytestmark = pytest.mark.integration


def _holder_leases(etcd: str, name: str) -> list[tuple[str, object]]:
    async def go() -> list[tuple[str, object]]:
        md = open_metadata(etcd)
        try:
            return [(kv.key, kv.lease_id) for kv in await md.get_prefix(holders_prefix(name))]
        finally:
            await md.close()
    return asyncio.run(go())


@pytest.fixture()
def payload(tmp_path: Path) -> Path:
    src = tmp_path / "payload"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(700_000))
    (src / "sub" / "b.bin").write_bytes(os.urandom(300_000))
    return src


def test_plain_gets_leave_no_holder_behind_and_print_nothing(etcd_url, procs, payload,
                                                             tmp_path) -> None:
    seed = start_p2p(procs, etcd_url, "register", "f1", str(payload), "--shard-size", "0.125")
    wait_ready(seed)
    for i in range(3):   # each plain get once left a holder record behind
        rc, out, err = finish(start_p2p(procs, etcd_url, "get", "f1", str(tmp_path / f"d{i}")))
        assert rc == 0 and out.startswith("pulled f1 into"), err
        assert err == "", err                       # no "Task was destroyed ..." either
    leases = _holder_leases(etcd_url, "f1")
    assert len(leases) == 1 and leases[0][1] is not None, leases    # the seed's, leased
    rc, out, err = finish(start_p2p(procs, etcd_url, "list", "--json"))
    assert (rc, err) == (0, "")
    # (the session's etcd may hold other files' payloads: only f1's row is this test's)
    assert [(i["name"], i["holders"]) for i in json.loads(out) if i["name"] == "f1"] == [
        ("f1", 1)]
    seed.send_signal(signal.SIGTERM)
    rc, out, err = finish(seed)
    assert (rc, err) == (0, "")
    deadline = time.monotonic() + 5
    while _holder_leases(etcd_url, "f1"):           # the seed revoked its lease at exit
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_target_that_is_a_file_is_one_line_error(etcd_url, procs, payload, tmp_path) -> None:
    wait_ready(start_p2p(procs, etcd_url, "register", "f2", str(payload)))
    f = tmp_path / "f"
    f.write_text("x\n")
    rc, out, err = finish(start_p2p(procs, etcd_url, "get", "f2", str(f)))
    assert (rc, out) == (1, "")
    assert err == (f"pymooncake: error: cannot pull 'f2' into {f}: exists and is not a "
                   f"directory: '{f}'\n"), err
    assert f.read_text() == "x\n"


def test_failed_pull_leaves_no_directory_it_made(etcd_url, procs, payload, tmp_path) -> None:
    seed = start_p2p(procs, etcd_url, "register", "f3", str(payload), "--ttl", "1")
    wait_ready(seed)
    seed.send_signal(signal.SIGKILL)
    seed.wait(10)
    into = tmp_path / "new" / "dir"
    rc, out, err = finish(start_p2p(procs, etcd_url, "get", "f3", str(into), "--stall-timeout",
                                "1.5"))
    assert (rc, out) == (1, "")
    assert err.startswith("pymooncake: error: payload 'f3': no holder could serve"), err
    assert len(err.splitlines()) == 1, err
    assert not (tmp_path / "new").exists()
