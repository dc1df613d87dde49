import sys, os, itertools, traceback
sys.path.insert(0, os.path.dirname(__file__))
import torch, torch.nn.functional as F
from triton.testing import do_bench
import fa_tma

torch.manual_seed(0)
for S in (16384, 8192):
    H, KVH, D = 16, 8, 128
    q = torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(S, KVH, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(S, KVH, D, device="cuda", dtype=torch.bfloat16)
    flops = 4 * S * S / 2 * D * H
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    t = do_bench(lambda: F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                 v.transpose(0, 1)[None], is_causal=True, enable_gqa=True), warmup=50, rep=300)
    print(f"S={S} SDPA(gqa) {t*1e3:.0f} us {flops/t/1e9:.0f} TFLOP/s", flush=True)
    cfgs = [(64, 64, 8, 3, False, None), (64, 64, 8, 4, False, None), (64, 64, 8, 2, False, None),
            (64, 128, 8, 2, False, None), (64, 64, 8, 3, False, 128), (64, 64, 8, 2, False, 128),
            (32, 64, 4, 2, True, None), (32, 64, 4, 3, True, None), (32, 128, 4, 1, True, None),
            (64, 128, 8, 3, False, None)]
    for bq, bn, w, st, ws, reg in cfgs:
        out = torch.empty_like(q)
        try:
            f = lambda: fa_tma.attention(q, k, v, out, bq, bn, w, st, ws, reg)
            f(); torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            t = do_bench(f, warmup=50, rep=300)
            print(f"  tma bq={bq} bn={bn} w={w} st={st} ws={ws} reg={reg}: {t*1e3:.0f} us {flops/t/1e9:.0f} TFLOP/s err {err:.3g}", flush=True)
        except Exception as e:
            print(f"  tma {bq,bn,w,st,ws,reg} ERR {str(e)[:200]}", flush=True)
