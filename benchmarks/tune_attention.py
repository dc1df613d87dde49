"""Time the paged attention kernel's tile shapes on a prefill and a decode batch (GPU only), next to
PyTorch's own flash attention (SDPA, contiguous K/V) as a yardstick for the prefill."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tests.gpu.test_triton_attention import make_batch
from minivllm.worker.attention.triton_attention import paged_attention

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def main() -> None:
    for name, cases in (("prefill 4x512", [(0, 512)] * 4), ("prefill 1x2048", [(0, 2048)]),
                        ("decode 256x700", [(700, 1)] * 256)):
        q, k, v, cache, md = make_batch(cases, HEADS, KV_HEADS, HEAD_DIM, 16, torch.bfloat16, seed=0)
        from minivllm.worker.attention.triton_attention import store_kv
        store_kv(k, v, cache, md.slot_mapping)
        decode = md.max_query_len == 1
        ms = []
        for bm, bn, w, st in itertools.product((16,) if decode else (64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
            try:
                t = do_bench(lambda: paged_attention(q, cache, md, 0.088, tiles=(bm, bn, w, st)), warmup=5, rep=30)
            except Exception:  # out of shared memory etc.
                t = float("inf")
            ms.append((t, (bm, bn, w, st)))
        ms.sort()
        print(name, "best:", [(round(t * 1000, 1), c) for t, c in ms[:4]], "us")
        if not decode:
            n = cases[0][1]
            qq = q.view(len(cases), n, HEADS, HEAD_DIM).transpose(1, 2)
            kk = k.view(len(cases), n, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(2, 1)
            vv = v.view(len(cases), n, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(2, 1)
            t = do_bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True), warmup=5, rep=30)
            print(f"  sdpa (flash, contiguous): {t * 1000:.1f} us")


if __name__ == "__main__":
    main()
