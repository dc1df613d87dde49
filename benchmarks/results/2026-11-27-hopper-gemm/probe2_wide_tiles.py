"""Probe 2: the module's tiling rule against cuBLAS at every decode bucket size; a sweep at small T."""
import statistics
import torch
from minivllm.worker import hopper_gemm as hg
from minivllm.worker import ops

dev = torch.device("cuda")
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
NSM = torch.cuda.get_device_properties(dev).multi_processor_count

def graph_time(fn, reps=30):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)

COPIES, CALLS = 8, 28
print("== small T sweep (us per call, 28 calls in a graph, 8 weight copies)")
for t in (2, 8, 16, 32):
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(COPIES)]
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
        row = [f"T={t:3d} {name:7s} cuBLAS {graph_time(lambda: [torch.mm(x, ws[i % COPIES].T, out=out) for i in range(CALLS)]) / CALLS:6.2f}"]
        for stages in (8, 24):
            for cw in (1, 2):
                how = hg.Tiling(32, stages, cw)
                row.append(f"32/{stages}/{cw} {graph_time(lambda: [hg.linear(x, ws[i % COPIES], out=out, how=how) for i in range(CALLS)]) / CALLS:6.2f}")
        print(" | ".join(row), flush=True)

print("\n== rule vs cuBLAS per shape, and the MLP+attention-free layer chain with norms (us per layer)")
hidden, inter = 1024, 3072
layers = [{nm: torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for nm, (n, k) in SHAPES.items()} for _ in range(28)]
norm_w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
for t in (2, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256):
    row = [f"T={t:3d}"]
    for name, (n, k) in SHAPES.items():
        ws = [layers[i][name] for i in range(COPIES)]
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
        c = graph_time(lambda: [torch.mm(x, ws[i % COPIES].T, out=out) for i in range(CALLS)]) / CALLS
        o = graph_time(lambda: [hg.linear(x, ws[i % COPIES], out=out) for i in range(CALLS)]) / CALLS
        row.append(f"{name} {c:5.2f}/{o:5.2f}")
    x0 = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
    res0 = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
    def run(use_ours):
        h, res = x0, res0.clone()
        saved = hg.ENABLED
        hg.ENABLED = use_ours  # (starts_early reads it: the norms take PDL only before our kernel)
        mm = (lambda a, w: hg.linear(a, w)) if use_ours else (lambda a, w: torch.mm(a, w.T))
        for L in layers:
            normed, res = ops.add_rms_norm(h, norm_w, 1e-6, res)
            qkv = mm(normed, L["qkv"])
            attn_out = qkv[:, :2048]
            h = mm(attn_out, L["o"])
            normed, res = ops.add_rms_norm(h, norm_w, 1e-6, res)
            h = mm(ops.silu_and_mul(mm(normed, L["gate_up"])), L["down"])
        hg.ENABLED = saved
        return h
    c = graph_time(lambda: run(False)) / 28
    o = graph_time(lambda: run(True)) / 28
    row.append(f"| layer chain cuBLAS {c:6.2f} ours {o:6.2f} ({(o / c - 1) * 100:+.1f}%)")
    print("  ".join(row), flush=True)
