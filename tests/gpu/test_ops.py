"""The fused Triton element-wise kernels equal their torch references."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (the CUDA build of torch)")
from minivllm.worker import ops  # noqa: E402


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 1024, 3000])
def test_add_rms_norm(dtype, hidden) -> None:
    x = torch.randn(37, hidden, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device="cuda", dtype=dtype)
    expected_sum = x + residual
    expected = ops.rms_norm_reference(expected_sum, weight, 1e-6)
    out, summed = ops.add_rms_norm(x, weight, 1e-6, residual.clone())
    assert torch.equal(summed, expected_sum)
    assert rel_error(out, expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    out, same = ops.add_rms_norm(x, weight, 1e-6)
    assert same is x and rel_error(out, ops.rms_norm_reference(x, weight, 1e-6)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(16, 8, 128, 128), (9, 3, 64, 64), (4, 2, 24, 16)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_norm_rope(dtype, heads, kv_heads, head_dim, rotary_dim, with_norm) -> None:
    tokens, max_pos = 29, 512
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    freqs = torch.arange(max_pos, device="cuda")[:, None] * torch.rand(rotary_dim // 2, device="cuda")[None]
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, max_pos, (tokens,), device="cuda")
    norms = (torch.randn(head_dim, device="cuda", dtype=dtype), torch.randn(head_dim, device="cuda", dtype=dtype))
    norm_args = norms if with_norm else (None, None)
    q_ref, k_ref = q.clone(), k.clone()
    if with_norm:
        q_ref, k_ref = ops.rms_norm_reference(q_ref, norms[0], 1e-6), ops.rms_norm_reference(k_ref, norms[1], 1e-6)
    q_ref = ops.rope_reference(q_ref, cos[positions], sin[positions])
    k_ref = ops.rope_reference(k_ref, cos[positions], sin[positions])
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    q_out, k_out = ops.norm_rope(q, k, positions, cos, sin, *norm_args, eps=1e-6)
    # Rotated in place inside the qkv tensor (no copies), v left alone.
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_error(q_out, q_ref) < tolerance and rel_error(k_out, k_ref) < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype) -> None:
    x = torch.randn(33, 2 * 3072, device="cuda", dtype=dtype)
    gate, up = x.split(3072, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert rel_error(ops.silu_and_mul(x), expected) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("kv_heads,tokens,slots_kind", [
    (8, 21, "scattered"), (8, 21, "prompt"), (8, 3, "prompt"), (2, 21, "prompt"), (12, 13, "scattered"),
    (8, 300, "prompt"),
])
def test_norm_rope_stores_kv(fp8, with_norm, kv_heads, tokens, slots_kind) -> None:
    """With kv_store the RoPE kernel writes each token's rotated k and its v into the cache exactly
    as the attention backend's own store would, skipping padding slots (-1): slots scattered or
    consecutive (a prompt's, from mid-block)."""
    from minivllm.worker.attention.kv_cache import KVCacheLayout
    from minivllm.worker.attention.triton_attention import store_kv

    heads, head_dim, block_size = 16, 128, 16
    num_blocks = tokens // block_size + 8
    dtype = torch.bfloat16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    freqs = torch.arange(256, device="cuda")[:, None] * torch.rand(head_dim // 2, device="cuda")[None]
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 256, (tokens,), device="cuda")
    norms = (torch.randn(head_dim, device="cuda", dtype=dtype), torch.randn(head_dim, device="cuda", dtype=dtype))
    if slots_kind == "scattered":
        slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
        slots[::5] = -1
    else:  # a prompt's chunk starting mid-block, its padding rows (-1) at the end
        slots = torch.arange(tokens, device="cuda") + 5
        slots[-2:] = -1
    layout = KVCacheLayout(block_size, kv_heads, head_dim, dtype, fp8=fp8)
    cache = layout.allocate(num_blocks, torch.device("cuda"))
    cache.copy_(torch.randint_like(cache, 0, 100))  # whatever was there must stay where nothing is written
    expected_cache = cache.clone()
    norm_args = norms if with_norm else (None, None)
    q_ref, k_ref = ops.norm_rope(q.clone(), k.clone(), positions, cos, sin, *norm_args, eps=1e-6)
    q_out, k_out = ops.norm_rope(q, k, positions, cos, sin, *norm_args, eps=1e-6,
                                 kv_store=(v, cache, slots, layout))
    # The kernel with the store and the one without are compiled apart, and their rotations may
    # round an element one bfloat16 step apart (with 12 KV heads and an FP8 cache, one element of
    # one seed in 30 on an H100). A step of the inputs, not of
    # the output: a rotated element near zero comes from two larger ones (x1 cos - x2 sin), so the
    # bound is a bfloat16 step of the largest element, not of each element (once, 2026-11-27, an
    # element failed the per-element bound). A wrong rotation is off by the elements' own size.
    # The store must write the rotated k it returns, exactly.
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        torch.testing.assert_close(out, ref, rtol=0, atol=2 ** -7 * ref.abs().max().item())
    store_kv(k_out, v, expected_cache, slots, layout)
    assert torch.equal(cache, expected_cache)
