"""(A probe, as it ran on the device.) Which rotation differs between ops.norm_rope with and without its FP8 K/V store, and by how much."""
import torch
from minivllm.worker import ops
from minivllm.worker.attention.kv_cache import KVCacheLayout
heads, head_dim, block_size = 16, 128, 16
for kv_heads, tokens, fp8 in ((12, 13, True), (8, 21, True), (12, 13, False), (8, 21, False)):
    bad = 0
    for seed in range(30):
        torch.manual_seed(seed)
        num_blocks = tokens // block_size + 8
        dtype = torch.bfloat16
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
        freqs = torch.arange(256, device="cuda")[:, None] * torch.rand(head_dim // 2, device="cuda")[None]
        cos, sin = freqs.cos(), freqs.sin()
        positions = torch.randint(0, 256, (tokens,), device="cuda")
        norms = (torch.randn(head_dim, device="cuda", dtype=dtype), torch.randn(head_dim, device="cuda", dtype=dtype))
        slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
        layout = KVCacheLayout(block_size, kv_heads, head_dim, dtype, fp8=fp8)
        cache = layout.allocate(num_blocks, torch.device("cuda"))
        q_ref, k_ref = ops.norm_rope(q.clone(), k.clone(), positions, cos, sin, *norms, eps=1e-6)
        q_out, k_out = ops.norm_rope(q, k, positions, cos, sin, *norms, eps=1e-6, kv_store=(v, cache, slots, layout))
        dq = (q_out != q_ref).sum().item(); dk = (k_out != k_ref).sum().item()
        if dq or dk:
            bad += 1
            i = (q_out != q_ref).nonzero()[:3].tolist() if dq else (k_out != k_ref).nonzero()[:3].tolist()
            print(f"kv_heads {kv_heads} tokens {tokens} fp8 {fp8} seed {seed}: q differs at {dq}, k at {dk}; first {i}; "
                  f"max |diff| q {(q_out.float() - q_ref.float()).abs().max().item():.3g} k {(k_out.float() - k_ref.float()).abs().max().item():.3g}")
    print(f"kv_heads {kv_heads} tokens {tokens} fp8 {fp8}: {bad} of 30 seeds differ", flush=True)
