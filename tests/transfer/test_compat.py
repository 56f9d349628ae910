"""The Mooncake-compatible facade, in Mooncake's own idiom, against a peer process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from pymooncake.transfer.compat import TransferEngine

pytestmark = pytest.mark.integration

TARGET = textwrap.dedent("""
    import sys
    from pymooncake.transfer.compat import TransferEngine
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    addr = te.allocate_managed_buffer(1 << 20)
    assert te.write_bytes_to_buffer(addr, bytes(range(256)) * 4096, 1 << 20) == 0
    print(f"127.0.0.1:{te.get_rpc_port()} {addr}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "read":
            print(te.read_bytes_from_buffer(int(cmd[1]), int(cmd[2])).hex(), flush=True)
        else:
            break
    te.close()
""")


@pytest.fixture
def target():  # noqa: ANN201
    proc = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        name, addr = proc.stdout.readline().split()
        yield proc, name, int(addr)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_mooncake_idiom_p2p_handshake(target) -> None:  # noqa: ANN001
    proc, segment, remote = target
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        assert te.get_local_segment_name() == f"127.0.0.1:{te.get_rpc_port()}"
        assert te.get_first_buffer_address(segment) == remote
        local = te.allocate_managed_buffer(64 * 1024)
        assert local != 0
        # read the target's pattern: bytes(range(256)) repeated
        assert te.transfer_sync_read(segment, local, remote + 10, 1000) == 0
        assert te.read_bytes_from_buffer(local, 1000) == bytes((10 + i) % 256
                                                               for i in range(1000))
        # write, then the target reads its own memory back
        payload = b"mooncake" * 512
        assert te.write_bytes_to_buffer(local, payload, len(payload)) == 0
        assert te.transfer_sync_write(segment, local, remote + 4096, len(payload)) == 0
        assert ask(proc, f"read {remote + 4096} {len(payload)}") == payload.hex()
        # batch, async: a batch id, then status 1 (done)
        bid = te.batch_transfer_async_write(segment, [local, local + 8], [remote, remote + 100],
                                            [8, 8])
        assert bid != 0
        deadline = time.monotonic() + 10
        while (st := te.transfer_check_status(bid)) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert st == 1
        assert ask(proc, f"read {remote} 8") == payload[:8].hex()
        bid = te.batch_transfer_async_read(segment, [local], [remote], [16])
        assert te.get_batch_transfer_status([bid]) == 0
        # The generic opcode forms.
        op = TransferEngine.TransferOpcode
        assert te.transfer_sync(segment, local, remote + 200, 8, op.Write) == 0
        assert te.batch_transfer_sync(segment, [local + 8], [remote + 300], [8], op.Read) == 0
        assert te.read_bytes_from_buffer(local + 8, 8) == bytes(range(300 % 256, 308 % 256))
        bid = te.batch_transfer_async(segment, [local], [remote + 400], [8], op.Write)
        assert te.get_batch_transfer_status([bid]) == 0
        assert ask(proc, f"read {remote + 400} 8") == payload[:8].hex()
        # Mooncake's failure conventions: -1 for out-of-range, unknown segment, bad args.
        assert te.transfer_sync_write(segment, local, remote + (1 << 20) - 4, 8) == -1
        assert te.transfer_sync_write("127.0.0.1:1", local, remote, 8) == -1
        assert te.batch_transfer_sync_write(segment, [local], [remote, remote], [8]) == -1
        assert te.batch_transfer_async_write(segment, [local], [], [8]) == 0
        # Every request refused at submit: "batch id, 0 on failure" (review finding 2).
        assert te.batch_transfer_async_write(segment, [local], [remote + (1 << 20)], [8]) == 0
        assert te.batch_transfer_async_read(segment, [0x1000], [remote], [16]) == 0
        # Only some refused: the batch started, so an id; its status reports the failure.
        bid = te.batch_transfer_async_write(segment, [local, local], [remote + (1 << 20),
                                                                      remote + 500], [8, 8])
        assert bid != 0
        assert te.get_batch_transfer_status([bid]) == -1
        assert ask(proc, f"read {remote + 500} 8") == payload[:8].hex()  # the good one ran
        assert te.unregister_memory(12345) == -1
        assert te.free_managed_buffer(local, 64 * 1024) == 0
    finally:
        te.close()


def test_initialize_reports_failure_as_minus_one() -> None:
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "redis://127.0.0.1:1", "tcp", "") == -1
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == -1


def test_second_initialize_with_the_same_name_is_refused(metadata_url: str, caplog) -> None:  # noqa: ANN001
    import ctypes
    import logging

    first, second = TransferEngine(), TransferEngine()
    assert first.initialize("127.0.0.1", metadata_url, "tcp", "") == 0
    try:
        buf = ctypes.create_string_buffer(b"first!" * 10, 64)
        addr = ctypes.addressof(buf)
        assert first.register_memory(addr, 64) == 0
        with caplog.at_level(logging.ERROR, logger="pymooncake.transfer.compat"):
            assert second.initialize("127.0.0.1", metadata_url, "tcp", "") == -1
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert "SegmentNameTaken" in logged and "'127.0.0.1'" in logged
        assert f"tcp port {first.get_rpc_port()}" in logged
        # The refused engine moves nothing (before the fix it wrote into its own buffer).
        mine = ctypes.create_string_buffer(b"mine" * 16, 64)
        assert second.transfer_sync_write("127.0.0.1", ctypes.addressof(mine), addr, 8) == -1
        assert second.batch_transfer_async_write("127.0.0.1", [ctypes.addressof(mine)],
                                                 [addr], [8]) == 0
        assert buf.raw[:6] == b"first!"
        # The first engine still owns the name and its descriptor.
        assert first.get_first_buffer_address("127.0.0.1") == addr
    finally:
        first.close()
    # Once the owner closed, the same name can be initialized again.
    assert second.initialize("127.0.0.1", metadata_url, "tcp", "") == 0
    second.close()


def test_p2p_handshake_engines_on_one_host_each_get_their_own_name() -> None:
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        try:
            names = {a.get_local_segment_name(), b.get_local_segment_name()}
            assert names == {f"127.0.0.1:{a.get_rpc_port()}", f"127.0.0.1:{b.get_rpc_port()}"}
            assert len(names) == 2
        finally:
            b.close()
    finally:
        a.close()
