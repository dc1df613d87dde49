"""The worker's half of speculative decoding: sample a step that verifies drafts, and propose the
drafts of the next step.

ModelRunner hands a step here (instead of to its ordinary sampling) when the step verifies drafts
or must propose new ones. Rows with drafts never ask for logprobs or logits processors (the
scheduler gives drafts only to requests that can speculate), but rows without drafts in the same
step may, and get them as in the ordinary path.

A step that proposes is synchronous on CUDA: the proposer needs the sampled tokens on the host (so
overlapped outputs are off for such steps; steps while speculation steps aside keep them).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import ModelRunnerOutput
from minivllm.worker.input_batch import StepInputs
from minivllm.worker.logits_processors import apply_logits_processors
from minivllm.worker.logprobs import sampled_logprobs
from minivllm.worker.sampler import SamplingMetadata, position_seed
from minivllm.worker.spec_decode.ngram_proposer import NgramProposer
from minivllm.worker.spec_decode.rejection_sampler import verify_against_samples

if TYPE_CHECKING:
    from minivllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class SpecDecoder:
    def __init__(self, config: EngineConfig, runner: "ModelRunner") -> None:
        spec = config.speculative_config
        assert spec is not None
        self.k = spec.num_speculative_tokens
        self.max_model_len = config.max_model_len
        self.draft_runner = None
        if spec.method == "ngram":
            self.ngram = NgramProposer(self.k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            from minivllm.worker.spec_decode.draft_model import DraftModelRunner

            self.ngram = None
            self.draft_runner = DraftModelRunner(config, runner)

    def kv_cache_bytes_per_block(self) -> int:
        return self.draft_runner.kv_cache_bytes_per_block() if self.draft_runner is not None else 0

    def initialize_cache(self, num_blocks: int) -> None:
        if self.draft_runner is not None:
            self.draft_runner.initialize_cache(num_blocks)

    def after_forward(self, step: StepInputs) -> None:
        if self.draft_runner is not None:
            self.draft_runner.catch_up(step)

    def handles(self, step: StepInputs, propose_drafts: bool) -> bool:
        return step.num_draft_tokens is not None or propose_drafts

    # ------------------------------------------------------------ sampling with drafts

    @torch.no_grad()
    def sample(self, runner: "ModelRunner", hidden_states: torch.Tensor, step: StepInputs,
               prompt_logprobs: dict, propose_drafts: bool) -> ModelRunnerOutput:
        batch = runner.input_batch
        device = runner.device
        rows = step.sampling_rows
        num_drafts = (step.num_draft_tokens if step.num_draft_tokens is not None
                      else np.zeros(len(rows), dtype=np.int64))
        indices = step.spec_logits_indices if step.spec_logits_indices is not None else step.logits_indices
        counts = num_drafts + 1
        last = np.cumsum(counts) - 1  # each request's last position among the sampled ones
        position_rows = np.repeat(rows, counts)
        offsets = np.arange(len(position_rows)) - np.repeat(last + 1 - counts, counts)
        # Known tokens before each position: the row's, plus the drafts before it.
        position_num_tokens = batch.num_tokens[position_rows] + offsets

        raw_logits = runner.model.compute_logits(hidden_states[torch.from_numpy(indices).to(device)])
        logits = raw_logits
        plain = np.flatnonzero(num_drafts == 0)  # rows without drafts may process their logits
        if len(plain) and batch.processes_logits[rows[plain]].any():
            at = torch.from_numpy(last[plain]).to(device)
            logits = raw_logits.float().clone()
            logits[at] = apply_logits_processors(raw_logits[at], batch, rows[plain]).float()

        generators: list[torch.Generator | None] = [None] * len(position_rows)
        for i in np.flatnonzero(batch.seed[position_rows] >= 0):  # seeded rows: a draw per position
            generator = torch.Generator(device=device)
            generator.manual_seed(position_seed(batch.seed[position_rows[i]], position_num_tokens[i]))
            generators[i] = generator
        metadata = SamplingMetadata.from_arrays(
            batch.temperature[position_rows], batch.top_k[position_rows], batch.top_p[position_rows], generators,
            device, batch.min_p[position_rows])
        target_ids = runner.sampler(logits, metadata)
        logprobs = None
        if (batch.num_logprobs[rows] >= 0).any():
            at = torch.from_numpy(last).to(device)
            logprobs = sampled_logprobs(raw_logits[at], target_ids[at], batch.num_logprobs[rows])

        req_ids = [step.req_ids[i] for i in step.sampling_req_index]
        drafts = [batch.token_ids[row, batch.num_tokens[row]:batch.num_tokens[row] + k].tolist()
                  for row, k in zip(rows.tolist(), num_drafts.tolist())]
        accepted, next_tokens = verify_against_samples(target_ids.tolist(), drafts)
        for row, row_accepted, token, k in zip(rows.tolist(), accepted, next_tokens, num_drafts.tolist()):
            batch.append_tokens(row, [*row_accepted, token])
            # The KV of the rejected drafts is stale: the scheduler pulls num_computed back the same way.
            batch.num_computed_tokens[row] -= k - len(row_accepted)

        spec_token_ids = None
        if propose_drafts:
            spec_token_ids = self.propose(runner, step, rows)
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=next_tokens, logprobs=logprobs,
            prompt_logprobs=[prompt_logprobs.get(r) for r in req_ids] if prompt_logprobs else None,
            accepted_draft_token_ids=accepted if step.num_draft_tokens is not None else None,
            spec_token_ids=spec_token_ids)

    # ------------------------------------------------------------ proposing

    def propose(self, runner: "ModelRunner", step: StepInputs, rows: np.ndarray) -> list[list[int]]:
        """Drafts for each sampling row (empty where it cannot speculate), from its known tokens."""
        batch = runner.input_batch
        if self.draft_runner is not None:
            return self.draft_runner.propose(step, rows)
        proposals = []
        for row in rows.tolist():
            num_tokens = int(batch.num_tokens[row])
            room = self.max_model_len - num_tokens - 1  # the scheduler trims further (max_tokens, budget)
            if not batch.can_speculate[row] or room <= 0:
                proposals.append([])
                continue
            proposals.append(self.ngram.propose(batch.token_ids[row, :num_tokens], room))
        return proposals
