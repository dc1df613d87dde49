"""The Hopper prefill attention kernel (worker/attention/hopper_prefill.cu) against the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from minivllm.worker.attention import hopper_prefill
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.reference import paged_attention as reference_attention

pytest.importorskip("triton", reason="needs Triton (the CUDA build of torch)")
from minivllm.worker.attention.triton_attention import paged_attention, store_kv

from tests.gpu.test_triton_attention import BLOCK_ORDERS, make_batch, with_graph_padding

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU")

# (context cached before the step, tokens this step): prompts on and off tile boundaries, chunks
# after prefixes on and off block and tile boundaries, decodes (one token after a context).
CASES = [(0, 2048), (0, 300), (0, 129), (0, 128), (0, 1), (500, 700), (4096, 1000), (17, 1), (0, 5),
         (127, 130), (1000, 1), (64, 2)]


def _batch(heads_per_kv: int, block_size: int, seed: int, cases=CASES, block_order="scattered"):
    q, k, v, cache, metadata = make_batch(cases, 2 * heads_per_kv, 2, 128, block_size, torch.bfloat16, seed,
                                          block_order=block_order)
    store_kv(k, v, cache, metadata.slot_mapping)
    return q, k, v, cache, metadata


def _decode_rows(metadata: AttentionMetadata) -> torch.Tensor:
    starts = metadata.query_start_loc
    lengths = starts[1:] - starts[:-1]
    return starts[:-1][lengths == 1].long()


def _check(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert not out.isnan().any()
    error = (out.double() - expected).norm() / expected.norm()
    assert error < 1e-2, f"relative error {error:.2e}"
    # bfloat16 keeps 8 bits: no element may be off by more than a few of its steps
    worst = (out.double() - expected).abs().max().item()
    assert worst < 0.05, f"largest difference {worst:.3f}"


@pytest.fixture(scope="module", autouse=True)
def _built():
    if hopper_prefill.library() is None:
        pytest.fail("the Hopper prefill kernel did not build (see the log)")


@pytest.mark.parametrize("block_order", BLOCK_ORDERS)
@pytest.mark.parametrize("heads_per_kv", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_kernel_equals_reference(heads_per_kv: int, block_size: int, block_order: str) -> None:
    """Every prefill row equals the reference; the decode rows (the decode kernel's) stay untouched.
    A tile whose blocks are a run of consecutive ids is copied with TMA as one box: in order anywhere
    (in an ascending batch, every tile but a sequence's last, which runs past its end), out of order
    (descending, shuffled) where every query row sees the whole tile. Other tiles go by a box per
    block with blocks of 64 slots (the causal diagonal's included), and are gathered with cp.async
    with smaller ones."""
    q, _, _, cache, metadata = _batch(heads_per_kv, block_size, seed=heads_per_kv * 100 + block_size,
                                      block_order=block_order)
    expected = reference_attention(q.double(), cache.double(), metadata, 128**-0.5)
    out = torch.full_like(q, float("nan"))
    layout = metadata.layout(cache)
    hopper_prefill.prefill_attention(q, cache, layout, metadata, 128**-0.5, out)
    decodes = _decode_rows(metadata)
    assert out[decodes].isnan().all(), "a decode row was written"
    prefill = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    prefill[decodes] = False
    _check(out[prefill], expected[prefill])


@pytest.mark.parametrize("pad_tokens", [2, 200])
def test_graph_padding_comes_out_zero(pad_tokens: int) -> None:
    """A mixed graph's padding, which an eager warm-up before a capture runs too: its tokens form a
    sequence of length 0 (negative positions, no keys), then empty sequences. They come out zero,
    and the real rows still equal the reference. (One padding token would be a decode: the decode
    kernel's.)"""
    q, _, _, cache, metadata = _batch(2, 16, seed=pad_tokens)
    expected = reference_attention(q.double(), cache.double(), metadata, 128**-0.5)
    num_tokens = q.shape[0]
    padded = with_graph_padding(metadata, num_tokens, pad_tokens)
    padded_q = torch.cat([q, torch.randn_like(q[:1]).expand(pad_tokens, -1, -1)])
    out = torch.full_like(padded_q, float("nan"))
    hopper_prefill.prefill_attention(padded_q, cache, metadata.layout(cache), padded, 128**-0.5, out)
    assert torch.equal(out[num_tokens:], torch.zeros_like(out[num_tokens:]))
    decodes = _decode_rows(metadata)
    prefill = torch.ones(num_tokens, dtype=torch.bool, device=q.device)
    prefill[decodes] = False
    _check(out[:num_tokens][prefill], expected[prefill])


def test_takes_decodes_when_told() -> None:
    """split_decodes False: no decode kernel runs, so the one-token sequences are this kernel's too."""
    q, _, _, cache, metadata = _batch(2, 16, seed=7)
    metadata = dataclasses.replace(metadata, split_decodes=False)
    expected = reference_attention(q.double(), cache.double(), metadata, 128**-0.5)
    out = torch.full_like(q, float("nan"))
    hopper_prefill.prefill_attention(q, cache, metadata.layout(cache), metadata, 128**-0.5, out)
    _check(out, expected)


def _one_sequence_reference(q, cache, metadata, rows, block_size):
    """Attention of the given rows of a one-sequence step, in float64, from its whole context."""
    seq_len = int(metadata.seq_lens[0])
    context = seq_len - q.shape[0]
    positions = torch.arange(seq_len, device=q.device)
    slots = metadata.block_tables[0, positions // block_size].long() * block_size + positions % block_size
    keys = cache[0].flatten(0, 1)[slots].double()  # [seq_len, kv_heads, dim]
    values = cache[1].flatten(0, 1)[slots].double()
    heads_per_kv = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(heads_per_kv, 1), values.repeat_interleave(heads_per_kv, 1)
    scores = torch.einsum("rhd,khd->rhk", q[rows].double(), keys) * 128**-0.5
    hidden = positions[None, :] > (context + rows)[:, None]
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    return torch.einsum("rhk,khd->rhd", scores.softmax(-1), values)


def test_long_prompt_and_chunk_after_it() -> None:
    """A 16k-token prompt, then an 8k-token chunk after 24k cached, in each way blocks lie and with
    blocks of 16 (gathered where scattered) and 64 (a box per block): rows far from the first keys
    (checked on a sample of rows, the first and last among them)."""
    for cases, block_order, block_size in (([(0, 16384)], "scattered", 16), ([(0, 16384)], "ascending", 16),
                                           ([(0, 16384)], "descending", 16), ([(24576, 8192)], "ascending", 16),
                                           ([(24576, 8192)], "shuffled", 16), ([(0, 16384)], "scattered", 64),
                                           ([(24576, 8192)], "scattered", 64)):
        q, _, _, cache, metadata = _batch(2, block_size, seed=cases[0][0] + len(block_order) + block_size,
                                          cases=cases, block_order=block_order)
        out = torch.full_like(q, float("nan"))
        hopper_prefill.prefill_attention(q, cache, metadata.layout(cache), metadata, 128**-0.5, out)
        assert not out.isnan().any()
        rows = torch.cat([torch.arange(0, q.shape[0], 61, device=q.device),
                          torch.tensor([q.shape[0] - 1], device=q.device)])
        _check(out[rows], _one_sequence_reference(q, cache, metadata, rows, block_size))


def test_paged_attention_takes_it_for_big_steps_with_a_long_sequence(monkeypatch) -> None:
    """paged_attention sends a step of MIN_TOKENS or more with a sequence of MIN_SEQ_LEN or more to
    the kernel (its decodes to the decode kernel), and others to Triton; both agree with the reference."""
    q, k, v, cache, metadata = _batch(2, 16, seed=3, cases=CASES + [(8000, 300)])
    assert q.shape[0] >= hopper_prefill.MIN_TOKENS and metadata.max_seq_len >= hopper_prefill.MIN_SEQ_LEN
    expected = reference_attention(q.double(), cache.double(), metadata, 128**-0.5)
    calls = []
    original = hopper_prefill.prefill_attention
    monkeypatch.setattr(hopper_prefill, "prefill_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    out = paged_attention(q, cache, metadata, 128**-0.5, key=k, value=v)
    assert calls, "the step did not reach the Hopper kernel"
    _check(out, expected)
    for name, value in (("MIN_TOKENS", q.shape[0] + 1), ("MIN_SEQ_LEN", metadata.max_seq_len + 1)):
        with monkeypatch.context() as patch:
            patch.setattr(hopper_prefill, name, value)
            calls.clear()
            triton_out = paged_attention(q, cache, metadata, 128**-0.5, key=k, value=v)
            assert not calls
            _check(triton_out, expected)


def test_refuses_what_it_does_not_serve() -> None:
    q, _, _, cache, metadata = _batch(2, 16, seed=5, cases=CASES + [(8000, 300)])
    layout = metadata.layout(cache)
    assert hopper_prefill.supports(q, layout, metadata)
    assert not hopper_prefill.supports(q[: hopper_prefill.MIN_TOKENS - 1], layout, metadata)
    assert not hopper_prefill.supports(q, layout, dataclasses.replace(metadata, max_seq_len=hopper_prefill.MIN_SEQ_LEN - 1))
    scattered = dataclasses.replace(metadata, tma_share=hopper_prefill.MIN_TMA_SHARE / 2)
    assert not hopper_prefill.supports(q, layout, scattered)  # the gather: at or below Triton's speed
    assert not hopper_prefill.supports(q.float(), layout, metadata)
    assert not hopper_prefill.supports(q, dataclasses.replace(layout, block_size=7), metadata)
    assert not hopper_prefill.supports(q, dataclasses.replace(layout, head_dim=64), metadata)
    assert not hopper_prefill.supports(q, dataclasses.replace(layout, fp8=True), metadata)


def _long_prompt_first_logprobs(model_dir: str, monkeypatch, hopper: bool, **engine_kwargs) -> dict:
    """The first token's top-20 log-probabilities after a 9,000-token prompt in chunks of 4,096 (the
    second chunk, with a sequence of 8,192, is a step the kernel takes), bf16."""
    from minivllm import LLM, SamplingParams

    prompt = {"prompt_token_ids": [(11 * j) % 500 + 1 for j in range(9000)]}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=20)
    monkeypatch.setenv("MINIVLLM_HOPPER_PREFILL", "1" if hopper else "0")
    with LLM(model_dir, device="cuda", dtype="bfloat16", max_model_len=10000, max_num_seqs=4,
             max_num_batched_tokens=4096, **engine_kwargs) as llm:
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].logprobs[0]


def _assert_close(hopper: dict, triton: dict) -> None:
    shared = set(hopper) & set(triton)
    assert len(shared) >= 15
    worst = max(abs(hopper[t].logprob - triton[t].logprob) for t in shared)
    assert worst < 0.1, f"first-token log-probabilities differ by up to {worst:.3f}"


def _long_prompt_model(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                              max_position_embeddings=12000)


def test_engine_long_prompt_close_to_triton(tiny_model_factory, monkeypatch) -> None:
    """A 9,000-token prompt in chunks of 4,096 through the engine in bfloat16: the chunk with a
    long sequence runs eagerly on the Hopper kernel, the others in graphs on Triton. The first
    token's log-probabilities are within bfloat16's noise of an engine that keeps Triton throughout."""
    model_dir = _long_prompt_model(tiny_model_factory)
    _assert_close(_long_prompt_first_logprobs(model_dir, monkeypatch, hopper=True),
                  _long_prompt_first_logprobs(model_dir, monkeypatch, hopper=False))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensor_parallel_ranks_run_it(tiny_model_factory, monkeypatch) -> None:
    """Tensor parallel over 2 GPUs: each rank builds and launches the kernel on its own device (the
    library brings its own CUDA runtime, which must use torch's current device, context and
    stream), one KV head each. The first token's log-probabilities are within bfloat16's noise of
    one GPU on Triton."""
    model_dir = _long_prompt_model(tiny_model_factory)
    _assert_close(_long_prompt_first_logprobs(model_dir, monkeypatch, hopper=True, tensor_parallel_size=2),
                  _long_prompt_first_logprobs(model_dir, monkeypatch, hopper=False))
