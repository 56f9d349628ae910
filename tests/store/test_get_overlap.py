"""A get of a key whose place the client knows — in another process's segment or its own
— reads the bytes while the master answers (``store.client_overlap``, issue 16), and keeps
them only when the answer confirms them: real master and store-server processes, real
Transfer Engine reads over tcp."""

from __future__ import annotations

import os

import pytest

from pymooncake.store.client_overlap import LOCATIONS_MAX, Location, remember
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.transfer import TransferConfig

from .procs import MiB

TCP = TransferConfig(transports=("local", "tcp"), max_retries=1, path_retry_interval_s=0.05,
                     connect_timeout_s=1.0, slice_timeout_s=2.0)


class _Calls:
    """Counts the master calls of one client by the way they were made."""

    def __init__(self, client) -> None:
        rpc = client._rpc
        self.begun: list[str] = []
        self.called: list[str] = []
        begin, call = rpc.begin, rpc.call

        def counted_begin(method, params=None):
            self.begun.append(method)
            return begin(method, params)

        def counted_call(method, params=None, *a, **kw):
            self.called.append(method)
            return call(method, params, *a, **kw)

        rpc.begin, rpc.call = counted_begin, counted_call


def test_get_of_a_key_it_wrote_reads_while_the_master_answers(cluster_factory) -> None:
    cl = cluster_factory()
    cl.store_server(32 * MiB, transports="local,tcp")
    a = cl.client(transfer_config=TCP)
    vals = {f"k{i}": os.urandom(64 * 1024 + i) for i in range(8)}
    for k, v in vals.items():
        a.put(k, v)
    assert set(a._locations) == set(vals)
    loc = a._locations["k3"]
    assert loc.segment != a.segment_name and loc.size == len(vals["k3"])
    calls = _Calls(a)
    for k, v in vals.items():
        assert a.get(k) == v
    # every get_replica_list was sent before the read and taken after it: none the usual way
    assert calls.begun == ["get_replica_list"] * len(vals)
    assert calls.called == []
    # a key never written or read by this client: the usual way (and remembered after)
    b = cl.client(transfer_config=TCP)
    b.put("other", b"x" * 4096)
    calls = _Calls(a)
    assert a.get("other") == b"x" * 4096
    assert calls.begun == [] and calls.called == ["get_replica_list"]
    assert "other" in a._locations


def test_a_stale_place_is_never_served(cluster_factory) -> None:
    """Another client removes the key and writes it again (another generation, another
    place or the same one with new bytes): the remembered read is not confirmed and the
    value comes from the master's answer; a key removed meanwhile is not found."""
    cl = cluster_factory()
    cl.store_server(32 * MiB, transports="local,tcp")
    a = cl.client(transfer_config=TCP)
    b = cl.client(transfer_config=TCP)
    old, new = b"o" * 65536, b"n" * 65536
    for round_ in range(6):
        key = f"stale-{round_}"
        a.put(key, old)
        before = a._locations[key]
        b.remove(key)
        if round_ % 2:  # a filler first: the new value lands elsewhere
            b.put(f"filler-{round_}", b"f" * 65536)
        b.put(key, new)
        calls = _Calls(a)
        assert a.get(key) == new
        assert calls.begun == ["get_replica_list"] and calls.called == []
        after = a._locations[key]  # the master's answer replaced the stale place
        assert after.generation != before.generation
    a.put("gone", old)
    b.remove("gone")
    with pytest.raises(StoreError) as e:
        a.get("gone")
    assert e.value.code == ErrorCode.OBJECT_NOT_FOUND
    assert "gone" not in a._locations


def test_corrupt_or_wrong_place_falls_back_to_the_usual_read(cluster_factory) -> None:
    """A remembered place that holds other bytes (here: another key's, same size and
    generation claimed) fails the answer's checks; the usual read serves the right value."""
    cl = cluster_factory()
    cl.store_server(32 * MiB, transports="local,tcp")
    a = cl.client(transfer_config=TCP)
    a.put("x", b"X" * 65536)
    a.put("y", b"Y" * 65536)
    lx, ly = a._locations["x"], a._locations["y"]
    a._locations["x"] = Location(ly.segment, ly.addr, lx.size, lx.generation)  # wrong place
    assert a.get("x") == b"X" * 65536
    assert a._locations["x"] == lx  # corrected from the answer
    a._locations["y"] = Location(ly.segment, ly.addr, ly.size, ly.generation + 99)
    assert a.get("y") == b"Y" * 65536


