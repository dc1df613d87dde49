"""Pipeline parallelism, the worker's side: one stage of the layers (see worker/distributed.py for
the ranks and the layer split, worker/models/llama.py for what a stage builds).

Every stage receives the same SchedulerOutput and keeps the same persistent batch (positions, slot
mappings, block tables), so only activations travel between stages:

    stage 0: embed -> its layers -> isend (hidden, residual) ──▶ stage 1: recv -> its layers -> ...
    ... last stage: its layers -> norm -> LM head -> sample -> tokens to the EngineCore

The EngineCore keeps up to pipeline_parallel_size batches in flight, so stage 0 already runs batch
B + 1 while stage 1 runs batch B; sends are asynchronous for that reason. Only the last stage
samples, so the scheduler sends the others the tokens each step runs (CachedRequestData.
new_token_ids) and apply_new_token_ids makes them known tokens of the persistent batch.

On CUDA a stage's layers run as CUDA graphs like a single worker's (unless enforce_eager): the
received activations are copied into a persistent buffer the graphs read by address, and the
sends copy the graphs' outputs out. Eager, a stage's step costs the CPU time of launching its
kernels (on the Qwen3-8B shape, 2x H200: PP=2 made 11,139 output tok/s eager, 13,222 as graphs).

With pipeline_parallel_size 1 nothing here is used: ModelRunner.stage is None.
"""

from __future__ import annotations

import numpy as np
import torch
from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import CachedRequestData
from minivllm.worker.cuda_graphs import max_step_tokens
from minivllm.worker.distributed import (
    get_pp_rank,
    get_pp_world_size,
    get_stage_rank,
    is_first_stage,
    is_last_stage,
)
from minivllm.worker.input_batch import InputBatch


class PipelineStage:
    """This worker's stage: receives the previous stage's activations, runs its layers, sends them
    on (or, on the last stage, returns the final hidden states for sampling).

    Sends are isend; a send's buffer is kept until it completed, and at most `max_sends` are
    outstanding (the EngineCore has at most pp batches in flight anyway)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, max_tokens: int,
                 max_sends: int = 2) -> None:
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.pp_rank, self.pp_size = get_pp_rank(), get_pp_world_size()
        self.is_first, self.is_last = is_first_stage(), is_last_stage()
        self.prev_rank = None if self.is_first else get_stage_rank(self.pp_rank - 1)
        self.next_rank = None if self.is_last else get_stage_rank(self.pp_rank + 1)
        self.max_sends = max_sends
        self.sends: list[tuple[torch.distributed.Work, torch.Tensor]] = []
        self.num_sent = self.num_received = 0
        # The previous stage's (hidden states, residual) for the step being run: persistent, so
        # graphs captured over it read each step's (zeros: padding rows stay finite).
        self.inputs = None if self.is_first else torch.zeros((2, max_tokens, hidden_size), dtype=dtype, device=device)

    def receive(self, num_tokens: int) -> None:
        """Before a step's forward: the previous stage's activations into the persistent inputs."""
        if not self.is_first:
            self.inputs[:, :num_tokens].copy_(self.recv(num_tokens))

    def intermediate(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the model's forward takes from the previous stage (None on the first)."""
        return None if self.is_first else (self.inputs[0, :num_tokens], self.inputs[1, :num_tokens])

    def finish(self, out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        """After a step's forward: the final hidden states on the last stage; the others send
        their (hidden states, residual) on and return None."""
        if self.is_last:
            return out
        self.send(*out)
        return None

    def send(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> None:
        import torch.distributed as dist

        payload = torch.stack((hidden_states, residual))  # one message per step
        self.sends.append((dist.isend(payload, dst=self.next_rank), payload))
        self.num_sent += 1
        while len(self.sends) > self.max_sends:
            self.sends.pop(0)[0].wait()

    def recv(self, num_tokens: int) -> torch.Tensor:
        """The previous stage's [2, num_tokens, hidden_size]: hidden states, residual."""
        import torch.distributed as dist

        payload = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(payload, src=self.prev_rank)
        self.num_received += 1
        return payload

    def profile_forward(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                        kv_caches: list[torch.Tensor], metadata) -> torch.Tensor | None:
        """A step of this stage alone, for the memory profile: the previous stage's activations are
        stand-in zeros and nothing is sent (the stages profile at the same time, not in lockstep)."""
        intermediate = None
        if not self.is_first:
            zeros = torch.zeros((input_ids.shape[0], self.hidden_size), dtype=self.dtype, device=self.device)
            intermediate = (zeros, zeros.clone())
        out = model(input_ids, positions, kv_caches, metadata, intermediate)
        return out if self.is_last else None


def make_pipeline_stage(config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype,
                        device: torch.device) -> PipelineStage | None:
    if config.pipeline_parallel_size == 1:
        return None
    return PipelineStage(model.config.hidden_size, dtype, device, max_step_tokens(config))


def apply_new_token_ids(batch: InputBatch, cached: CachedRequestData) -> None:
    """Tokens this step runs for a request the worker holds, as the scheduler sent them: the ones
    past what this stage knows become known tokens (a stage other than the last never samples, so
    this is how it learns the previous step's token). Idempotent: the last stage, which sampled
    the token itself, finds nothing new."""
    if not cached.new_token_ids:
        return
    row = batch.row_of[cached.req_id]
    # The scheduler sends the step's range past the prompt (the prompt is known from the start).
    start = max(cached.num_computed_tokens, int(batch.num_prompt_tokens[row]))
    end = start + len(cached.new_token_ids)
    known = int(batch.num_tokens[row])
    if end > known:
        if known < start:
            raise RuntimeError(f"request {cached.req_id}: tokens [{known}, {start}) never reached this stage")
        batch.token_ids[row, known:end] = np.asarray(cached.new_token_ids[known - start:], dtype=np.int64)
        batch.num_tokens[row] = end
