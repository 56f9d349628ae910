import ctypes, time, statistics, threading, queue, sys
import numpy as np
from pymooncake.transfer.memory import SharedBuffer, PeerMapping
S=4<<20; B=8; T=S*B
src=np.random.default_rng(0).integers(0,256,T,dtype=np.uint8)
mid=np.zeros_like(src); dst=np.zeros_like(src)
sb=SharedBuffer(T); pm=PeerMapping(sb.name,T)
sa=src.ctypes.data; da=dst.ctypes.data; ma=mid.ctypes.data; pa=pm.addr
mm=ctypes.memmove
def npcopy():
    for i in range(B): np.copyto(mid[i*S:(i+1)*S], src[i*S:(i+1)*S])
    for i in range(B): np.copyto(dst[i*S:(i+1)*S], mid[i*S:(i+1)*S])
def ctanon():
    for i in range(B): mm(ma+i*S, sa+i*S, S)
    for i in range(B): mm(da+i*S, ma+i*S, S)
def ctshm():
    for i in range(B): mm(pa+i*S, sa+i*S, S)
    for i in range(B): mm(da+i*S, pa+i*S, S)
q=queue.SimpleQueue(); ev=[None]
def worker():
    while True:
        f=q.get(); f(); ev[0].set()
threading.Thread(target=worker,daemon=True).start()
def thr():
    for f in (lambda: [mm(pa+i*S, sa+i*S, S) for i in range(B)], lambda: [mm(da+i*S, pa+i*S, S) for i in range(B)]):
        e=threading.Event(); ev[0]=e; q.put(f); e.wait()
subs={"np":npcopy,"ct_anon":ctanon,"ct_shm":ctshm,"thr_shm":thr}
for f in subs.values(): f()
res={k:[] for k in subs}
for r in range(int(sys.argv[1]) if len(sys.argv)>1 else 300):
    for k,f in subs.items():
        t=time.perf_counter(); f(); res[k].append(time.perf_counter()-t)
base=res["np"]
for k,v in res.items():
    rat=[b/x for b,x in zip(base,v)]
    q1,med,q3=statistics.quantiles(rat,n=4)
    print(f"{k:8s} {2*T/statistics.median(v)/1e9:6.2f} GB/s  ratio vs np {med:.3f} [{q1:.3f}-{q3:.3f}]")
sb.close()
