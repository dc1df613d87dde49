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

On CUDA both forwards replay CUDA graphs of the draft model's own (worker/cuda_graphs.py: the
target's buckets, verify ones included), and the k drafts stay on the device between the draft
steps: one device->host copy per step brings all of them over. A step that proposes is
synchronous (its tokens must be on the host to draft from); the others keep overlapped outputs,
the catch-up taking its input ids still on the device from there, as the target's forward does.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from minivllm.protocol.config import EngineConfig
from minivllm.worker import ops
from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.cuda_graphs import PatchInputIds, StepBuffers, StepGraphs, run_forward
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
        draft_config = msgspec.structs.replace(config, model=spec.model, tokenizer=spec.model, speculative_config=None,
                                              hf_config=None)  # (the target's; the draft reads its own)
        self.model = load_model(draft_config, self.device, runner.dtype, attn_backend=default_backend(self.device))
        logger.info("draft model loaded: %s", describe(self.model))
        self.kv_layout = KVCacheLayout(config.block_size, self.model.num_kv_heads, self.model.head_dim, runner.dtype,
                                       fp8=config.kv_cache_dtype != "auto")
        self.kv_caches: list[torch.Tensor] = []
        self.config = config
        self.buffers: StepBuffers | None = None  # CUDA: persistent inputs of its own (its own KV layout)
        if runner.buffers is not None:
            self.buffers = StepBuffers(runner.buffers.max_tokens, config.max_num_seqs,
                                       runner.input_batch.max_blocks_per_req, self.device)
            self.buffers.kv_layout = self.kv_layout
        self.graphs: StepGraphs | None = None

    def kv_cache_bytes_per_block(self) -> int:
        return 2 * self.kv_layout.block_bytes * self.model.num_layers

    def initialize_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.kv_layout.allocate_layers(self.model.num_layers, num_blocks, self.device)
        config = self.config
        if self.buffers is not None and not config.enforce_eager:
            with torch.inference_mode():
                self.graphs = StepGraphs(self._forward, self.buffers, config.max_num_seqs,
                                         config.max_num_batched_tokens, config.max_model_len,
                                         verify_query_len=self.k + 1,
                                         max_verify_seqs=config.speculative_config.max_speculating_batch)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, metadata)

    def _run(self, step: StepInputs, patch_input_ids: PatchInputIds | None) -> torch.Tensor:
        """The draft model's hidden states over a step (see run_forward for patch_input_ids)."""
        return run_forward(self._forward, step, self.buffers, self.graphs, self.kv_layout, patch_input_ids)

    @torch.inference_mode()
    def catch_up(self, step: StepInputs) -> None:
        """Run this step's tokens through the draft model too (only its KV is kept). Input ids the
        host does not have yet (overlapped outputs) come from the device, as for the target."""
        if self.kv_caches:
            self._run(step, self.runner._patch_pending_inputs)

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
        # The drafts stay on the device from one draft step to the next (the input ids of the next).
        last_tokens = torch.from_numpy(batch.token_ids[rows[active], num_tokens[active] - 1]).to(self.device)
        steps: list[tuple[np.ndarray, torch.Tensor]] = []  # (the requests drafting, their drafts) per step
        for j in range(self.k):
            keep = budget[active] > j
            if not keep.all():
                active = active[keep]
                last_tokens = last_tokens[torch.from_numpy(np.flatnonzero(keep)).to(self.device)]
            if not len(active):
                break
            active_rows = rows[active]
            positions = num_tokens[active] - 1 + j
            seq_lens = positions + 1
            num_columns = -(-int(seq_lens.max()) // self.block_size)
            step = StepInputs(
                req_ids=[""] * len(active), input_ids=np.zeros(len(active), dtype=np.int64), positions=positions,
                slot_mapping=(batch.block_table[active_rows, positions // self.block_size].astype(np.int64)
                              * self.block_size + positions % self.block_size),
                query_start_loc=np.arange(len(active) + 1), seq_lens=seq_lens,
                block_table=batch.block_table[active_rows, :num_columns], logits_indices=np.arange(len(active)),
                sampling_req_index=np.arange(len(active)), sampling_rows=active_rows, max_query_len=1,
                max_seq_len=int(seq_lens.max()))
            hidden = self._run(step, lambda input_ids, _index, _source, drafts=last_tokens: input_ids.copy_(drafts))
            last_tokens = ops.argmax(self.model.compute_logits(hidden))
            steps.append((active, last_tokens))
        if steps:
            drafts = torch.cat([tokens for _, tokens in steps]).tolist()  # the one device->host sync
            at = 0
            for drafting, _ in steps:
                for i, token in zip(drafting.tolist(), drafts[at:at + len(drafting)]):
                    proposals[i].append(token)
                at += len(drafting)
        return proposals
