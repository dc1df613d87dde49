"""Probe: an engine-like prompt step (decodes, one chunk after a cached context, fresh prompts to
16,384 tokens) through paged_attention, bf16 and FP8: the whole call, and each kernel's time."""
import os, sys
import numpy as np
import torch
from triton.testing import do_bench
sys.path.insert(0, os.getcwd())
from benchmarks.tune_attention import build_step, _ragged_prompts, HEAD_DIM
from minivllm.worker.attention import triton_attention
from minivllm.worker.attention.triton_attention import paged_attention

rng = np.random.default_rng(3)
decodes = [(int(c), 1) for c in rng.integers(300, 900, 29)]
fresh = _ragged_prompts(16384 - 29 - 400, 100, 1024)
with_chunk = decodes + [(300, 400)] + fresh
all_fresh = decodes + [(0, 400)] + fresh
cases = {"with a continuation": with_chunk, "all fresh": all_fresh}

def kernel_times(fn, reps=20):
    fn(); torch.cuda.synchronize()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    # group by order within a call: kernels per call = len(evs) // reps
    per = len(evs) // reps
    rows = []
    for i in range(per):
        durs = sorted(evs[j * per + i].device_time for j in range(reps))
        rows.append((evs[i].name[:60], durs[len(durs) // 2]))
    return rows

for fp8 in (False, True):
    for label, c in cases.items():
        q, cache, md, k, v = build_step(c, fp8, 0)
        run = lambda: paged_attention(q, cache, md, HEAD_DIM**-0.5, key=k, value=v)
        ms = do_bench(run, warmup=10, rep=100, return_mode="median")
        print(f"{'fp8 ' if fp8 else 'bf16'} {label}: {ms*1000:.1f} us the call")
        for name, us in kernel_times(run):
            print(f"      {us:8.1f} us  {name}")
