"""Every tiling tried at one row count, all printed (us a call, 28 calls in a CUDA graph, weights rotating)."""
import os
import sys
import torch
from minivllm.worker import hopper_gemm as hg
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_sweep_lib import graph_time, valid, CLUSTERS, SHAPES

dev = torch.device("cuda")
t = int(sys.argv[1])
COPIES, CALLS = 8, 28
for name, (n, k) in SHAPES.items():
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(COPIES)]
    x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
    rule = hg.tiling(t, n, k, 132)
    for tile in sorted({rule.token_tile, min(256, rule.token_tile * 2), max(16, rule.token_tile // 2 // 16 * 16)}):
        line = []
        for many in (False, True):
            for cr, ct in CLUSTERS:
                how = hg.Tiling(tile, many, cr, ct)
                if not valid(t, n, how):
                    continue
                ms = graph_time(lambda: [hg.linear(x, ws[i % COPIES], out=out, how=how) for i in range(CALLS)]) / CALLS
                line.append(f"{int(many)}:{cr}x{ct} {ms:5.2f}")
        print(f"T={t} {name:8s} tile {tile:3d} | " + "  ".join(line), flush=True)
