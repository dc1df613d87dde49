"""The torch path of worker/ops.py (CPU; no Triton) computes the references' bits exactly: RMSNorm
and RoPE on fewer buffers, SiLU-and-mul in place on silu's output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.worker import ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
def test_rms_norm_equals_reference(dtype, weight_dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 96, generator=gen) * 3).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype if weight_dtype == "same" else weight_dtype)
    before = x.clone()
    out = ops.rms_norm_cpu(x, weight, 1e-6)
    expected = ops.rms_norm_reference(x, weight, 1e-6)
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    assert torch.equal(x, before)  # the input is left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_returns_sum_and_norm(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(64, generator=gen).to(dtype)
    out, summed = ops.add_rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(out, ops.rms_norm_reference(x + residual, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_equals_reference(dtype, rotary_dim) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(11, 4, 64, generator=gen).to(dtype)
    angles = torch.rand(11, rotary_dim // 2, generator=gen) * 100
    before = x.clone()
    out = ops.rope_cpu(x, angles.cos(), angles.sin())
    assert torch.equal(out, ops.rope_reference(x, angles.cos(), angles.sin()))
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_and_silu_and_mul_equal_references(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(6, 4, 32, generator=gen).to(dtype), torch.randn(6, 2, 32, generator=gen).to(dtype)
    norms = torch.randn(32, generator=gen).to(dtype), torch.randn(32, generator=gen).to(dtype)
    angles = torch.rand(100, 16, generator=gen) * 10
    positions = torch.tensor([0, 5, 9, 50, 99, 3])
    q_out, k_out = ops.norm_rope(q, k, positions, angles.cos(), angles.sin(), *norms, eps=1e-6)
    cos, sin = angles.cos()[positions], angles.sin()[positions]
    assert torch.equal(q_out, ops.rope_reference(ops.rms_norm_reference(q, norms[0], 1e-6), cos, sin))
    assert torch.equal(k_out, ops.rope_reference(ops.rms_norm_reference(k, norms[1], 1e-6), cos, sin))
    gate_up = torch.randn(6, 2 * 48, generator=gen).to(dtype)
    assert torch.equal(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :48]) * gate_up[:, 48:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_equals_torch_argmax_with_ties_nan_and_inf(dtype) -> None:
    """ops.argmax goes through max() on the CPU: the same index as argmax, the first of equal
    maxima, a NaN's where a row has one, an inf's over finite values."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        x = torch.randint(-3, 4, (17, 1001), generator=gen).to(dtype)  # many ties
        if trial % 3 == 0:
            x[torch.rand(x.shape, generator=gen) < 0.002] = float("nan")
        if trial % 5 == 0:
            x[:, 7] = float("inf")
            x[3, 900] = float("inf")
        assert torch.equal(ops.argmax(x), x.argmax(dim=-1)), trial
    x = torch.randn(1, 49152, generator=gen).to(dtype)
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1)) and ops.argmax(x).dtype == torch.int64
