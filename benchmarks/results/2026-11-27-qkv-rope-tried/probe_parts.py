"""Where the fused qkv kernel's time goes: the plain GEMM, + rotation, + store (bf16 / FP8), one dot
of head_dim columns against two of half; cuBLAS for scale."""
import sys
import torch
import torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from qkv_rope import graph_time_us, COPIES
from minivllm.worker import qkv_rope
from minivllm.worker.attention.kv_cache import KVCacheLayout

torch.manual_seed(0)
dev, dtype = torch.device("cuda"), torch.bfloat16
H, NQ, NKV, D = 1024, 16, 8, 128
W = [torch.randn((NQ + 2 * NKV) * D, H, device=dev, dtype=dtype) / 32 for _ in range(COPIES)]
qn = torch.ones(D, device=dev, dtype=dtype); kn = qn.clone()
freqs = torch.arange(32768, device=dev)[:, None] * torch.rand(D // 2, device=dev)[None]
cos, sin = freqs.cos(), freqs.sin()
for M in (64, 256, 2048, 16384):
    x = torch.randn(M, H, device=dev, dtype=dtype)
    pos = torch.randint(0, 32768, (M,), device=dev)
    nb = M + 1 if M <= 512 else M // 16 + 2
    slots = (torch.randperm(nb, device=dev)[:M] * 16) if M <= 512 else torch.arange(M, device=dev)
    caches = {fp8: (lay.allocate(nb, dev), slots, lay) for fp8 in (False, True) for lay in [KVCacheLayout(16, NKV, D, dtype, fp8=fp8)]}
    cfgs = [qkv_rope.TileConfig(64, 4, 4), qkv_rope.TileConfig(128, 8, 3), qkv_rope.TileConfig(128, 4, 3)]
    res = [f"cuBLAS {graph_time_us(lambda l: F.linear(x, W[l % COPIES])):.2f}"]
    for cfg in cfgs:
        for one_dot in (False, True):
            def f(rotate, store):
                return lambda l: qkv_rope.qkv_norm_rope(x, W[l % COPIES], None, NQ, NKV, pos, cos, sin, qn, kn,
                                                        kv_store=store, rotate=rotate, config=cfg, one_dot=one_dot)
            try:
                t = [graph_time_us(f(False, None)), graph_time_us(f(True, None)), graph_time_us(f(True, caches[False])),
                     graph_time_us(f(True, caches[True]))]
                res.append(f"{tuple(cfg)}{' one-dot' if one_dot else ''}: plain {t[0]:.2f} rot {t[1]:.2f} +bf16 {t[2]:.2f} +fp8 {t[3]:.2f}")
            except Exception as e:
                res.append(f"{tuple(cfg)} one_dot={one_dot}: {type(e).__name__} {str(e)[:200]}")
    print(f"M={M}: " + "\n   ".join(res), flush=True)
