"""The unified-parallelism layout writes (``put_tensor_with_parallelism`` with TP, DP+TP,
PP+TP, EP+TP, EP-only axes and writer partitions) store the same keys with the same bytes —
shard objects and 96-byte manifests — on pymooncake as on Mooncake's wheel
(``mooncake-transfer-engine-non-cuda`` 0.3.13.post1), with the same return codes.

Runs with ``PYMOONCAKE_COMPAT_VS_MOONCAKE=1 PYMOONCAKE_MOONCAKE_PYTHON=/path/to/python``
(a venv holding the wheel; torch is taken from this venv, appended to its ``sys.path``)."""

from __future__ import annotations

import json
import site
import textwrap

import pytest

from tests.store.procs import mooncake_python, run_against_mooncake_master

pytestmark = pytest.mark.integration

# the same calls on both sides; `ms` is the module holding ParallelAxis & co.
SCENARIO = textwrap.dedent("""
    def run(s, ms, torch):
        def ax(kind, rank, size, sd=None, **kw):
            a = ms.ParallelAxis()
            a.kind, a.rank, a.size, a.split_dim = kind, rank, size, sd
            for k, v in kw.items():
                setattr(a, k, v)
            return a

        def par(*axes):
            p = ms.TensorParallelism()
            p.axes = list(axes)
            return p

        class W:
            def __init__(self, r, n, d):
                self.rank, self.size, self.split_dim = r, n, d

        x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        c = []
        for r, sh in enumerate(x.chunk(2, 1)):
            c.append(s.put_tensor_with_parallelism("a", sh.contiguous(),
                                                   par(ax("tp", r, 2, 1))))
        for r in range(3):
            c.append(s.put_tensor_with_parallelism("b", x, par(ax("dp", 1, 2),
                                                               ax("tp", r, 3, 1))))
        for r in range(2):
            c.append(s.put_tensor_with_parallelism(
                "p", x, par(ax("pp", 0, 2, stage_id=7), ax("tp", r, 2, 0))))
            c.append(s.put_tensor_with_parallelism(
                "e", x, par(ax("ep", 1, 2, expert_id=3), ax("tp", r, 2, 0))))
            c.append(s.put_tensor_with_parallelism("w", x, writer_partition=W(r, 2, 0)))
        c.append(s.put_tensor_with_parallelism("g", x, par(ax("ep", 1, 2, expert_id=3))))
        c.append(s.put_tensor_with_parallelism("bad", x, par(ax("tp", 0, 4, 1),
                                                             ax("dp", 0, 2))))
        c.append(s.put_tensor_with_parallelism("bad", x, object()))
        c.append(s.put_tensor_with_parallelism("bad", x, writer_partition=W(0, 4, 1)))
        return c
""")
KEYS = ["a_tp_0", "a_tp_1", "a__parallelism_manifest", "b__dp_1of2__tp_0of3_sd1",
        "b__dp_1of2__tp_2of3_sd1", "b__parallelism_manifest", "p__tp_1of2_sd0__pp_0of2_sid7",
        "p__parallelism_manifest", "e__tp_0of2_sd0__ep_1of2_eid3", "e__parallelism_manifest",
        "w__writer_0of2_sd0", "w__writer_1of2_sd0", "w__writer_manifest", "g__ep_1of2_eid3",
        "g", "bad"]

MOONCAKE_SIDE = textwrap.dedent("""
    import json, sys
    sys.path.append(sys.argv[3])  # torch from pymooncake's venv, after the wheel's packages
    import torch
    import mooncake.store as ms
    s = ms.MooncakeDistributedStore()
    assert s.setup("localhost", sys.argv[2], 16 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
    req = json.loads(sys.stdin.read())
    exec(req["scenario"])
    codes = run(s, ms, torch)
    print(json.dumps({"codes": codes, "objs": {k: s.get(k).hex() for k in req["keys"]}}))
    s.close()
""")


def test_layout_objects_equal_mooncakes(cluster_factory) -> None:
    torch = pytest.importorskip("torch")
    py = mooncake_python()
    from pymooncake.store import compat as ms

    out = run_against_mooncake_master(py, ["-c", MOONCAKE_SIDE], [site.getsitepackages()[0]],
                                      input=json.dumps({"scenario": SCENARIO, "keys": KEYS}))
    theirs = json.loads(out.strip().splitlines()[-1])

    cl = cluster_factory()
    s = ms.MooncakeDistributedStore()
    assert s.setup("localhost", cl.metadata_url, 16 << 20, 16 << 20, "tcp", "",
                   cl.master_addr) == 0
    try:
        scope: dict = {}
        exec(SCENARIO, scope)  # noqa: S102 - the scenario text above
        codes = scope["run"](s, ms, torch)
        objs = {k: s.get(k).hex() for k in KEYS}
    finally:
        s.close()
    assert codes == theirs["codes"]
    assert codes[-3:] == [-600, -600, -600]
    for k in KEYS:
        assert objs[k] == theirs["objs"][k], k
    assert objs["g"] == objs["bad"] == ""  # only the tagged key; nothing for a rejection
