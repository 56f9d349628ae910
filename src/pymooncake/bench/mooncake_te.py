"""Mooncake's own Transfer Engine doing the rounds of ``pymooncake bench transfer``.

A standalone script (standard library, numpy and the ``mooncake`` wheel only), so the
interpreter of the venv that holds ``mooncake-transfer-engine-non-cuda`` runs it by path::

    python mooncake_te.py rounds SIZE BATCH   # the initiator, one round per "r" line
    python mooncake_te.py serve TOTAL         # the target (started by rounds)

The initiator and the target are two processes (tcp transport, P2PHANDSHAKE metadata). A
round = ``batch_transfer_sync_write`` of BATCH requests of SIZE bytes into the target,
then ``batch_transfer_sync_read`` back into a second buffer; the initiator answers each
``r`` with the round's times, so ``pymooncake bench transfer`` alternates single rounds of
every subject (``transfer_subjects``). Nothing crosses the process boundary but lines of
text (never pickle).
"""

from __future__ import annotations

import ctypes
import os
import select
import subprocess
import sys
import time


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _readline(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        raise RuntimeError("mooncake target did not answer")
    return line.strip()


def _stop(proc: subprocess.Popen[str]) -> None:
    try:
        if proc.poll() is None and proc.stdin is not None:
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)


def cpu_s(child: int) -> float:
    """CPU seconds so far of this process and ``child``: the sum over their threads of
    ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds on a CPU). The same reading as
    ``pymooncake.bench.transfer_refs.tasks_cpu_s``, written again because this script runs
    under the wheel's interpreter, where pymooncake is not importable."""
    total = 0
    for pid in (os.getpid(), child):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, IndexError, ValueError):
                pass
    return total / 1e9


def rounds(size_bytes: int, batch: int) -> None:
    """The initiator, driven round by round over stdin: prints ``ready`` after its set-up
    and a warm-up round (connections), then answers each ``r`` line with one round's
    ``WRITE_S READ_S``, ``cpu`` with the CPU seconds so far of this process and its target,
    and ``verify`` with ``1`` when every round since the last ``verify`` succeeded and the
    read-back equals the source (else ``0``), clearing the read-back buffer; ``exit`` ends
    it."""
    import numpy as np
    from mooncake.engine import TransferEngine

    total = size_bytes * batch
    proc = _spawn("serve", str(total))
    try:
        target, taddr_s = _readline(proc).split()
        taddr = int(taddr_s)
        te = TransferEngine()
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        src_addr = te.allocate_managed_buffer(total)
        dst_addr = te.allocate_managed_buffer(total)
        if not src_addr or not dst_addr:
            raise RuntimeError("mooncake allocate_managed_buffer failed")
        data = np.random.default_rng(3).integers(0, 256, total, dtype=np.uint8)
        ctypes.memmove(src_addr, data.ctypes.data, total)
        locs = [src_addr + i * size_bytes for i in range(batch)]
        dsts = [dst_addr + i * size_bytes for i in range(batch)]
        rems = [taddr + i * size_bytes for i in range(batch)]
        lens = [size_bytes] * batch
        ok = True

        def one() -> tuple[float, float]:
            nonlocal ok
            t0 = time.perf_counter()
            rw = te.batch_transfer_sync_write(target, locs, rems, lens)
            t1 = time.perf_counter()
            rr = te.batch_transfer_sync_read(target, dsts, rems, lens)
            t2 = time.perf_counter()
            ok = ok and rw == 0 and rr == 0
            return t1 - t0, t2 - t1

        one()  # warm-up: connections
        ctypes.memset(dst_addr, 0, total)
        print("ready", flush=True)
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "r":
                w, r = one()
                print(f"{w} {r}", flush=True)
            elif cmd == "cpu":
                print(cpu_s(proc.pid), flush=True)
            elif cmd == "verify":
                good = ok and ctypes.string_at(dst_addr, total) == data.tobytes()
                print("1" if good else "0", flush=True)
                ctypes.memset(dst_addr, 0, total)
                ok = True
            elif cmd == "exit":
                break
    finally:
        _stop(proc)


def serve(total: int) -> None:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake initialize failed")
    addr = te.allocate_managed_buffer(total)
    print(f"127.0.0.1:{te.get_rpc_port()} {addr}", flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break


def main(argv: list[str]) -> None:
    if argv[:1] == ["rounds"] and len(argv) == 3:
        rounds(int(argv[1]), int(argv[2]))
    elif argv[:1] == ["serve"] and len(argv) == 2:
        serve(int(argv[1]))
    elif argv[:1] == ["check"]:
        import mooncake.engine  # noqa: F401 - raises when absent
        print("ok", flush=True)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
