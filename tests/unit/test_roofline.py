"""The throughput floor of frontend/roofline.py, checked against sums done by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from minivllm.frontend.roofline import DeviceCeilings, ModelShape, workload_floor

# 1 layer, 2 heads of dim 4, 1 KV head; 100 matmul weights of 2 bytes; K/V 2 * 1 * 4 * 2 = 16 B/token.
SHAPE = ModelShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, matmul_params=100, dtype_bytes=2,
                   kv_dtype_bytes=2)
QWEN3_CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3-0.6b"
CEILINGS = DeviceCeilings("test", bandwidth_bytes_per_s=1000.0, matmul_flops_per_s=10_000.0)


def test_all_requests_fit_at_once() -> None:
    floor = workload_floor(SHAPE, CEILINGS, input_lens=[3, 5], output_lens=[2, 4], max_num_seqs=8)
    # prefill: 2 * 100 * 8 tokens + attention 4 * 1 * 2 * 4 * (3*4/2 + 5*6/2) = 1600 + 672 FLOPs
    assert floor.prefill_s == pytest.approx((1600 + 672) / 10_000)
    # decode: 4 steps of 200 weight bytes; K/V read: request 0 reads 3 + 4 tokens, request 1 5+6+7+8.
    assert floor.num_decode_steps == 4
    assert floor.decode_s == pytest.approx((4 * 200 + (7 + 26) * 16) / 1000)
    assert floor.output_tokens == 6
    assert floor.output_tokens_per_s == pytest.approx(6 / (floor.prefill_s + floor.decode_s))


def test_requests_wait_for_a_seat() -> None:
    # One seat: the second request starts when the first is done, so the steps add up.
    floor = workload_floor(SHAPE, CEILINGS, input_lens=[3, 5], output_lens=[2, 4], max_num_seqs=1)
    assert floor.num_decode_steps == 6
    assert floor.decode_s == pytest.approx((6 * 200 + (7 + 26) * 16) / 1000)
    # Three requests, two seats: the third takes the seat of the one finishing first (step 2).
    floor = workload_floor(SHAPE, CEILINGS, input_lens=[1, 1, 1], output_lens=[5, 2, 4], max_num_seqs=2)
    assert floor.num_decode_steps == 6


def test_qwen3_shape_counts_its_weights() -> None:
    shape = ModelShape.from_model_dir(str(QWEN3_CONFIG), dtype_bytes=2)
    # 28 layers * (q 1024x2048 + k,v 1024x1024 + o 2048x1024 + MLP 3 * 1024x3072) + LM head 151936x1024
    assert shape.matmul_params == 28 * (2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072) + 151936 * 1024
    assert shape.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2


def test_a_step_takes_the_slower_of_its_bytes_and_its_flops() -> None:
    slow_compute = DeviceCeilings("test", bandwidth_bytes_per_s=1e9, matmul_flops_per_s=1000.0)
    floor = workload_floor(SHAPE, slow_compute, input_lens=[3], output_lens=[2], max_num_seqs=8)
    # two steps of one request: 2 * 100 weight FLOPs + 4 * 1 * 2 * 4 * (3, then 4) context FLOPs
    assert floor.decode_s == pytest.approx((200 + 32 * 3 + 200 + 32 * 4) / 1000.0)
