"""A loop that made etcd (grpc) calls is stopped, not closed, when the p2p holder records
or a Transfer Engine's publisher close: gRPC asyncio hands a call made on a second loop its
late completions from the first loop with ``call_soon_threadsafe``, which on a closed loop
printed "Event loop is closed" tracebacks on stderr (the p2p CLI's ``get``, in CI)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent("""
    import asyncio, sys, threading
    from pymooncake.metadata import open_metadata
    from pymooncake.p2p.records import stop_loop
    from pymooncake.transfer import TransferEngine
    url = sys.argv[1]
    md = open_metadata(url)
    first = asyncio.new_event_loop()      # the loop grpc runs its completions on
    threading.Thread(target=first.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(md.put("/loops/a", b"1"), first).result(5)
    for i in range(40):
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        async def use():
            watch = await md.watch_prefix("/loops/")
            lease = await md.grant_lease(5)
            await md.put("/loops/b", b"2", lease_id=lease)
            await md.revoke_lease(lease)
            await watch.close()
            pending = await md.watch_prefix("/loops-none/")   # left for the close to end
            fut = asyncio.ensure_future(pending.__anext__())
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            await asyncio.sleep(0)
        asyncio.run_coroutine_threadsafe(use(), loop).result(5)
        stop_loop(loop, thread, md)
        if i % 8 == 0:
            with TransferEngine(f"loops-te-{i}", url):   # the publisher's own loop
                pass
    asyncio.run_coroutine_threadsafe(md.put("/loops/c", b"3"), first).result(5)
    print("done")
""")


def test_closing_a_second_grpc_loop_prints_nothing(etcd_url) -> None:
    """A race, so not certain to fail on the old code (loops closed after stopping): this
    test failed there in 4 of 11 runs, each time with the "Event loop is closed"
    traceback (2 cores); it passed in every run since."""
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", SCRIPT, etcd_url], capture_output=True,
                           text=True, timeout=120)
        assert (r.returncode, r.stdout) == (0, "done\n"), r.stderr
        assert "Event loop is closed" not in r.stderr, r.stderr
        assert r.stderr == "", r.stderr
