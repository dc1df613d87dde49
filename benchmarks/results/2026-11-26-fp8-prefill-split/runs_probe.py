"""Probe: an FP8 block laid out with each head's scales right after its data (two runs per head and
block: keys+scales, values+scales) against kv_cache.py's layout (four: keys, values, and the scales at
the block's end), the CUDA decode kernel reading either through the views' strides. From the repository root, on a GPU:
python3 benchmarks/results/2026-11-26-fp8-prefill-split/runs_probe.py (its TB/s column is 16x too
large: it counted 2,112 bytes per token and KV head, which is per token; fp8_decode_tried.txt gives the times)."""
import sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
from triton.testing import do_bench_cudagraph
import tune_attention as tu
from minivllm.worker.attention import fp8_decode, kv_cache as kvc
from minivllm.worker.attention.triton_attention import decode_attention

orig_split = kvc.KVCacheLayout.split

def split_runs(self, kv_cache):
    if not self.fp8:
        return orig_split(self, kv_cache)
    num_blocks, size, heads, dim = kv_cache.shape[1], self.block_size, self.num_kv_heads, self.head_dim
    run, bb = size * dim + size * 4, kv_cache.shape[2]
    assert bb == heads * run
    data = kv_cache.view(kvc.FP8_DTYPE)
    key = data[0].as_strided((num_blocks, size, heads, dim), (bb, dim, run, 1))
    value = data[1].as_strided((num_blocks, size, heads, dim), (bb, 1, run, size))
    f = kv_cache.view(torch.float32)
    ks = f[0].as_strided((num_blocks, size, heads), (bb // 4, 1, run // 4), f[0].storage_offset() + size * dim // 4)
    vs = f[1].as_strided((num_blocks, size, heads), (bb // 4, 1, run // 4), f[1].storage_offset() + size * dim // 4)
    return kvc.KVCacheViews(key, value, ks, vs)

t0 = time.time()
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
while time.time() - t0 < 3:
    x @ x
torch.cuda.synchronize()
for case in ["decode-256xragged", "decode-256x700", "decode-32x4096"]:
    steps, outs, times = {}, {}, {}
    for name, split in (("four runs", orig_split), ("two runs", split_runs)):
        kvc.KVCacheLayout.split = split
        steps[name] = tu.build_step(tu.CASES[case][0], True)
        times[name] = []
    for rnd in range(3):
        for name, split in (("four runs", orig_split), ("two runs", split_runs)):
            kvc.KVCacheLayout.split = split
            q, cache, md, k, v = steps[name]
            out = torch.empty_like(q)
            fn = lambda: decode_attention(q, cache, md, 128**-0.5, out=out)
            fn(); torch.cuda.synchronize()
            times[name].append(do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000)
            outs[name] = out.clone()
            fp8_decode.ENABLED = False
            fn(); torch.cuda.synchronize()
            if rnd == 0:
                times[name + ", Triton"] = []
            times[name + ", Triton"].append(do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000)
            outs[name + ", Triton"] = out.clone()
            fp8_decode.ENABLED = True
    kvc.KVCacheLayout.split = orig_split
    live = sum(c + 1 for c, _ in tu.CASES[case][0])
    work = live * tu.KV_HEADS * 2 * 2112 / 1e12
    print(case)
    for name, t in times.items():
        base = "four runs, Triton" if "Triton" in name else "four runs"
        same = torch.equal(outs[name], outs[base])
        print(f"  {name:18s} {min(t):6.1f}-{max(t):6.1f} us  {work / min(t) * 1e6:.2f} TB/s  "
              f"{'bit-identical' if same else 'DIFFERS'} to {base}", flush=True)
