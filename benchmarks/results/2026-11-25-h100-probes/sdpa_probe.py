import torch, torch.nn.functional as F, traceback
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench
torch.manual_seed(0)
H, KVH, D = 16, 8, 128
print(torch.__version__, torch.backends.cudnn.version())
for L, S in [(16384, 16384), (8192, 8192), (8192, 16384), (8192, 32768), (2048, 2048), (2048, 10240), (1024, 1024), (512, 512)]:
    q = torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, KVH, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, KVH, S, D, device="cuda", dtype=torch.bfloat16)
    pairs = L * (S - L) + L * (L + 1) / 2
    flops = 4 * pairs * D * H
    ke, ve = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    ref = None
    for name, be in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("eff", SDPBackend.EFFICIENT_ATTENTION), ("default", None)]:
        for gqa in (True, False):
            for maskkind in ("is_causal", "lower_right"):
                if maskkind == "is_causal" and L != S:
                    continue
                kk, vv = (k, v) if gqa else (ke, ve)
                kw = dict(is_causal=True) if maskkind == "is_causal" else dict(attn_mask=causal_lower_right(L, S))
                f = lambda: F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa, **kw)
                try:
                    if be is None:
                        o = f(); t = do_bench(f, warmup=20, rep=150)
                    else:
                        with sdpa_kernel([be]):
                            o = f(); t = do_bench(f, warmup=20, rep=150)
                    if ref is None:
                        ref = o
                    err = (o.float() - ref.float()).abs().max().item()
                    print(f"L={L} S={S} {name} gqa={gqa} {maskkind}: {t*1e3:.0f} us {flops/t/1e9:.0f} TFLOP/s err {err:.3g}", flush=True)
                except Exception as e:
                    print(f"L={L} S={S} {name} gqa={gqa} {maskkind}: ERR {type(e).__name__} {str(e)[:80]}", flush=True)
    # gather cost: a cache of 16-token blocks, scattered
    nb = S // 16
    cache = torch.randn(2, 40000, 16, KVH, D, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(40000, device="cuda")[:nb]
    g = lambda: cache[:, ids].flatten(1, 2)
    t = do_bench(g, warmup=20, rep=100)
    print(f"  gather K/V of {S} tokens: {t*1e3:.0f} us", flush=True)
