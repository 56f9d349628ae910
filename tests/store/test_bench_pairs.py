"""``bench store`` runs the two stores side by side, their puts (then gets) alternating
chunk by chunk (issue 16: a swing in the host's speed hits both alike). Stand-in stores."""

from __future__ import annotations

import time

import pytest

from pymooncake.bench.store import CHUNKS, _run_pair, _Side


def _side(tag: str, log: list[tuple[str, str]], slow=lambda: False):  # noqa: ANN001, ANN202
    data: dict[str, bytes] = {}

    def put(k: str, v: bytes) -> None:
        log.append((tag, "put"))
        time.sleep(0.003 if slow() else 0.001)
        data[k] = v

    def get(k: str) -> bytes:
        log.append((tag, "get"))
        time.sleep(0.003 if slow() else 0.001)
        return data[k]

    return _Side(tag, put, get, lambda k: data.pop(k), []), data


def test_puts_then_gets_alternate_chunk_by_chunk_and_every_value_is_checked() -> None:
    log: list[tuple[str, str]] = []
    (a, da), (b, db) = _side("a", log), _side("b", log)
    out = _run_pair([a, b], 64, 16)
    timed = log[4:]                      # after each side's warm-up put and get
    step = 16 // CHUNKS
    want = [(t, op) for op in ("put", "get") for n in range(CHUNKS)
            for t in (("a", "b") if n % 2 == 0 else ("b", "a")) for _ in range(step)]
    assert timed == want                 # A B, B A, A B, ... chunk by chunk
    assert da == {} and db == {}          # removed at the end
    for put, get in out:
        assert put["count"] == get["count"] == 16
        assert put["verified"] is True and get["verified"] is True
        assert 0.0009 < put["p50_s"] < 0.01


def test_a_wrong_value_read_back_is_not_verified() -> None:
    log: list[tuple[str, str]] = []
    a, _ = _side("a", log)
    real_get = a.get
    a.get = lambda k: b"x" if k.endswith("-3") else real_get(k)
    (put, get), = _run_pair([a], 16, 8)
    assert get["verified"] is False


def test_a_slow_spell_hits_both_stores_alike() -> None:
    """From 40 % of the run on, every call is 3x slower. Chunk by chunk both stores meet
    the spell in their gets; store by store (the old harness), the second would have."""
    log: list[tuple[str, str]] = []
    start = time.perf_counter()
    slow = lambda: time.perf_counter() - start > 0.4 * 0.13  # noqa: E731 - ~64 calls of 2 ms
    (a, _), (b, _) = _side("a", log, slow), _side("b", log, slow)
    (pa, ga), (pb, gb) = _run_pair([a, b], 64, 16)
    assert pa["throughput_bytes_per_s"] / pb["throughput_bytes_per_s"] == pytest.approx(1, abs=0.35)
    assert ga["throughput_bytes_per_s"] / gb["throughput_bytes_per_s"] == pytest.approx(1, abs=0.35)


class _Driver:
    """A stand-in for one side's metadata clients: a call costs ``cost()`` seconds."""

    def __init__(self, side: str, log: list, cost) -> None:  # noqa: ANN001
        self.side, self.log, self.cost = side, log, cost

    def phase(self, op: str, lo: int, hi: int) -> tuple[float, int, bool]:
        self.log.append((self.side, op, lo, hi))
        return (hi - lo) * self.cost(), hi - lo, True


def test_metadata_sides_take_their_sub_phases_in_turn() -> None:
    from pymooncake.bench.store_meta import OPS, alternate

    log: list = []
    out = alternate([_Driver("ours", log, lambda: 1e-5), _Driver("mooncake", log,
                                                                  lambda: 2e-5)], 100, 4)
    assert log == [(side, op, lo, lo + 25) for op in OPS for lo in (0, 25, 50, 75)
                   for side in (("ours", "mooncake") if lo % 50 == 0 else ("mooncake", "ours"))]
    assert out["ours"]["remove"][0] == pytest.approx(1e5)
    assert out["mooncake"]["is_exist"] == (pytest.approx(5e4), True)


def test_metadata_a_slow_spell_hits_both_sides_alike() -> None:
    from pymooncake.bench.store_meta import alternate

    calls = [0]

    def cost() -> float:   # the second half of every op kind's calls runs 3x slower
        calls[0] += 1
        return 3e-5 if calls[0] % 8 >= 4 else 1e-5

    log: list = []
    out = alternate([_Driver("ours", log, cost), _Driver("mooncake", log, cost)], 100, 4)
    for op, (ops_s, _) in out["ours"].items():
        assert ops_s / out["mooncake"][op][0] == pytest.approx(1.0)


def _worker_that_fails_once(side, addr, md, wid, n, batch, keys, barrier, cmds, q):  # noqa: ANN001, ANN201
    """A stand-in client process: number 1 fails to start, the others wait for orders."""
    if wid == 1:
        q.put((wid, "RuntimeError('setup failed')"))
        return
    q.put((wid, "ready"))
    while cmds.get() is not None:
        pass


def test_a_client_that_fails_to_start_takes_its_siblings_down(monkeypatch) -> None:  # noqa: ANN001
    from pymooncake.bench import store_meta

    monkeypatch.setattr(store_meta, "_worker", _worker_that_fails_once)
    made = []
    real_init = store_meta._Clients.__init__

    def init(self, *a, **k) -> None:  # noqa: ANN001, ANN002, ANN003
        made.append(self)
        real_init(self, *a, **k)

    monkeypatch.setattr(store_meta._Clients, "__init__", init)
    with pytest.raises(RuntimeError, match="setup failed"):
        store_meta._Clients("ours", "127.0.0.1:1", "http://127.0.0.1:1/metadata", 3, 10, 16,
                            ["k"])
    assert [p.is_alive() for p in made[0].procs] == [False, False, False]
