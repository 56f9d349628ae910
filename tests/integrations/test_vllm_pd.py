"""P/D over the Transfer Engine, the parts that need no vLLM: holds and the read plan
(in-process stand-in for the Store client; the real processes are in
test_vllm_connector.py)."""

from __future__ import annotations

import msgpack

from pymooncake.integrations.vllm.pd import (
    HOLD_TIMEOUT_S,
    LAYOUT_PREFIX,
    LEASE_MARGIN_S,
    DirectLoad,
    Holds,
    direct_load,
    direct_tokens,
    done_key,
    grant_lease,
    lease_key,
    lease_problem,
    read_blocks,
)
from pymooncake.store.datapath import MoveResult
from pymooncake.store.errors import ErrorCode, StoreError


class FakeClient:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.moves: list = []
        self.fail_addrs: set[int] = set()
        self.segment_name = "me"
        self._dp = self
        self.during_read = None

    def put(self, key: str, value: bytes) -> None:
        self.objects[key] = bytes(value)

    def get(self, key: str) -> bytes:
        if key not in self.objects:
            raise StoreError(ErrorCode.OBJECT_NOT_FOUND, key)
        return self.objects[key]

    def remove(self, key: str, force: bool = False) -> None:
        self.objects.pop(key, None)

    def batch_exist(self, keys):
        return [k in self.objects for k in keys]

    def run(self, moves):
        self.moves += moves
        if self.during_read:
            self.during_read()
        return [MoveResult(m.local_addr not in self.fail_addrs) for m in moves]


def test_holds_release_on_marker_or_timeout_removing_the_lease_first() -> None:
    now = [100.0]
    c = FakeClient()
    h = Holds("P", clock=lambda: now[0])
    for r in ("r1", "r2"):
        grant_lease(c, "P", r, HOLD_TIMEOUT_S, clock=lambda: 5000.0)
    h.add(["r1", "r2"])
    assert h.released(c) == (set(), set())
    c.put(done_key("P", "r1"), b"1")
    now[0] += 0.001                      # inside the poll interval: no lookup
    assert h.released(c) == (set(), set())
    now[0] += 1
    assert h.released(c) == ({"r1"}, set())      # read by its decode
    assert done_key("P", "r1") not in c.objects and lease_key("P", "r1") not in c.objects
    assert lease_key("P", "r2") in c.objects
    now[0] += HOLD_TIMEOUT_S
    assert h.released(c) == (set(), {"r2"}) and h.held == {}   # timed out, lease gone
    assert lease_key("P", "r2") not in c.objects


def test_a_timed_out_hold_whose_lease_cannot_be_removed_waits_past_the_margin() -> None:
    now = [0.0]
    c = FakeClient()
    h = Holds("P", clock=lambda: now[0], hold_s=10.0)
    grant_lease(c, "P", "r", 10.0)
    h.add(["r"])

    def down(key, force=False):
        raise OSError("store down")
    c.remove = down
    now[0] = 10.0
    assert h.released(c) == (set(), set()) and "r" in h.held      # kept, retried
    now[0] = 10.0 + LEASE_MARGIN_S
    assert h.released(c) == (set(), {"r"})   # every decode now sees the lease expired


def _pd_client(expires_in: float = 60.0) -> tuple[FakeClient, DirectLoad]:
    c = FakeClient()
    c.put(LAYOUT_PREFIX + "P", msgpack.packb({"segment": "p-seg", "bases": [1000],
                                              "block_bytes": 10, "namespace": "ns"}))
    token = grant_lease(c, "P", "r9", expires_in, clock=lambda: 1000.0)
    return c, DirectLoad("d1", "P", "r9", [3, 4], [6, 7], token)


def test_lease_problem_names_released_expired_and_another_generation() -> None:
    c, ld = _pd_client(expires_in=60.0)
    assert lease_problem(c, ld, clock=lambda: 1000.0) is None
    assert "expires in" in lease_problem(c, ld, clock=lambda: 1060.0 - LEASE_MARGIN_S)
    assert "another generation" in lease_problem(
        c, DirectLoad("d1", "P", "r9", [3], [6], "other-token"), clock=lambda: 1000.0)
    assert lease_problem(c, DirectLoad("d1", "P", "r9", [3], [6]), lambda: 1000.0) == \
        "no lease in kv_transfer_params"
    c.remove(lease_key("P", "r9"))
    assert "released by the prefill instance" in lease_problem(c, ld, clock=lambda: 1000.0)


