import timeit, msgspec
from pymooncake.store.protocol import BatchExistRequest, ExistRequest
from pymooncake.store.master.core import MasterCore
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.client_master import MasterOps
from pymooncake.store.compat._types import keys_arg
from pymooncake.rpc.codec import pack_frame, encode
from pymooncake.store.master.core_state import keys_fast_ok
core = MasterCore(MasterConfig())
core.mount_segment("c0", "s0", "h0", 1 << 32, 64 << 20, 0.0)
keys = [f"meta-key-{i}" for i in range(256)]
for k in keys:
    h = core.put_start("c0", k, 1024, ReplicateConfig(), 0.0); core.put_end("c0", k, h.generation, 0.0)
g = keys[:16]
N = 20000
def t(name, f):
    s = min(timeit.repeat(f, number=N, repeat=5)) / N * 1e6
    print(f"{name:40s} {s:6.2f} us")
t("keys_arg", lambda: keys_arg("f", g))
t("keys_fast_ok(no_nul)", lambda: keys_fast_ok(g, 4096, no_nul=True))
t("BatchExistRequest()", lambda: BatchExistRequest("c", tuple(g), ()))
req = BatchExistRequest("c", tuple(g), ())
t("encode(batch req)", lambda: encode(req))
t("pack_frame(batch call)", lambda: pack_frame({"m": "batch_exist", "i": 1, "p": req}))
t("pack_frame(single call)", lambda: pack_frame({"m": "exist", "i": 1, "p": ExistRequest("c", "meta-key-1", ())}))
dec = msgspec.msgpack.Decoder(BatchExistRequest)
raw = encode(req)
t("decode batch req", lambda: dec.decode(raw))
dec1 = msgspec.msgpack.Decoder(ExistRequest); raw1 = encode(ExistRequest("c", "meta-key-1"))
t("decode single req", lambda: dec1.decode(raw1))
t("exist_many(16)", lambda: core.exist_many(req.keys, 1.0, frozenset()))
t("exist(1)", lambda: core.exist("c", "meta-key-1", 1.0, frozenset()))
res = core.exist_many(req.keys, 1.0, frozenset())
t("reply frame (16 bools)", lambda: pack_frame({"i": 1, "r": res}))
t("reply frame (1 bool)", lambda: pack_frame({"i": 1, "r": True}))
anyd = msgspec.msgpack.Decoder()
rf = encode({"i": 1, "r": res})
t("decode reply 16", lambda: anyd.decode(rf))
_B = {bool}
t("type set check", lambda: {*map(type, res)} == _B)
t("compat int conversion", lambda: [1 if v is True else 0 if v is False else -1 for v in res])
t("list(map(int))", lambda: list(map(int, res)))
