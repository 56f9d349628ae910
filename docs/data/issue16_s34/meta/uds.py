# CPU per ping-pong round trip, TCP loopback vs Unix abstract socket (blocking, and polled)
import os, socket, time, sys
def server(kind, addr, ready_w):
    if kind == "tcp":
        ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); ls.bind(addr)
    else:
        ls = socket.socket(socket.AF_UNIX); ls.bind(addr)
    ls.listen(); os.write(ready_w, b"x")
    c, _ = ls.accept()
    if kind == "tcp": c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        d = c.recv(100)
        if not d: break
        c.sendall(d)
    os._exit(0)
def run(kind, poll, n=40000):
    addr = ("127.0.0.1", 0) if kind == "tcp" else "\0pmk-uds-test-%d" % os.getpid()
    if kind == "tcp":
        s0 = socket.socket(); s0.bind(addr); port = s0.getsockname()[1]; s0.close(); addr = ("127.0.0.1", port)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0: server(kind, addr, w)
    os.read(r, 1)
    c = socket.socket(socket.AF_INET if kind == "tcp" else socket.AF_UNIX); c.connect(addr)
    if kind == "tcp": c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"x" * 40
    t0, w0 = time.process_time(), time.perf_counter()
    st0 = open(f"/proc/{pid}/stat").read().split()
    for _ in range(n):
        c.send(msg)
        if poll:
            while True:
                try:
                    c.recv(100, socket.MSG_DONTWAIT); break
                except BlockingIOError:
                    pass
        else:
            c.recv(100)
    cl = (time.process_time() - t0) / n * 1e6; wall = (time.perf_counter() - w0) / n * 1e6
    st1 = open(f"/proc/{pid}/stat").read().split()
    hz = os.sysconf("SC_CLK_TCK")
    srv = ((int(st1[13]) + int(st1[14])) - (int(st0[13]) + int(st0[14]))) / hz / n * 1e6
    c.close(); os.waitpid(pid, 0)
    print(f"{kind:4s} poll={poll}: wall {wall:5.1f} us/rt, client CPU {cl:5.1f}, server CPU {srv:5.1f}", flush=True)
for rep in range(2):
    for kind in ("tcp", "unix"):
        for poll in (False, True):
            run(kind, poll)
