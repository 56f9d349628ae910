import contextlib, socket
from pymooncake.bench import store_meta as sm
MiB = 1 << 20
if __name__ == "__main__":
    with contextlib.ExitStack() as st:
        addr, md = st.enter_context(sm._ours_cluster())
        s = sm._store("ours"); st.callback(s.close)
        assert s.setup("localhost", md, 64 * MiB, 16 * MiB, "tcp", "", addr) == 0
        assert s.put("k", bytes(1024)) == 0 and s.is_exist("k") == 1
        print("addr", addr)
        import subprocess
        print(subprocess.run(["ss", "-xp"], capture_output=True, text=True).stdout.count("pymooncake-rpc"))
        print([l for l in subprocess.run(["ss", "-xlp"], capture_output=True, text=True).stdout.splitlines() if "pymooncake-rpc" in l])
        import gc
        from pymooncake.rpc.client import SyncRpcClient
        print([(c.host, c.port, c._sock.family if c._sock else None) for c in gc.get_objects() if isinstance(c, SyncRpcClient)])