def test_a_lease_released_during_the_read_fails_every_block_and_puts_no_marker(caplog
                                                                              ) -> None:
    """The prefill's hold ends while the READs run (it removes the lease, then hands the
    blocks back): the check after the read sees it, so the read is never a success."""
    c, ld = _pd_client()
    c.during_read = lambda: c.remove(lease_key("P", "r9"))
    done, failed = read_blocks(c, [ld], [100], 10, "ns", {}, clock=lambda: 1000.0)
    assert done == {"d1"} and failed == {6, 7} and len(c.moves) == 2
    assert done_key("P", "r9") not in c.objects
    assert "not live after the read: released by the prefill instance" in caplog.text


def test_a_lease_released_or_expired_before_the_read_reads_nothing(caplog) -> None:
    c, ld = _pd_client(expires_in=60.0)
    done, failed = read_blocks(c, [ld], [100], 10, "ns", {}, clock=lambda: 1058.0)
    assert done == {"d1"} and failed == {6, 7} and c.moves == []      # expiring: no READ
    assert "not live before the read: lease expires in 2.0 s" in caplog.text
    c.remove(lease_key("P", "r9"))
    done, failed = read_blocks(c, [ld], [100], 10, "ns", {}, clock=lambda: 1000.0)
    assert failed == {6, 7} and c.moves == [] and done_key("P", "r9") not in c.objects


def test_a_live_lease_reads_and_marks_done() -> None:
    c, ld = _pd_client()
    done, failed = read_blocks(c, [ld], [100], 10, "ns", {}, clock=lambda: 1000.0)
    assert done == {"d1"} and failed == set() and done_key("P", "r9") in c.objects


def test_read_blocks_moves_every_layer_and_marks_done() -> None:
    c = FakeClient()
    c.put(LAYOUT_PREFIX + "P", msgpack.packb({"segment": "p-seg", "bases": [1000, 5000],
                                              "block_bytes": 10, "namespace": "ns"}))
    c.fail_addrs = {200 + 7 * 10}        # layer 1 of local block 7 fails
    token = grant_lease(c, "P", "r9", HOLD_TIMEOUT_S)
    done, failed = read_blocks(c, [DirectLoad("d1", "P", "r9", [3, 4], [6, 7], token)],
                               [100, 200], 10, "ns", {})
    assert done == {"d1"} and failed == {7}
    assert [(m.write, m.local_addr, m.segment, m.target_addr, m.length) for m in c.moves] == [
        (False, 160, "p-seg", 1030, 10), (False, 170, "p-seg", 1040, 10),
        (False, 260, "p-seg", 5030, 10), (False, 270, "p-seg", 5040, 10)]
    assert done_key("P", "r9") in c.objects


def test_read_blocks_refuses_another_namespace_or_a_missing_layout() -> None:
    c = FakeClient()
    c.put(LAYOUT_PREFIX + "P", msgpack.packb({"segment": "s", "bases": [0], "block_bytes": 10,
                                              "namespace": "other"}))
    loads = [DirectLoad("a", "P", "r", [1], [2], grant_lease(c, "P", "r", 60.0)),
             DirectLoad("b", "Q", "r", [1], [3], grant_lease(c, "Q", "r", 60.0))]
    done, failed = read_blocks(c, loads, [100], 10, "ns", {})
    assert done == {"a", "b"} and failed == {2, 3} and c.moves == []


def test_direct_tokens_and_load_cover_the_blocks_vllm_lacks() -> None:
    params = {"pymooncake_pd": "decode", "engine": "P", "remote_req": "r7",
              "remote_block_ids": [10, 11, 12], "lease": "t"}  # 10 tokens, blocks of 4
    assert direct_tokens(params, 10, 0, 4) == 10
    assert direct_tokens(params, 10, 4, 4) == 6       # vLLM had block 0 itself
    assert direct_tokens(params, 13, 0, 4) == 0       # 3 remote blocks cannot hold 13
    assert direct_tokens({"pymooncake_pd": "decode"}, 10, 0, 4) == 0   # no engine: Store
    assert direct_load("d", params, 10, 6, 4, [5, 6, 7]) == DirectLoad(
        "d", "P", "r7", [11, 12], [6, 7], "t")
    assert direct_load("d", params, 10, 10, 4, [5, 6, 7]) == DirectLoad(
        "d", "P", "r7", [10, 11, 12], [5, 6, 7], "t")
