"""Why the decode kernel reads ~2.98 TB/s alone but less inside the engine's step: the engine's decode
graph profiled kernel by kernel, and the kernel alone with and without its RoPE prologue (H100)."""
import argparse, os, time
import numpy as np
import torch
from triton.testing import do_bench_cudagraph
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import NewRequestData, SchedulerOutput, CachedRequestData
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.attention.metadata import RopeInputs
from minivllm.worker.attention.triton_attention import decode_attention

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=256)
p.add_argument("--lo", type=int, default=100)
p.add_argument("--hi", type=int, default=1280)
p.add_argument("--kv-cache-dtype", default="auto")
args = p.parse_args()
B, bs = args.batch, 16
rng = np.random.default_rng(0)
ctx = rng.integers(args.lo, args.hi, size=B)
bpr = -(-(int(ctx.max()) + 64) // bs)
num_blocks = B * bpr + 64
config = EngineConfig.create("benchmarks/configs/qwen3-0.6b", load_format="dummy", num_gpu_blocks=num_blocks,
                             max_model_len=4096, max_num_seqs=B, max_num_batched_tokens=2048,
                             kv_cache_dtype=args.kv_cache_dtype)
runner = ModelRunner(config)
runner.initialize_cache(num_blocks)
for cache in runner.kv_caches:
    views = runner.kv_layout.split(cache)
    for data, scales in ((views.key, views.key_scale), (views.value, views.value_scale)):
        data.copy_(torch.randn(data.shape, device=data.device).to(data.dtype))
        if scales is not None:
            scales.uniform_(0.01, 0.02)
params = SamplingParams(temperature=1.0, max_tokens=10_000, ignore_eos=True)
perm = rng.permutation(B * bpr)
new = [NewRequestData(req_id=str(i), prompt_token_ids=rng.integers(0, 150_000, size=int(ctx[i]) + 1).tolist(),
                      output_token_ids=[], sampling_params=params,
                      block_ids=perm[i * bpr:(i + 1) * bpr].tolist(), num_computed_tokens=int(ctx[i])) for i in range(B)]
runner.execute_model(SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=[],
                                     num_scheduled_tokens={str(i): 1 for i in range(B)},
                                     total_num_scheduled_tokens=B, finished_req_ids=[]))
so = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[CachedRequestData(str(i), [], int(ctx[i]) + 1) for i in range(B)],
                     num_scheduled_tokens={str(i): 1 for i in range(B)}, total_num_scheduled_tokens=B, finished_req_ids=[])
step = runner.input_batch.prepare(so.num_scheduled_tokens)
model = runner.model
layer_bytes = int(sum(ctx + 1)) * 2 * runner.kv_layout.block_bytes // bs
print(f"{torch.cuda.get_device_name()}; batch {B}, contexts {args.lo}-{args.hi} (mean {ctx.mean():.0f}), kv {args.kv_cache_dtype}, "
      f"DECODE_ROPE={os.environ.get('MINIVLLM_DECODE_ROPE', '1')} PDL={os.environ.get('MINIVLLM_PDL', '1')}; "
      f"KV a layer {layer_bytes / 1e6:.0f} MB")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
t = time.time()
while time.time() - t < 3:
    a @ a
torch.cuda.synchronize()
with torch.inference_mode():
    runner.graphs.run(step)
    g = runner.graphs.graphs[("decode", B)]
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        s0, e0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        for _ in range(30):
            g.replay()
        e0.record(); e0.synchronize()
        ts.append(s0.elapsed_time(e0) / 30)
    print(f"decode graph replay: best {min(ts) * 1000:.0f} us, median {sorted(ts)[2] * 1000:.0f} us")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
    sums = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            sums.setdefault(ev.name, [0.0, 0])
            sums[ev.name][0] += ev.device_time
            sums[ev.name][1] += 1
    for name, (us, n) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:12]:
        extra = ""
        if "decode" in name.lower():
            extra = f"  -> {layer_bytes / (us / n * 1e-6) / 1e12:.2f} TB/s a call"
        print(f"  {us / 10:9.1f} us a step  {n // 10:4d} calls  {us / n:7.2f} us a call  {name[:60]}{extra}")
    metadata = runner.buffers.metadata(B, B, 1, int(ctx.max()) + 1)
    sa = model.model.layers[0].self_attn
    qkv = torch.randn(B, sa.q_size + 2 * sa.kv_size, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
    q = q.view(B, sa.num_heads, sa.head_dim); k = k.view(B, sa.num_kv_heads, sa.head_dim); v = v.view(B, sa.num_kv_heads, sa.head_dim)
    pos = runner.buffers.forward_inputs[1]
    rope = RopeInputs(k, v, pos, sa.rotary_emb.cos_cache, sa.rotary_emb.sin_cache, sa.q_norm.weight, sa.k_norm.weight, sa.q_norm.eps)
    out = torch.empty_like(q)
    for name, fn in [("kernel alone, no rope", lambda: decode_attention(q, runner.kv_caches[5], metadata, sa.scale, out=out)),
                     ("kernel alone, rope", lambda: decode_attention(q, runner.kv_caches[5], metadata, sa.scale, out=out, rope=rope))]:
        ms = do_bench_cudagraph(fn, rep=200)
        print(f"{name}: {ms * 1000:.1f} us = {layer_bytes / ms / 1e9:.2f} TB/s")
