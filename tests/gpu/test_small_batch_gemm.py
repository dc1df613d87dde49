"""The one-row projection kernel (worker/small_batch_gemm.py) against an fp64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("n,k", [(4096, 1024), (1000, 2048), (37, 520), (151936, 1024), (6144, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp64(n: int, k: int, dtype: torch.dtype, with_bias: bool) -> None:
    from minivllm.worker import small_batch_gemm

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if with_bias else None
    x = torch.randn(1, k, device="cuda", generator=gen).to(dtype)
    assert small_batch_gemm.supports(x, weight)
    out = small_batch_gemm.linear(x, weight, bias)
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.shape == (1, n) and out.dtype == dtype and not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.parametrize("n,k", [(4096, 1024), (37, 520), (6144, 3000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_linear(n: int, k: int, dtype: torch.dtype, with_residual: bool) -> None:
    """RMSNorm(x + residual) * g, then the projection, in one kernel: the residual stream it
    returns is exactly x + residual, and the product matches an fp64 norm-then-project."""
    from minivllm.worker import ops, small_batch_gemm

    gen = torch.Generator(device="cuda").manual_seed(n * k)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    x, residual = (torch.randn(1, k, device="cuda", generator=gen).to(dtype) * 3 for _ in range(2))
    norm_weight = torch.randn(k, device="cuda", generator=gen).to(dtype)
    out, summed = small_batch_gemm.norm_linear(x, residual if with_residual else None, norm_weight, 1e-6, weight, bias)
    expected_sum = x + residual if with_residual else x
    assert torch.equal(summed, expected_sum)
    normed = ops.rms_norm_reference(expected_sum.double(), norm_weight.double(), 1e-6)
    ref = F.linear(normed, weight.double(), bias.double())
    assert out.shape == (1, n) and not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.parametrize("n,k", [(1024, 3072), (37, 520)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_linear(n: int, k: int, dtype: torch.dtype) -> None:
    from minivllm.worker import small_batch_gemm

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    gate_up = (torch.randn(1, 2 * k, device="cuda", generator=gen) * 2).to(dtype)
    out = small_batch_gemm.silu_mul_linear(gate_up, weight)
    ref = F.linear(F.silu(gate_up[:, :k].double()) * gate_up[:, k:].double(), weight.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3
    with pytest.raises(ValueError, match="columns"):
        small_batch_gemm.silu_mul_linear(gate_up[:, :k], weight)


def test_only_one_contiguous_half_precision_row() -> None:
    from minivllm.worker import small_batch_gemm

    weight = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    assert not small_batch_gemm.supports(torch.randn(2, 64, device="cuda", dtype=torch.bfloat16), weight)
    assert not small_batch_gemm.supports(torch.randn(1, 64, device="cuda"), weight.float())
    assert not small_batch_gemm.supports(torch.randn(1, 128, device="cuda", dtype=torch.bfloat16)[:, ::2], weight)
