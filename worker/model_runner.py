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

Overlapped outputs (on CUDA; MINIVLLM_OVERLAP_OUTPUTS=1/0 forces it on or off): a step's sampled
ids are not waited for. The step counts them (InputBatch.append_pending) and copies them to the
host in the background; the next step, prepared meanwhile, takes its input ids for them straight
from the device, launches its forward, and only then collects the previous step's tokens (long
since computed) and hands them on. So the GPU never waits for the host between steps. On CPU,
where nothing runs in the background, this would only hold every token back by one step.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.messages import ModelRunnerOutput, SchedulerOutput
from minivllm.worker.attention import hopper_prefill
from minivllm.worker.attention.kv_cache import KVCacheLayout
from minivllm.worker.attention.metadata import AttentionBackend, AttentionMetadata
from minivllm.worker.cuda_graphs import StepBuffers, StepGraphs, max_step_tokens, run_forward
from minivllm.worker.input_batch import InputBatch, StepInputs
from minivllm.worker.kv_connector import make_kv_connector_driver
from minivllm.worker.logits_processors import apply_logits_processors
from minivllm.worker.logprobs import sampled_logprobs
from minivllm.worker.models.loader import describe, load_model
from minivllm.worker.output_rows import OutputRows
from minivllm.worker.pipeline import apply_new_token_ids, make_pipeline_stage
from minivllm.worker.prompt_logprobs import gather_prompt_logprobs
from minivllm.worker.sampler import Sampler, SamplingMetadata, reseed_generators

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KVCACHE_ENV = "MINIVLLM_CPU_KVCACHE_GB"
DEFAULT_CPU_KVCACHE_GB = 1.0
OVERLAP_ENV = "MINIVLLM_OVERLAP_OUTPUTS"
_NO_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


@dataclass
class PendingStep:
    """A step whose sampled ids are on their way to the host."""

    req_ids: list[str]
    rows: np.ndarray  # their persistent-batch rows
    sampled: torch.Tensor  # [n] on the device; the next step reads input ids from it
    host: torch.Tensor  # [n] the copy on the host, complete once `copied` has happened
    host_values: np.ndarray  # the same memory as `host`, for numpy
    copied: torch.cuda.Event | None


