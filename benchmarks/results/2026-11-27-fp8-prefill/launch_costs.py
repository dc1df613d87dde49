"""What each launch of a prefill step's attention costs, in CUDA graphs (H100): an FP8 step's two
prefill launches (fresh prompts on the plain kernel, chunks after a cached context on the FP8 one)
and its decode rows' kernel, each alone, against a bf16 step's one launch; steps padded to the
mixed graph's 257 sequences (as the engine runs them) and unpadded.

    python benchmarks/results/2026-11-27-fp8-prefill/launch_costs.py
"""
import os
import sys

import numpy as np
import torch
from triton.testing import do_bench_cudagraph

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
import tune_attention as ta  # noqa: E402
from minivllm.worker.attention import triton_attention  # noqa: E402
from minivllm.worker.attention.triton_attention import paged_attention  # noqa: E402

ALL = {0: "all", 1: "cached", 2: "fresh"}


class OnlySome:
    """Stands in for a prefill kernel: launches only the WHICH_SEQS values in `keep` (the cached
    chunks' own kernel, where the tree has one, counts as CACHED_SEQS, 1)."""

    def __init__(self, kernel, keep, which=None):
        self.kernel, self.keep, self.which = kernel, keep, which

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            which = self.which if self.which is not None else int(kwargs.get("WHICH_SEQS", 0))
            if which in self.keep:
                launch(*args, **kwargs)
        return run


def prompt_step(decodes: int, continuation: tuple[int, int] | None) -> list[tuple[int, int]]:
    """A prompt-phase step of the 256-request workload: `decodes` one-token rows (the earlier
    steps' requests), a chunk after a cached context, then fresh prompts of 100-1,024 to 16,384."""
    rng = np.random.default_rng(3)
    cases = [(int(n), 1) for n in rng.integers(100, 1024, decodes)]
    if continuation:
        cases.append(continuation)
    left = 16384 - sum(n for _, n in cases)
    for n in rng.integers(100, 1025, 64):
        cases.append((0, min(int(n), left)))
        left -= cases[-1][1]
        if not left:
            break
    return cases


STEPS = {
    "fresh prompts only": prompt_step(0, None),
    "58 decodes, 450 after 600, prompts": prompt_step(58, (600, 450)),
    "58 decodes, 900 after 120, prompts": prompt_step(58, (120, 900)),
    "58 decodes, prompts": prompt_step(58, None),
}


def main() -> None:
    kernel = triton_attention._paged_attention_kernel
    cached_kernel = getattr(triton_attention, "_cached_prefill_kernel", None)
    real_decode = triton_attention.decode_attention
    print(f"{torch.cuda.get_device_name()}; us a step in a CUDA graph (median)")
    for name, cases in STEPS.items():
        for pad in (257, 0):
            row = []
            for fp8 in (False, True):
                q, cache, md, k, v = ta.build_step(cases, fp8, graph_seqs=pad)
                parts = [("both", {0, 1, 2}, True), ("fresh", {2}, False), ("cached", {1}, False),
                         ("decodes", set(), True)] if fp8 else [("all", {0}, True), ("prefill", {0}, False),
                                                               ("decodes", set(), True)]
                for label, keep, with_decodes in parts:
                    triton_attention._paged_attention_kernel = OnlySome(kernel, keep)
                    if cached_kernel is not None:
                        triton_attention._cached_prefill_kernel = OnlySome(cached_kernel, keep, which=1)
                    triton_attention.decode_attention = real_decode if with_decodes else (
                        lambda query, *a, out=None, **kw: out if out is not None else torch.empty_like(query))
                    fn = lambda: paged_attention(q, cache, md, ta.HEAD_DIM**-0.5, key=k, value=v)  # noqa: E731
                    us = do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000
                    row.append(f"{'fp8' if fp8 else 'bf16'} {label} {us:.1f}")
                triton_attention._paged_attention_kernel = kernel
                if cached_kernel is not None:
                    triton_attention._cached_prefill_kernel = cached_kernel
                triton_attention.decode_attention = real_decode
            print(f"{name} ({len(cases)} seqs, padded to {pad or 'none'}): " + "; ".join(row), flush=True)


if __name__ == "__main__":
    main()
