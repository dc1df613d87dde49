"""(A probe, as it ran on the device; the split kernel it timed was reverted: tried_norm_rope_split.diff.)

Time ops.norm_rope with its K/V store (Qwen3-0.6B's shape: 16 query heads, 8 KV heads, 128 dims,
q/k norm) in a CUDA graph of 28 calls over 28 layers' tensors, as a decode step (256 tokens) and a
prompt step (16,384 tokens) would, for a bf16 and an FP8 cache. Prints us a call."""
import sys

import torch

from minivllm.worker import ops
from minivllm.worker.attention.kv_cache import KVCacheLayout

heads, kv_heads, head_dim, block_size, layers = 16, 8, 128, 16, 28
dev = torch.device("cuda")
torch.manual_seed(0)
freqs = torch.arange(40960, device=dev)[:, None] * torch.rand(head_dim // 2, device=dev)[None]
cos, sin = freqs.cos(), freqs.sin()
norms = (torch.randn(head_dim, device=dev, dtype=torch.bfloat16), torch.randn(head_dim, device=dev, dtype=torch.bfloat16))
for tokens in (1, 256, 16384):
    for fp8 in (False, True):
        num_blocks = tokens // block_size + 64
        layout = KVCacheLayout(block_size, kv_heads, head_dim, torch.bfloat16, fp8=fp8)
        qkvs = [torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        caches = [layout.allocate(num_blocks, dev) for _ in range(layers)]
        positions = torch.randint(0, 4096, (tokens,), device=dev)
        slots = torch.randperm(num_blocks * block_size, device=dev)[:tokens]

        def step():
            for qkv, cache in zip(qkvs, caches):
                q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
                q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
                ops.norm_rope(q, k, positions, cos, sin, *norms, eps=1e-6, kv_store=(v, cache, slots, layout))

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(); step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        for _ in range(20):
            g.replay()
        times = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(20):
                g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / 20 / layers)
        times.sort()
        print(f"{sys.argv[1] if len(sys.argv) > 1 else ''} tokens {tokens:6d} {'fp8 ' if fp8 else 'bf16'} "
              f"{times[len(times) // 2]:7.2f} us a call (min {times[0]:.2f})", flush=True)
        del qkvs, caches, g
