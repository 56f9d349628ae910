"""A Transfer Engine in its own process, driven over stdin/stdout by the tests.

Prints one JSON line when ready: {"name", "addr", "length", "shm_addr", "port", "pid"}.
Then answers one line per command:
  digest ADDR LEN      blake2b-128 hex of the bytes at ADDR (the test checks it itself)
  drop                 close the server side of every accepted data connection
  unregister ADDR      withdraw a registered range (the memory stays allocated)
  close                close the engine (the process and its memory stay)
  exit
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

from pymooncake.transfer import TransferConfig, TransferEngine
from pymooncake.transfer.memory import view_at


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--size", type=int, default=8 << 20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shm-size", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--drop-after-slices", type=int, default=None)
    ap.add_argument("--delay-per-slice-ms", type=float, default=0.0)
    ap.add_argument("--segment-ttl-s", type=float, default=10.0)
    ap.add_argument("--transports", default="local,shm,tcp")
    args = ap.parse_args()

    engine = TransferEngine(args.name, args.metadata,
                            config=TransferConfig(checksum=True, tcp_port=args.port,
                                                  segment_ttl_s=args.segment_ttl_s,
                                                  transports=tuple(
                                                      args.transports.split(",")))).start()
    buf = np.random.default_rng(args.seed).integers(0, 256, args.size, dtype=np.uint8)
    addr = engine.register_memory(buf)
    shm_addr = 0
    if args.shm_size:
        shm = engine.allocate_shared(args.shm_size)
        np.frombuffer(shm.view(), dtype=np.uint8)[:] = np.random.default_rng(
            args.seed + 1).integers(0, 256, args.shm_size, dtype=np.uint8)
        shm_addr = shm.addr
    if engine.server is not None:
        engine.server.fault_drop_after_slices = args.drop_after_slices
    if args.delay_per_slice_ms and engine.server is not None:
        delay_s = args.delay_per_slice_ms / 1000
        # per 64 KiB served: a run of contiguous slices is one wire request (tcp.runs)
        engine.server.on_slice = lambda op, n: time.sleep(delay_s * max(1, n >> 16))
    print(json.dumps({"name": args.name, "addr": addr, "length": args.size,
                      "shm_addr": shm_addr, "port": engine.tcp_port,
                      "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "digest":
            a, n = int(cmd[1]), int(cmd[2])
            print(hashlib.blake2b(view_at(a, n), digest_size=16).hexdigest(), flush=True)
        elif cmd[0] == "drop":
            print(engine.server.drop_connections() if engine.server is not None
                  else "no tcp server", flush=True)
        elif cmd[0] == "close":
            engine.close()
            print("ok", flush=True)
        elif cmd[0] == "unregister":
            engine.unregister_memory(int(cmd[1]))
            print("ok", flush=True)
        elif cmd[0] == "exit":
            break
    engine.close()


if __name__ == "__main__":
    main()
