"""(A probe, as it ran on the device.)

Time ops.norm_rope with its K/V store (Qwen3-0.6B's shape: 16 query heads, 8 KV heads, 128 dims,
q/k norm) in a CUDA graph of 28 calls over 28 layers' tensors, FP8 values stored token by token
(group 1, the old way) against by groups of 8 (store_value_group), alternating; a bf16 cache for
reference. Slots: 'decode' 256 tokens scattered at random; 'prompts' ~12k tokens of 100-1,024-token
prompts, each filling fresh blocks from slot 0 as a prompt step does; 'scattered' 16,384 at random."""
import torch

from minivllm.worker import ops
from minivllm.worker.attention.kv_cache import KVCacheLayout

heads, kv_heads, head_dim, block_size, layers = 16, 8, 128, 16, 28
dev = torch.device("cuda")
torch.manual_seed(0)
freqs = torch.arange(40960, device=dev)[:, None] * torch.rand(head_dim // 2, device=dev)[None]
cos, sin = freqs.cos(), freqs.sin()
norms = (torch.randn(head_dim, device=dev, dtype=torch.bfloat16), torch.randn(head_dim, device=dev, dtype=torch.bfloat16))


def prompt_slots(total: int, num_blocks: int) -> torch.Tensor:
    """Prompts of 100-1,024 tokens, each in its own blocks (taken at random), slots in order."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randperm(num_blocks, generator=g)
    slots, used = [], 0
    while sum(len(s) for s in slots) < total:
        n = min(int(torch.randint(100, 1025, (1,), generator=g)), total - sum(len(s) for s in slots))
        nb = -(-n // block_size)
        mine = blocks[used:used + nb]
        used += nb
        slots.append((mine[:, None] * block_size + torch.arange(block_size)[None]).flatten()[:n])
    return torch.cat(slots).to(dev)


def timed(tokens: int, slots: torch.Tensor, fp8: bool, group: int, num_blocks: int) -> float:
    ops.FP8_VALUE_GROUP = group
    ops.FP8_VALUE_GROUP_MIN_TOKENS = 0
    layout = KVCacheLayout(block_size, kv_heads, head_dim, torch.bfloat16, fp8=fp8)
    qkvs = [torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    caches = [layout.allocate(num_blocks, dev) for _ in range(layers)]
    positions = torch.randint(0, 4096, (tokens,), device=dev)

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
    for _ in range(10):
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
    del qkvs, caches, g
    times.sort()
    return times[len(times) // 2]


cases = []
for name, tokens in (("decode", 256), ("prompts", 12288), ("scattered", 16384)):
    num_blocks = tokens // block_size + 2048
    slots = prompt_slots(tokens, num_blocks) if name == "prompts" else torch.randperm(num_blocks * block_size, device=dev)[:tokens]
    cases.append((name, tokens, slots, num_blocks))
for rnd in range(2):
    for name, tokens, slots, num_blocks in cases:
        for fp8, group in ((False, 1), (True, 1), (True, 8), (True, 16) if rnd else (True, 4)):
            us = timed(tokens, slots, fp8, group, num_blocks)
            print(f"round {rnd} {name:9s} {tokens:6d} tokens {'fp8 ' if fp8 else 'bf16'} group {group:2d}: {us:7.2f} us a call",
                  flush=True)
