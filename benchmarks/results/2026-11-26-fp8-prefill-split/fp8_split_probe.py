"""Probe: an FP8 prefill step's fresh prompts on the plain kernel (paged_attention's split), timed in
CUDA graphs after a warm-up, in one process. From the repository root, on a GPU:

    python3 benchmarks/results/2026-11-26-fp8-prefill-split/fp8_split_probe.py
"""
import sys, os, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
from triton.testing import do_bench, do_bench_cudagraph
import tune_attention as tu
from minivllm.worker.attention import triton_attention as ta

def bench(fn):
    fn()
    return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000

t0 = time.time()
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
while time.time() - t0 < 3:
    x @ x
torch.cuda.synchronize()
for case in ("prefill-16384xragged", "prefill-8192x562"):
    bf = [tu.build_step(c, False, 0) for c in tu.CASES[case]]
    f8 = [tu.build_step(c, True, 0) for c in tu.CASES[case]]
    def run(steps, fresh=True, config=None):
        for q, cache, md, k, v in steps:
            ta.paged_attention(q, cache, md, 128**-0.5, config=config, **(dict(key=k, value=v) if fresh else {}))
    print(case)
    print(f"  bf16 cache: {bench(lambda: run(bf, False)):.0f} us")
    ta.PREFILL_FRESH_SEQS_PLAIN = False
    print(f"  fp8, one launch: {bench(lambda: run(f8)):.0f} us")
    ta.PREFILL_FRESH_SEQS_PLAIN = True
    real = ta._paged_attention_kernel
    for cfg in [ta.PREFILL, ta.PrefillConfig(128, 32, 8, 3, 128), ta.PrefillConfig(128, 64, 8, 3, 128),
                ta.PrefillConfig(128, 64, 8, 2, 128), ta.PrefillConfig(128, 32, 8, 2, 128)]:
        ta.PREFILL_FP8_FRESH = cfg
        split = bench(lambda: run(f8))
        class OnlyFresh:
            def __getitem__(self, grid):
                launch = real[grid]
                return lambda *a, **kw: None if kw.get("WHICH_SEQS") == ta.CACHED_SEQS else launch(*a, **kw)
        ta._paged_attention_kernel = OnlyFresh()
        fresh_only = bench(lambda: run(f8))
        ta._paged_attention_kernel = real
        print(f"  fp8, split, fresh at {tuple(cfg)}: {split:.0f} us; its fresh launch alone {fresh_only:.0f} us")
    ta.PREFILL_FP8_FRESH = ta.PREFILL
    print(f"  bf16 cache again: {bench(lambda: run(bf, False)):.0f} us")
