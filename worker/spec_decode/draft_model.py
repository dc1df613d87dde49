"""Draft-model proposer: a smaller model of the same family, in the same worker, with its own
paged KV cache.

Its cache has its own tensors but the target's block ids and slots: a token's draft K/V lives at
the very slot its target K/V does, so the scheduler's block tables, prefix-cache hits and
preemptions serve both caches at once. To keep it complete the draft runs every step's tokens
right after the target does (the catch-up forward: prompt chunks, verified drafts and all).
Then, for each request that sampled, it proposes k tokens greedily, one batched single-token
forward per draft, writing their K/V into the lookahead slots the scheduler allocated past the
step (see Scheduler.num_lookahead_tokens). Greedy drafts are one-hot, which the verification of
rejection_sampler.verify_against_samples keeps exact for sampled requests too.

Runs eagerly (no CUDA graphs); overlapped outputs are off with a draft model (every step's input
ids must be on the host for the catch-up forward).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from minivllm.protocol.config import EngineConfig
from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.input_batch import StepInputs
from minivllm.worker.models.loader import describe, load_model

if TYPE_CHECKING:
    from minivllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class DraftModelRunner:
    def __init__(self, config: EngineConfig, runner: "ModelRunner") -> None:
        from minivllm.worker.model_runner import default_backend

        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        self.runner = runner
        self.device = runner.device
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        draft_config = msgspec.structs.replace(config, model=spec.model, tokenizer=spec.model, speculative_config=None)
        self.model = load_model(draft_config, self.device, runner.dtype, attn_backend=default_backend(self.device))
        logger.info("draft model loaded: %s", describe(self.model))
        self.kv_layout = KVCacheLayout(config.block_size, self.model.num_kv_heads, self.model.head_dim, runner.dtype,
                                       fp8=config.kv_cache_dtype != "auto")
        self.kv_caches: list[torch.Tensor] = []
        runner.overlap_outputs = False

    def kv_cache_bytes_per_block(self) -> int:
        return 2 * self.kv_layout.block_bytes * self.model.num_layers

    def initialize_cache(self, num_blocks: int) -> None:
        self.kv_caches = [self.kv_layout.allocate(num_blocks, self.device) for _ in range(self.model.num_layers)]

    def _metadata(self, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray,
                  slot_mapping: np.ndarray, max_query_len: int) -> AttentionMetadata:
        to = lambda array, dtype=None: torch.from_numpy(  # noqa: E731
            array if dtype is None else array.astype(dtype)).to(self.device, non_blocking=True)
        return AttentionMetadata(
            query_start_loc=to(query_start_loc, np.int32), seq_lens=to(seq_lens, np.int32),
            block_tables=to(np.ascontiguousarray(block_table)), slot_mapping=to(slot_mapping, np.int64),
            max_query_len=max_query_len, max_seq_len=int(seq_lens.max()), kv_layout=self.kv_layout)

    @torch.inference_mode()
    def catch_up(self, step: StepInputs) -> None:
        """Run this step's tokens through the draft model too (only its KV is kept)."""
        if not self.kv_caches:
            return
        metadata = self._metadata(step.query_start_loc, step.seq_lens, step.block_table, step.slot_mapping,
                                  step.max_query_len)
        input_ids = torch.from_numpy(step.input_ids).to(self.device, non_blocking=True)
        positions = torch.from_numpy(step.positions).to(self.device, non_blocking=True)
        self.model(input_ids, positions, self.kv_caches, metadata)

    @torch.inference_mode()
    def propose(self, step: StepInputs, rows: np.ndarray) -> list[list[int]]:
        """k greedy drafts for each of `rows` (after their known tokens, as the batch has them
        now), fewer where the request's blocks or max_model_len leave no room."""
        batch = self.runner.input_batch
        num_tokens = batch.num_tokens[rows]
        # Draft j (0-based) is predicted from the token at position num_tokens - 1 + j, whose K/V
        # goes to that position's slot: only slots inside the request's blocks may be written.
        capacity = batch.num_blocks[rows] * self.block_size - (num_tokens - 1)
        budget = np.minimum(np.minimum(capacity, self.max_model_len - num_tokens - 1), self.k)
        budget[~batch.can_speculate[rows]] = 0
        proposals: list[list[int]] = [[] for _ in rows]
        active = np.flatnonzero(budget > 0)
        last_tokens = batch.token_ids[rows[active], num_tokens[active] - 1]
        for j in range(self.k):
            active_keep = budget[active] > j
            active, last_tokens = active[active_keep], last_tokens[active_keep]
            if not len(active):
                break
            active_rows = rows[active]
            positions = num_tokens[active] - 1 + j
            slot_mapping = (batch.block_table[active_rows, positions // self.block_size].astype(np.int64)
                            * self.block_size + positions % self.block_size)
            seq_lens = positions + 1
            num_columns = -(-int(seq_lens.max()) // self.block_size)
            metadata = self._metadata(np.arange(len(active) + 1), seq_lens, batch.block_table[active_rows, :num_columns],
                                      slot_mapping, 1)
            hidden = self.model(torch.from_numpy(np.ascontiguousarray(last_tokens)).to(self.device),
                                torch.from_numpy(positions).to(self.device), self.kv_caches, metadata)
            drafts = self.model.compute_logits(hidden).argmax(dim=-1).cpu().numpy()
            for i, token in zip(active.tolist(), drafts.tolist()):
                proposals[i].append(token)
            last_tokens = drafts
        return proposals