def test_locations_are_bounded() -> None:
    locs: dict[str, Location] = {}
    for i in range(LOCATIONS_MAX + 10):
        remember(locs, f"k{i}", Location("s", i, 1, 1))
    assert len(locs) == LOCATIONS_MAX
    assert "k0" not in locs and f"k{LOCATIONS_MAX + 9}" in locs
    remember(locs, "k20", Location("s", 0, 1, 2))  # refreshed: now the newest
    assert list(locs)[-1] == "k20"


def test_get_size_is_one_metadata_call_without_a_lease(cluster_factory) -> None:
    """``get_size`` asks the master's ``get_size`` (no replica list, no read lease): the
    key can be removed right after it (the replica-list way held a lease for its TTL)."""
    cl = cluster_factory("--default-kv-lease-ttl", "60000")
    cl.store_server(16 * MiB, transports="local,tcp")
    a = cl.client(transfer_config=TCP)
    a.put("s", b"z" * 5000)
    calls = _Calls(a)
    assert a.get_size("s") == 5000
    assert calls.called == ["get_size"]
    a.remove("s")  # no lease: removable at once
    with pytest.raises(StoreError) as e:
        a.get_size("s")
    assert e.value.code == ErrorCode.OBJECT_NOT_FOUND


class _Serves:
    """Counts the reads a client makes the usual way (``_serve``, after the answer): an
    overlapped get whose bytes the answer confirmed makes none."""

    def __init__(self, client) -> None:
        self.n = 0
        inner = client._serve

        def counted(plans):
            self.n += 1
            return inner(plans)

        client._serve = counted


def test_a_key_in_the_own_segment_is_copied_while_the_master_answers(cluster_factory
                                                                    ) -> None:
    """A key with a replica in the client's own segment is remembered there with the
    object's checksum (by a one-key put, and by a one-key get's answer): its get copies
    the bytes out of the segment between sending ``get_replica_list`` and taking the
    answer, and serves that copy (no read after the answer), at every size (the fused
    copy-and-hash from 4 MiB on). With a second, remote replica the own one is the one
    remembered; a key held only remotely is remembered remotely, without a checksum."""
    from pymooncake.store.checksum import digests
    from pymooncake.store.config import ReplicateConfig

    cl = cluster_factory()
    cl.store_server(16 * MiB, transports="local,tcp")
    a = cl.client(transfer_config=TCP, global_segment_size=32 * MiB)
    vals = {"small": os.urandom(1000), "kv": os.urandom(700 * 1024),
            "big": os.urandom(5 * MiB + 12345)}
    for k, v in vals.items():
        a.put(k, v, ReplicateConfig(preferred_segment=a.segment_name))
        loc = a._locations[k]
        assert loc.segment == a.segment_name and loc.size == len(v)
        assert loc.checksum == digests(v)
    a.put("both", b"b" * 8192, ReplicateConfig(replica_num=2))
    reps = a.replica_list("both").replicas
    assert {r.segment == a.segment_name for r in reps} == {True, False}
    assert a._locations["both"].segment == a.segment_name
    calls, serves = _Calls(a), _Serves(a)
    copied: list[int] = []   # own-segment copies: one a get, none by the Transfer Engine
    inner = a._copy_out
    a._copy_out = lambda views, sums: copied.extend(v.nbytes for v in views) or inner(
        views, sums)
    for k, v in [*vals.items(), ("both", b"b" * 8192)]:
        assert a.get(k) == v
    assert calls.begun == ["get_replica_list"] * 4 and calls.called == []
    assert serves.n == 0 and copied == [*map(len, vals.values()), 8192]
    other = next(r.segment for r in reps if r.segment != a.segment_name)
    a.put("far", b"f" * 8192, ReplicateConfig(preferred_segment=other))
    assert a._locations["far"].segment == other and a._locations["far"].checksum is None
    assert a.get("far") == b"f" * 8192
    # learnt from a read: forgotten, read the usual way, then remembered with its checksum
    del a._locations["kv"]
    calls, serves = _Calls(a), _Serves(a)
    assert a.get("kv") == vals["kv"] and calls.called == ["get_replica_list"]
    assert serves.n == 1 and a._locations["kv"].checksum == digests(vals["kv"])
    assert a.get("kv") == vals["kv"] and calls.begun == ["get_replica_list"]
    assert serves.n == 1


def test_batch_paths_and_large_objects_leave_own_places_alone(cluster_factory,
                                                             monkeypatch) -> None:
    """Own-segment places are remembered by the one-key paths only (a batch of KV blocks
    is read back in batches, which never look them up) and for objects of at most
    ``OWN_MAX_BYTES`` (their checksums are kept with them)."""
    from pymooncake.store import client_overlap

    cl = cluster_factory()
    a = cl.client(transfer_config=TCP, global_segment_size=16 * MiB)
    vals = [os.urandom(70_000 + i) for i in range(3)]
    a.batch_put([f"b{i}" for i in range(3)], vals)
    assert a.batch_get([f"b{i}" for i in range(3)]) == vals
    assert a._locations == {}
    assert a.get("b1") == vals[1] and set(a._locations) == {"b1"}
    monkeypatch.setattr(client_overlap, "OWN_MAX_BYTES", 100_000)
    big = os.urandom(100_001)
    a.put("big", big)
    assert "big" not in a._locations
    assert a.get("big") == big and "big" not in a._locations


