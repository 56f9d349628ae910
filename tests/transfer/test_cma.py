"""The ``cma`` transport: one kernel copy into a same-host peer's ordinary memory.

Real peer processes (tests/transfer/peer.py) that offer only ``local`` and ``cma``, so a
request that did not go over ``cma`` fails; expected bytes are regenerated here from the
peer's seed or compared by the BLAKE2b digest the peer computes. The guards of
``transports/cma.py`` — the anchor's token and name digest, and the owner's own table of
registered ranges — are checked across processes, against descriptors forged in the
metadata service, and (for a reused pid, which a test cannot arrange) on this process's
own anchor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from pymooncake.metadata import open_metadata
from pymooncake.obs.metrics import REGISTRY
from pymooncake.transfer import (
    StatusCode,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferState,
)
from pymooncake.transfer.segment import BufferDesc, SegmentDescriptor, segment_key
from pymooncake.transfer.transports import cma
from pymooncake.transfer.transports.local import CopyJob, run_copies


def _kernel_allows_cma() -> str:
    """Why cma cannot run here ("" when it can): the calls missing, or refused between
    two processes (a seccomp filter, missing CAP_SYS_PTRACE as root, Yama)."""
    if not cma.supported():
        return "no process_vm_writev/readv or pidfds"
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        with open(f"/proc/{child.pid}/maps") as f:
            addr = next(int(ln.split("-")[0], 16) for ln in f if ln.split()[1][0] == "r")
        cma._read(child.pid, addr, 16)
        return ""
    except (OSError, StopIteration) as e:
        return f"cross-memory reads between processes refused here ({e})"
    finally:
        child.kill()
        child.wait()


_WHY_NOT = _kernel_allows_cma()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT)]

MiB = 1 << 20
CMA_ONLY = "local,cma"


def digest(data: np.ndarray | bytes) -> str:
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()


def transport_bytes(transport: str) -> float:
    total = 0.0
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if (s.name == "pymooncake_transfer_bytes_total"
                    and s.labels.get("transport") == transport):
                total += s.value
    return total


def publish_raw(url: str, name: str, desc: SegmentDescriptor) -> None:
    """Write a descriptor into the metadata service as anyone with access could."""
    async def go() -> None:
        md = open_metadata(url)
        try:
            await md.put(segment_key(name), desc.encode())
        finally:
            await md.close()
    asyncio.run(go())


def copies(jobs: list[CopyJob]) -> list[tuple[list[int], str]]:
    """``run_copies`` outcome: one ``(indices, reason)`` per ``done`` call."""
    out: list[tuple[list[int], str]] = []
    run_copies(jobs, lambda js, reason, code: out.append(([j.index for j in js], reason)))
    return out


@pytest.fixture
def user(metadata_url: str):  # noqa: ANN201
    eng = TransferEngine(f"cma-user-{time.monotonic_ns()}", metadata_url,
                         config=TransferConfig(transports=("local", "cma"))).start()
    try:
        yield eng
    finally:
        eng.close()


def held_peer(eng: TransferEngine, name: str) -> cma.CmaPeer:
    """The peer as ``eng`` routes to it now, kept past later changes on the peer's side."""
    desc = eng._resolve(name)
    assert desc is not None and desc.cma_anchor
    peer = eng._router.cma.peer(desc.name, desc.pid, desc.cma_anchor, desc.cma_token)
    assert isinstance(peer, cma.CmaPeer), peer
    return peer


def test_cma_write_and_read_are_byte_exact(user: TransferEngine, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("cma-peer", size=8 * MiB, seed=5, transports=CMA_ONLY)
    want = peer.initial_bytes()
    local = np.zeros(8 * MiB, dtype=np.uint8)
    addr = user.register_memory(local)
    before = transport_bytes("cma")

    # a read of the whole buffer in uneven requests, through the copy thread
    cuts = [0, 1, 4096 + 7, 3 * MiB + 5, 8 * MiB]
    reqs = [TransferRequest(TransferOp.READ, addr + a, peer.name, peer.addr + a, b - a)
            for a, b in itertools.pairwise(cuts)]
    bid = user.allocate_batch(len(reqs))
    assert user.submit(bid, reqs) == 0
    assert all(s.state is TransferState.COMPLETED for s in user.wait(bid, timeout_s=30))
    user.free_batch(bid)
    assert np.array_equal(local, want)

    # a write at an odd offset, done in the calling thread
    src = np.random.default_rng(9).integers(0, 256, 3 * MiB, dtype=np.uint8)
    local[:3 * MiB] = src
    st = user.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr + 333, 3 * MiB)
    assert st.state is TransferState.COMPLETED, st
    assert peer.digest(peer.addr + 333, 3 * MiB) == digest(src)
    assert peer.digest(peer.addr, 333) == digest(want[:333])  # nothing before it touched
    assert transport_bytes("cma") - before == 8 * MiB + 3 * MiB


