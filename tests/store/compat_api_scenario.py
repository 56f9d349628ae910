"""One scenario over the whole public ``MooncakeDistributedStore`` API, run unchanged
against pymooncake (``pymooncake.store.compat``) and Mooncake's wheel (``mooncake.store``).

``python compat_api_scenario.py MODULE MASTER_ADDR METADATA_URL`` prints one JSON object:
step name → what the call returned (ints, bytes as ``{"b": hex}``, lists, or
``{"exc": "TypeError"}``). tests/store/test_compat_api.py compares the two outputs and
checks pymooncake's against Mooncake's documented codes. Numpy only (no torch), so it runs in
a bare venv that holds just the Mooncake wheel.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import time
from typing import Any

import numpy as np

MB = 1 << 20


def _plain(v: Any) -> Any:
    if isinstance(v, bytes | bytearray):
        return {"b": bytes(v).hex()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return {"type": type(v).__name__}


def run(module: str, master: str, metadata: str) -> dict[str, Any]:
    mod = importlib.import_module(module)
    out: dict[str, Any] = {}

    def rec(name: str, fn: Any) -> Any:
        print(name, file=sys.stderr, flush=True)  # the last step named before a crash
        try:
            v = fn()
        except Exception as e:  # noqa: BLE001 - the exception type is the observation
            out[name] = {"exc": type(e).__name__}
            return None
        out[name] = _plain(v)
        return v

    S, RC = mod.MooncakeDistributedStore, mod.ReplicateConfig  # noqa: N806

    # -- ReplicateConfig and enums ------------------------------------------------------
    cfg = RC()
    rec("cfg.defaults", lambda: [cfg.replica_num, cfg.with_hard_pin, cfg.preferred_segment,
                                 int(cfg.soft_pin_action), cfg.soft_pin_ttl_ms,
                                 cfg.preferred_segments, cfg.nof_replica_num,
                                 cfg.dfs_replica_num, cfg.preferred_nof_segments,
                                 cfg.prefer_alloc_in_same_node, int(cfg.data_type),
                                 cfg.group_ids])
    for field, value in (("replica_num", "x"), ("replica_num", -1), ("replica_num", 2.0),
                         ("with_hard_pin", "x"), ("preferred_segment", 3),
                         ("preferred_segment", None), ("soft_pin_ttl_ms", "x"),
                         ("soft_pin_ttl_ms", -1), ("soft_pin_action", 1), ("data_type", 1),
                         ("preferred_segments", "ab"), ("group_ids", [1]),
                         ("nof_replica_num", "x"), ("preferred_nof_segments", "x"),
                         ("with_hard_pin", 1), ("replica_num", True), ("soft_pin_ttl_ms", 5),
                         ("preferred_segments", ["a"]), ("group_ids", ["g"]),
                         ("group_ids", None), ("prefer_alloc_in_same_node", 1)):
        c = RC()

        def set_get(c: Any = c, field: str = field, value: Any = value) -> Any:
            setattr(c, field, value)
            return getattr(c, field)

        rec(f"cfg.set.{field}={value!r}", set_get)
    rec("cfg.ctor_kwargs", lambda: RC(replica_num=2))
    rec("enums", lambda: {e: {k: int(v) for k, v in getattr(mod, e).__members__.items()}
                          for e in ("SoftPinAction", "ReplicaStatus", "ObjectDataType",
                                    "TaskStatus", "TaskType")})

    # -- lifecycle ----------------------------------------------------------------------
    fresh = S()
    rec("health.before_setup", fresh.health_check)
    rec("close.before_setup", fresh.close)
    pct = S()
    rec("setup.percent", lambda: pct.setup({"local_hostname": "localhost",
                                            "metadata_server": metadata,
                                            "global_segment_size": "50%",
                                            "master_server_addr": master}))
    st = S()
    rec("setup", lambda: st.setup("localhost", metadata, 16 * MB, 16 * MB, "tcp", "", master))
    rec("health", st.health_check)
    rec("hostname.form", lambda: bool(re.fullmatch(r"[^:]+:\d+", st.get_hostname())))

    # -- put / put_batch / put_parts ---------------------------------------------------
    rec("put", lambda: st.put("k1", b"hello"))
    rec("put.existing", lambda: st.put("k1", b"other value"))
    rec("get.k1", lambda: st.get("k1"))
    rec("put.memoryview", lambda: st.put("k_mv", memoryview(b"mv-bytes")))
    rec("put.ndarray", lambda: st.put("k_np", np.arange(4, dtype=np.uint8)))
    rec("get.k_np", lambda: st.get("k_np"))
    rec("put.str", lambda: st.put("k_str", "text"))
    rec("put.empty_key", lambda: st.put("", b"x"))
    rec("put.empty_value", lambda: st.put("k_empty", b""))
    rec("put_batch", lambda: st.put_batch(["b1", "b2"], [b"one", b"two!"]))
    rec("put_batch.mismatch", lambda: st.put_batch(["b3", "b4"], [b"x"]))
    rec("get_batch", lambda: st.get_batch(["b1", "b2", "missing"]))
    rec("put_parts", lambda: st.put_parts("parts", b"ab", bytearray(b"cd"), memoryview(b"ef")))
    rec("get.parts", lambda: st.get("parts"))
    rec("put_parts.none", lambda: st.put_parts("parts0"))
    rec("exist.parts0", lambda: st.is_exist("parts0"))
    rec("put_parts.str", lambda: st.put_parts("parts_s", "text"))
    rec("put_parts.config", lambda: st.put_parts("parts_c", b"x", b"y", config=RC()))

    # -- upsert ------------------------------------------------------------------------
    rec("upsert.new", lambda: st.upsert("u1", b"first"))
    rec("upsert.grow", lambda: st.upsert("u1", b"second, longer value"))
    rec("get.u1", lambda: st.get("u1"))
    rec("size.u1", lambda: st.get_size("u1"))
    rec("upsert.shrink", lambda: st.upsert("u1", b"3"))
    rec("get.u1.shrunk", lambda: st.get("u1"))
    rec("upsert.empty_key", lambda: st.upsert("", b"x"))
    rec("upsert.leased", lambda: (st.get("u1"), st.upsert("u1", b"while leased"))[1])
    rec("upsert_batch", lambda: st.upsert_batch(["u1", "u2"], [b"batch-1", b"batch-two"]))
    rec("get_batch.upserted", lambda: st.get_batch(["u1", "u2"]))
    rec("upsert_parts", lambda: st.upsert_parts("u2", b"p", b"q"))
    rec("get.u2", lambda: st.get("u2"))

    # -- zero copy ---------------------------------------------------------------------
    src = np.frombuffer(bytes(range(256)) * 64, dtype=np.uint8).copy()  # 16 KiB
    dst = np.zeros(64 * 1024, dtype=np.uint8)
    sp, dp = src.ctypes.data, dst.ctypes.data
    rec("register.src", lambda: st.register_buffer(sp, src.nbytes))
    rec("register.dst", lambda: st.register_buffer(dp, dst.nbytes))
    rec("put_from", lambda: st.put_from("z1", sp, 100))
    rec("get_into", lambda: st.get_into("z1", dp, 4096))
    rec("get_into.bytes", lambda: dst[:100].tobytes() == src[:100].tobytes())
    rec("get_into.small", lambda: st.get_into("z1", dp, 10))
    rec("get_into.missing", lambda: st.get_into("nope", dp, 4096))
    rec("batch_put_from", lambda: st.batch_put_from(["z2", "z3"], [sp + 10, sp + 300],
                                                     [50, 60]))
    rec("batch_get_into", lambda: st.batch_get_into(["z2", "z3", "nope"],
                                                     [dp, dp + 1000, dp + 2000], [64, 64, 64]))
    rec("batch_get_into.bytes", lambda: dst[1000:1060].tobytes() == src[300:360].tobytes())
    rec("upsert_from", lambda: st.upsert_from("z1", sp + 1000, 200))
    rec("size.z1", lambda: st.get_size("z1"))
    rec("batch_upsert_from", lambda: st.batch_upsert_from(["z2", "z_new"], [sp, sp + 2000],
                                                           [30, 40]))
    rec("get.z2", lambda: st.get("z2"))
    rec("get.z_new", lambda: st.get("z_new"))
    dst[:] = 0
    rec("batch_put_from_multi_buffers", lambda: st.batch_put_from_multi_buffers(
        ["m1", "m2"], [[sp, sp + 500], [sp + 900]], [[10, 20], [30]]))
    rec("get.m1", lambda: st.get("m1"))
    rec("batch_get_into_multi_buffers", lambda: st.batch_get_into_multi_buffers(
        ["m1", "m2", "nope"], [[dp, dp + 100], [dp + 200], [dp + 300]],
        [[15, 15], [30], [8]]))
    rec("multi.bytes", lambda: dst[:15].tobytes() + dst[100:115].tobytes())
    dst[:] = 0
    rec("get_into_ranges", lambda: st.get_into_ranges(
        [dp, dp + 4096], [["z1", "m2"], ["b2"]], [[[0, 10], [20]], [[0]]],
        [[[0, 5], [1]], [[1]]], [[[4, 3], [2]], [[2]]]))
    rec("get_into_ranges.bytes", lambda: dst[:24].tobytes() + dst[4096:4098].tobytes())
    rec("get_into_ranges.missing", lambda: st.get_into_ranges(
        [dp], [["nope"]], [[[0]]], [[[0]]], [[[4]]]))

    # -- buffers -----------------------------------------------------------------------
    def handle(h: Any) -> Any:
        return None if h is None else [h.size(), h.ptr() != 0, bytes(memoryview(h))]

    rec("get_buffer", lambda: handle(st.get_buffer("k1")))
    rec("get_buffer.missing", lambda: handle(st.get_buffer("nope")))
    rec("batch_get_buffer", lambda: [handle(h) for h in st.batch_get_buffer(["b1", "nope"])])

    # -- existence, size, replicas -----------------------------------------------------
    rec("is_exist", lambda: [st.is_exist("k1"), st.is_exist("nope")])
    rec("batch_is_exist", lambda: st.batch_is_exist(["k1", "nope", "b2"]))
    rec("get_size", lambda: [st.get_size("k1"), st.get_size("nope")])

    def desc(d: Any) -> Any:
        return [d.is_memory_replica(), d.is_disk_replica(), str(d.status).rsplit(".", 1)[-1],
                d.get_memory_descriptor().buffer_descriptor.size
                if d.is_memory_replica() else None]

    rec("get_replica_desc", lambda: [desc(d) for d in st.get_replica_desc("k1")])
    rec("replica.endpoint", lambda: [d.get_memory_descriptor().buffer_descriptor
                                     .transport_endpoint == st.get_hostname()
                                     for d in st.get_replica_desc("b2")])
    pref = RC()
    rec("preferred_segment", lambda: (setattr(pref, "preferred_segment", st.get_hostname()),
                                      st.put("pref", b"p", pref))[1])
    rec("get_replica_desc.missing", lambda: [desc(d) for d in st.get_replica_desc("nope")])
    rec("batch_get_replica_desc", lambda: {k: [desc(d) for d in v] for k, v in
                                            st.batch_get_replica_desc(["b1", "nope"]).items()})

    # -- remove ------------------------------------------------------------------------
    rec("remove.leased", lambda: st.remove("k1"))  # get/is_exist above leased it
    rec("remove.force", lambda: st.remove("k1", force=True))
    rec("remove.missing", lambda: st.remove("k1"))
    rec("put.r", lambda: st.put_batch(["r/1", "r/2", "r/3", "s/1"], [b"1", b"2", b"3", b"4"]))
    rec("batch_remove", lambda: st.batch_remove(["r/1", "nope"]))
    rec("remove_by_regex", lambda: st.remove_by_regex(r"^r/"))
    rec("remove_by_regex.none", lambda: st.remove_by_regex(r"^zzz"))
    rec("remove_by_regex.bad", lambda: st.remove_by_regex(r"("))
    rec("is_exist.after_regex", lambda: st.batch_is_exist(["r/2", "r/3", "s/1"]))
    rec("batch_remove.leased", lambda: (st.get("s/1"), st.batch_remove(["s/1"]))[1])
    rec("batch_remove.force", lambda: st.batch_remove(["s/1"], force=True))
    time.sleep(0.7)  # the read leases above lapse (masters run with a 500 ms lease)
    rec("batch_replica_clear", lambda: st.batch_replica_clear(["b1", "nope"]))
    rec("is_exist.after_clear", lambda: st.batch_is_exist(["b1", "b2"]))
    rec("remove_all.force", lambda: st.remove_all(True) > 0)
    rec("remove_all.empty", lambda: st.remove_all())

    # -- copy / move tasks (one segment: the codes, and a copy onto where it lies) ------
    h = st.get_hostname()
    rec("copy.missing", lambda: st.create_copy_task("nope", [h])[1])
    rec("put.c1", lambda: st.put("c1", b"copy me"))
    rec("copy.unknown_segment", lambda: st.create_copy_task("c1", ["unknown:1"])[1])
    rec("move.same_segment", lambda: st.create_move_task("c1", h, h)[1])
    rec("move.unknown_source", lambda: st.create_move_task("c1", "unknown:1", h)[1])
    made: list[Any] = []
    rec("copy.onto_itself", lambda: (made.append(st.create_copy_task("c1", [h])),
                                     [len(made[0][0]), made[0][1]])[1])
    task = made[0] if made else None

    def finished() -> Any:
        for _ in range(100):
            resp, err = st.query_task(task[0])
            if err != 0 or resp.status in (mod.TaskStatus.SUCCESS, mod.TaskStatus.FAILED):
                return [err, str(resp.status).rsplit(".", 1)[-1], str(resp.type)
                        .rsplit(".", 1)[-1], resp.id == task[0]]
            time.sleep(0.05)
        return "pending"

    if task is not None and task[1] == 0:
        rec("query_task.copy", finished)
    rec("get.c1.after_copy", lambda: [st.get("c1"), len(st.get_replica_desc("c1"))])
    rec("query_task.unknown", lambda: st.query_task((1, 2)))

    # -- buffer pool -------------------------------------------------------------------
    bp = getattr(mod, "BufferPool", None)
    pool = rec("pool", lambda: bp(st, min_size_class=4096, alignment=4096))

    def lease_info() -> Any:
        lease = pool.acquire(1000)
        lease.buffer[:3] = b"abc"
        out = [lease.size, lease.ptr % 64, len(lease.buffer), st.put_from("bp", lease.ptr, 3)]
        lease.release()
        return out

    if pool is not None:
        rec("pool.lease", lease_info)
        rec("get.bp", lambda: st.get("bp"))
        rec("pool.huge", lambda: pool.acquire(1 << 60))
        rec("pool.close", pool.close)
    rec("pool.bad_alignment", lambda: bp(st, alignment=12345))

    # -- close -------------------------------------------------------------------------
    rec("close", st.close)
    rec("health.after_close", st.health_check)
    rec("get.after_close", lambda: st.get("b2"))
    # (Mooncake 0.3.13 crashes on put or is_exist after close: not part of the scenario)
    # (is_exist after close crashes it too)
    return out


if __name__ == "__main__":
    print(json.dumps(run(*sys.argv[1:4]), sort_keys=True))