def test_own_segment_copy_is_kept_only_when_the_answer_confirms_it(cluster_factory
                                                                   ) -> None:
    """The own-segment copy made ahead of the answer is dropped, and the value read the
    usual way, when the key was written again by another client (another generation,
    often the same place), when the remembered checksum is not the answer's (even if the
    bytes now there match it), or when the bytes fail it: a flipped byte in the only
    replica is ``CHECKSUM_MISMATCH``, never data; with a second replica elsewhere that
    one is served."""
    from pymooncake.store.checksum import digests
    from pymooncake.store.config import ReplicateConfig

    cl = cluster_factory()
    a = cl.client(transfer_config=TCP, global_segment_size=32 * MiB)
    b = cl.client(transfer_config=TCP)   # no segment: its puts land in a's
    serves = _Serves(a)
    for round_ in range(4):
        key, old, new = f"re-{round_}", os.urandom(300_000), os.urandom(300_000)
        a.put(key, old)
        before = a._locations[key]
        assert before.segment == a.segment_name
        b.remove(key)
        b.put(key, new)
        calls = _Calls(a)
        assert a.get(key) == new
        assert calls.begun == ["get_replica_list"] and calls.called == []
        assert serves.n == round_ + 1   # read again the usual way
        assert a._locations[key].generation != before.generation
    v = os.urandom(5 * MiB)
    a.put("sum", v)
    loc = a._locations["sum"]
    wrong = bytes([loc.checksum[0]]) + bytes(len(loc.checksum) - 1)
    a._locations["sum"] = loc._replace(checksum=wrong)  # verifies nothing: not kept
    assert a.get("sum") == v
    assert a._locations["sum"].checksum == loc.checksum   # from the answer
    # other bytes written in place, and remembered as if they were the object's: the
    # copy verifies against that checksum, but the answer's differs
    other = os.urandom(5 * MiB)
    view = a._local_view(loc.addr, loc.size)
    view[:] = memoryview(other)
    a._locations["sum"] = loc._replace(checksum=digests(other))
    with pytest.raises(StoreError) as e:
        a.get("sum")
    assert e.value.code == ErrorCode.CHECKSUM_MISMATCH
    w = os.urandom(5 * MiB)
    a.put("one", w)
    lo = a._locations["one"]
    a._local_view(lo.addr, lo.size)[lo.size // 3] ^= 0x20
    with pytest.raises(StoreError) as e:
        a.get("one")
    assert e.value.code == ErrorCode.CHECKSUM_MISMATCH
    cl.store_server(16 * MiB, transports="local,tcp")
    a.put("two", w, ReplicateConfig(replica_num=2))
    lt = a._locations["two"]
    assert lt.segment == a.segment_name
    a._local_view(lt.addr, lt.size)[7] ^= 0x01
    assert a.get("two") == w


def test_a_remembered_place_on_a_dead_segment_is_read_once(cluster_factory) -> None:
    """The remembered replica's server is killed: the overlapped read finds its peer down,
    the segment is marked failed at once, so the usual read with the master's answer goes
    to the live replica (not to the dead one a second time), and later gets skip it."""
    import types

    from pymooncake.store.config import ReplicateConfig

    from .test_store_processes import CountingPath

    cl = cluster_factory("--client-ttl", "60")  # the master never learns of the death here
    servers = [cl.store_server(8 * MiB, transports="local,tcp") for _ in range(2)]
    a = cl.client(transfer_config=TCP)
    v = os.urandom(65536)
    a.put("both", v, ReplicateConfig(replica_num=2))
    dead = a._locations["both"].segment
    live = next(s.info["segment"] for s in servers if s.info["segment"] != dead)
    assert {r.segment for r in a.replica_list("both").replicas} == {dead, live}
    a._rng = types.SimpleNamespace(  # the answer's order: the dead replica first
        shuffle=lambda reps: reps.sort(key=lambda r: r.segment != dead))
    counter = CountingPath(a)
    next(s for s in servers if s.info["segment"] == dead).kill()
    assert a.get("both") == v
    assert counter.by_segment == {dead: 1, live: 1}
    assert a._bad.get(dead, 0.0) > a._clock()
    assert a._locations["both"].segment == live  # remembered anew from the answer
    assert a.get("both") == v
    assert counter.by_segment == {dead: 1, live: 2}