def test_cma_is_used_only_where_both_ends_offer_it(metadata_url: str, spawn_peer) -> None:  # noqa: ANN001
    plain = spawn_peer("no-cma-peer", size=MiB, seed=6)  # local,shm,tcp: no anchor
    offers = spawn_peer("cma-tcp-peer", size=MiB, seed=11, transports="local,cma,tcp")
    for ours, target, via in ((("local", "cma", "tcp"), plain, "tcp"),
                              (("local", "tcp"), offers, "tcp"),
                              (("local", "cma", "tcp"), offers, "cma")):
        with TransferEngine(f"cma-optin-{time.monotonic_ns()}", metadata_url,
                            config=TransferConfig(transports=ours)) as eng:
            local = np.zeros(MiB, dtype=np.uint8)
            addr = eng.register_memory(local)
            before = {t: transport_bytes(t) for t in ("cma", "tcp")}
            st = eng.transfer_sync(TransferOp.READ, addr, target.name, target.addr, MiB)
            assert st.state is TransferState.COMPLETED, (ours, target.name, st)
            assert np.array_equal(local, target.initial_bytes())
            moved = {t: transport_bytes(t) - before[t] for t in ("cma", "tcp")}
            assert moved == {via: MiB, ("tcp" if via == "cma" else "cma"): 0}, (ours, moved)


def test_withdrawn_memory_is_never_copied_whatever_the_descriptor(
        user: TransferEngine, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("cma-unreg", size=2 * MiB, seed=7, transports=CMA_ONLY)
    local = np.random.default_rng(10).integers(0, 256, MiB, dtype=np.uint8)
    first = local.copy()
    addr = user.register_memory(local)
    st = user.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr, MiB)
    assert st.state is TransferState.COMPLETED, st
    held = held_peer(user, peer.name)  # routed with the descriptor read before

    assert peer.ask(f"unregister {peer.addr}") == "ok"  # the memory stays allocated there
    local[:] = 0xAB
    out = copies([CopyJob(TransferOp.WRITE, addr, peer.addr, MiB, 0, 0, "cma", held),
                  CopyJob(TransferOp.READ, addr, peer.addr + MiB, 4096, 0, 1, "cma", held)])
    assert [i for i, _ in out] == [[0], [1]], out  # each its own reason (its range)
    assert all("outside every range segment 'cma-unreg' has registered" in r for _, r in out)
    st = user.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr, MiB)
    assert st.state is TransferState.FAILED, st  # through the engine too
    assert peer.digest(peer.addr, MiB) == digest(first)  # still the first write's bytes
    assert not (local != 0xAB).any()  # and nothing read from it


