"""P2PStore peers in one process (embedded metadata, tcp over loopback between engines)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pymooncake.p2p import (
    NoHolderError,
    P2PExists,
    P2PNotFound,
    P2PStore,
    PullOptions,
)

from .conftest import assert_same_tree

SHARD = 64 * 1024
FAST = PullOptions(parallel=4, stall_timeout_s=1.0, retry_backoff_s=0.2, refresh_s=0.05)


@pytest.fixture()
def peers() -> Iterator[list[P2PStore]]:
    md = f"embedded://p2p-{uuid.uuid4().hex[:8]}"
    made = [P2PStore(md, holder_ttl_s=2.0) for _ in range(3)]
    try:
        yield made
    finally:
        for p in made:
            p.close()


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(os.urandom(5 * SHARD + 123))
    (src / "sub" / "tokenizer.json").write_bytes(os.urandom(SHARD // 3))
    (src / "empty.txt").write_bytes(b"")
    return src




def test_register_get_replica_list_unregister(peers, model_dir, tmp_path) -> None:
    seed, a, b = peers
    m = seed.register("org/m", [model_dir], shard_bytes=SHARD)
    assert len(m.shards) == 6 + 1 and m.total_bytes == 5 * SHARD + 123 + SHARD // 3
    assert seed.register("org/m", [model_dir], shard_bytes=SHARD) == m   # idempotent
    ra = a.get_replica("org/m", tmp_path / "a", FAST)
    assert_same_tree(model_dir, tmp_path / "a")
    assert ra.stats.bytes == m.total_bytes and ra.path == tmp_path / "a"
    rb = b.get_replica("org/m", tmp_path / "b", FAST)
    assert_same_tree(model_dir, tmp_path / "b")
    assert not list((tmp_path / "b").rglob("*.p2p-part"))
    # b could pull from the seed and from a, which became a holder
    assert set(rb.stats.bytes_from) <= {seed.segment, a.segment}
    [info] = seed.list()
    assert (info.name, info.holders, info.complete_holders) == ("org/m", 3, 3)
    assert seed.list("nope") == []
    assert a.unregister("org/m")
    assert seed.list() == [] and not a.unregister("org/m")
    with pytest.raises(P2PNotFound):
        b.get_replica("org/m", tmp_path / "c", FAST)


def test_same_name_other_content_is_refused(peers, model_dir, tmp_path) -> None:
    seed, a, _ = peers
    seed.register("m", [model_dir], shard_bytes=SHARD)
    other = tmp_path / "other.bin"
    other.write_bytes(b"different")
    with pytest.raises(P2PExists, match="other content"):
        a.register("m", [other])
    with pytest.raises(ValueError, match="exactly one"):
        a.register("x")
    with pytest.raises(FileNotFoundError):
        a.register("x", [tmp_path / "missing"])


def test_unknown_name_and_bad_into(peers, model_dir, tmp_path) -> None:
    seed, a, _ = peers
    with pytest.raises(P2PNotFound, match="no payload named 'ghost'"):
        a.get_replica("ghost", tmp_path / "x", FAST)
    seed.register("m", [model_dir], shard_bytes=SHARD)
    with pytest.raises(ValueError, match="give a directory"):
        a.get_replica("m", None, FAST)


def test_tensors_payload(peers) -> None:
    torch = pytest.importorskip("torch")
    seed, a, b = peers
    t = {"w": torch.randn(300, 70), "ids": torch.arange(5000, dtype=torch.int64),
         "h": torch.randn(1000).to(torch.bfloat16)}
    seed.register("t", tensors=t, shard_bytes=SHARD)
    got = a.get_replica("t", None, FAST).buffers
    assert got is not None and all(torch.equal(got[k], t[k]) for k in t)
    into = {k: torch.empty_like(v) for k, v in t.items()}
    b.get_replica("t", into, FAST)
    assert all(torch.equal(into[k], t[k]) for k in t)
    assert b.delete_replica("t") and not b.delete_replica("t")
    with pytest.raises(ValueError, match="has 12 bytes"):
        b.get_replica("t", {**into, "w": torch.empty(3)}, FAST)


def test_corrupt_holder_is_skipped_and_repulled_elsewhere(peers, model_dir, tmp_path) -> None:
    seed, a, b = peers
    seed.register("m", [model_dir], shard_bytes=SHARD)
    a.get_replica("m", tmp_path / "a", FAST)
    for buf in a._held["m"].payload.buffers:        # a's copy goes bad after it was verified
        if buf is not None:     # flip bits: writing a constant leaves a byte that had it
            for off in range(0, len(buf), SHARD // 2):
                buf[off] ^= 0xFF
    rb = b.get_replica("m", tmp_path / "b", PullOptions(parallel=4, per_holder=1,
                                                        stall_timeout_s=2.0, seed=3))
    assert rb.stats.checksum_failures >= 1
    assert rb.stats.bytes_from.get(a.segment, 0) == 0      # nothing from a was kept
    assert_same_tree(model_dir, tmp_path / "b")


def test_only_holder_corrupt_is_an_error_not_data(peers, model_dir, tmp_path) -> None:
    seed, a, _ = peers
    seed.register("m", [model_dir], shard_bytes=SHARD)
    seed._held["m"].payload.buffers[1][5] ^= 0xFF      # the seed's private (CoW) mapping
    with pytest.raises(NoHolderError, match="checksum") as e:
        a.get_replica("m", tmp_path / "a", FAST)
    assert e.value.missing == [0]
    assert not [p for p in (tmp_path / "a").rglob("*") if p.is_file()]
    assert [h.segment for h in seed.holders("m")] == [seed.segment]   # a withdrew


def test_no_holder_left_is_a_clean_error(peers, model_dir, tmp_path) -> None:
    seed, a, _ = peers
    seed.register("m", [model_dir], shard_bytes=SHARD)
    seed.delete_replica("m")
    with pytest.raises(NoHolderError, match="held by nobody"):
        a.get_replica("m", tmp_path / "a", FAST)
    assert not list((tmp_path / "a").rglob("*.p2p-part"))


def test_unregister_during_a_pull_ends_it(peers, model_dir, tmp_path) -> None:
    seed, a, _ = peers
    seed.register("m", [model_dir], shard_bytes=SHARD)
    got: list[BaseException] = []
    slow = PullOptions(parallel=1, max_rate=SHARD, refresh_s=0.05, stall_timeout_s=5.0)

    def pull() -> None:
        try:
            a.get_replica("m", tmp_path / "a", slow)        # ~7 s at one shard a second
        except BaseException as e:      # noqa: BLE001
            got.append(e)

    t = threading.Thread(target=pull)
    t.start()
    time.sleep(1.0)
    assert seed.unregister("m")
    t.join(10)
    assert not t.is_alive() and isinstance(got[0], P2PNotFound), got
    assert not [p for p in (tmp_path / "a").rglob("*") if p.is_file()]


def test_a_receiver_serves_shards_before_it_has_finished(peers, model_dir, tmp_path) -> None:
    seed, a, b = peers
    m = seed.register("m", [model_dir], shard_bytes=SHARD)
    slow = PullOptions(parallel=1, max_rate=2 * SHARD, refresh_s=0.05)   # ~3.5 s for 7
    t = threading.Thread(target=a.get_replica, args=("m", tmp_path / "a", slow))
    t.start()
    deadline = time.monotonic() + 10
    while True:                 # a advertises each verified shard at once
        rec = {h.segment: h for h in seed.holders("m")}.get(a.segment)
        if rec is not None and rec.count() >= 3:
            break
        assert time.monotonic() < deadline, "a never advertised 3 shards"
        time.sleep(0.05)
    assert rec.count() < len(m.shards)
    rb = b.get_replica("m", tmp_path / "b", FAST)
    assert t.is_alive()                           # a is still pulling...
    assert rb.stats.bytes_from.get(a.segment, 0) > 0    # ...and b pulled from it
    assert_same_tree(model_dir, tmp_path / "b")
    t.join(15)
    assert_same_tree(model_dir, tmp_path / "a")


class _ClockThatMovesBetweenReads:
    """``time`` for the puller whose every second ``monotonic()`` is 1 s later: a worker
    preempted between two reads of the clock (CI, two busy workers on two cores)."""

    def __init__(self) -> None:
        self.n = 0
        self.sleep, self.time = time.sleep, time.time

    def monotonic(self) -> float:
        self.n += 1
        return time.monotonic() + (1.0 if self.n % 2 == 0 else 0.0)


def test_a_rate_limited_worker_preempted_before_its_sleep_still_pulls_every_shard(
        peers, model_dir, tmp_path, monkeypatch) -> None:
    """The CI failure of ``test_a_receiver_serves_shards_before_it_has_finished``: a's
    only worker checked ``start_at > monotonic()``, was preempted past ``start_at``, then
    slept ``start_at - monotonic()`` < 0: ValueError killed the thread (CI's "1 warning"),
    the pull "succeeded" with shards missing and the files were renamed with zeros."""
    import pymooncake.p2p.puller as puller_mod

    seed, a, _ = peers
    seed.register("m", [model_dir], shard_bytes=SHARD)
    monkeypatch.setattr(puller_mod, "time", _ClockThatMovesBetweenReads())
    slow = PullOptions(parallel=1, max_rate=4 * SHARD, refresh_s=0.05)
    r = a.get_replica("m", tmp_path / "a", slow)
    assert_same_tree(model_dir, tmp_path / "a")
    assert r.stats.shards == 7
