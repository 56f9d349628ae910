"""Mooncake's put/get session calls, ``put_from_with_metadata`` and
``get_offload_rpc_read_count`` answer the same codes and store the same bytes on pymooncake
as on Mooncake's wheel (``mooncake-transfer-engine-non-cuda`` 0.3.13.post1): one scenario
(reservations, ranged writes and reads, revokes, every -600/-702/-704/-705 case, the
``TypeError``s and the answers before ``setup``) run on both, results compared item by item.

Runs with ``PYMOONCAKE_COMPAT_VS_MOONCAKE=1 PYMOONCAKE_MOONCAKE_PYTHON=/path/to/python``
(a venv holding the wheel, ``LD_LIBRARY_PATH`` set for its libraries)."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.store.procs import mooncake_python, run_against_mooncake_master

pytestmark = pytest.mark.integration

SCENARIO = textwrap.dedent('''
def run(s, ms, fresh):
    import ctypes
    c = []
    n = 8192
    src = (ctypes.c_char * n)()
    dst = (ctypes.c_char * n)()
    for i in range(n):
        src[i] = (i * 7 + 3) % 251
    sp, dp = ctypes.addressof(src), ctypes.addressof(dst)
    c.append(s.register_buffer(sp, n))
    c.append(s.register_buffer(dp, n))
    c.append(s.put("old", b"x" * 10))
    c.append(s.batch_put_session_start(["old", "p", "q"], [100, 2048, 4096]))
    c.append(s.batch_put_session_start(["p"], [2048]))
    c.append(s.batch_put_session_start(["r1", "r2"], [1]))
    c.append(s.batch_put_session_start([], []))
    c.append(s.is_exist("p"))
    c.append(s.get("p").hex())
    c.append(s.batch_put_from_multi_buffer_ranges(
        ["nosession", "p", "p", "p", "q"],
        [[sp], [sp], [sp, sp], [sp + 100], [sp + 1000, sp]],
        [[8], [1024], [8], [2048], [3096, 1000]],
        [[0], [1025], [0, 8], [0], [1000, 0]]))
    c.append(s.batch_put_from_multi_buffer_ranges(["p", "p"], [[sp]], [[8]], [[0]]))
    c.append(s.batch_put_from_multi_buffer_ranges(["q"], [[]], [[]], [[]]))
    c.append(s.batch_put_session_end(["p", "q", "nosession"]))
    c.append(s.batch_put_session_end(["p"]))
    c.append(s.get("p").hex())
    c.append(s.get("q").hex())
    c.append(s.batch_put_session_start(["rv"], [512]))
    c.append(s.batch_put_from_multi_buffer_ranges(["rv"], [[sp]], [[512]], [[0]]))
    c.append(s.batch_put_session_revoke(["rv", "none"]))
    c.append(s.is_exist("rv"))
    c.append(s.batch_put_from_multi_buffer_ranges(["rv"], [[sp]], [[8]], [[0]]))
    c.append(s.put("rv", b"again"))
    c.append(s.get("rv").hex())
    c.append(s.batch_get_session_start(["q", "old", "missing"]))
    c.append(s.batch_get_into_multi_buffer_ranges(
        ["q", "old", "old", "missing", "old", "nosession"],
        [[dp, dp + 5000], [dp + 4096], [dp], [dp], [dp, dp], [dp]],
        [[100, 3000], [10], [11], [1], [1], [1]],
        [[3996, 0], [0], [0], [0], [0], [0]]))
    c.append(s.batch_get_into_multi_buffer_ranges(["q"], [[dp]], [[0]], [[4096]]))
    c.append(s.batch_get_into_multi_buffer_ranges(["q", "q"], [[dp]], [[1]], [[0]]))
    c.append(bytes(dst[:8106]).hex())
    c.append(s.batch_get_session_end(["q", "old", "never"]))
    c.append(s.batch_get_into_multi_buffer_ranges(["q"], [[dp]], [[8]], [[0]]))
    c.append(s.batch_get_session_start([]))
    c.append(s.put_from_with_metadata("m", sp + 16, sp, 100, 16))
    c.append(s.get("m").hex())
    c.append(s.put_from_with_metadata("m", sp, sp, 10, 1))
    c.append(s.get_size("m"))
    c.append(s.put_from_with_metadata("empty", sp, sp, 0, 16))
    c.append(s.is_exist("empty"))
    cfg = ms.ReplicateConfig()
    cfg.prefer_alloc_in_same_node = True
    c.append(s.put_from_with_metadata("n", sp, sp, 100, 16, cfg))
    c.append(s.get_offload_rpc_read_count())
    for call in (lambda: s.batch_put_session_start("abc", [1]),
                 lambda: s.batch_put_session_start(["k"], [-1]),
                 lambda: s.batch_get_session_start([1]),
                 lambda: s.batch_get_into_multi_buffer_ranges(["k"], [[1.5]], [[1]], [[0]]),
                 lambda: s.batch_put_from_multi_buffer_ranges(["k"], [1], [[1]], [[0]]),
                 lambda: s.batch_get_session_end(None),
                 lambda: s.put_from_with_metadata("k", "ptr", 0, 1, 1)):
        try:
            call()
            c.append("no error")
        except TypeError:
            c.append("TypeError")
    c.append(fresh.batch_put_session_start(["k"], [1]))
    c.append(fresh.batch_put_from_multi_buffer_ranges(["k"], [[1]], [[1]], [[0]]))
    c.append(fresh.batch_put_session_end(["k"]))
    c.append(fresh.batch_put_session_revoke(["k"]))
    c.append(fresh.batch_get_session_start(["k"]))
    c.append(fresh.batch_get_into_multi_buffer_ranges(["k"], [[1]], [[1]], [[0]]))
    c.append(fresh.batch_get_session_end(["k"]))
    c.append(fresh.put_from_with_metadata("k", 1, 1, 1, 1))
    return c
''')

MOONCAKE_SIDE = textwrap.dedent("""
    import json, sys
    import mooncake.store as ms
    s = ms.MooncakeDistributedStore()
    assert s.setup("localhost", sys.argv[2], 16 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
    scope = {}
    exec(sys.stdin.read(), scope)
    print(json.dumps(scope["run"](s, ms, ms.MooncakeDistributedStore())))
    s.close()
""")


def test_session_calls_match_mooncakes(cluster_factory) -> None:
    py = mooncake_python()
    from pymooncake.store import compat as ms

    out = run_against_mooncake_master(py, ["-c", MOONCAKE_SIDE], input=SCENARIO)
    theirs = json.loads(out.strip().splitlines()[-1])

    cl = cluster_factory()
    s = ms.MooncakeDistributedStore()
    assert s.setup("localhost", cl.metadata_url, 16 << 20, 16 << 20, "tcp", "",
                   cl.master_addr) == 0
    try:
        scope: dict = {}
        exec(SCENARIO, scope)  # noqa: S102 - the scenario text above
        ours = scope["run"](s, ms, ms.MooncakeDistributedStore())
    finally:
        s.close()
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, f"item {i}: pymooncake {a!r} != Mooncake {b!r}"
