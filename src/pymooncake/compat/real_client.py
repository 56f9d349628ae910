"""``python -m pymooncake.compat real-client``: the process Mooncake's dummy clients
(``MooncakeDistributedStore.setup_dummy``) attach to — Mooncake's ``mooncake_client``.

It sets up one compat store client that contributes ``--global-segment-size`` of memory
and answers the ``real_client_info`` RPC (pymooncake's RPC layer) with its master, metadata
service and segment name; a dummy client then connects with no segment of its own and
places its objects on this segment first."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from pymooncake.store.compat import MooncakeDistributedStore
from pymooncake.store.compat._dummy import INFO_METHOD


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master-server-address", default="127.0.0.1:50051")
    p.add_argument("--metadata-server", default="P2PHANDSHAKE")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052, help="RPC port for dummy clients")
    p.add_argument("--global-segment-size", default="4GB")
    p.add_argument("--local-buffer-size", default="0")
    p.add_argument("--protocol", default="tcp")


def serve(a: argparse.Namespace) -> int:
    from pymooncake.rpc import RpcServer

    store = MooncakeDistributedStore()
    rc = store.setup({"local_hostname": a.host, "metadata_server": a.metadata_server,
                      "global_segment_size": a.global_segment_size,
                      "local_buffer_size": a.local_buffer_size, "protocol": a.protocol,
                      "master_server_address": a.master_server_address})
    if rc != 0:
        print(json.dumps({"event": "error", "code": rc}), flush=True)
        return 1
    master, metadata = store._setup_args
    info = {"master": master, "metadata": metadata, "segment": store.get_hostname()}

    async def run() -> None:
        server = RpcServer(a.host, a.port)
        server.register(INFO_METHOD, lambda params: info)
        await server.start()
        print(json.dumps({"event": "ready", "port": server.port, **info}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    try:
        asyncio.run(run())
    finally:
        store.close()
    return 0
