# the client path's CPU per call, outside the network: layers above SyncRpcClient.call, and the
# codec work inside it (pack_frame + reply_of/result_of)
import time, contextlib
from pymooncake.bench import store_meta as sm
from pymooncake.rpc import client as rc
from pymooncake.rpc.codec import pack_frame, HEADER
from pymooncake.rpc.replies import reply_of, result_of
MiB = 1 << 20
def main():
    with contextlib.ExitStack() as st:
        addr, md = st.enter_context(sm._ours_cluster())
        s = sm._store("ours"); st.callback(s.close)
        assert s.setup("localhost", md, 64 * MiB, 16 * MiB, "tcp", "", addr) == 0
        assert s.put("k", bytes(1024)) == 0
        N = 20000
        for rnd in range(3):
            t = time.process_time()
            for _ in range(N): s.is_exist("k")
            real = (time.process_time() - t) / N * 1e6
            # layers above the RPC: replace SyncRpcClient.call by a stub answering True
            orig = rc.SyncRpcClient.call
            rc.SyncRpcClient.call = lambda self, m, p=None, timeout_s=None, reply_type=None: True
            t = time.process_time()
            for _ in range(N): s.is_exist("k")
            above = (time.process_time() - t) / N * 1e6
            rc.SyncRpcClient.call = orig
            # codec inside the call
            from pymooncake.store.protocol import ExistRequest
            req = ExistRequest("client-x", "k", ())
            frame_ok = pack_frame({"i": 1, "r": True})
            t = time.process_time()
            for i in range(N):
                pack_frame({"i": i, "m": "exist", "p": req})
                result_of(reply_of(memoryview(frame_ok)[HEADER.size:]), None)
            codec = (time.process_time() - t) / N * 1e6
            print(f"is_exist CPU/call: whole {real:.1f} us (depth 1, polling), layers above call {above:.1f} us, codec {codec:.1f} us", flush=True)
if __name__ == "__main__":
    main()
