"""Two-batch overlap probe: a decode step of 256 ragged sequences, the batch split in two halves
whose attention (bandwidth-bound) runs on one stream while the other half's norms and projections
run on another. Times graph replays against the engine's own decode graph (H100)."""
import argparse, dataclasses, time
import numpy as np
import torch
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import NewRequestData, SchedulerOutput, CachedRequestData
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.attention.metadata import RopeInputs
from minivllm.worker import pdl

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=256)
p.add_argument("--lo", type=int, default=560)
p.add_argument("--hi", type=int, default=1380)
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
perm = rng.permutation(B * bpr)  # scattered blocks, as a serving engine's are
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
kv_bytes = int(sum(ctx + 1)) * 2 * runner.kv_layout.block_bytes // bs * model.num_layers


def bench(fn, iters=30, reps=5):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) / iters)
    return min(ts), float(np.median(ts))


a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
t = time.time()
while time.time() - t < 3:
    a @ a
torch.cuda.synchronize()

# The engine's graph.
runner.graphs.run(step)
base_out = runner.graphs.outputs[("decode", B)]
metadata = runner.buffers.metadata(B, B, 1, int(ctx.max()) + 1)
ref = base_out.clone()


def half_metadata(lo, hi, order):
    return dataclasses.replace(metadata, query_start_loc=torch.arange(hi - lo + 1, dtype=torch.int32, device="cuda"),
                               seq_lens=metadata.seq_lens[lo:hi], block_tables=metadata.block_tables[lo:hi],
                               slot_mapping=metadata.slot_mapping[lo:hi], num_active_seqs=None,
                               max_seq_len=metadata.max_seq_len,
                               seq_order=torch.tensor(order, dtype=torch.int32, device="cuda"))


_mds = {}


def tbo_forward(split, other_prio, attn_prio, ordered=True):
    ids, pos = runner.buffers.forward_inputs
    lens = ctx + 1
    halves = [(0, split), (split, B)]
    if (split, ordered) not in _mds:
        _mds[(split, ordered)] = [half_metadata(lo, hi, np.argsort(-lens[lo:hi], kind="stable") if ordered else np.arange(hi - lo))
                                  for lo, hi in halves]
    mds = _mds[(split, ordered)]
    m = model.model
    layers = m.stage_layers
    cap = torch.cuda.current_stream()
    other = torch.cuda.Stream(priority=other_prio)
    attn_s = torch.cuda.Stream(priority=attn_prio)
    other.wait_stream(cap); attn_s.wait_stream(cap)
    h, r, qkv, att = [None, None], [None, None], [None, None], [None, None]

    def pre(x, L):
        lo, hi = halves[x]
        layer = layers[L]
        if L == 0:
            h[x] = m.embed_tokens(ids[lo:hi])
        qkv[x], r[x] = layer.self_attn.qkv_proj.forward_normed(h[x], r[x], layer.input_layernorm)

    def attend(x, L):
        lo, hi = halves[x]
        sa = layers[L].self_attn
        n = hi - lo
        q, k, v = qkv[x].split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
        q = q.view(n, sa.num_heads, sa.head_dim); k = k.view(n, sa.num_kv_heads, sa.head_dim); v = v.view(n, sa.num_kv_heads, sa.head_dim)
        rope = RopeInputs(k, v, pos[lo:hi], sa.rotary_emb.cos_cache, sa.rotary_emb.sin_cache,
                          *((sa.q_norm.weight, sa.k_norm.weight, sa.q_norm.eps) if sa.use_qk_norm else ()))
        att[x] = sa.attn_backend.decode_rotating(q, runner.kv_caches[L], mds[x], sa.scale, rope)

    def post(x, L):
        lo, hi = halves[x]
        layer = layers[L]
        sa = layer.self_attn
        o = sa.o_proj(att[x].reshape(hi - lo, sa.q_size))
        gu, r[x] = layer.mlp.gate_up_proj.forward_normed(o, r[x], layer.post_attention_layernorm)
        h[x] = layer.mlp.down_proj(gu, gated=True)

    pre_done = [[torch.cuda.Event() for _ in layers] for _ in range(2)]
    attn_done = [[torch.cuda.Event() for _ in layers] for _ in range(2)]
    nL = len(layers)
    with torch.cuda.stream(other):
        pre(0, 0); pre_done[0][0].record()
        pre(1, 0); pre_done[1][0].record()
    for L in range(nL):
        for x in range(2):
            with torch.cuda.stream(attn_s):
                attn_s.wait_event(pre_done[x][L])
                attend(x, L)
                attn_done[x][L].record()
            with torch.cuda.stream(other):
                other.wait_event(attn_done[x][L])
                post(x, L)
                if L + 1 < nL:
                    pre(x, L + 1); pre_done[x][L + 1].record()
    with torch.cuda.stream(other):
        out = torch.cat([m.norm(h[x], r[x])[0] for x in range(2)])
    cap.wait_stream(other); cap.wait_stream(attn_s)
    return out


def capture(fn):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=runner.graphs.pool):
        out = fn()
    return g, out


print(f"{torch.cuda.get_device_name()}; batch {B}, contexts {args.lo}-{args.hi} (mean {ctx.mean():.0f}); "
      f"KV read per step {kv_bytes / 1e9:.2f} GB; kv {args.kv_cache_dtype}")
with torch.inference_mode():
    for rnd in range(2):
        best, med = bench(lambda: runner.graphs.run(step))
        print(f"engine graph                 : best {best:.3f} ms, median {med:.3f} ms")
        for pdl_on in (True, False):
            pdl.ENABLED = pdl_on
            for name, split, op, ap, ordered in [("tbo", B // 2, 0, 0, True), ("tbo prio(other)", B // 2, -1, 0, True),
                                                 ("tbo prio(attn)", B // 2, 0, -1, True), ("tbo unordered", B // 2, 0, 0, False)]:
                if rnd == 1 and name != "tbo":
                    continue
                g, out = capture(lambda: tbo_forward(split, op, ap, ordered))
                g.replay(); torch.cuda.synchronize()
                diff = (out.float() - ref.float()).abs().max().item()
                best, med = bench(g.replay)
                print(f"{name:17s} pdl={int(pdl_on)}: best {best:.3f} ms, median {med:.3f} ms (max |diff| vs engine {diff:.3g})")
                del g
        pdl.ENABLED = True
        if rnd == 0:
            g, out = capture(lambda: runner._forward(*runner.buffers.forward_inputs, metadata))
            print(f"engine forward recaptured   : best/median {bench(g.replay)}")
