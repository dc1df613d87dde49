"""Programmatic dependent launch (worker/pdl.py, MINIVLLM_PDL=1): the kernels that may start
before the kernel ahead of them finishes give the same bits as without it, alone, chained in a
CUDA graph, and through the whole engine."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.worker import pdl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper (or later) GPU")


@pytest.fixture
def pdl_switch(monkeypatch):
    def switch(on: bool) -> None:
        monkeypatch.setattr(pdl, "ENABLED", on)
    return switch


def assert_same_bits_with_pdl(pdl_switch, chain, make_args, base_cache: torch.Tensor) -> None:
    """chain(*make_args(kv_cache)) writes its output into the last argument and K/V into the cache.
    Run without PDL, then with it eagerly and as three layers back to back in a CUDA graph: the
    output and the cache have the same bits every time."""

    def run(on: bool, graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
        pdl_switch(on)
        kv_cache = base_cache.clone()
        args = make_args(kv_cache)
        out = args[-1]
        chain(*args)  # compiles (and is the eager result)
        if graph:
            g = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                chain(*args)  # warm up on the capture stream
                with torch.cuda.graph(g, stream=stream):
                    for _ in range(3):  # three layers' worth of dependent kernels back to back
                        chain(*args)
            torch.cuda.current_stream().wait_stream(stream)
            kv_cache.copy_(base_cache)
            out.zero_()
            g.replay()
        torch.cuda.synchronize()
        return out.clone(), kv_cache

    plain_out, plain_cache = run(False, graph=False)
    for graph in (False, True):
        out, cache = run(True, graph)
        assert torch.equal(out, plain_out) and torch.equal(cache, plain_cache), f"graph={graph}"


def layer_parameters(hidden: int, dt: torch.dtype) -> tuple:
    """A Qwen3-0.6B-shaped layer's weights (qkv, o, gate_up, down, q_norm, k_norm), its norm weight,
    cos/sin tables and KV cache layout, on the GPU."""
    from minivllm.worker.attention.kv_cache import KVCacheLayout

    weights = [(torch.randn(n, k, device="cuda") / k ** 0.5).to(dt) for n, k in
               [(4096, hidden), (hidden, 2048), (6144, hidden), (hidden, 3072)]]
    weights += [torch.rand(128, device="cuda").to(dt) + 0.5 for _ in range(2)]
    norm_weight = torch.rand(hidden, device="cuda").to(dt) + 0.5
    cos, sin = torch.rand(4096, 64, device="cuda"), torch.rand(4096, 64, device="cuda")
    return weights, norm_weight, cos, sin, KVCacheLayout(block_size=16, num_kv_heads=8, head_dim=128, dtype=dt)


def layer_chain(x, residual, weights, norm_weight, cos, sin, positions, kv_cache, layout, metadata, outputs):
    """One decoder layer's batch-1 kernels in order, each reading the one before: norm + qkv,
    q/k norm + RoPE + K/V store, decode attention, o, norm + gate_up, silu * mul + down."""
    from minivllm.worker import ops, small_batch_gemm
    from minivllm.worker.attention.triton_attention import decode_attention

    qkv_w, o_w, gate_up_w, down_w, q_norm, k_norm = weights
    qkv, summed = small_batch_gemm.norm_linear(x, residual, norm_weight, 1e-6, qkv_w)
    q, k, v = qkv.view(1, -1, 128).split([16, 8, 8], dim=1)
    q, k = ops.norm_rope(q, k, positions, cos, sin, q_norm, k_norm, 1e-6,
                         kv_store=(v, kv_cache, metadata.slot_mapping, layout))
    attn = decode_attention(q, kv_cache, metadata, 128 ** -0.5)
    o = small_batch_gemm.linear(attn.view(1, -1), o_w)
    gate_up, summed2 = small_batch_gemm.norm_linear(o, summed, norm_weight, 1e-6, gate_up_w)
    outputs.copy_(small_batch_gemm.silu_mul_linear(gate_up, down_w) + summed2)


def test_one_layer_chain_same_bits_with_pdl_eager_and_in_a_graph(pdl_switch) -> None:
    from minivllm.worker.attention.metadata import AttentionMetadata

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, context, num_blocks = 1024, 200, 32
    weights, norm_weight, cos, sin, layout = layer_parameters(hidden, dt)
    block_table = torch.randperm(num_blocks, device=dev, dtype=torch.int32)[None, :]
    position = context - 1
    slot = int(block_table[0, position // 16]) * 16 + position % 16
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], device=dev, dtype=torch.int32),
        seq_lens=torch.tensor([context], device=dev, dtype=torch.int32),
        block_tables=block_table, slot_mapping=torch.tensor([slot], device=dev, dtype=torch.int64),
        max_query_len=1, max_seq_len=context, kv_layout=layout)
    x, residual = (torch.randn(1, hidden, device=dev).to(dt) for _ in range(2))
    positions = torch.tensor([position], device=dev)
    base_cache = torch.randn(layout.shape(num_blocks), device=dev).to(dt)

    def make_args(kv_cache: torch.Tensor) -> tuple:
        out = torch.empty(1, hidden, device=dev, dtype=dt)
        return x, residual, weights, norm_weight, cos, sin, positions, kv_cache, layout, metadata, out

    assert_same_bits_with_pdl(pdl_switch, layer_chain, make_args, base_cache)


def test_engine_greedy_tokens_same_with_pdl(tiny_model_factory, monkeypatch) -> None:
    """Batch 1 (where the one-row kernels run), CUDA graphs on: MINIVLLM_PDL=1 changes no token."""
    model_dir = tiny_model_factory("qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(11 * i + j) % 300 + 1 for j in range(n)]} for i, n in enumerate([3, 40, 130])]

    def tokens(on: str) -> list[list[int]]:
        monkeypatch.setenv("MINIVLLM_PDL", on)  # the worker process reads it
        with LLM(model_dir, device="cuda", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256) as llm:
            return [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]

    assert tokens("1") == tokens("0")
