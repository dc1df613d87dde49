"""The fastest any engine could run a throughput workload on this device: its roofline floor.

Two phases, each held to the one ceiling it cannot escape (benchmarks/ROOFLINE.md derives it):

  prefill  every prompt token goes through every matmul once (2 FLOPs per weight), plus causal
           attention over the prompt (4 * heads * head_dim FLOPs per layer per visible key);
           at the device's measured matmul rate.
  decode   each step reads every weight once, plus the K/V of every running request's context,
           at the device's measured memory bandwidth -- or, where that is sooner done, multiplies
           every running request's token through the weights and its context at the matmul rate
           (on a GPU decode is bandwidth-bound; on a CPU it can be compute-bound). Requests run
           max_num_seqs at a time; one leaves when it has its output tokens and the next waiting
           one takes its seat.

floor = prefill time + decode time; the output tokens over it is the limit on output tok/s.
Both ceilings are measured here (a large device-to-device copy, a large matmul), not datasheet
figures. Embedding lookups, norms, sampling and the output logits of prompt tokens are left out:
the floor is a little optimistic, never pessimistic.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    matmul_params: int  # every projection's weights plus the LM head: what a token multiplies through
    dtype_bytes: int
    kv_dtype_bytes: int

    @classmethod
    def from_model_dir(cls, model: str, dtype_bytes: int, kv_dtype_bytes: int | None = None) -> "ModelShape":
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model)
        hidden, layers = c.hidden_size, c.num_hidden_layers
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or hidden // heads
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
        mlp = 3 * hidden * c.intermediate_size  # gate, up, down
        matmul_params = layers * (attention + mlp) + c.vocab_size * hidden
        return cls(layers, heads, kv_heads, head_dim, matmul_params, dtype_bytes, kv_dtype_bytes or dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes


@dataclass
class DeviceCeilings:
    device: str
    bandwidth_bytes_per_s: float  # bytes read + written per second by a large copy
    matmul_flops_per_s: float  # a large matmul in the engine's dtype


@dataclass
class Floor:
    prefill_s: float
    decode_s: float
    num_decode_steps: int
    output_tokens: int

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self) -> dict:
        return {**asdict(self), "seconds": self.seconds, "output_tokens_per_s": self.output_tokens_per_s}


def workload_floor(shape: ModelShape, ceilings: DeviceCeilings, input_lens: list[int], output_lens: list[int],
                   max_num_seqs: int) -> Floor:
    prompt = np.asarray(input_lens, dtype=np.float64)
    matmul_flops = 2.0 * shape.matmul_params * prompt.sum()
    # Prompt token p (0-based) sees p + 1 keys: QK^T and PV are 2 FLOPs per key per head dim each.
    attention_flops = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * (prompt * (prompt + 1) / 2).sum()
    prefill_s = float(matmul_flops + attention_flops) / ceilings.matmul_flops_per_s

    # Decode steps, requests taking seats in arrival order as earlier ones finish.
    running: list[int] = []  # the steps at which the requests holding a seat finish (a heap)
    start_step = np.zeros(len(input_lens), dtype=np.int64)
    step = 0
    for i, num_outputs in enumerate(output_lens):
        if len(running) >= max_num_seqs:
            step = heapq.heappop(running)  # the next seat frees up then
        start_step[i] = step
        heapq.heappush(running, step + num_outputs)
    outputs = np.asarray(output_lens, dtype=np.int64)
    num_steps = int((start_step + outputs).max(initial=0))
    # Per step t: the requests running, and the K/V tokens they read. A request that started at
    # step s reads p + (t - s) tokens in step t, so the sum over running requests is
    # sum(p - s) + t * count: two running sums over start/end events.
    count = np.zeros(num_steps + 1)
    offset = np.zeros(num_steps + 1)
    np.add.at(count, start_step, 1)
    np.add.at(count, start_step + outputs, -1)
    np.add.at(offset, start_step, prompt - start_step)
    np.add.at(offset, start_step + outputs, -(prompt - start_step))
    running_reqs = np.cumsum(count)[:num_steps]
    kv_tokens = np.cumsum(offset)[:num_steps] + np.arange(num_steps) * running_reqs
    # Each step reads every weight once and the running requests' K/V, and multiplies each running
    # request's token through the weights and over its context: whichever ceiling is hit first.
    step_bytes = shape.matmul_params * shape.dtype_bytes + kv_tokens * shape.kv_bytes_per_token
    step_flops = (2.0 * shape.matmul_params * running_reqs
                  + 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * kv_tokens)
    decode_s = float(np.maximum(step_bytes / ceilings.bandwidth_bytes_per_s,
                                step_flops / ceilings.matmul_flops_per_s).sum())
    return Floor(prefill_s, decode_s, num_steps, int(sum(output_lens)))


def measure_ceilings(device: str, dtype: str) -> DeviceCeilings:
    """Time a large copy and a large matmul on `device` ("cuda" or "cpu") in `dtype` (medians)."""
    import torch

    torch_dtype = getattr(torch, dtype)
    if device == "cuda":
        import triton.testing

        nbytes, n = 1 << 30, 8192
        src = torch.randn(nbytes // 4, device="cuda")
        dst = torch.empty_like(src)
        a = torch.randn(n, n, device="cuda", dtype=torch_dtype)
        b = torch.randn(n, n, device="cuda", dtype=torch_dtype)
        copy_s = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1000
        matmul_s = triton.testing.do_bench(lambda: a @ b, return_mode="median") / 1000
        name = torch.cuda.get_device_name()
        del src, dst, a, b
        torch.cuda.empty_cache()
    else:
        from minivllm.worker import cpu_gemm

        nbytes, n = 1 << 28, 2048
        src = torch.randn(nbytes // 4)
        dst = torch.empty_like(src)
        a = torch.randn(n, n, dtype=torch_dtype)
        weight = torch.randn(n, n, dtype=torch_dtype)
        if cpu_gemm.packs(weight):  # what the engine runs its matmuls on
            packed = cpu_gemm.pack(weight)
            matmul = lambda: cpu_gemm.linear(a, packed, None)  # noqa: E731
        else:
            matmul = lambda: a @ weight  # noqa: E731
        copy_s, matmul_s = _median_seconds(lambda: dst.copy_(src)), _median_seconds(matmul)
        name = f"cpu ({torch.get_num_threads()} threads)"
    return DeviceCeilings(name, 2 * nbytes / copy_s, 2 * n**3 / matmul_s)


def _median_seconds(fn, reps: int = 5) -> float:
    """Host-timed median of `reps` calls after a warm-up one (CPU work, which is synchronous)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))
