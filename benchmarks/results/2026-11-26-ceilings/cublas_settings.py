"""The decode step's projections (28 layers x qkv, o, gate_up, down; distinct weights, so they come
from HBM) in one CUDA graph, under cuBLAS's settings: which kernels, how long (H100)."""
import os, sys, time
import torch
import torch.nn.functional as F

lib = sys.argv[1] if len(sys.argv) > 1 else "default"
if lib != "default":
    torch.backends.cuda.preferred_blas_library(lib)
H, QKV, Q, I, L = 1024, 4096, 2048, 3072, 28
ws = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 32 for n, k in ((QKV, H), (H, Q), (2 * I, H), (H, I))] for _ in range(L)]
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
t = time.time()
while time.time() - t < 2:
    a @ a
for m in (256, 128, 64):
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k in (H, Q, H, I)]

    def body():
        for layer in ws:
            for x, w in zip(xs, layer):
                F.linear(x, w)
    body(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(30):
            g.replay()
        e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) / 30)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay(); torch.cuda.synchronize()
    names = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            names.setdefault(ev.name, []).append(ev.device_time)
    per = "; ".join(f"{n[:48]} x{len(v)} {sum(v) / len(v):.2f}us" for n, v in names.items())
    print(f"[{lib} ws={os.environ.get('CUBLASLT_WORKSPACE_SIZE', '-')}/{os.environ.get('CUBLAS_WORKSPACE_CONFIG', '-')}] m={m}: "
          f"{min(ts) * 1000 / L:.2f} us a layer (median {sorted(ts)[2] * 1000 / L:.2f}); {per}")
