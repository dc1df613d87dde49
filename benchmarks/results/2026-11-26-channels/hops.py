"""Latency of one process-to-process hop on this host, several ways (round trips, median us)."""
import ctypes, mmap, os, socket, statistics, struct, sys, time
import zmq

N = 3000

def report(name, ts):
    ts = sorted(ts[300:])
    print(f"{name:40s} RTT median {ts[len(ts)//2]*1e6:7.1f} us  p90 {ts[int(.9*len(ts))]*1e6:7.1f}", flush=True)

def sleep_overshoot():
    for want in (20e-6, 50e-6, 0):
        ts = []
        for _ in range(2000):
            t = time.perf_counter(); time.sleep(want); ts.append(time.perf_counter() - t)
        ts.sort(); print(f"time.sleep({want*1e6:.0f} us) takes median {ts[1000]*1e6:.1f} us, p90 {ts[1800]*1e6:.1f}", flush=True)

def zmq_pair(spin_client, spin_server):
    a, b = f"ipc:///tmp/hz-a-{os.getpid()}", f"ipc:///tmp/hz-b-{os.getpid()}"
    def recv(s, spin):
        if spin:
            while True:
                try: return s.recv(zmq.NOBLOCK)
                except zmq.Again: pass
        return s.recv()
    pid = os.fork()
    if pid == 0:
        ctx = zmq.Context(); pull = ctx.socket(zmq.PULL); pull.bind(a); push = ctx.socket(zmq.PUSH); push.connect(b)
        for _ in range(N): push.send(recv(pull, spin_server))
        time.sleep(0.2); os._exit(0)
    ctx = zmq.Context(); push = ctx.socket(zmq.PUSH); push.connect(a); pull = ctx.socket(zmq.PULL); pull.bind(b)
    ts = []
    for _ in range(N):
        t = time.perf_counter(); push.send(b"x" * 300); recv(pull, spin_client); ts.append(time.perf_counter() - t)
        time.sleep(0.0003)
    os.waitpid(pid, 0); ctx.destroy(linger=0)
    report(f"zmq ipc (client spin {spin_client}, server spin {spin_server})", ts)

def unix_pair(spin):
    s1, s2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        s1.close()
        if spin: s2.setblocking(False)
        for _ in range(N):
            while True:
                try: m = s2.recv(65536); break
                except BlockingIOError: pass
            s2.send(m)
        os._exit(0)
    s2.close()
    if spin: s1.setblocking(False)
    ts = []
    for _ in range(N):
        t = time.perf_counter(); s1.send(b"x" * 300)
        while True:
            try: s1.recv(65536); break
            except BlockingIOError: pass
        ts.append(time.perf_counter() - t); time.sleep(0.0003)
    os.waitpid(pid, 0)
    report(f"unix socketpair (spin {spin})", ts)

def shm_pair():
    buf = mmap.mmap(-1, 4096)  # shared with the child across fork
    def wait(off, want):
        while struct.unpack_from("q", buf, off)[0] != want: pass
    pid = os.fork()
    if pid == 0:
        for i in range(1, N + 1):
            wait(0, i); buf[64:364] = buf[1024:1324]; struct.pack_into("q", buf, 8, i)
        os._exit(0)
    ts = []
    for i in range(1, N + 1):
        t = time.perf_counter(); buf[1024:1324] = b"x" * 300; struct.pack_into("q", buf, 0, i); wait(8, i)
        ts.append(time.perf_counter() - t); time.sleep(0.0003)
    os.waitpid(pid, 0)
    report("shared memory, both spin", ts)

if __name__ == "__main__":
    print(os.cpu_count(), "cpus")
    sleep_overshoot()
    zmq_pair(False, False); zmq_pair(True, True)
    unix_pair(False); unix_pair(True)
    shm_pair()
