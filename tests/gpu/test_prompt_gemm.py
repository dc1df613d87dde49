"""gate|up with SiLU-and-mul in one Triton kernel for prompt steps (worker/prompt_gemm.py): against
what it replaces (F.linear then ops.silu_and_mul) and an fp64 reference, at ragged sizes, and as
the MLP takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs a Hopper GPU (compute capability 9.0)")


def _inputs(rows: int, intermediate: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(2 * intermediate, hidden, device="cuda", generator=gen) / hidden**0.5).to(torch.bfloat16)
    return x, weight


@pytest.mark.parametrize("rows,intermediate,hidden", [
    (16384, 3072, 1024),  # Qwen3-0.6B's MLP in a full prompt step
    (2693, 3072, 1024),  # the 256-request workload's last prompt step
    (2048, 3072, 1024),  # MIN_ROWS
    (2500, 1536, 1024),  # its TP=2 shard
    (2777, 200, 320),  # neither the features nor K a multiple of the tile: TMA's edges
    (4100, 8960, 1536),  # Qwen2-1.5B's
])
def test_matches_the_projection_then_silu_and_mul(rows: int, intermediate: int, hidden: int) -> None:
    from minivllm.worker import ops, prompt_gemm

    x, weight = _inputs(rows, intermediate, hidden, rows + intermediate)
    assert prompt_gemm.supports_silu_mul(x, weight)
    out = prompt_gemm.silu_mul_linear(x, weight)
    assert out.shape == (rows, intermediate)
    expected = ops.silu_and_mul(F.linear(x, weight))
    # Rounded the same way; the sums may run in another order than cuBLAS's, so allow a bfloat16
    # step on a few elements, and check against fp64 too.
    differs = (out != expected)
    assert differs.float().mean().item() < 0.01, differs.float().mean().item()
    assert ((out.float() - expected.float()).abs() <= 2e-2 * expected.float().abs() + 1e-3).all()
    full = x.double() @ weight.double().T
    reference = F.silu(full[:, :intermediate]) * full[:, intermediate:]
    assert ((out.double() - reference).norm() / reference.norm()).item() < 5e-3


def test_declines_what_it_does_not_serve() -> None:
    from minivllm.worker import prompt_gemm

    x, weight = _inputs(prompt_gemm.MIN_ROWS, 256, 128, 0)
    assert prompt_gemm.supports_silu_mul(x, weight)
    assert not prompt_gemm.supports_silu_mul(x[: prompt_gemm.MIN_ROWS - 1], weight)  # fewer rows
    assert not prompt_gemm.supports_silu_mul(x, weight, bias=torch.zeros(512, device="cuda", dtype=torch.bfloat16))
    assert not prompt_gemm.supports_silu_mul(x.float(), weight.float())
    assert not prompt_gemm.supports_silu_mul(x[:, 1:], weight[:, 1:])  # rows not 16-byte aligned
    assert not prompt_gemm.supports_silu_mul(x, weight[:-8])  # an intermediate size (252) not a multiple of 8


def test_the_mlp_takes_it_for_prompt_rows_and_in_a_cuda_graph() -> None:
    """ColumnParallelLinear.fuses_silu_mul routes a prompt step's rows to the kernel; captured in a
    CUDA graph (as the engine's mixed steps are) and replayed on new inputs, it gives what it gives
    eagerly."""
    from minivllm.worker import prompt_gemm
    from minivllm.worker.models.parallel_layers import ColumnParallelLinear, ShardSpec

    layer = ColumnParallelLinear(256, {"gate": ShardSpec(384, 0, 384), "up": ShardSpec(384, 0, 384)}, bias=False)
    layer = layer.to(device="cuda", dtype=torch.bfloat16)
    x, weight = _inputs(2048, 384, 256, 7)
    with torch.no_grad():
        layer.weight.copy_(weight)
    assert layer.fuses_silu_mul(x)
    eager = layer.silu_mul(x)
    assert torch.equal(eager, prompt_gemm.silu_mul_linear(x, weight))
    static_x = torch.zeros_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.silu_mul(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer.silu_mul(static_x)
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto"])
def test_a_prompt_steps_mlps_take_it_and_give_the_plain_paths_logits(tiny_model_factory, monkeypatch,
                                                                    kv_cache_dtype: str) -> None:
    """A prompt step of 2,200 tokens (three prompts) on a tiny Qwen3 takes silu_mul_linear in its
    MLPs (all but the last layer's, which runs on the three sampled rows only); that step's logits
    and the next decode step's are those of cuBLAS then silu_and_mul ($MINIVLLM_PROMPT_GEMM=0),
    within bf16 rounding."""
    from minivllm import SamplingParams
    from minivllm.protocol.config import EngineConfig
    from minivllm.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
    from minivllm.worker import prompt_gemm
    from minivllm.worker.model_runner import ModelRunner

    model_dir = tiny_model_factory("qwen3", head_dim=128, max_position_embeddings=4096)
    calls = []
    kernel = prompt_gemm.silu_mul_linear
    monkeypatch.setattr(prompt_gemm, "silu_mul_linear", lambda *args: calls.append(args[0].shape[0]) or kernel(*args))
    prompts = [[(7 * i + j) % 400 + 1 for j in range(n)] for i, n in enumerate([900, 700, 600])]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def step_logits(enabled: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(prompt_gemm, "ENABLED", enabled)
        config = EngineConfig.create(model_dir, device="cuda", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                                     num_gpu_blocks=160, max_num_batched_tokens=4096, enforce_eager=True)
        runner = ModelRunner(config)
        runner.initialize_cache(160)
        captured = []
        compute_logits = runner.model.compute_logits
        runner.model.compute_logits = lambda h: captured.append(compute_logits(h)) or captured[-1]
        first_block = [0, 57, 101]  # each prompt's blocks from here on (room for one more token)
        new = [NewRequestData(req_id=str(i), prompt_token_ids=ids, output_token_ids=[], sampling_params=greedy,
                              block_ids=list(range(first_block[i], first_block[i] + -(-(len(ids) + 1) // 16))),
                              num_computed_tokens=0) for i, ids in enumerate(prompts)]
        runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=[],
            num_scheduled_tokens={r.req_id: r.num_prompt_tokens for r in new},
            total_num_scheduled_tokens=sum(map(len, prompts)), finished_req_ids=[]))
        prompt_step = captured[-1].float()
        runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=[CachedRequestData(str(i), [], len(ids))
                                                          for i, ids in enumerate(prompts)],
            num_scheduled_tokens={str(i): 1 for i in range(3)}, total_num_scheduled_tokens=3, finished_req_ids=[]))
        return [prompt_step, captured[-1].float()]

    fused = step_logits(True)
    assert calls and set(calls) == {2200}, calls
    calls.clear()
    plain = step_logits(False)
    assert not calls
    for ours, theirs in zip(fused, plain):
        assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
