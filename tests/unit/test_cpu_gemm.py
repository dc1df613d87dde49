"""oneDNN-packed fp32 (and, where the CPU has oneDNN's bf16 kernels, bf16) matmuls on the CPU
(worker/cpu_gemm.py) compute what F.linear does, and a model loaded on the CPU runs on them without
changing its logits beyond rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.protocol.config import EngineConfig
from minivllm.worker import cpu_gemm
from minivllm.worker.models.loader import CPU_PACKED_GEMM_ENV, load_model
from minivllm.worker.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from tests.tiny_models import ARCHS

pytestmark = pytest.mark.skipif(not cpu_gemm.packs(torch.zeros(1)), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 64, 700])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 40, generator=gen)
    packed = cpu_gemm.pack(weight)
    torch.testing.assert_close(cpu_gemm.linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_loaded_model_runs_on_packed_weights(arch: str, tiny_model_factory, monkeypatch) -> None:
    model_dir = tiny_model_factory(arch)
    config = EngineConfig.create(model_dir, device="cpu", num_gpu_blocks=8)
    packed = load_model(config, "cpu", torch.float32)
    monkeypatch.setenv(CPU_PACKED_GEMM_ENV, "0")
    plain = load_model(config, "cpu", torch.float32)

    projections = [m for m in packed.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert projections and all(m.packed_weight is not None and m.weight is None for m in projections)
    assert packed.packed_logits_weight is not None
    assert all(m.packed_weight is None and m.weight is not None for m in plain.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))

    hidden = torch.randn(5, packed.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-4, atol=1e-5)
    mlp_in = hidden * 0.1
    first_mlp = packed.model.layers[0].mlp
    torch.testing.assert_close(first_mlp(mlp_in), plain.model.layers[0].mlp(mlp_in), rtol=1e-4, atol=1e-5)


needs_bf16_kernels = pytest.mark.skipif(not cpu_gemm.bf16_kernels(), reason="no oneDNN bf16 kernels on this CPU")


def test_bf16_weights_pack_only_with_bf16_kernels() -> None:
    assert cpu_gemm.packs(torch.zeros(1, dtype=torch.bfloat16)) == cpu_gemm.bf16_kernels()
    assert not cpu_gemm.packs(torch.zeros(1, dtype=torch.float16))


@needs_bf16_kernels
@pytest.mark.parametrize("rows", [1, 3, 64, 700])
def test_packed_bf16_linear_equals_f_linear(rows: int) -> None:
    """bf16 in, bf16 out, as F.linear: both within a bf16 rounding of the fp32 product."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    x = torch.randn(rows, 40, generator=gen).bfloat16()
    out = cpu_gemm.linear(x, cpu_gemm.pack(weight), bias)
    assert out.dtype == torch.bfloat16
    exact = F.linear(x.float(), weight.float(), bias.float())
    for result in (out, F.linear(x, weight, bias)):
        torch.testing.assert_close(result.float(), exact, rtol=1.6e-2, atol=2e-2)


@needs_bf16_kernels
def test_bf16_model_runs_on_packed_weights(tiny_model_factory, monkeypatch) -> None:
    model_dir = tiny_model_factory(ARCHS[0])
    config = EngineConfig.create(model_dir, device="cpu", dtype="bfloat16", num_gpu_blocks=8)
    packed = load_model(config, "cpu", torch.bfloat16)
    monkeypatch.setenv(CPU_PACKED_GEMM_ENV, "0")
    plain = load_model(config, "cpu", torch.bfloat16)
    assert packed.packed_logits_weight is not None and plain.packed_logits_weight is None
    hidden = torch.randn(5, packed.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits, plain_logits = packed.compute_logits(hidden).float(), plain.compute_logits(hidden).float()
    assert (logits - plain_logits).norm() / plain_logits.norm() < 1e-2