def test_a_closed_engine_is_not_copied_to(user: TransferEngine, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("cma-closed", size=MiB, seed=12, transports=CMA_ONLY)
    local = np.full(MiB, 0x11, dtype=np.uint8)
    addr = user.register_memory(local)
    held = held_peer(user, peer.name)
    assert copies([CopyJob(TransferOp.WRITE, addr, peer.addr, 4096, 0, 0, "cma", held)]) \
        == [([0], "")]
    assert peer.ask("close") == "ok"  # its process and buffer stay
    out = copies([CopyJob(TransferOp.WRITE, addr, peer.addr + 4096, 4096, 0, 0, "cma", held)])
    assert "outside every range" in out[0][1], out
    assert peer.digest(peer.addr + 4096, 4096) == digest(peer.initial_bytes()[4096:8192])


def test_forged_descriptors_reach_no_unregistered_memory(user: TransferEngine, spawn_peer,  # noqa: ANN001
                                                         metadata_url: str) -> None:
    victim = spawn_peer("cma-victim", size=MiB, seed=13, transports=CMA_ONLY)
    real = user._resolve(victim.name)
    assert real is not None
    wide = (BufferDesc(victim.addr, 64 * MiB),)  # far past what the victim registered
    local = np.full(4096, 0x5A, dtype=np.uint8)
    addr = user.register_memory(local)
    beyond = victim.addr + 2 * MiB

    # 1. the victim's own name rewritten with a wider buffer: its table still decides
    publish_raw(metadata_url, victim.name, dataclasses.replace(real, buffers=wide))
    st = user._resolve(victim.name, True)
    assert st is not None and st.buffers == wide
    st = user.transfer_sync(TransferOp.WRITE, addr, victim.name, beyond, 4096)
    assert st.state is TransferState.FAILED and "outside every range" in st.reason, st

    # 2. another name pointing at the victim's pid and anchor: the name digest differs
    publish_raw(metadata_url, "cma-evil", dataclasses.replace(real, name="cma-evil",
                                                              buffers=wide))
    st = user.transfer_sync(TransferOp.WRITE, addr, "cma-evil", victim.addr, 4096)
    assert st.state is TransferState.FAILED and st.code is StatusCode.INVALID_ARGUMENT, st
    assert "cma refused" in st.reason and "does not hold its anchor" in st.reason, st

    # 3. another host, or no cma in its transports: not tried at all
    for i, forged in enumerate((dataclasses.replace(real, host_id="elsewhere"),
                                dataclasses.replace(real, transports=("local",)))):
        publish_raw(metadata_url, f"cma-forged-{i}", dataclasses.replace(forged,
                                                                         name=f"cma-forged-{i}"))
        st = user.transfer_sync(TransferOp.WRITE, addr, f"cma-forged-{i}", victim.addr, 4096)
        assert st.state is TransferState.FAILED and "no common transport" in st.reason, st
        assert "cma refused" not in st.reason, st
    assert victim.digest(victim.addr, MiB) == digest(victim.initial_bytes())


def test_a_killed_peer_fails_at_once(user: TransferEngine, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("cma-dead", size=MiB, seed=8, transports=CMA_ONLY)
    local = np.zeros(MiB, dtype=np.uint8)
    addr = user.register_memory(local)
    st = user.transfer_sync(TransferOp.READ, addr, peer.name, peer.addr, MiB)
    assert st.state is TransferState.COMPLETED, st
    held = held_peer(user, peer.name)
    assert held.alive()
    peer.kill()
    assert not held.alive()  # its pidfd: the pid can be reused, this peer stays dead
    out = copies([CopyJob(TransferOp.WRITE, addr + i * 4096, peer.addr + i * 4096, 4096, 0, i,
                          "cma", held) for i in range(6)])
    assert len(out) == 1 and out[0][0] == list(range(6)), out  # one reason, one report
    assert "has exited" in out[0][1], out
    t0 = time.monotonic()
    bid = user.allocate_batch(1)
    user.submit(bid, [TransferRequest(TransferOp.WRITE, addr, peer.name, peer.addr, MiB)])
    (st,) = user.wait(bid, timeout_s=10)
    assert st.state is TransferState.FAILED, st
    assert "has exited" in st.reason, st.reason
    assert time.monotonic() - t0 < 5


def test_a_closed_engine_stays_closed_to_cma(user: TransferEngine, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("cma-close-unreg", size=MiB, seed=14, shm_size=MiB,
                      transports=CMA_ONLY)
    local = np.full(4096, 0x77, dtype=np.uint8)
    addr = user.register_memory(local)
    held = held_peer(user, peer.name)
    assert peer.ask("close") == "ok"
    assert peer.ask(f"unregister {peer.shm_addr}") == "ok"  # a change after close
    out = copies([CopyJob(TransferOp.WRITE, addr, peer.addr, 4096, 0, 0, "cma", held)])
    assert "outside every range" in out[0][1], out
    assert peer.digest(peer.addr, 4096) == digest(peer.initial_bytes()[:4096])


def test_a_descriptor_under_another_name_is_refused(user: TransferEngine, spawn_peer,  # noqa: ANN001
                                                    metadata_url: str) -> None:
    victim = spawn_peer("cma-alias-victim", size=MiB, seed=15, transports=CMA_ONLY)
    real = user._resolve(victim.name)
    assert real is not None
    publish_raw(metadata_url, "cma-alias", real)  # the victim's own descriptor, name and all
    local = np.full(4096, 0x66, dtype=np.uint8)
    addr = user.register_memory(local)
    st = user.transfer_sync(TransferOp.WRITE, addr, "cma-alias", victim.addr, 4096)
    assert st.state is TransferState.FAILED and "does not hold its anchor" in st.reason, st
    assert victim.digest(victim.addr, MiB) == digest(victim.initial_bytes())


def test_ranges_past_the_address_space_are_refused(metadata_url: str, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("cma-wrap", size=MiB, seed=16, transports="local,cma,tcp")
    for ours in (("local", "cma"), ("local", "tcp")):
        with TransferEngine(f"wrap-{time.monotonic_ns()}", metadata_url,
                            config=TransferConfig(transports=ours)) as eng:
            with pytest.raises(ValueError, match=r"2\*\*64"):
                eng.register_memory_at((1 << 64) - 4096, 1 << 48)
            local = np.zeros(4096, dtype=np.uint8)
            addr = eng.register_memory(local)
            st = eng.transfer_sync(TransferOp.WRITE, addr, peer.name, (1 << 64) + peer.addr,
                                   4096)
            assert st.state is TransferState.FAILED, (ours, st)
            assert st.code is StatusCode.INVALID_ARGUMENT and "64-bit" in st.reason, st
    assert peer.digest(peer.addr, MiB) == digest(peer.initial_bytes())


def pidfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    return n


def test_departed_peers_leave_no_pidfd_behind(user: TransferEngine, spawn_peer) -> None:  # noqa: ANN001
    base = pidfds()
    local = np.zeros(4096, dtype=np.uint8)
    addr = user.register_memory(local)
    for i in range(5):  # the last one exits and is asked for again
        peer = spawn_peer(f"cma-transient-{i}", size=MiB, seed=20 + i, transports=CMA_ONLY)
        st = user.transfer_sync(TransferOp.READ, addr, peer.name, peer.addr, 4096)
        assert st.state is TransferState.COMPLETED, st
        assert pidfds() - base <= 2  # this one's, and at most the last departed one's
        if i % 2:
            peer.kill()  # gone without a word: its pidfd goes at the next probe
        else:
            assert peer.proc.stdin is not None
            peer.proc.stdin.write("exit\n")  # withdrawn: the next request to it forgets it
            peer.proc.stdin.flush()
            peer.proc.wait(timeout=10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                st = user.transfer_sync(TransferOp.READ, addr, peer.name, peer.addr, 4096)
                if st.code is StatusCode.NOT_FOUND:
                    break
                time.sleep(0.05)
            assert st.code is StatusCode.NOT_FOUND, st
    assert pidfds() == base
    anchor = cma.CmaAnchor("me-again")
    assert isinstance(user._router.cma.peer("me-again", os.getpid(), anchor.addr,
                                            anchor.token.hex()), cma.CmaPeer)
    assert pidfds() == base + 1
    user._router.cma.close()
    assert pidfds() == base
    assert user._router.cma.peer("me-again", os.getpid(), anchor.addr,
                                 anchor.token.hex()) == "the engine is closed"
    assert pidfds() == base  # closed: nothing held open


def test_numpy_addresses_cannot_wrap_the_check(user: TransferEngine) -> None:
    local = np.zeros(8192, dtype=np.uint8)
    addr = user.register_memory(local)
    near_top = np.uint64((1 << 64) - 4096)
    st = user.transfer_sync(TransferOp.WRITE, addr, user.name, near_top, np.uint64(8192))
    assert st.state is TransferState.FAILED and st.code is StatusCode.INVALID_ARGUMENT, st
    assert "64-bit" in st.reason
    st = user.transfer_sync(TransferOp.WRITE, addr, user.name, float(addr), 16)
    assert st.code is StatusCode.INVALID_ARGUMENT and "integers" in st.reason, st
