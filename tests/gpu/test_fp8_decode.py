"""The CUDA decode kernel for FP8 caches (worker/attention/fp8_decode.cu) against the reference and
against Triton's decode kernel, and the steps it leaves to Triton. Needs an H100/H200 and nvcc."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.reference import paged_attention as reference_attention

pytest.importorskip("triton", reason="needs Triton (the CUDA build of torch)")
from minivllm.worker.attention import fp8_decode  # noqa: E402
from minivllm.worker.attention.triton_attention import decode_attention  # noqa: E402
from tests.gpu import test_triton_attention  # noqa: E402
from tests.gpu.test_triton_attention import (  # noqa: E402
    LONG_DECODES,
    cache_in_layout,
    decode_metadata_with_padding,
    make_batch,
    with_graph_padding,
)

# Enough sequences for the kernel (fp8_decode.MIN_SEQS): lengths on and off block boundaries, up to 5,000.
DECODES = LONG_DECODES * 3

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the kernel is built for compute capability 9.0")


@pytest.fixture
def kernel():
    if fp8_decode.library() is None:
        pytest.skip("the FP8 decode kernel did not build here (no nvcc?)")
    yield
    fp8_decode.ENABLED = True


def fp8_batch(cases, heads_per_kv, dtype=torch.bfloat16, num_kv_heads=2, seed=0):
    q, k, v, plain_cache, plain = make_batch(cases, num_kv_heads * heads_per_kv, num_kv_heads, 128, 16, dtype,
                                             seed=seed)
    layout = KVCacheLayout(16, num_kv_heads, 128, dtype, fp8=True)
    cache = cache_in_layout(plain_cache, k, v, plain.slot_mapping, layout)
    return q, cache, layout, plain


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads_per_kv", [1, 2, 3, 8])
@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_kernel_equals_reference_and_triton(kernel, dtype, heads_per_kv, num_splits) -> None:
    """Lengths on and off block boundaries, up to 5,000 keys, padding rows (zero out), any group
    size up to 8 and split count: the kernel equals the reference within FP8's error, and Triton's
    kernel on the same cache within a rounding of the output."""
    q, cache, layout, plain = fp8_batch(DECODES, heads_per_kv, dtype, seed=heads_per_kv + num_splits)
    metadata = decode_metadata_with_padding(plain, layout)
    q = torch.cat([q, torch.randn_like(q[:2])])
    assert fp8_decode.supports(q, layout, metadata.num_seqs)
    scale = 128**-0.5
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache, metadata, scale, out=out, num_splits=num_splits)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    expected = reference_attention(q.float(), cache, metadata, scale)
    error = (out[:-2].float() - expected[:-2]).norm(dim=-1) / expected[:-2].norm(dim=-1)
    assert error.max() < 1e-2, f"relative error {error.max():.2e}"
    fp8_decode.ENABLED = False
    triton_out = decode_attention(q, cache, metadata, scale, num_splits=num_splits)
    difference = (out.float() - triton_out.float()).abs().max().item()
    assert difference < 2e-2 * expected[:-2].abs().max().item(), difference


# A step with prefill chunks (with and without a cached context) among enough decodes for the kernel.
MIXED_STEP = [(0, 37)] + LONG_DECODES + [(64, 70), (5, 200)] + LONG_DECODES + [(15, 2), (1000, 1)]


@pytest.mark.parametrize("heads_per_kv", [1, 2, 8])
@pytest.mark.parametrize("pad_tokens", [0, 1, 3])
def test_mixed_step_decodes(kernel, monkeypatch, heads_per_kv, pad_tokens) -> None:
    """A mixed step's one-token sequences (decode_attention's `mixed`) go to the kernel, which finds
    each one's query row through query_start_loc: those rows equal the reference and Triton's, the
    chunks' rows are left alone, and a CUDA graph's padding (a sequence of pad_tokens tokens and
    length 0, then empty sequences) comes out zero where it is one token."""
    q, cache, layout, plain = fp8_batch(MIXED_STEP, heads_per_kv, seed=3 + heads_per_kv)
    metadata = dataclasses.replace(plain, kv_layout=layout)
    expected = reference_attention(q.float(), cache, metadata, 128**-0.5)
    num_tokens = q.shape[0]
    if pad_tokens:
        metadata = dataclasses.replace(with_graph_padding(plain, num_tokens, pad_tokens), kv_layout=layout)
        q = torch.cat([q, torch.randn_like(q[:pad_tokens])])
    query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
    decode_rows = torch.repeat_interleave(query_lens == 1, query_lens, output_size=q.shape[0])
    real_decodes = decode_rows.clone()
    real_decodes[num_tokens:] = False
    assert fp8_decode.supports(q, layout, metadata.num_seqs)
    calls = []
    cuda_decode = fp8_decode.decode
    monkeypatch.setattr(fp8_decode, "decode", lambda *args, **kwargs: calls.append(kwargs) or cuda_decode(*args, **kwargs))
    out = torch.full_like(q, float("nan"))
    decode_attention(q, cache, metadata, 128**-0.5, out=out, mixed=True)
    assert [c.get("mixed") for c in calls] == [True]
    assert out[~decode_rows].isnan().all()
    assert torch.equal(out[decode_rows & ~real_decodes], torch.zeros_like(out[decode_rows & ~real_decodes]))
    error = (out[real_decodes].float() - expected[real_decodes[:num_tokens]]).norm(dim=-1) / \
        expected[real_decodes[:num_tokens]].norm(dim=-1)
    assert error.max() < 1e-2, f"relative error {error.max():.2e}"
    fp8_decode.ENABLED = False
    triton_out = torch.full_like(q, float("nan"))
    decode_attention(q, cache, metadata, 128**-0.5, out=triton_out, mixed=True)
    assert len(calls) == 1
    difference = (out[decode_rows].float() - triton_out[decode_rows].float()).abs().max().item()
    assert difference < 2e-2 * expected.abs().max().item(), difference


def test_many_sequences_longest_first(kernel) -> None:
    """More programs than SMs, lengths all over: the kernel takes them longest first (seq_order) and
    every row equals the reference."""
    lengths = torch.randint(1, 1500, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    q, cache, layout, plain = fp8_batch([(n, 1) for n in lengths], 2, num_kv_heads=8, seed=11)
    metadata = dataclasses.replace(plain, kv_layout=layout)
    out = decode_attention(q, cache, metadata, 128**-0.5, num_splits=1)
    expected = reference_attention(q.float(), cache, metadata, 128**-0.5)
    error = (out.float() - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < 2e-2, f"relative error {error.max():.2e}"


@pytest.mark.parametrize("num_splits", [1, 4])
def test_staggered_first_wave_changes_nothing_but_timing(kernel, monkeypatch, num_splits) -> None:
    """More CTAs than fit at once, so the first wave's heads are staggered (fp8_decode.STAGGER): the
    rows equal the reference, and bit for bit the output of the heads run in step."""
    lengths = torch.randint(1, 1500, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    q, cache, layout, plain = fp8_batch([(n, 1) for n in lengths], 2, num_kv_heads=8, seed=13)
    metadata = dataclasses.replace(plain, kv_layout=layout)
    expected = reference_attention(q.float(), cache, metadata, 128**-0.5)
    outs = {}
    for stagger in (False, True):
        monkeypatch.setattr(fp8_decode, "STAGGER", stagger)
        outs[stagger] = decode_attention(q, cache, metadata, 128**-0.5, num_splits=num_splits)
    error = (outs[True].float() - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < 2e-2, f"relative error {error.max():.2e}"
    assert torch.equal(outs[False], outs[True])


@pytest.mark.parametrize("with_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("rotary_dim", [128, 64])
def test_steps_before_rope_go_through_the_rope_kernel(kernel, with_norm, num_splits, rotary_dim) -> None:
    """decode_attention(rope=...) with the kernel: ops.norm_rope norms, rotates and stores first. The
    output and the cache left behind as test_triton_attention checks them for Triton's kernel (which
    rotates in registers)."""
    test_triton_attention.test_decode_rotating_equals_rope_kernel_then_decode(True, with_norm, num_splits, 128, rotary_dim,
                                                                              cases=DECODES)


def test_small_batches_stay_on_triton(kernel) -> None:
    """Below MIN_SEQS sequences a decode step goes to Triton's kernel (quicker there)."""
    q, _, layout, _ = fp8_batch(LONG_DECODES, 2)
    assert len(LONG_DECODES) < fp8_decode.MIN_SEQS <= len(DECODES)
    assert not fp8_decode.supports(q, layout, len(LONG_DECODES))
    assert fp8_decode.supports(q, layout, len(DECODES))


