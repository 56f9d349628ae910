"""Latency of the HTTP metadata backend on loopback: 40 sequential gets and puts (p50, p90)
and put -> watch event (p50 of 10), against an in-process MetadataHttpServer.
Usage: .venv/bin/python docs/data/issue16_s40/httplat.py"""
import asyncio
import time

from pymooncake.metadata import open_metadata
from pymooncake.metadata.http import MetadataHttpServer


async def main(url: str) -> None:
    md = open_metadata(url)
    await md.put("k", b"v" * 100)
    for op in ("get", "put"):
        ts = []
        for _ in range(40):
            t = time.perf_counter()
            await (md.get("k") if op == "get" else md.put("k", b"v" * 100))
            ts.append(time.perf_counter() - t)
        ts.sort()
        print(f"{op} p50 {ts[20] * 1e3:.2f} ms  p90 {ts[36] * 1e3:.2f} ms")
    w = await md.watch_prefix("w/")
    lat = []
    for i in range(10):
        t = time.perf_counter()
        await md.put(f"w/{i}", b"x")
        await asyncio.wait_for(w.__anext__(), 5)
        lat.append(time.perf_counter() - t)
    lat.sort()
    print(f"put->watch event p50 {lat[5] * 1e3:.2f} ms")
    await w.close()
    await md.close()


srv = MetadataHttpServer().start()
try:
    asyncio.run(main(srv.url))
finally:
    srv.stop()
