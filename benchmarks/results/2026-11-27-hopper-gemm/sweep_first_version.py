"""Probe: hopper_gemm against cuBLAS at decode shapes (Qwen3-0.6B), correctness then timing."""
import sys, time, statistics
import torch
from minivllm.worker import hopper_gemm as hg

torch.manual_seed(0)
dev = torch.device("cuda")
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
NSM = torch.cuda.get_device_properties(dev).multi_processor_count
print(torch.cuda.get_device_name(), "SMs", NSM, flush=True)

# ---- correctness
bad = 0
for name, (n, k) in SHAPES.items():
    for t in (1, 7, 33, 64, 100, 128, 200, 256):
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        ref = (x.double() @ w.double().T)
        for (tile, stages), cw in [(c, cw) for c in hg.CONFIGS for cw in (1, 2)]:
            out = torch.full((t, n), float("nan"), device=dev, dtype=torch.bfloat16)
            hg.linear(x, w, out=out, tile=tile, stages=stages, consumers=cw)
            torch.cuda.synchronize()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            if not (err < 8e-3):
                bad += 1
                print(f"BAD {name} t={t} tile={tile} stages={stages} cw={cw} err={err}", flush=True)
# strided x (a slice of a wider buffer) and a strided out
x_wide = torch.randn(200, 4096, device=dev, dtype=torch.bfloat16)
w = torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16) / 2048 ** 0.5
out_wide = torch.full((200, 3000), float("nan"), device=dev, dtype=torch.bfloat16)
hg.linear(x_wide[:, :2048], w, out=out_wide[:, 512:1536])
torch.cuda.synchronize()
ref = x_wide[:, :2048].double() @ w.double().T
err = ((out_wide[:, 512:1536].double() - ref).norm() / ref.norm()).item()
untouched = out_wide[:, :512].isnan().all().item() and out_wide[:, 1536:].isnan().all().item()
print(f"strided: err {err:.2e} untouched {untouched}")
bad += not (err < 8e-3 and untouched)
print("correctness:", "ALL OK" if bad == 0 else f"{bad} BAD", flush=True)

# ---- timing helpers
def graph_time(fn, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
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

COPIES = 8
BEST = {}
CALLS = 28
print("\n== one shape, 28 calls in a graph, weights rotating over 8 copies: us per call")
for t in (64, 128, 256):
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(COPIES)]
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
        row = [f"T={t:3d} {name:7s} cuBLAS {graph_time(lambda: [torch.mm(x, ws[i % COPIES].T, out=out) for i in range(CALLS)]) / CALLS:6.2f}"]
        rule = hg.token_tile(t, n, NSM)
        res = {}
        for tile, stages in hg.CONFIGS:
            if tile > 2 * t and tile > 32:
                continue
            for cw in (1, 2):
                us = graph_time(lambda: [hg.linear(x, ws[i % COPIES], out=out, tile=tile, stages=stages, consumers=cw) for i in range(CALLS)]) / CALLS
                res[(tile, stages, cw)] = us
                row.append(f"{tile}/{stages}/{cw}{'*' if tile == rule else ''} {us:6.2f}")
        best = min(res, key=res.get)
        BEST[(t, name)] = best
        row.append(f"BEST {best} {res[best]:.2f}")
        print(" | ".join(row), flush=True)

print("\n== chain: 28 layers of qkv, o, gate_up, down (weights per layer), us per layer")
def chain_weights():
    return [{nm: torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for nm, (n, k) in SHAPES.items()} for _ in range(28)]
layers = chain_weights()
for t in (64, 128, 256):
    x0 = torch.randn(t, 1024, device=dev, dtype=torch.bfloat16)
    bufs = {nm: torch.empty(t, n, device=dev, dtype=torch.bfloat16) for nm, (n, k) in SHAPES.items()}
    def run(mm):
        h = x0
        for L in layers:
            mm(h, L["qkv"], bufs["qkv"])
            mm(bufs["qkv"][:, :2048], L["o"], bufs["o"])
            mm(bufs["o"], L["gate_up"], bufs["gate_up"])
            mm(bufs["gate_up"][:, :3072], L["down"], bufs["down"])
            h = bufs["down"]
    cub = graph_time(lambda: run(lambda a, w, o: torch.mm(a, w.T, out=o))) / 28
    def best_mm(a, w, o):
        nm = [k for k, (n, kk) in SHAPES.items() if (n, kk) == tuple(w.shape)][0]
        tile, stages, cw = BEST[(t, nm)]
        hg.linear(a, w, out=o, tile=tile, stages=stages, consumers=cw)
    ours_best = graph_time(lambda: run(best_mm)) / 28
    ours_p = graph_time(lambda: run(lambda a, w, o: hg.linear(a, w, out=o, pdl=True))) / 28
    ours8 = graph_time(lambda: run(lambda a, w, o: hg.linear(a, w, out=o, stages=8))) / 28
    ours = graph_time(lambda: run(lambda a, w, o: hg.linear(a, w, out=o, pdl=False))) / 28
    # same result?
    run(lambda a, w, o: torch.mm(a, w.T, out=o)); torch.cuda.synchronize(); r1 = bufs["down"].float().clone()
    run(lambda a, w, o: hg.linear(a, w, out=o)); torch.cuda.synchronize(); r2 = bufs["down"].float().clone()
    rel = ((r1 - r2).norm() / r1.norm()).item()
    print(f"T={t:3d} cuBLAS {cub:6.2f}  ours(best per shape) {ours_best:6.2f}  ours(rule, max stages) {ours_p:6.2f}  ours(rule, 8 stages) {ours8:6.2f}  ours no PDL {ours:6.2f}  (rel diff {rel:.2e}, |r1| {r1.norm().item():.3e})", flush=True)