def test_steps_it_leaves_to_triton() -> None:
    """Blocks of other sizes, other head dims, groups past 8 and float32 queries stay on Triton."""
    query = torch.empty(4, 16, 128, dtype=torch.bfloat16, device="cuda")
    layout = KVCacheLayout(16, 8, 128, torch.bfloat16, fp8=True)
    assert fp8_decode.serves(query.dtype, 16, layout, query.device)
    assert not fp8_decode.serves(query.dtype, 16, dataclasses.replace(layout, fp8=False), query.device)
    assert not fp8_decode.serves(query.dtype, 16, dataclasses.replace(layout, block_size=32), query.device)
    assert not fp8_decode.serves(query.dtype, 16, dataclasses.replace(layout, head_dim=64), query.device)
    assert not fp8_decode.serves(query.dtype, 16, dataclasses.replace(layout, num_kv_heads=1), query.device)
    assert not fp8_decode.serves(torch.float32, 16, layout, query.device)


def test_a_bad_layout_is_refused(kernel) -> None:
    """Views that are not kv_cache.py's FP8 layout are refused with the strides, not read wrongly:
    here values stored transposed, [head, dim, slot] in a block (the layout before 2026-11-28)."""
    q, cache, layout, plain = fp8_batch([(40, 1)], 2)
    views = layout.split(cache)
    value = views.value
    transposed = value.as_strided(value.shape, (value.stride(0), 1, value.stride(2), layout.block_size))
    with pytest.raises(ValueError, match="FP8 layout"):
        fp8_decode.decode(q, views._replace(value=transposed), layout, dataclasses.replace(plain, kv_layout=layout),
                          0.1, torch.empty_like(q), 1, None)
