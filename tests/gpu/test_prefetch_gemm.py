"""The prefetching projection kernel (worker/prefetch_gemm.py) against an fp64 reference and
cuBLAS, for every tile shape it may take; which inputs it takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (1000, 576), (37, 128)])
@pytest.mark.parametrize("m", [2, 7, 16, 33, 64, 100, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_fp64_and_cublas(n: int, k: int, m: int, dtype: torch.dtype) -> None:
    from minivllm.worker import prefetch_gemm

    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if m % 2 else None
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    out = prefetch_gemm.linear(x, weight, bias)
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.shape == (m, n) and out.dtype == dtype and not out.isnan().any()
    assert relative_error(out, ref) < 5e-3
    assert relative_error(out, F.linear(x, weight, bias)) < 5e-3


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("block_n", [16, 32, 64, 128])
@pytest.mark.parametrize("block_k", [64, 128])
def test_every_tile_shape(block_m: int, block_n: int, block_k: int) -> None:
    """Partial row and column blocks included (100 rows, 1000 columns), and a strided input (a
    view into a wider activation, as the attention output's projection gets)."""
    from minivllm.worker import prefetch_gemm

    gen = torch.Generator(device="cuda").manual_seed(block_m * block_n + block_k)
    weight = (torch.randn(1000, 1024, device="cuda", generator=gen) / 32).to(torch.bfloat16)
    x = torch.randn(100, 1536, device="cuda", generator=gen).to(torch.bfloat16)[:, 256:1280]
    tile = prefetch_gemm.Tile(block_m, block_n, block_k, 4, 3)
    out = prefetch_gemm.linear(x, weight, tile=tile)
    assert relative_error(out, F.linear(x.double(), weight.double())) < 5e-3
    assert torch.equal(out, prefetch_gemm.linear(x.contiguous(), weight, tile=tile))


def test_which_inputs_it_takes(monkeypatch) -> None:
    from minivllm.worker import pdl, prefetch_gemm

    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(prefetch_gemm, "ENABLED", True)  # (MINIVLLM_PREFETCH_GEMM=1; off by default)
    weight = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    rows = lambda m, k=128, dtype=torch.bfloat16: torch.randn(m, k, device="cuda", dtype=dtype)  # noqa: E731
    hopper = torch.cuda.get_device_capability()[0] >= 9
    m = prefetch_gemm.MIN_ROWS
    assert prefetch_gemm.supports(rows(m), weight) == hopper  # (it runs only where PDL does)
    assert prefetch_gemm.supports(rows(prefetch_gemm.MAX_ROWS), weight) == hopper
    assert not prefetch_gemm.supports(rows(m - 1), weight)  # cuBLAS's (one row: small_batch_gemm's)
    assert not prefetch_gemm.supports(rows(prefetch_gemm.MAX_ROWS + 1), weight)  # cuBLAS's
    assert not prefetch_gemm.supports(rows(m, dtype=torch.float32), weight.float())
    assert not prefetch_gemm.supports(rows(m, 96), torch.randn(64, 96, device="cuda", dtype=torch.bfloat16))
    assert not prefetch_gemm.supports(rows(m, 256)[:, ::2], weight)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not prefetch_gemm.supports(rows(m), weight)
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(prefetch_gemm, "ENABLED", False)
    assert not prefetch_gemm.supports(rows(m), weight)
    with pytest.raises(ValueError, match="multiple of BLOCK_K"):
        prefetch_gemm.linear(rows(8, 192), torch.randn(64, 192, device="cuda", dtype=torch.bfloat16),
                             tile=prefetch_gemm.Tile(16, 16, 128, 4, 3))
