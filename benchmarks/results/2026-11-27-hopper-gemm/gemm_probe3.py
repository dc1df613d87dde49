"""Probe 3: the rule's tiling, nearby tilings and cuBLAS at every decode bucket; the layer chain."""
import statistics
import torch
from minivllm.worker import hopper_gemm as hg
from minivllm.worker import ops

dev = torch.device("cuda")
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
NSM = torch.cuda.get_device_properties(dev).multi_processor_count

def graph_time(fn, reps=25):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)

COPIES, CALLS = 8, 28
hidden = 1024
layers = [{nm: torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for nm, (n, k) in SHAPES.items()} for _ in range(28)]
norm_w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
print("T | per shape: cuBLAS / rule (tile,many) / best nearby (tile,many) | layer chain with norms and SiLU")
for t in (2, 8, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256):
    row = [f"T={t:3d}"]
    for name, (n, k) in SHAPES.items():
        ws = [layers[i][name] for i in range(COPIES)]
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
        c = graph_time(lambda: [torch.mm(x, ws[i % COPIES].T, out=out) for i in range(CALLS)]) / CALLS
        rule = hg.tiling(t, n, k, NSM)
        cands = {rule}
        for tile in (rule.token_tile - 16, rule.token_tile + 16, rule.token_tile * 2, rule.token_tile // 2 // 16 * 16):
            if 16 <= tile <= 256:
                cands.add(hg.Tiling(tile, rule.many_stages))
        cands |= {hg.Tiling(c_.token_tile, not c_.many_stages) for c_ in list(cands)}
        res = {h: graph_time(lambda: [hg.linear(x, ws[i % COPIES], out=out, how=h) for i in range(CALLS)]) / CALLS for h in cands}
        best = min(res, key=res.get)
        row.append(f"{name} {c:5.2f}/{res[rule]:5.2f}({rule.token_tile},{int(rule.many_stages)})/{res[best]:5.2f}({best.token_tile},{int(best.many_stages)})")
    x0 = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
    res0 = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
    def run(use_ours):
        h, res = x0, res0.clone()
        saved = hg.ENABLED
        hg.ENABLED = use_ours
        mm = (lambda a, w: hg.linear(a, w)) if use_ours else (lambda a, w: torch.mm(a, w.T))
        for L in layers:
            normed, res = ops.add_rms_norm(h, norm_w, 1e-6, res)
            h = mm(mm(normed, L["qkv"])[:, :2048], L["o"])
            normed, res = ops.add_rms_norm(h, norm_w, 1e-6, res)
            h = mm(ops.silu_and_mul(mm(normed, L["gate_up"])), L["down"])
        hg.ENABLED = saved
        return h
    c = graph_time(lambda: run(False)) / 28
    o = graph_time(lambda: run(True)) / 28
    row.append(f"| chain {c:6.2f} -> {o:6.2f} ({(o / c - 1) * 100:+.1f}%)")
    print("  ".join(row), flush=True)
