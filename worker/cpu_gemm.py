"""fp32 and bf16 matmuls on the CPU through oneDNN, with each weight packed once at load time.

`F.linear` on a CPU goes through a BLAS that re-reads the weight in its plain row-major layout on
every call. oneDNN's packed ("blocked") weight layout feeds its AVX-512 / AVX2 kernels straight
from memory in the order they consume it; on the 2-core AVX-512 box we test on, a Llama MLP
projection runs ~2.5x faster that way (~500 vs ~195 GFLOP/s at 256 rows, and still ~2x at 8
rows). The result is fp32 arithmetic in a different summation order (errors ~1e-5 relative,
the same order as the BLAS's own).

bf16 weights are packed where oneDNN has bf16 kernels here (AVX-512 BF16 or AMX: what inductor
checks before it packs them): on a 2-core Sapphire Rapids box (AMX) SmolLM2's projections run
1.3-1.8x faster than bf16 `F.linear` at 128 rows and 1.7-2.6x at one row, the LM head 1.7-1.8x
(`benchmarks/RESULTS.md`). Elsewhere bf16 stays on `F.linear`.

Packing is what inductor's CPU freezing pass does; we do it by hand for the projections and the
LM head, and drop the plain copy of the projections' weights (nothing reads them after loading).
"""

from __future__ import annotations

import torch

# The row count oneDNN picks its packed layout for; any row count runs on the result. Step sizes
# range from 1 (batch-1 decode) to the token budget; this one is within ~5% of the best at each.
PACK_ROWS_HINT = 256


def packs(weight: torch.Tensor) -> bool:
    """Whether this weight is one oneDNN can pack here: on the CPU, oneDNN built in, and fp32, or
    bf16 where this CPU has oneDNN's bf16 kernels."""
    if not (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_kernels())


def bf16_kernels() -> bool:
    """Whether oneDNN has native bf16 kernels on this CPU (AVX-512 BF16 or AMX)."""
    return hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> oneDNN's packed copy of it (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T + b with W packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
