import time, os, subprocess, contextlib
from pymooncake.bench import store_meta as sm, store as sb
from pymooncake.bench import transfer_refs as refs
def tree(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [q for k in out for q in tree(int(k))]
if __name__ == "__main__":
    keys = [f"meta-key-{i}" for i in range(256)]
    with contextlib.ExitStack() as st:
        d = {}
        for side in ("ours", "mooncake"):
            addr, md = st.enter_context(sb._mooncake_cluster() if side == "mooncake" else sm._ours_cluster())
            h = sm._store(side); st.callback(h.close)
            assert h.setup("localhost", md, 64 << 20, 16 << 20, "tcp", "", addr) == 0
            d[side] = sm._Clients(side, addr, md, 4, 100, 16, keys); st.callback(d[side].close)
        me = os.getpid()
        allp = tree(me)
        a = {p: refs.tasks_cpu_s(p) for p in allp}
        time.sleep(3)
        b = {p: refs.tasks_cpu_s(p) for p in allp}
        for p in allp:
            try: cmd = open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:90]
            except OSError: cmd = "?"
            print(round(b[p] - a[p], 4), p, cmd)