def default_backend(device: torch.device) -> AttentionBackend:
    """Triton kernels on CUDA; torch's fused SDPA on the CPU (reference.py stays the ground truth
    both are tested against)."""
    if device.type == "cuda":
        from minivllm.worker.attention.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    from minivllm.worker.attention.cpu_sdpa import SdpaAttentionBackend

    return SdpaAttentionBackend()


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

        self.model = load_model(config, self.device, self.dtype, attn_backend=default_backend(self.device))
        logger.info("model loaded on %s (%s): %s", self.device, self.dtype, describe(self.model))
        # Pipeline parallelism (worker/pipeline.py): this worker's stage, None with one stage.
        self.stage = make_pipeline_stage(config, self.model, self.dtype, self.device)
        self.kv_layout = KVCacheLayout(config.block_size, self.model.num_kv_heads, self.model.head_dim, self.dtype,
                                       fp8=config.kv_cache_dtype != "auto")
        if self.device.type == "cpu":  # build the CPU decode kernel now, if it will serve, not in the first step
            from minivllm.worker.attention import cpu_decode

            cpu_decode.prepare(self.kv_layout)

        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.seed_rng = np.random.default_rng(config.seed)  # row seeds of the fused CUDA sampler
        if self.device.type == "cuda":
            from minivllm.worker.fused_sampling import row_seeds  # needs Triton: CUDA builds of torch only

            self.row_seeds = row_seeds
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, config.block_size, self.device)
        self.buffers: StepBuffers | None = None
        if self.device.type == "cuda":  # persistent inputs: graphs read them, steps copy into them
            self.buffers = StepBuffers(max_step_tokens(config), config.max_num_seqs, self.input_batch.max_blocks_per_req,
                                       self.device)
            self.buffers.kv_layout = self.kv_layout
            # (Builds the Hopper prefill kernel now, nvcc ~2 s, where it serves: not in the first step.)
            self.buffers.hopper_prefill = hopper_prefill.serves(self.dtype, self.kv_layout, self.device)
        self.graphs: StepGraphs | None = None
        overlap = os.environ.get(OVERLAP_ENV)
        self.overlap_outputs = self.device.type == "cuda" if overlap is None else overlap == "1"
        self.overlap_outputs &= self.stage is None  # pipeline stages overlap batches instead
        self.pending: PendingStep | None = None
        self.gpu_wait_s = 0.0  # time spent waiting for held-back tokens (the worker's step timer reads it)
        self.sampled_host = torch.empty(config.max_num_seqs, dtype=torch.int64,
                                        pin_memory=self.device.type == "cuda")
        self.sampled_host_np = self.sampled_host.numpy()  # (a view made per step costs more than a slice)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        # KV connector (worker/kv_connector/): when one is configured its hooks wrap every step;
        # when none is, run_step stays the plain method.
        self.kv_connector = make_kv_connector_driver(config, rank, self.device)
        # Speculative decoding (worker/spec_decode/): samples the steps that verify or propose drafts.
        self.spec_decoder = None
        if config.speculative_config is not None:
            from minivllm.worker.spec_decode.spec_decoder import SpecDecoder

            self.spec_decoder = SpecDecoder(config, self)
        if self.kv_connector is not None:
            plain_run_step = self.run_step
            self.run_step = lambda scheduler_output: self.kv_connector.run_step(plain_run_step, scheduler_output)

    # ------------------------------------------------------------ KV cache

    def kv_cache_bytes_per_block(self) -> int:
        """K and V, every layer, one block (and the draft model's, when speculating with one)."""
        spec_bytes = self.spec_decoder.kv_cache_bytes_per_block() if self.spec_decoder is not None else 0
        return 2 * self.kv_layout.block_bytes * self.model.num_layers + spec_bytes

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit (config.num_gpu_blocks, when set, wins)."""
        if self.config.num_gpu_blocks is not None:
            return self.config.num_gpu_blocks
        bytes_per_block = self.kv_cache_bytes_per_block()
        if self.device.type == "cuda":
            budget = self._profile_kv_budget()
        else:
            budget = int(float(os.environ.get(CPU_KVCACHE_ENV, DEFAULT_CPU_KVCACHE_GB)) * (1 << 30))
        # More blocks than every seat filled to max_model_len are never needed at once; for a
        # small model they would only slow the start (zeroing them, and one Python object per
        # block in the EngineCore's block pool).
        blocks_per_seq = -(-self.config.max_model_len // self.block_size)
        num_blocks = min(budget // bytes_per_block, self.config.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            raise RuntimeError(f"no room for a single KV block ({bytes_per_block} bytes; budget {budget} bytes); "
                               "raise gpu_memory_utilization or lower max_num_batched_tokens")
        tokens = num_blocks * self.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB; maximum concurrency at max_model_len=%d: %.2fx",
            num_blocks, self.block_size, tokens, num_blocks * bytes_per_block / (1 << 30),
            self.config.max_model_len, tokens / self.config.max_model_len,
        )
        return num_blocks

    @torch.inference_mode()
    def _profile_kv_budget(self) -> int:
        """Bytes left for the KV cache: run the largest step the scheduler can send (a full token
        budget, max_num_seqs requests sampling) against a one-block cache, measure the peak, and
        give gpu_memory_utilization of the card minus that peak (weights included) and minus
        what is used outside torch's allocator (CUDA context, cuBLAS workspaces)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch_caches = self.kv_layout.allocate_layers(self.model.num_layers, 1, self.device)
        num_tokens = self.config.max_num_batched_tokens
        num_seqs = min(self.config.max_num_seqs, num_tokens)
        query_lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
        query_lens[: num_tokens % num_seqs] += 1
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], query_lens)
        step = StepInputs(
            req_ids=[str(i) for i in range(num_seqs)],
            input_ids=np.zeros(num_tokens, dtype=np.int64),
            positions=positions,
            slot_mapping=positions % self.block_size,  # everything in block 0: the numbers don't matter
            query_start_loc=query_start_loc,
            seq_lens=query_lens,
            block_table=np.zeros((num_seqs, 1), dtype=np.int32),
            logits_indices=query_start_loc[1:] - 1,
            sampling_req_index=np.arange(num_seqs),
            sampling_rows=np.arange(num_seqs),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(query_lens.max()),
        )
        metadata = self.buffers.load(step)
        inputs = (*self.buffers.forward_inputs, scratch_caches, metadata)
        hidden = self.model(*inputs) if self.stage is None else self.stage.profile_forward(self.model, *inputs)
        logits = None
        if hidden is not None:  # not on a pipeline stage before the last
            logits = self.model.compute_logits(hidden[torch.from_numpy(step.logits_indices).to(self.device)])
            ones = np.ones(num_seqs, dtype=np.float32)
            self.sampler(logits, SamplingMetadata.from_arrays(
                ones, np.full(num_seqs, 50, dtype=np.int64), ones * 0.9, [None] * num_seqs, self.device))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch_caches, hidden, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak - outside_torch
        logger.info(
            "memory profile: card %.1f GiB, peak of a full step %.2f GiB (weights %.2f GiB), outside torch %.2f GiB,"
            " left for the KV cache at gpu_memory_utilization=%.2f: %.2f GiB",
            total / (1 << 30), peak / (1 << 30), torch.cuda.memory_allocated(self.device) / (1 << 30),
            outside_torch / (1 << 30), self.config.gpu_memory_utilization, budget / (1 << 30),
        )
        return budget

    def initialize_cache(self, num_blocks: int) -> None:
        """One tensor per layer, [2, num_blocks, ...] (K = [0], V = [1]; the rest as
        worker/attention/kv_cache.py lays it out), views of one allocation; then, on CUDA, capture
        the step graphs (they bake in the cache's address)."""
        self.kv_caches = self.kv_layout.allocate_layers(self.model.num_layers, num_blocks, self.device)
        self.num_blocks = num_blocks
        if self.spec_decoder is not None:
            self.spec_decoder.initialize_cache(num_blocks)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        if self.device.type == "cuda":
            self._warm_up_logits()
        if self.device.type == "cuda" and not self.config.enforce_eager:
            with torch.inference_mode():
                spec = self.config.speculative_config
                # Sampling graphs: one process samples alone (not with speculative decoding, whose
                # verify steps sample drafts, nor on pipeline stages or tensor-parallel ranks).
                sample = self._graph_sample if spec is None and self.stage is None and \
                    self.config.tensor_parallel_size == 1 else None
                self.graphs = StepGraphs(
                    self._forward, self.buffers, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                    self.config.max_model_len, verify_query_len=spec.num_speculative_tokens + 1 if spec else 0,
                    max_verify_seqs=spec.max_speculating_batch if spec else 0, sample=sample,
                    eager_prefill=self.buffers.takes_hopper_prefill if self.buffers.hopper_prefill else None)

    @torch.inference_mode()
    def _warm_up_logits(self) -> None:
        """Run the LM head once for every row count an eager step can sample (1 to max_num_seqs, or
        that many verified tokens with speculative decoding).
        cuBLAS picks its kernel by the row count, and CUDA loads a kernel on its first launch; that
        load waits for the device to go idle. Met first in a mixed step, it held the worker's host
        until the step's forward had finished, and the GPU then idled while the next step was
        prepared: ~2.5 ms in most prompt steps of a fresh engine (H200, 256-request workload)."""
        if self.stage is not None and not self.stage.is_last:
            return  # no LM head on this stage
        spec = self.config.speculative_config
        max_rows = self.config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))  # verify steps
        hidden = torch.zeros(max_rows, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        for rows in range(1, max_rows + 1):
            self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------ one step

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                 output_rows: OutputRows | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward a graph captures; a pipeline stage's reads the previous stage's activations
        from its persistent inputs, and returns (hidden states, residual) on a stage before the last."""
        if self.stage is not None:
            intermediate = self.stage.intermediate(input_ids.shape[0])
            return self.model(input_ids, positions, self.kv_caches, metadata, intermediate, output_rows)
        return self.model(input_ids, positions, self.kv_caches, metadata, output_rows=output_rows)

    def _graph_sample(self, hidden_states: torch.Tensor) -> None:
        """What a sampling graph captures: the LM head over every row of a decode bucket, then the
        fused sampler, its per-row inputs and its output in the step buffers."""
        from minivllm.worker.fused_sampling import fused_sample_on_device

        n, b = hidden_states.shape[0], self.buffers
        views = b.views(n, n)  # a decode bucket's layout: n tokens of n sequences
        fused_sample_on_device(self.model.compute_logits(hidden_states), b.sample_rows[:n], views.temperature,
                               views.sample_seeds, b.sampled)

    def _samples_in_graph(self, step: StepInputs) -> bool:
        """Whether a step can sample in a graph: a decode bucket's step whose every token samples,
        each plainly (greedy or temperature alone, no logits processors, no logprobs)."""
        if self.graphs is None or not self.graphs.sample_graphs or step.max_query_len != 1 \
                or len(step.sampling_rows) != len(step.req_ids) or not self.graphs.can_sample(step):
            return False
        return bool(self.input_batch.samples_plainly[step.sampling_rows].all())

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return its output (nothing held back)."""
        return [*self.run_step(scheduler_output), *self.finish_pending()][-1]

    @torch.inference_mode()
    def run_step(self, scheduler_output: SchedulerOutput) -> list[ModelRunnerOutput]:
        """Run one step. Returns the outputs of the steps completed, oldest first: the previous
        step's when its tokens were held back, and this step's unless they are held back now."""
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return [*self.finish_pending(), _NO_OUTPUT]
        if not self.kv_caches:
            raise RuntimeError("execute_model before initialize_cache")

        step = self.input_batch.prepare(scheduler_output.num_scheduled_tokens,
                                        scheduler_output.scheduled_spec_decode_tokens)
        batch, rows = self.input_batch, step.sampling_rows
        sample_in_graph = self._samples_in_graph(step)
        if sample_in_graph:  # the sampling graph's inputs travel with the step's
            step.sample_temperature = batch.temperature[rows]
            step.sample_seeds = self.row_seeds(batch.seed[rows], batch.num_tokens[rows], self.seed_rng)
        hidden_states = self._run_model(step, sample=sample_in_graph)
        if hidden_states is None:  # a pipeline stage before the last: its activations went on
            return [_NO_OUTPUT]
        if self.spec_decoder is not None:
            self.spec_decoder.after_forward(step)  # a draft model runs the same tokens
        outputs = self.finish_pending()  # the previous step's tokens: needed by the sampling below
        # Before the early return: partial prefill chunks score their prompt tokens too.
        prompt_logprobs = gather_prompt_logprobs(self.model.compute_logits, hidden_states, step, self.input_batch)
        if len(step.sampling_rows) == 0:  # only partial prefill chunks this step
            return [*outputs, _NO_OUTPUT]
        if self.spec_decoder is not None and self.spec_decoder.handles(step, scheduler_output.propose_drafts):
            return [*outputs, self.spec_decoder.sample(self, hidden_states, step, prompt_logprobs,
                                                       scheduler_output.propose_drafts)]

        if sample_in_graph:  # sampled already, by the graph behind the forward's
            sampled_ids, logprobs = self.buffers.sampled[: len(rows)], None
        else:
            sampled_ids, logprobs = self._sample(hidden_states, step)
        sampled_req_ids = step.sampling_req_ids()
        # (Logprobs were brought to the host already: holding the tokens back would gain nothing.)
        if self.overlap_outputs and logprobs is None and not prompt_logprobs:
            host = self.sampled_host[: len(rows)]
            host.copy_(sampled_ids, non_blocking=True)
            copied = None
            if self.device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record()
            self.pending = PendingStep(sampled_req_ids, rows, sampled_ids, host, self.sampled_host_np[: len(rows)],
                                       copied)
            batch.append_pending(rows)
            return outputs
        sampled = sampled_ids.tolist()  # the step's one device->host sync (two when logprobs are asked)
        batch.append_sampled(rows, sampled)
        return [*outputs, ModelRunnerOutput(
            req_ids=sampled_req_ids, sampled_token_ids=sampled, logprobs=logprobs,
            # A prompt's logprobs are finished exactly in the step that samples its first token.
            prompt_logprobs=[prompt_logprobs.get(r) for r in sampled_req_ids] if prompt_logprobs else None)]

    def _sample(self, hidden_states: torch.Tensor, step: StepInputs,
                ) -> tuple[torch.Tensor, list | None]:
        """The step's sampled ids (one per sampling row, in order) and their logprobs (None when
        no row asked), from its hidden states."""
        batch, rows = self.input_batch, step.sampling_rows
        if not step.hidden_rows_sampled:  # (else the forward returned those rows alone)
            hidden_states = hidden_states[torch.from_numpy(step.logits_indices).to(self.device, non_blocking=True)]
        raw_logits = self.model.compute_logits(hidden_states)
        logits = apply_logits_processors(raw_logits, batch, rows)
        request_seeds = batch.seed[rows]
        # Only a row with a seed has a generator of its own (most steps have none).
        generators = [batch.generators[r] for r in rows.tolist()] if (request_seeds >= 0).any() \
            else [None] * len(rows)
        reseed_generators(generators, request_seeds, batch.num_tokens[rows])
        if self.device.type == "cuda":
            seeds = self.row_seeds(request_seeds, batch.num_tokens[rows], self.seed_rng)
            sampled_ids = self.sampler.sample_rows(logits, batch.temperature[rows], batch.top_k[rows],
                                                   batch.top_p[rows], generators, seeds, batch.min_p[rows])
        else:
            sampled_ids = self.sampler(logits, SamplingMetadata.from_arrays(
                batch.temperature[rows], batch.top_k[rows], batch.top_p[rows], generators, self.device,
                batch.min_p[rows]))
        return sampled_ids, sampled_logprobs(raw_logits, sampled_ids, batch.num_logprobs[rows])

    def has_pending(self) -> bool:
        return self.pending is not None

    def pending_ready(self) -> bool:
        """Whether the held-back tokens have reached the host (finish_pending would not wait)."""
        return self.pending is None or self.pending.copied is None or self.pending.copied.query()

    def finish_pending(self) -> list[ModelRunnerOutput]:
        """The held-back step's output (waiting for its copy if needed), or nothing."""
        pending, self.pending = self.pending, None
        if pending is None:
            return []
        if pending.copied is not None:
            t0 = time.perf_counter()
            pending.copied.synchronize()
            self.gpu_wait_s += time.perf_counter() - t0
        self.input_batch.resolve_pending(pending.rows, pending.host_values)
        return [ModelRunnerOutput(req_ids=pending.req_ids, sampled_token_ids=pending.host.tolist())]

    def _patch_pending_inputs(self, input_ids: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
        """Input ids the host does not have yet (at `index`) come from the previous step's sampled
        ids (at `source`), still on the device."""
        if not len(index):
            return
        assert self.pending is not None, "a pending input token without a pending step"
        input_ids[index] = self.pending.sampled[source]

    def _run_model(self, step: StepInputs, sample: bool = False) -> torch.Tensor | None:
        """One forward pass: a captured graph when one fits the step, else eager (`sample`: and
        the sampling graph behind it). None on a pipeline stage before the last (its activations
        went on to the next stage)."""
        if self.stage is not None:
            self.stage.receive(step.num_tokens)
        # Every row's hidden state is read where prompts are scored or drafts proposed and
        # verified; a pipeline stage before the last sends every row on; an FP8 cache's prefill
        # reads a chunk's own keys unquantized (worker/output_rows.py).
        sampled_rows_only = ((self.stage is None or self.stage.is_last) and self.spec_decoder is None
                             and not self.kv_layout.fp8 and not self.input_batch.prompt_logprobs_reqs)
        out = run_forward(self._forward, step, self.buffers, self.graphs, self.kv_layout,
                          patch_input_ids=self._patch_pending_inputs, sample=sample,
                          sampled_rows_only=sampled_rows_only)
        return out if self.stage is None else self.stage.finish(out)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            batch.remove_request(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            batch.remove_request(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            batch.add_request(new)
        cached_reqs = scheduler_output.scheduled_cached_reqs
        if not cached_reqs:
            return
        # Every running request's position in one assignment; the rarer changes (a new block, blocks
        # released, tokens sent) one request at a time.
        rows = batch.rows_of([cached.req_id for cached in cached_reqs])
        batch.num_computed_tokens[rows] = np.fromiter([cached.num_computed_tokens for cached in cached_reqs],
                                                      np.int64, len(cached_reqs))
        for i in [i for i, cached in enumerate(cached_reqs)
                  if cached.new_block_ids or cached.num_released_blocks or cached.new_token_ids]:
            cached, row = cached_reqs[i], int(rows[i])
            batch.num_blocks[row] -= cached.num_released_blocks  # they held rejected drafts only
            if cached.new_block_ids:
                batch.append_blocks(row, cached.new_block_ids)
            if cached.new_token_ids:  # pipeline parallelism: tokens a stage that does not sample lacks
                apply_new_token_ids(batch, cached)
