"""The soak Store checker's final pass (``bench.soak_checks.StoreChecker.stop``): which
objects it calls lost. A client-side ``OBJECT_NOT_FOUND`` (replicas skipped or failed)
while the master still lists the key is retried, never counted lost (the short soak's
"lost" objects in two CI runs); only a key the master no longer knows is lost, or gone
with every holder when all its holders were killed after the put. No sockets: a fake
client stands in for ``StoreClient``."""

from __future__ import annotations

from pymooncake.bench.soak_checks import GONE, StoreChecker, _value
from pymooncake.store.errors import ErrorCode, StoreError


class FakeClient:
    """``get`` answers from ``reads[key]`` in turn (the last one repeats); ``replica_list``
    raises ``OBJECT_NOT_FOUND`` for keys in ``forgotten`` (the master's answer)."""

    def __init__(self, reads: dict[str, list[str]], forgotten: set[str]) -> None:
        self.reads, self.forgotten = reads, forgotten
        self.gets: dict[str, int] = {}
        self.closed = False

    def get(self, key: str) -> bytes:
        n = self.gets[key] = self.gets.get(key, 0) + 1
        seq = self.reads[key]
        out = seq[min(n, len(seq)) - 1]
        if out == "ok":
            return _value(key, 8 << 10)
        raise StoreError(ErrorCode[out], f"{key!r}: no reachable replica")

    def replica_list(self, key: str) -> object:
        if key in self.forgotten:
            raise StoreError(ErrorCode.OBJECT_NOT_FOUND, f"key {key!r} not found")
        return object()

    def close(self) -> None:
        self.closed = True


def _checker(client: FakeClient, objects: dict[str, tuple[float, tuple[str, ...]]]
             ) -> StoreChecker:
    ck = StoreChecker(hosts=None, master="unused", every_s=3600)  # type: ignore[arg-type]
    ck.client = client
    ck.objects = dict(objects)
    ck._thread.start()  # the put loop: stopped at once by stop()
    return ck


def test_client_side_miss_is_retried_and_verified_not_lost():
    h3 = "10.0.0.13:200:aa"
    client = FakeClient({"soak/1": ["OBJECT_NOT_FOUND", "OBJECT_NOT_FOUND", "ok"],
                         "soak/2": ["ok"]}, forgotten=set())
    ck = _checker(client, {"soak/1": (1.0, ("10.0.0.12:100:bb", h3)),
                           "soak/2": (1.0, (h3, "prefill-a-kv"))})
    rep = ck.stop(killed=[(2.0, "10.0.0.12:100:")])
    assert rep["objects_lost"] == 0
    assert rep["objects_unreadable_at_end"] == 0
    assert rep["reads_verified"] == 2 and rep["bytes_verified"] == 2 * 8192
    assert client.gets == {"soak/1": 3, "soak/2": 1}
    assert client.closed


def test_key_the_master_forgot_is_lost_or_gone_with_its_killed_holders():
    client = FakeClient({k: ["OBJECT_NOT_FOUND"] for k in ("soak/1", "soak/2", "soak/3")},
                        forgotten={"soak/1", "soak/2", "soak/3"})
    ck = _checker(client, {
        "soak/1": (1.0, ("10.0.0.12:100:bb", "10.0.0.13:200:aa")),  # h3 holder never killed
        "soak/2": (1.0, ("10.0.0.12:100:bb", "prefill-b-kv")),      # both holders killed
        "soak/3": (9.0, ("10.0.0.12:100:bb", "prefill-b-kv"))})     # put after the kills
    rep = ck.stop(killed=[(2.0, "10.0.0.12:100:"), (3.0, "prefill-b-kv")])
    assert rep["objects_lost"] == 2
    assert rep["objects_lost_examples"] == ["soak/1", "soak/3"]
    assert rep["objects_gone_with_every_holder"] == 1
    assert rep["final_read_errors"] == {GONE: 3}
    assert client.gets == {"soak/1": 1, "soak/2": 1, "soak/3": 1}  # final: not retried
