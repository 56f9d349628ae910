"""Tensor objects are byte-identical with Mooncake's wheel: ``put_tensor`` and
``put_tensor_with_tp`` objects written by ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1
equal pymooncake's serialisation, pymooncake's bytes read back through Mooncake's
``get_tensor``, and the TP split rules (-600 for an uneven or negative split) agree.

Runs with ``PYMOONCAKE_COMPAT_VS_MOONCAKE=1 PYMOONCAKE_MOONCAKE_PYTHON=/path/to/python``
(a venv holding the wheel; torch is taken from this venv, appended to its ``sys.path``)."""

from __future__ import annotations

import json
import site
import textwrap

import pytest

from tests.store.procs import mooncake_python, run_against_mooncake_master

pytestmark = pytest.mark.integration

CASES = [((4, 6), 2, 1), ((4, 6), 3, 1), ((8, 2), 4, 0), ((4, 5), 2, 1), ((7, 2), 3, 0),
         ((4, 6), 2, 2), ((4, 6), 2, -1)]

MOONCAKE_SIDE = textwrap.dedent("""
    import json, sys
    sys.path.append(sys.argv[3])  # torch from pymooncake's venv, after the wheel's packages
    import torch
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    assert s.setup("localhost", sys.argv[2], 16 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
    req = json.loads(sys.stdin.read())
    out = {"codes": []}
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    assert s.put_tensor("full", t) == 0
    out["full"] = s.get("full").hex()
    for i, (shape, tp, dim) in enumerate(req["cases"]):
        x = torch.arange(shape[0] * shape[1], dtype=torch.int32).reshape(*shape)
        out["codes"].append(s.put_tensor_with_tp(f"c{i}", x, tp_size=tp, split_dim=dim))
        out[f"c{i}"] = [s.get(f"c{i}_tp_{r}").hex() for r in range(tp)]
    assert s.put("ours", bytes.fromhex(req["ours"])) == 0
    g = s.get_tensor("ours")
    out["ours"] = [str(g.dtype), list(g.shape), g.float().flatten().tolist()]
    print(json.dumps(out))
    s.close()
""")


def test_tensor_bytes_equal_mooncakes() -> None:
    torch = pytest.importorskip("torch")
    py = mooncake_python()
    from pymooncake.store.compat import _tensor
    from pymooncake.store.compat._tensor_tp import _shards

    ours = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    req = {"cases": CASES, "ours": _tensor.tensor_bytes(ours).hex()}
    out = run_against_mooncake_master(py, ["-c", MOONCAKE_SIDE], [site.getsitepackages()[0]],
                                      input=json.dumps(req))
    theirs = json.loads(out.strip().splitlines()[-1])
    full = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    assert bytes.fromhex(theirs["full"]) == _tensor.tensor_bytes(full)
    assert theirs["ours"] == ["torch.float16", [2, 3], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    for i, (shape, tp, dim) in enumerate(CASES):
        x = torch.arange(shape[0] * shape[1], dtype=torch.int32).reshape(*shape)
        code, sh, raw = _tensor.raw_of(x)
        mine = _shards(code, sh, raw, tp, dim)
        assert (theirs["codes"][i] == 0) == (mine is not None), (shape, tp, dim)
        if mine is not None:
            assert [bytes.fromhex(h) for h in theirs[f"c{i}"]] == mine, (shape, tp, dim)
