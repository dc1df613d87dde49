"""The Hopper GEMM's four projections (rule's tiling) and the layer chain at a few row counts, us (28 calls
in a CUDA graph, weights rotating over 8 copies). Run on the tree, then with x_ring.diff applied."""
import statistics
import torch
from minivllm.worker import hopper_gemm as hg, ops

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


layers = [{nm: torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for nm, (n, k) in SHAPES.items()}
          for _ in range(28)]
norm_w = torch.ones(1024, device=dev, dtype=torch.bfloat16)
for t in (2, 16, 64, 128, 256):
    row = [f"T={t:3d}"]
    for name, (n, k) in SHAPES.items():
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ layers[0][name].float().T
        err = ((hg.linear(x, layers[0][name]).float() - ref).norm() / ref.norm()).item()
        us = graph_time(lambda: [hg.linear(x, layers[i % 8][name], out=out) for i in range(28)]) / 28
        row.append(f"{name} {us:5.2f}{'' if err < 5e-3 else ' BAD'}")
        if name == "gate_up":
            out2 = torch.empty(t, n // 2, device=dev, dtype=torch.bfloat16)
            g, u = ref.double().split(n // 2, dim=-1)
            ref2 = torch.nn.functional.silu(g) * u
            err = ((hg.linear(x, layers[0][name], silu_mul=True).double() - ref2).norm() / ref2.norm()).item()
            us = graph_time(lambda: [hg.linear(x, layers[i % 8][name], out=out2, silu_mul=True) for i in range(28)]) / 28
            row.append(f"gu+silu {us:5.2f}{'' if err < 5e-3 else ' BAD'}")
    x0 = torch.randn(t, 1024, device=dev, dtype=torch.bfloat16)
    r0 = torch.randn(t, 1024, device=dev, dtype=torch.bfloat16)

    def chain(fused=False):
        h, res = x0, r0.clone()
        for L in layers:
            normed, res = ops.add_rms_norm(h, norm_w, 1e-6, res)
            h = hg.linear(hg.linear(normed, L["qkv"])[:, :2048], L["o"])
            normed, res = ops.add_rms_norm(h, norm_w, 1e-6, res)
            act = (hg.linear(normed, L["gate_up"], silu_mul=True) if fused
                   else ops.silu_and_mul(hg.linear(normed, L["gate_up"])))
            h = hg.linear(act, L["down"])
        return h
    row.append(f"| chain {graph_time(chain) / 28:6.2f} fused {graph_time(lambda: chain(True)) / 28:6.2f} us/layer")
    print("  ".join(row), flush=True)
