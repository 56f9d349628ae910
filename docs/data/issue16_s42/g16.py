"""Embedded 16 MiB gets like bench store (16 keys, the previous value held): ours, with the
master round trip (``GetOps._plan_one``) and the copy (``copy_verified``) timed, and
Mooncake's, alternating in one process, 4 rounds. Meant for the library before session 42
(``_plan_one`` is not called once a get overlaps its round trip). Usage, from the repo root:
LD_LIBRARY_PATH=... PYTHONPATH=/tmp/s42/old/src .venv/bin/python docs/data/issue16_s42/g16.py"""
import os, sys, time, resource, ctypes
sys.path.insert(0, "/tmp/mcvenv/lib/python3.11/site-packages")
from pymooncake.bench.store_procs import _pymooncake_cluster, _mooncake_cluster
from pymooncake.store.client import StoreClient
from pymooncake.transfer import TransferConfig
import pymooncake.store.client_get as cg
import pymooncake.store.checksum as ck
MiB = 1 << 20; N = 16; SZ = 16 * MiB
T = {"cv": 0.0, "plan": 0.0}
_cv = cg.copy_verified
def cv(*a):
    t = time.perf_counter(); r = _cv(*a); T["cv"] += time.perf_counter() - t; return r
cg.copy_verified = cv
_po = cg.GetOps._plan_one
def po(self, k):
    t = time.perf_counter(); r = _po(self, k); T["plan"] += time.perf_counter() - t; return r
cg.GetOps._plan_one = po
def flt(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
seg = 320 * MiB
from mooncake.store import MooncakeDistributedStore
with _pymooncake_cluster(0) as (addr, md, _), _mooncake_cluster() as (maddr, mmd):
    c = StoreClient(addr, md, global_segment_size=seg, local_buffer_size=33 * MiB,
                    transfer_config=TransferConfig(transports=("local", "tcp"))).start()
    m = MooncakeDistributedStore()
    assert m.setup("localhost", mmd, seg, 33 * MiB, "tcp", "", maddr) == 0
    vals = [os.urandom(SZ) for _ in range(N)]
    for i in range(N):
        c.put(f"k{i}", vals[i]); assert m.put(f"k{i}", vals[i]) == 0
    for rnd in range(4):
        for name, g in (("ours", c.get), ("mc", m.get)):
            T.update(cv=0.0, plan=0.0)
            f0 = flt(); c0 = time.process_time(); lat = []; got = None
            for i in range(N):
                t = time.perf_counter(); got = g(f"k{i}"); lat.append(time.perf_counter() - t)
            c1 = time.process_time(); f1 = flt()
            lat.sort()
            print("%-4s p50 %.2f ms mean %.2f cpu %.2f faults %d | plan %.3f cv %.2f ms" % (
                name, lat[N // 2] * 1e3, sum(lat) / N * 1e3, (c1 - c0) / N * 1e3, (f1 - f0) / N,
                T["plan"] / N * 1e3, T["cv"] / N * 1e3))
            del got
    c.close(); m.close()
