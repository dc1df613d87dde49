"""The chunked Gumbel-max sampler (worker/fused_sampling.py) against the one-program-per-row version
it replaced (kept here, as the reference it must equal): same tokens, and the time of each.

    python3 benchmarks/gumbel_sampler.py     # on the device machine
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
import triton.testing

from minivllm.worker.fused_sampling import _BLOCK, _block_best, _noisy_block_best, gumbel_max_sample


@triton.jit
def _one_program_per_row(logits_ptr, stride_row, rows_ptr, temperature_ptr, seeds_ptr, out_ptr, vocab_size,
                         BLOCK: tl.constexpr):
    """Row i's token, one program walking the whole row (the sampler's own block scoring, so the
    draws are the same function of (seed, position): the tokens must be equal)."""
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    temperature = tl.load(temperature_ptr + i)
    seed = tl.load(seeds_ptr + i)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    scale = tl.where(temperature == 0.0, 1.0, 1.4426950408889634 / temperature)
    best_score = float("-inf")
    best_index = 0
    for start in range(0, vocab_size, BLOCK):
        if temperature == 0.0:
            block_best, block_index = _block_best(logits_row, start, vocab_size, BLOCK)
        else:
            block_best, block_index = _noisy_block_best(logits_row, start, seed, scale, vocab_size, BLOCK)
        better = block_best > best_score
        best_index = tl.where(better, block_index, best_index)
        best_score = tl.where(better, block_best, best_score)
    tl.store(out_ptr + row, best_index)


def one_program_per_row(logits, rows, temperature, seeds, out) -> None:
    dev = logits.device
    _one_program_per_row[(len(rows),)](
        logits, logits.stride(0), torch.from_numpy(rows.astype(np.int64)).to(dev),
        torch.from_numpy(temperature.astype(np.float32)).to(dev), torch.from_numpy(seeds.astype(np.int64)).to(dev),
        out, logits.shape[1], BLOCK=_BLOCK, num_warps=4)


def main() -> None:
    vocab = 151936
    print(f"{'rows':>5} {'same tokens':>12} {'one program/row us':>19} {'chunked us':>11}")
    for batch in (1, 8, 64, 256):
        logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16) * 3
        rows = np.arange(batch)
        temperature = np.where(rows % 4 == 0, 0.0, 0.7)
        seeds = np.random.default_rng(batch).integers(0, 2**31 - 1, size=batch)
        old = torch.full((batch,), -1, device="cuda", dtype=torch.int64)
        new = torch.full((batch,), -1, device="cuda", dtype=torch.int64)
        one_program_per_row(logits, rows, temperature, seeds, old)
        gumbel_max_sample(logits, rows, temperature, seeds, new)
        same = bool((old == new).all()) and bool((new >= 0).all())
        t_old = triton.testing.do_bench(lambda: one_program_per_row(logits, rows, temperature, seeds, old),
                                        return_mode="median") * 1e3
        t_new = triton.testing.do_bench(lambda: gumbel_max_sample(logits, rows, temperature, seeds, new),
                                        return_mode="median") * 1e3
        print(f"{batch:>5} {str(same):>12} {t_old:>19.1f} {t_new:>11.1f}")


if __name__ == "__main__":
    main()
