"""us a layer for a decode step's K/V store alone (triton_attention.store_kv), FP8 against bf16, with
each token in a block of its own (decode: one slot in each sequence's last block) and with the
tokens' slots consecutive (a prompt's). 28 stores in a CUDA graph, caches rotating over 4 copies
of 4096 blocks. Where FP8 norm_rope's extra cost at decode sizes comes from."""
import torch
from minivllm.worker.attention import triton_attention
from minivllm.worker.attention.kv_cache import KVCacheLayout
import sys; sys.path.insert(0, "benchmarks/results/2026-11-27-qkv-rope-epilogue")
from rope_probe import timed

def main():
    dev = torch.device("cuda")
    nkv, hd = 8, 128
    for fp8 in (True, False):
        layout = KVCacheLayout(16, nkv, hd, torch.bfloat16, fp8=fp8)
        caches = [layout.allocate(4096, dev) for _ in range(4)]
        for rows in (16, 64, 128, 256):
            k = torch.randn(rows, nkv, hd, device=dev).to(torch.bfloat16)
            v = torch.randn(rows, nkv, hd, device=dev).to(torch.bfloat16)
            own_block = torch.randperm(4096, device=dev)[:rows] * 16 + torch.randint(0, 16, (rows,), device=dev)
            consecutive = torch.arange(rows, device=dev) + 1600
            res = {name: timed(lambda i: triton_attention.store_kv(k, v, caches[i % 4], slots, layout))
                   for name, slots in (("own block", own_block), ("consecutive", consecutive))}
            print(f"{'fp8 ' if fp8 else 'bf16'} rows {rows:4d}: " + "  ".join(f"{n} {t:6.2f}" for n, t in res.items()), flush=True)

if __name__ == "__main__":
    main()
