import ctypes, time, statistics, sys, os, subprocess
import numpy as np
S=4<<20; B=8; T=S*B
if sys.argv[1]=="child":
    from pymooncake.transfer.memory import SharedBuffer
    sb=SharedBuffer(T); a=np.zeros(T,dtype=np.uint8)
    np.frombuffer(sb.view(),dtype=np.uint8)[:]=0
    print(os.getpid(), sb.name, sb.addr, a.ctypes.data, flush=True)
    sys.stdin.readline(); sb.close(); sys.exit(0)
from pymooncake.transfer.memory import PeerMapping
p=subprocess.Popen([sys.executable,__file__,"child"],stdin=subprocess.PIPE,stdout=subprocess.PIPE,text=True)
pid,name,saddr,aaddr=p.stdout.readline().split(); pid=int(pid); saddr=int(saddr); aaddr=int(aaddr)
pm=PeerMapping(name,T); pa=pm.addr
src=np.random.default_rng(0).integers(0,256,T,dtype=np.uint8)
mid=np.zeros_like(src); dst=np.zeros_like(src)
sa=src.ctypes.data; da=dst.ctypes.data
libc=ctypes.CDLL(None,use_errno=True)
class iovec(ctypes.Structure): _fields_=[("base",ctypes.c_void_p),("len",ctypes.c_size_t)]
pvw=libc.process_vm_writev; pvr=libc.process_vm_readv
for f in (pvw,pvr):
    f.argtypes=[ctypes.c_int,ctypes.POINTER(iovec),ctypes.c_ulong,ctypes.POINTER(iovec),ctypes.c_ulong,ctypes.c_ulong]; f.restype=ctypes.c_ssize_t
def cma(remote):
    for fn,loc in ((pvw,sa),(pvr,da)):
        for i in range(B):
            l=iovec(loc+i*S,S); r=iovec(remote+i*S,S)
            n=fn(pid,ctypes.byref(l),1,ctypes.byref(r),1,0)
            if n!=S: raise OSError(ctypes.get_errno(),"cma")
mm=ctypes.memmove
def npcopy():
    for i in range(B): np.copyto(mid[i*S:(i+1)*S], src[i*S:(i+1)*S])
    for i in range(B): np.copyto(dst[i*S:(i+1)*S], mid[i*S:(i+1)*S])
def ctshm():
    for i in range(B): mm(pa+i*S, sa+i*S, S)
    for i in range(B): mm(da+i*S, pa+i*S, S)
subs={"np":npcopy,"ct_shm":ctshm,"cma_shm":lambda: cma(saddr),"cma_anon":lambda: cma(aaddr)}
for f in subs.values(): f()
cma(saddr); assert np.array_equal(dst,src); dst[:]=0
res={k:[] for k in subs}
for r in range(int(sys.argv[1])):
    for k,f in subs.items():
        t=time.perf_counter(); f(); res[k].append(time.perf_counter()-t)
base=res["np"]
for k,v in res.items():
    rat=[b/x for b,x in zip(base,v)]
    q1,med,q3=statistics.quantiles(rat,n=4)
    print(f"{k:8s} {2*T/statistics.median(v)/1e9:6.2f} GB/s  ratio vs np {med:.3f} [{q1:.3f}-{q3:.3f}]")
p.stdin.write("q\n"); p.stdin.flush(); p.wait()
