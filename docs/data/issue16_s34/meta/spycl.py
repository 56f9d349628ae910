# ours only, 4 clients: py-spy one client (and the master) over a long remove / is_exist phase
import contextlib, sys, time, os, subprocess
from pymooncake.bench import store_meta as sm, store as sb
from pymooncake.bench import store_procs as sp
MiB = 1 << 20
def main():
    op = sys.argv[1]
    keys = [f"meta-key-{i}" for i in range(256)]
    n = 10000
    with contextlib.ExitStack() as st:
        addr, md = st.enter_context(sm._ours_cluster())
        master = sp._HELPERS[0]
        h = sm._store("ours"); st.callback(h.close)
        assert h.setup("localhost", md, 64 * MiB, 16 * MiB, "tcp", "", addr) == 0
        for k in keys: assert h.put(k, bytes(1024)) == 0
        d = sm._Clients("ours", addr, md, 4, n, 16, keys); st.callback(d.close)
        spies = [subprocess.Popen([".venv/bin/py-spy", "record", "-r", "2000", "-f", "raw", "-o", f"/tmp/s34/spy_{op}_{who}.txt", "-p", str(pid), "--nonblocking", "-d", "3"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for who, pid in (("client", d.procs[0].pid), ("master", master))]
        time.sleep(1.5)
        wall, done, ok = d.phase(op, 0, n)
        print(op, done / wall, ok)
        for s in spies: s.wait()
if __name__ == '__main__':
    main()
