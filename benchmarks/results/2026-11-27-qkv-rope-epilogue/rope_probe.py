"""us a layer: qkv projection then ops.norm_rope (with its K/V store) against linear_rope at the rule's
tile and others, 28 layers in a CUDA graph with PDL, Qwen3-0.6B's shapes (16 q, 8 kv heads, hidden 1024),
weights rotating over 8 copies. Then how many of linear_rope's q, k, v bits equal norm_rope's."""
import sys, torch
from minivllm.worker import hopper_gemm, ops, pdl
from minivllm.worker.attention.kv_cache import KVCacheLayout

def timed(fn):
    for i in range(28): fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(28): fn(i)
    for _ in range(5): g.replay()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(20): g.replay()
        e.record(); torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) / 20 / 28 * 1e3)
    return best

HIDDEN, NQ, NKV, HD = 1024, 16, 8, 128  # Qwen3-0.6B

def layer_inputs(dev):
    """8 copies of the qkv weight, cos/sin tables, the q and k norm weights."""
    n = (NQ + 2 * NKV) * HD
    weights = [(torch.randn(n, HIDDEN, device=dev) / 32).to(torch.bfloat16) for _ in range(8)]
    angles = torch.rand(40960, 64, device=dev) * 6.3
    qn = (1 + 0.1 * torch.randn(HD, device=dev)).to(torch.bfloat16)
    return weights, angles.cos(), angles.sin(), qn, qn.clone()

def main():
    dev = torch.device("cuda")
    hidden, nq, nkv, hd = HIDDEN, NQ, NKV, HD
    n = (nq + 2 * nkv) * hd
    weights, cos, sin, qn, kn = layer_inputs(dev)
    for fp8 in (True, False):
        layout = KVCacheLayout(16, nkv, hd, torch.bfloat16, fp8=fp8)
        caches = [layout.allocate(4096, dev) for _ in range(4)]
        for rows in [16, 32, 64, 96, 128, 192, 256]:
            x = torch.randn(rows, hidden, device=dev).to(torch.bfloat16)
            pos = torch.randint(0, 4000, (rows,), device=dev)
            slots = torch.randperm(4096 * 16, device=dev)[:rows]
            def plain(i):
                y = hopper_gemm.linear(x, weights[i % 8])
                q, k, v = y.split([nq * hd, nkv * hd, nkv * hd], -1)
                ops.norm_rope(q.view(rows, nq, hd), k.view(rows, nkv, hd), pos, cos, sin, qn, kn, 1e-6,
                              kv_store=(v.view(rows, nkv, hd), caches[i % 4], slots, layout))
                return y
            def fused(i, tile=None):
                return hopper_gemm.linear_rope(x, weights[i % 8], hopper_gemm.QkvRope(pos, slots, cos, sin, qn, kn, 1e-6, nq, nkv,
                                                                                        caches[i % 4], layout), token_tile=tile)
            rule = hopper_gemm.rope_token_tile(rows, n // hd, pdl.num_sms(0))
            res = {"gemm": timed(lambda i: hopper_gemm.linear(x, weights[i % 8])), "gemm+norm_rope": timed(plain),
                   f"rope@{rule}": timed(fused)}
            for tile in (16, 32, 64, 128):
                if tile != rule and tile < 2 * rows: res[f"@{tile}"] = timed(lambda i: fused(i, tile))
            a, b = fused(0), plain(0)
            eq = [f"{(u == v).float().mean().item():.3f}" for u, v in zip(a.split([nq * hd, nkv * hd, nkv * hd], -1), b.split([nq * hd, nkv * hd, nkv * hd], -1))]
            print(f"{'fp8 ' if fp8 else 'bf16'} rows {rows:4d}: " + "  ".join(f"{k} {v:6.2f}" for k, v in res.items()) + f"   equal q,k,v {eq}", flush=True)

if __name__ == "__main__":
    main()
