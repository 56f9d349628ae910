"""Mooncake's own Transfer Engine doing the rounds of ``pymooncake bench transfer``.

A standalone script (standard library, numpy and the ``mooncake`` wheel only), so the
interpreter of the venv that holds ``mooncake-transfer-engine-non-cuda`` runs it by path::

    python mooncake_te.py initiate SIZE BATCH MIN_TIME_S   # prints one JSON line
    python mooncake_te.py serve TOTAL                      # the target (started by initiate)

The initiator and the target are two processes (tcp transport, P2PHANDSHAKE metadata). A
round = ``batch_transfer_sync_write`` of BATCH requests of SIZE bytes into the target,
then ``batch_transfer_sync_read`` back into a second buffer; the medians of the write and
read times over the rounds are printed, with whether the read-back equals the source.
Nothing crosses the process boundary but lines of text (never pickle).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import statistics
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
    """CPU seconds (user + system, all threads) of this process and ``child``."""
    total = 0.0
    for pid in ("self", str(child)):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def initiate(size_bytes: int, batch: int, min_time_s: float) -> dict[str, object]:
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
        ctypes.memset(dst_addr, 0, total)
        locs = [src_addr + i * size_bytes for i in range(batch)]
        dsts = [dst_addr + i * size_bytes for i in range(batch)]
        rems = [taddr + i * size_bytes for i in range(batch)]
        lens = [size_bytes] * batch
        ok = True
        ws: list[float] = []
        rs: list[float] = []
        t_end = time.perf_counter() + min_time_s
        first = True
        cpu0 = cpu_s(proc.pid)
        while first or len(ws) < 3 or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            rw = te.batch_transfer_sync_write(target, locs, rems, lens)
            t1 = time.perf_counter()
            rr = te.batch_transfer_sync_read(target, dsts, rems, lens)
            t2 = time.perf_counter()
            ok = ok and rw == 0 and rr == 0
            if first:  # warm-up: connections
                first = False
                t_end = time.perf_counter() + min_time_s
                cpu0 = cpu_s(proc.pid)
                continue
            ws.append(t1 - t0)
            rs.append(t2 - t1)
        cpu = cpu_s(proc.pid) - cpu0
        verified = ok and ctypes.string_at(dst_addr, total) == data.tobytes()
        return {"write_s": statistics.median(ws), "read_s": statistics.median(rs),
                "rounds": len(ws), "verified": verified,
                "cpu_s_per_gib": cpu / (2 * total * len(ws) / 1024**3)}
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
    if argv[:1] == ["initiate"] and len(argv) == 4:
        print(json.dumps(initiate(int(argv[1]), int(argv[2]), float(argv[3]))), flush=True)
    elif argv[:1] == ["serve"] and len(argv) == 2:
        serve(int(argv[1]))
    elif argv[:1] == ["check"]:
        import mooncake.engine  # noqa: F401 - raises when absent
        print("ok", flush=True)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
