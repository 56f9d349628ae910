"""A CPP stage process: one ``StageRuntime`` behind the RPC layer, pinned to one core.

``python -m pymooncake.engine.cpp.stage --model M --stage I --num-stages N [--core C]``
loads stage ``I``'s layers (``split_layers``), serves RPC on ``--host:--port`` (0: any
free port) and prints ``CPP_STAGE_READY <port>`` on stdout once it can take work.

Three threads share the core: the asyncio RPC loop (receives chunks, answers calls), the
compute thread (runs chunks in arrival order; one torch thread) and the send thread (hands
each chunk's output ``[n, hidden]`` to the next stage as raw bytes in one ``cpp.chunk``
call, so chunk ``k + 1`` computes while chunk ``k`` is on the wire). The last stage turns
the final chunk's last row into the first token (greedy) and answers ``cpp.result``.

Methods: ``cpp.info``, ``cpp.connect {host, port}`` (the next stage), ``cpp.prefill
{rid, token_ids, chunk_tokens, edge_tokens}`` (first stage), ``cpp.chunk {rid, start, num_tokens,
rows, data, error}``, ``cpp.result {rid}`` (last stage; waits), ``cpp.stats {rid}``,
``cpp.export_kv {rid, layer}``, ``cpp.release {rid}``, ``cpp.ping`` (the group's health
watch, ``engine.cpp.health``), ``cpp.shutdown``. A chunk that fails is passed on as an
``error`` so that ``cpp.result`` fails with it instead of hanging. A send to the next stage
that fails aborts the request here: it is logged once, its later chunks are neither
computed nor sent (the next stage is gone; the group's watch reports it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import sys
import threading
import time
from typing import Any

from pymooncake.rpc import RpcServer, SyncRpcClient
from pymooncake.rpc.errors import ErrorCode, RpcError

READY_PREFIX = "CPP_STAGE_READY"
ERROR_PREFIX = "CPP_STAGE_ERROR"
"""``CPP_STAGE_ERROR <one line>`` on stdout: the stage could not start (the group relays
the line instead of a traceback)."""


class StageServer:
    """The RPC face and the compute/send threads around a ``StageRuntime``."""

    def __init__(self, runtime: Any, loop: asyncio.AbstractEventLoop) -> None:
        import torch
        self.torch = torch
        self.rt = runtime
        self.loop = loop
        self.hidden = runtime.model.config.hidden_size
        self.dtype = runtime.model.dtype
        self.work: queue.Queue[tuple | None] = queue.Queue()
        self.out: queue.Queue[dict | None] = queue.Queue()
        self.next: SyncRpcClient | None = None
        self.results: dict[str, asyncio.Future[dict]] = {}
        self.stats: dict[str, dict[str, list[float]]] = {}
        self.failed: set[str] = set()
        self.stop = asyncio.Event()
        threading.Thread(target=self._compute_loop, name="cpp-compute", daemon=True).start()
        threading.Thread(target=self._send_loop, name="cpp-send", daemon=True).start()

    def register(self, server: RpcServer) -> None:
        for name in ("info", "connect", "prefill", "chunk", "stats", "release", "shutdown",
                     "ping"):
            server.register(f"cpp.{name}", getattr(self, f"_rpc_{name}"))
        server.register("cpp.result", self._rpc_result)
        server.register("cpp.export_kv", self._rpc_export_kv)

    # -- RPC handlers (on the loop: enqueue or read, never compute) ---------------------
    def _rpc_info(self, _: Any) -> dict:
        m = self.rt.model
        return {"start": m.start, "stop": m.stop, "first": m.first, "last": m.last,
                "num_layers": m.config.num_layers, "vocab_size": m.config.vocab_size,
                "hidden_size": m.config.hidden_size,
                "free_blocks": self.rt.num_free_blocks,
                "pid": os.getpid(), "core": sorted(os.sched_getaffinity(0))}

    def _rpc_ping(self, _: Any) -> bool:
        return True

    def _rpc_connect(self, p: dict) -> bool:
        self.next = SyncRpcClient(p["host"], int(p["port"]), timeout_s=60.0)
        return True

    def _rpc_prefill(self, p: dict) -> int:
        if not self.rt.model.first:
            raise RpcError(ErrorCode.INVALID_ARGUMENT, "cpp.prefill goes to the first stage")
        ids, k = list(p["token_ids"]), int(p["chunk_tokens"])
        from pymooncake.engine.cpp.runtime import chunk_bounds
        try:
            bounds = chunk_bounds(len(ids), k, int(p.get("edge_tokens", 0)))
        except ValueError as e:
            raise RpcError(ErrorCode.INVALID_ARGUMENT, str(e)) from None
        for s, n in bounds:
            self.work.put((p["rid"], s, len(ids), ids[s:s + n], None))
        return len(bounds)

    def _rpc_chunk(self, p: dict) -> bool:
        self.work.put((p["rid"], int(p["start"]), int(p["num_tokens"]),
                       (int(p["rows"]), p["data"]), p.get("error")))
        return True

    async def _rpc_result(self, p: dict) -> dict:
        if not self.rt.model.last:
            raise RpcError(ErrorCode.INVALID_ARGUMENT, "cpp.result goes to the last stage")
        fut = self._future(p["rid"])
        res = await fut
        if "error" in res:
            raise RpcError(ErrorCode.INTERNAL, res["error"])
        return res

    def _rpc_stats(self, p: dict) -> dict:
        return self.stats.get(p["rid"], {})

    async def _rpc_export_kv(self, p: dict) -> dict:
        def export() -> dict:
            t = self.rt.export_kv(p["rid"], int(p["layer"]))
            return {"layer": self.rt.model.start + int(p["layer"]), "shape": list(t.shape),
                    "data": t.view(self.torch.uint8).numpy().tobytes()}
        try:
            return await self.loop.run_in_executor(None, export)
        except ValueError as e:
            raise RpcError(ErrorCode.INVALID_ARGUMENT, str(e)) from None

    def _rpc_release(self, p: dict) -> bool:
        rid = p["rid"]
        self.results.pop(rid, None)
        self.stats.pop(rid, None)
        self.failed.discard(rid)
        self.work.put(("__release__", 0, 0, rid, None))  # after the request's own chunks
        return True

    def _rpc_shutdown(self, _: Any) -> bool:
        self.loop.call_later(0.05, self.stop.set)
        return True

    # -- threads ----------------------------------------------------------------------
    def _future(self, rid: str) -> asyncio.Future[dict]:
        fut = self.results.get(rid)
        if fut is None:
            fut = self.results[rid] = self.loop.create_future()
        return fut

    def _resolve(self, rid: str, res: dict) -> None:
        def done() -> None:
            fut = self._future(rid)
            if not fut.done():
                fut.set_result(res)
        self.loop.call_soon_threadsafe(done)

    def _compute_loop(self) -> None:
        torch = self.torch
        while True:
            item = self.work.get()
            if item is None:
                return
            rid, start, total, payload, error = item
            if rid == "__release__":
                self.rt.release(payload)
                continue
            st = self.stats.setdefault(rid, {"compute_s": [], "compute_cpu_s": [],
                                             "send_s": [], "recv_at": []})
            st["recv_at"].append(time.time())
            if error is None and rid in self.failed:
                continue
            if error is None:
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    if isinstance(payload, list):
                        x = torch.as_tensor(payload, dtype=torch.int64)
                    else:
                        rows, data = payload
                        x = torch.frombuffer(bytearray(data), dtype=self.dtype).view(
                            rows, self.hidden)
                    y = self.rt.run_chunk(rid, start, total, x)
                    n = x.shape[0]
                except Exception as e:  # noqa: BLE001 - reported down the pipeline
                    error = (f"stage [{self.rt.model.start}, {self.rt.model.stop}): "
                             f"{type(e).__name__}: {e}")
                else:
                    st["compute_s"].append(time.perf_counter() - t0)
                    st["compute_cpu_s"].append(time.thread_time() - c0)
            if error is not None:
                self.failed.add(rid)
                if self.rt.model.last:
                    self._resolve(rid, {"error": error})
                else:
                    self.out.put({"rid": rid, "start": start, "num_tokens": total, "rows": 0,
                                  "data": b"", "error": error})
                continue
            if not self.rt.model.last:
                self.out.put({"rid": rid, "start": start, "num_tokens": total, "rows": n,
                              "data": y.numpy().tobytes()})
            elif start + n == total:
                self._resolve(rid, {"token": self.rt.first_token(y[-1:]),
                                    "done_at": time.time()})

    def _send_loop(self) -> None:
        while True:
            msg = self.out.get()
            if msg is None:
                return
            if msg["rid"] in self.failed and msg.get("error") is None:
                continue        # aborted at an earlier failed send
            t0 = time.perf_counter()
            try:
                if self.next is None:
                    raise RuntimeError("no next stage (cpp.connect was not called)")
                self.next.call("cpp.chunk", msg)
            except Exception as e:  # noqa: BLE001 - the next stage is gone: nothing to tell
                self.failed.add(msg["rid"])     # the compute loop skips its later chunks
                nxt = "?" if self.next is None else f"{self.next.host}:{self.next.port}"
                print(f"cpp stage [{self.rt.model.start}, {self.rt.model.stop}): request "
                      f"{msg['rid']} aborted: send to the next stage ({nxt}) failed: {e}",
                      file=sys.stderr)
                continue
            st = self.stats.get(msg["rid"])
            if st is not None:
                st["send_s"].append(time.perf_counter() - t0)


async def _serve(args: argparse.Namespace) -> None:
    from pymooncake.engine.cpp.model import load_stage_model
    from pymooncake.engine.cpp.runtime import StageRuntime
    model = load_stage_model(args.model, args.stage, args.num_stages, args.dtype)
    rt = StageRuntime(model, args.num_blocks, args.block_size)
    loop = asyncio.get_running_loop()
    stage = StageServer(rt, loop)
    server = RpcServer(args.host, args.port)
    stage.register(server)
    await server.start()
    print(f"{READY_PREFIX} {server.port}", flush=True)
    await stage.stop.wait()
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pymooncake.engine.cpp.stage")
    p.add_argument("--model", default="tiny")
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--num-stages", type=int, required=True)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--core", type=int, default=None, help="pin the process to this core")
    args = p.parse_args(argv)
    try:
        return _main(args)
    except Exception as e:  # noqa: BLE001 - reported to the group as one line
        msg = " ".join(f"{type(e).__name__}: {e}".split())
        print(f"{ERROR_PREFIX} stage {args.stage}: {msg}", flush=True)
        return 1


def _main(args: argparse.Namespace) -> int:
    if args.core is not None:  # before torch starts its threads: they inherit it
        os.sched_setaffinity(0, {args.core})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    parent = os.getppid()

    def orphan_watch() -> None:  # a stage never outlives its group (own session: no SIGHUP)
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=orphan_watch, name="cpp-orphan", daemon=True).start()
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
