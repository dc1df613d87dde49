"""ModelRunner: keeps per-request state across steps, turns a SchedulerOutput into one packed
forward pass over the paged KV cache, and samples the next token of every request that is due.

Contract with the scheduler (see protocol/messages.py):
  1. forget finished_req_ids and preempted_req_ids;
  2. scheduled_new_reqs arrive in full (all their block ids; output_token_ids non-empty when
     resuming after a preemption); scheduled_cached_reqs bring new block ids and
     num_computed_tokens (the position before this step);
  3. each scheduled request runs its known tokens [num_computed, num_computed + num_scheduled);
     it samples iff that range reaches the end of its known tokens, and the sampled token
     becomes a known token.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from protocol.config import EngineConfig
from protocol.messages import ModelRunnerOutput, SchedulerOutput
from protocol.sampling_params import SamplingParams
from worker.attention.metadata import AttentionMetadata, kv_cache_shape
from worker.models.loader import describe, load_model
from worker.sampler import Sampler, SamplingMetadata

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KVCACHE_ENV = "MINIVLLM_CPU_KVCACHE_GB"
DEFAULT_CPU_KVCACHE_GB = 1.0
GPU_MEMORY_FRACTION = 0.9


@dataclass
class RequestState:
    """What the worker remembers about one running request between steps."""

    req_id: str
    token_ids: list[int]  # every known token: prompt + outputs so far
    block_ids: list[int]  # all its KV blocks, in order
    num_computed_tokens: int  # tokens whose K/V are in the cache
    sampling_params: SamplingParams
    generator: torch.Generator | None  # its own RNG when it has a seed


@dataclass
class ModelInputs:
    """One step's packed batch, ready for the model."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling] rows of the hidden states that sample
    sampling_req_ids: list[str]  # the requests those rows belong to, in the same order


def resolve_device(device: str, rank: int = 0) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = resolve_device(config.device, rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)

        self.model = load_model(config, self.device, self.dtype)
        logger.info("model loaded on %s (%s): %s", self.device, self.dtype, describe(self.model))

        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0

    # ------------------------------------------------------------ KV cache

    def kv_cache_bytes_per_block(self) -> int:
        """K and V, every layer, one block."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.block_size * self.model.num_kv_heads * self.model.head_dim * element_size
        return per_layer * self.model.num_layers

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit (config.num_gpu_blocks, when set, wins)."""
        if self.config.num_gpu_blocks is not None:
            return self.config.num_gpu_blocks
        bytes_per_block = self.kv_cache_bytes_per_block()
        if self.device.type == "cuda":
            # Crude: a share of what is free now that the weights are loaded (profiling comes later).
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free_bytes * GPU_MEMORY_FRACTION)
        else:
            budget = int(float(os.environ.get(CPU_KVCACHE_ENV, DEFAULT_CPU_KVCACHE_GB)) * (1 << 30))
        num_blocks = budget // bytes_per_block
        if self.device.type == "cpu":
            # More blocks than every seat filled to max_model_len can never be used; zeroing them
            # would only slow the start.
            blocks_per_seq = -(-self.config.max_model_len // self.block_size)
            num_blocks = min(num_blocks, self.config.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            raise RuntimeError(f"no room for a single KV block ({bytes_per_block} bytes; budget {budget} bytes)")
        logger.info(
            "KV cache: %d blocks of %d tokens (%d bytes per block)", num_blocks, self.block_size, bytes_per_block
        )
        return num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer (K = [0], V = [1])."""
        shape = kv_cache_shape(num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.model.num_layers)
        ]
        self.num_blocks = num_blocks

    # ------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if not self.kv_caches:
            raise RuntimeError("execute_model before initialize_cache")

        inputs = self._prepare_inputs(scheduler_output)
        hidden_states = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        if not inputs.sampling_req_ids:  # only partial prefill chunks this step
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
        states = [self.requests[req_id] for req_id in inputs.sampling_req_ids]
        sampling_metadata = SamplingMetadata.from_params(
            [s.sampling_params for s in states], [s.generator for s in states], self.device
        )
        sampled = self.sampler(logits, sampling_metadata).tolist()
        for state, token_id in zip(states, sampled):
            state.token_ids.append(token_id)
        return ModelRunnerOutput(req_ids=inputs.sampling_req_ids, sampled_token_ids=sampled)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            self.requests.pop(req_id, None)

        for new in scheduler_output.scheduled_new_reqs:
            seed = new.sampling_params.seed
            generator = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=new.sampling_params,
                generator=generator,
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        """Pack every scheduled request's tokens flat and describe the batch for attention."""
        req_ids = [r for r, n in scheduler_output.num_scheduled_tokens.items() if n > 0]
        states = [self.requests[req_id] for req_id in req_ids]
        num_reqs = len(states)

        query_lens = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        start_positions = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        seq_lens = start_positions + query_lens
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if num_tokens != scheduler_output.total_num_scheduled_tokens:
            raise ValueError(
                f"num_scheduled_tokens sums to {num_tokens}, total_num_scheduled_tokens says "
                f"{scheduler_output.total_num_scheduled_tokens}"
            )

        # Positions: for token t of request r, start_positions[r] + (t - query_start_loc[r]).
        req_index = np.repeat(np.arange(num_reqs), query_lens)
        positions = np.arange(num_tokens) - query_start_loc[req_index] + start_positions[req_index]

        input_ids = np.empty(num_tokens, dtype=np.int64)
        for i, state in enumerate(states):
            start, end = int(start_positions[i]), int(seq_lens[i])
            if end > len(state.token_ids):
                raise ValueError(
                    f"request {state.req_id}: scheduled up to token {end} but only {len(state.token_ids)} are known"
                )
            input_ids[query_start_loc[i] : query_start_loc[i + 1]] = state.token_ids[start:end]

        # Block table: only as many columns as the longest context needs; padding entries are 0
        # (masked by the attention backend).
        blocks_needed = -(-seq_lens // self.block_size)
        block_table = np.zeros((num_reqs, max(int(blocks_needed.max()), 1)), dtype=np.int32)
        for i, state in enumerate(states):
            n = int(blocks_needed[i])
            if len(state.block_ids) < n:
                raise ValueError(f"request {state.req_id}: {n} blocks needed, {len(state.block_ids)} allocated")
            block_table[i, :n] = state.block_ids[:n]

        # slot = block_ids[pos // block_size] * block_size + pos % block_size
        slot_mapping = (
            block_table[req_index, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )

        # A request samples iff this step reaches the end of its known tokens.
        num_known = np.array([len(s.token_ids) for s in states], dtype=np.int64)
        samples = seq_lens == num_known
        logits_indices = query_start_loc[1:][samples] - 1
        sampling_req_ids = [req_ids[i] for i in np.flatnonzero(samples)]

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        attn_metadata = AttentionMetadata(
            query_start_loc=to_device(query_start_loc.astype(np.int32)),
            seq_lens=to_device(seq_lens.astype(np.int32)),
            block_tables=to_device(block_table),
            slot_mapping=to_device(slot_mapping),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        # Keep state in step with the cache: these tokens' K/V are written by this forward.
        for i, state in enumerate(states):
            state.num_computed_tokens = int(seq_lens[i])
        return ModelInputs(
            input_ids=to_device(input_ids),
            positions=to_device(positions),
            attn_metadata=attn_metadata,
            logits_indices=to_device(logits_indices),
            sampling_req_ids=sampling_req_ids,
        )
