"""(As run in the second call; the first had the last three steps only, and eight shapes.)

Probe: an FP8 prompt step as the engine's 16,384-token mixed graph runs it (257 sequences), the
chunks after a cached context on the FP8 kernel at several shapes: light (one continuation) and
heavy (every prompt after a 512-token cached prefix) steps, in CUDA graphs."""
import os, sys
import numpy as np
import torch
from triton.testing import do_bench_cudagraph
sys.path.insert(0, os.getcwd())
from benchmarks.tune_attention import build_step, _ragged_prompts, HEAD_DIM
from minivllm.worker.attention import triton_attention as ta
from minivllm.worker.attention.triton_attention import PrefillConfig, paged_attention

rng = np.random.default_rng(3)
decodes = [(int(c), 1) for c in rng.integers(300, 900, 29)]
fresh = _ragged_prompts(16384 - 29 - 400, 100, 1024)
heavy_new = 16384 - 29
steps = {
    "8192 after 8192 cached": [(8192, 8192)],
    "8192 after 24576 cached": [(24576, 8192)],
    "16384 after 16384 cached": [(16384, 16384)],
    "2048 after 4096, x8": [(4096, 2048)] * 8,
    "light (1 continuation)": decodes + [(300, 400)] + fresh,
    "none cached": decodes + [(0, 400)] + fresh,
    "heavy (30 after 512 cached)": decodes + [(512, heavy_new // 30)] * 29 + [(512, heavy_new - 29 * (heavy_new // 30))],
}
shapes = [ta.PREFILL_FP8, PrefillConfig(128, 64, 8, 3, None), PrefillConfig(64, 64, 4, 3, None),
          PrefillConfig(64, 64, 4, 2, None)]
for label, cases in steps.items():
    q, cache, md, k, v = build_step(cases, True, 257)
    for shape in shapes:
        ta.PREFILL_FP8_CACHED = shape
        try:
            us = 1000 * do_bench_cudagraph(lambda: paged_attention(q, cache, md, HEAD_DIM**-0.5, key=k, value=v), rep=50, return_mode="median")
        except Exception as e:
            print(f"{label}: {tuple(shape)}: {type(e).__name__} {str(e)[:100]}"); continue
        print(f"{label}: cached launch at {tuple(shape)}: {us:.1f} us the call (graph)")
