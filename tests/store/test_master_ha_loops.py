"""The HA background loops of a master never end silently (in-process, embedded metadata):
an unexpected error in the journal tail or the election loop is logged as an ERROR with
its traceback, shown in ``ha_status``, and the loop goes on (following, campaigning)."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from pymooncake.metadata.election import LeaderElection
from pymooncake.rpc import RpcClient, RpcError
from pymooncake.store.config import MasterConfig
from pymooncake.store.master.ha import HaConfig
from pymooncake.store.master.ha_follow import JournalTail
from pymooncake.store.master.service import MasterService


async def _until(pred, what: str, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.02)


def test_an_error_in_the_tail_or_the_election_loop_is_logged_and_the_loop_goes_on(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        cfg = HaConfig(f"embedded://loops-{uuid.uuid4().hex[:8]}", "c", lease_ttl_s=1.0)
        a = MasterService(MasterConfig(port=0), ha=cfg)
        await a.start()
        b = None
        try:
            await _until(lambda: a.ha.leading, "a never led")
            rpc = RpcClient("127.0.0.1", a.port)
            await rpc.call("mount_segment", {"client_id": "w", "segment": "S", "host": "h",
                                             "base_addr": 1 << 20, "size_bytes": 1 << 20})
            await rpc.close()
            # (from now on only b tails and campaigns: the leader does neither)
            real_catch_up, real_campaign = JournalTail.catch_up, LeaderElection.campaign
            fails = {"tail": 2, "election": 2}

            async def bad_catch_up(self: JournalTail) -> bool:
                if fails["tail"] > 0:
                    fails["tail"] -= 1
                    raise RuntimeError("tail bug")
                return await real_catch_up(self)

            async def bad_campaign(self: LeaderElection, timeout_s: float | None = None) -> bool:
                if fails["election"] > 0:
                    fails["election"] -= 1
                    raise RuntimeError("election bug")
                return await real_campaign(self, timeout_s)

            monkeypatch.setattr(JournalTail, "catch_up", bad_catch_up)
            monkeypatch.setattr(LeaderElection, "campaign", bad_campaign)
            b = MasterService(MasterConfig(port=0), ha=cfg)
            with caplog.at_level(logging.WARNING):
                await b.start()
                await _until(lambda: fails == {"tail": 0, "election": 0}, "never failed")
                await _until(lambda: b.ha.index.applied_seq == a.ha.index.applied_seq > 0,
                             f"the tail stopped: {b.ha.status()}")
                st = b.ha.status()
                assert st["follower_alive"] and st["candidate"], st
                assert "RuntimeError" in st["last_error"], st
                b.ha._campaign.cancel()  # a stray cancellation ends the election loop
                await _until(lambda: not b.ha._campaign.cancelled(), "not restarted")
                await asyncio.sleep(0.1)
                assert b.ha.status()["candidate"] and "election task ended" in \
                    b.ha.status()["last_error"]
                await a.stop()  # b must still campaign, and win
                await _until(lambda: b.ha.leading, f"b never led: {b.ha.status()}")
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert {("tail bug" in str(r.exc_info[1]), "election bug" in str(r.exc_info[1]))
                    for r in errors if r.exc_info} >= {(True, False), (False, True)}
        finally:
            for s in (b, a):
                if s is not None:
                    await s.stop()

    asyncio.run(main())


def test_a_put_whose_journal_write_is_in_flight_at_a_step_down_is_answered_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal entry being written when the leader steps down is failed with the rest
    (it was left pending: its put never got an answer)."""
    async def main() -> None:
        cfg = HaConfig(f"embedded://inflight-{uuid.uuid4().hex[:8]}", "c", lease_ttl_s=1.0)
        a = MasterService(MasterConfig(port=0), ha=cfg)
        await a.start()
        rpc = None
        try:
            await _until(lambda: a.ha.leading, "a never led")
            rpc = RpcClient("127.0.0.1", a.port, timeout_s=10.0)
            await rpc.call("mount_segment", {"client_id": "w", "segment": "S", "host": "h",
                                             "base_addr": 1 << 20, "size_bytes": 1 << 20})
            stuck = asyncio.Event()

            async def hang(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
                stuck.set()
                await asyncio.sleep(3600)  # a write that never ends (etcd unreachable)

            monkeypatch.setattr(a.ha.md, "guarded_write", hang)
            put = asyncio.ensure_future(rpc.call("put_start", {
                "client_id": "w", "key": "k", "size_bytes": 4096, "config": None}))
            await asyncio.wait_for(stuck.wait(), 5)
            await a.ha.election.abandon()  # the lease is gone: the leader steps down
            with pytest.raises(RpcError) as e:
                await asyncio.wait_for(put, 5)
            assert e.value.code == "UNAVAILABLE_IN_CURRENT_STATUS"
        finally:
            if rpc is not None:
                await rpc.close()
            await a.stop()

    asyncio.run(main())
