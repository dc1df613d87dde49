"""Verify-step CUDA graphs (speculative decoding): a step of a few requests of up to 1 + k tokens
each replays a verify graph of its own size, padded, and gives what the eager forward gives; a
step with a longer chunk goes to a few-sequence graph. Steps with prefill chunks replay a
few-sequence graph (one attention kernel) or a mixed one by their sequence count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.metadata import FEW_SEQS, FEW_SEQS_SPLIT_MAX_TOKENS, step_splits_contexts
from minivllm.worker.cuda_graphs import StepBuffers, StepGraphs
from minivllm.worker.input_batch import StepInputs

pytest.importorskip("triton", reason="needs Triton (the CUDA build of torch)")
from minivllm.worker.attention.triton_attention import TritonAttentionBackend  # noqa: E402

BLOCK, HEADS, KV_HEADS, HEAD_DIM, MAX_BLOCKS, VOCAB = 16, 4, 2, 64, 8, 100
K = 3  # drafts per request: verify steps of up to 4 tokens a request


def make_step(contexts: list[int], query_lens: list[int], block_table: np.ndarray) -> StepInputs:
    n = len(contexts)
    query_start_loc = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    token_req = np.repeat(np.arange(n), query_lens)
    positions = np.arange(query_start_loc[-1]) - query_start_loc[token_req] + np.asarray(contexts)[token_req]
    seq_lens = np.asarray(contexts) + np.asarray(query_lens)
    return StepInputs(
        req_ids=[str(i) for i in range(n)],
        input_ids=np.random.default_rng(sum(contexts) + n).integers(0, VOCAB, int(query_start_loc[-1])),
        positions=positions,
        slot_mapping=block_table[token_req, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table[:n],
        logits_indices=query_start_loc[1:] - 1, sampling_req_index=np.arange(n), sampling_rows=np.arange(n),
        max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()))


def attention_layer(cache: torch.Tensor, device: torch.device):
    """A forward of one attention layer over the paged cache, its q/k/v from a random embedding."""
    embedding = torch.randn(VOCAB, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=device)
    backend = TritonAttentionBackend()

    def forward(input_ids, positions, metadata):
        q, k, v = embedding[input_ids].split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        return backend.forward(q.reshape(-1, HEADS, HEAD_DIM).contiguous(), k.reshape(-1, KV_HEADS, HEAD_DIM).contiguous(),
                               v.reshape(-1, KV_HEADS, HEAD_DIM).contiguous(), cache, metadata, HEAD_DIM ** -0.5)

    return forward


def test_verify_steps_replay_verify_graphs_and_equal_eager() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    layout = KVCacheLayout(BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    cache = layout.allocate(8 * MAX_BLOCKS, device)
    block_table = np.arange(8 * MAX_BLOCKS, dtype=np.int32).reshape(8, MAX_BLOCKS)[::-1].copy()
    forward = attention_layer(cache, device)

    buffers = StepBuffers(512, 8, MAX_BLOCKS, device)
    buffers.kv_layout = layout
    graphs = StepGraphs(forward, buffers, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=MAX_BLOCKS * BLOCK,
                        verify_query_len=K + 1, max_verify_seqs=4)
    assert graphs.verify_buckets == [1, 2, 4]
    # max_num_seqs <= FEW_SEQS: few graphs take every step with prompt tokens here, no mixed ones captured
    prompt_graphs = sorted(key for key in graphs.graphs if key[0] in ("few", "mixed"))
    assert prompt_graphs == [("few", t) for t in (64, 128, 256, 512)]

    def eager(step: StepInputs) -> torch.Tensor:
        metadata = buffers.load(step)
        return forward(*buffers.forward_inputs, metadata).clone()

    contexts = [37, 20, 5]
    eager(make_step([0, 0, 0], contexts, block_table))  # their prompts into the cache
    cases = [([4, 1, 3], ("verify", 4)), ([4], ("verify", 1)), ([2, 2], ("verify", 2)), ([5, 1, 1], ("few", 64))]
    for query_lens, expected_key in cases:
        step = make_step(contexts[: len(query_lens)], query_lens, block_table)
        assert graphs.bucket(step)[0] == expected_key
        expected = eager(step)
        replayed = graphs.run(step)
        assert replayed is not None and replayed.shape == expected.shape
        torch.testing.assert_close(replayed, expected)


def test_large_decode_batches_replay_graphs_and_equal_eager() -> None:
    """A decode step of more (sequence, KV head) programs than the GPU has SMs runs its sequences
    longest first. The graph computes that order on every replay (a capture once inherited the
    order its warm-up computed, whose memory was freed and reused, and replays read garbage), so
    with freed memory overwritten in between, replays still equal the eager forward."""
    torch.manual_seed(1)
    device = torch.device("cuda")
    num_seqs = torch.cuda.get_device_properties(device).multi_processor_count  # x KV_HEADS programs
    layout = KVCacheLayout(BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    cache = layout.allocate(num_seqs * MAX_BLOCKS, device).normal_()
    rng = np.random.default_rng(2)
    block_table = rng.permutation(num_seqs * MAX_BLOCKS).astype(np.int32).reshape(num_seqs, MAX_BLOCKS)
    forward = attention_layer(cache, device)
    buffers = StepBuffers(512, num_seqs, MAX_BLOCKS, device)
    buffers.kv_layout = layout
    graphs = StepGraphs(forward, buffers, max_num_seqs=num_seqs, max_num_batched_tokens=512,
                        max_model_len=MAX_BLOCKS * BLOCK)
    junk = torch.full((64 << 20,), 2**30, dtype=torch.int32, device=device)  # reuses whatever was freed
    for batch in (num_seqs, num_seqs - 3):
        step = make_step(rng.integers(0, MAX_BLOCKS * BLOCK - 1, batch).tolist(), [1] * batch, block_table)
        assert graphs.bucket(step)[0] == ("decode", num_seqs)
        metadata = buffers.load(step)
        expected = forward(*buffers.forward_inputs, metadata).clone()
        replayed = graphs.run(step)
        torch.testing.assert_close(replayed, expected)
    del junk


def prefill_graphs(num_seqs: int, max_blocks: int, max_num_batched_tokens: int, seed: int):
    """(block table, forward, buffers, graphs) for steps with prefill chunks over an fp32 cache of
    num_seqs x max_blocks blocks, each sequence's blocks spread at random."""
    device = torch.device("cuda")
    layout = KVCacheLayout(BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    cache = layout.allocate(num_seqs * max_blocks, device)
    block_table = np.random.default_rng(seed).permutation(num_seqs * max_blocks).astype(np.int32).reshape(num_seqs, -1)
    forward = attention_layer(cache, device)
    buffers = StepBuffers(max_num_batched_tokens, num_seqs, max_blocks, device)
    buffers.kv_layout = layout
    graphs = StepGraphs(forward, buffers, max_num_seqs=num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_blocks * BLOCK)
    return block_table, forward, buffers, graphs


def test_few_and_many_sequence_steps_replay_their_graphs_and_equal_eager() -> None:
    """Up to FEW_SEQS sequences (and FEW_SEQS_MAX_TOKENS tokens) with prefill chunks: a few graph,
    padded to FEW_SEQS + 1 sequences, without the decode kernel (decodes included go to the prefill
    kernel, eagerly too); more sequences or tokens: a mixed graph. Padding rows come out zero, a
    padding sequence of one token included (which no decode kernel takes there)."""
    torch.manual_seed(2)
    num_seqs = 12
    block_table, forward, buffers, graphs = prefill_graphs(num_seqs, MAX_BLOCKS, 1024, seed=3)
    assert graphs.few_buckets == [64, 128, 256, 512] and graphs.few_seqs == FEW_SEQS == 8

    contexts = [10] * num_seqs
    metadata = buffers.load(make_step([0] * num_seqs, contexts, block_table))  # their prompts into the cache
    forward(*buffers.forward_inputs, metadata)
    cases = [([40, 22, 1], ("few", 64)),  # 63 tokens: the padding sequence has one
             ([5, 1, 1], ("few", 64)), ([100, 90, 80], ("few", 512)), ([2] * 8, ("few", 64)),
             ([2] * 9, ("mixed", 64)), ([1] * 10 + [3, 2], ("mixed", 64)), ([100] * 6, ("mixed", 1024))]
    for query_lens, expected_key in cases:
        step = make_step(contexts[: len(query_lens)], query_lens, block_table)
        assert graphs.bucket(step)[0] == expected_key, query_lens
        metadata = buffers.load(step)
        assert metadata.split_decodes == (expected_key[0] == "mixed")
        expected = forward(*buffers.forward_inputs, metadata).clone()
        replayed = graphs.run(step)
        torch.testing.assert_close(replayed, expected)
        padding = graphs.outputs[expected_key][step.num_tokens:]
        assert torch.equal(padding, torch.zeros_like(padding)), query_lens


def test_short_chunks_after_long_prefixes_share_their_contexts_in_graphs_as_eagerly() -> None:
    """A few-sequence step of up to FEW_SEQS_SPLIT_MAX_TOKENS tokens shares its contexts out among
    programs (step_splits_contexts), in its graph as eagerly, and the two agree; a longer one does not."""
    torch.manual_seed(3)
    block_table, forward, buffers, graphs = prefill_graphs(4, 200, 512, seed=4)  # 3,200 tokens a sequence
    contexts = [3000, 2100, 40, 500]
    for i, context in enumerate(contexts):  # the prompts into the cache, 500 tokens a step
        for start in range(0, context, 500):
            metadata = buffers.load(make_step([start], [min(500, context - start)], block_table[i:]))
            forward(*buffers.forward_inputs, metadata)
    cases = [([50, 3, 1, 7], 64, True), ([1, 200], 256, True), ([9, 1], 64, True), ([30, 30, 30, 30], 128, True),
             ([200, 100], 512, False)]
    for query_lens, bucket, split in cases:
        step = make_step(contexts[: len(query_lens)], query_lens, block_table)
        assert graphs.bucket(step)[0] == ("few", bucket), query_lens
        metadata = buffers.load(step)
        assert step_splits_contexts(metadata.split_decodes, step.num_tokens) == split
        assert split == (step.num_tokens <= FEW_SEQS_SPLIT_MAX_TOKENS)
        expected = forward(*buffers.forward_inputs, metadata).clone()
        torch.testing.assert_close(graphs.run(step), expected)
