"""AsyncLLM: the asyncio API (vLLM's `AsyncLLM`), for servers and anything else that streams.

    async for out in engine.generate(prompt, params, request_id="r1"):
        ...  # a RequestOutput each time tokens arrive; the last one has finished=True

One background task (AsyncEngineCoreClient) owns the engine socket and routes each request's
EngineCoreOutputs to that request's queue; the stream that consumes a queue detokenizes and
builds the RequestOutputs, so a slow consumer gets one output for several steps instead of a
backlog. A stream that is cancelled, broken out of or closed aborts its request in the engine,
which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncGenerator, Coroutine, Iterable
from typing import Any, TypeVar

from minivllm.frontend.core_client import AsyncEngineCoreClient, EngineDeadError, request_error
from minivllm.frontend.engine_start import start_engine
from minivllm.frontend.input_processor import PromptType
from minivllm.frontend.output_processor import RequestState, fan_out, gather_stream_output
from minivllm.frontend.outputs import RequestOutput
from minivllm.protocol.messages import EngineStats
from minivllm.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncLLM:
    """A language model serving many concurrent streams from one event loop.

    model and **engine_kwargs: as for LLM (tokenizer, max_num_batched_tokens, max_num_seqs,
    block_size, num_gpu_blocks, max_model_len, device, dtype, seed, load_format,
    enable_prefix_caching, scheduling_policy, ...). engine_address: attach to an engine started
    with `minivllm engine` instead of spawning one (engine_kwargs are then ignored); engine_key:
    that engine's secret, if it was started with one (default: $MINIVLLM_ENGINE_KEY).

    Build it anywhere; use it from one event loop at a time (a later asyncio.run may take over).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        skip_tokenizer_init: bool = False,
        engine_address: str | None = None,
        engine_key: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.client, self.input_processor = start_engine(
            AsyncEngineCoreClient, model, engine_kwargs, skip_tokenizer_init=skip_tokenizer_init,
            engine_address=engine_address, engine_key=engine_key)
        # Stop the engine when this object is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, self.client.shutdown)
        self.engine_info = self.client.engine_info
        self.tokenizer = self.input_processor.tokenizer
        self.child_ids: dict[str, list[str]] = {}  # request id -> its engine requests, when n > 1

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's RequestOutputs as its tokens arrive, shaped by
        sampling_params.output_kind (CUMULATIVE: all so far; DELTA: only the new tokens and
        text; FINAL_ONLY: just the last). The last output has finished=True.

        With n > 1 the engine runs n child requests ("<request_id>_<k>", as LLM.generate), and
        each output holds the completions with their `index`: all n (CUMULATIVE, FINAL_ONLY) or
        those with something new (DELTA); it is finished once all n are. Leaving the stream or
        abort(request_id) stops all n.

        Raises ValueError for bad input or a request_id already running (nothing reaches the
        engine then) or for a request the engine refuses as invalid (its message),
        EngineOverloadedError if the engine refuses it for load (it holds max_pending_requests;
        other requests go on), EngineDeadError if the engine dies meanwhile.
        """
        if request_id in self.child_ids or self.client.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already running; give each live request its own id.")
        request, prompt_text = self.input_processor.process(request_id, prompt, sampling_params, priority)
        engine_requests = fan_out(request)
        if any(self.client.has_request(r.request_id) for r in engine_requests):
            raise ValueError(f"request id {request_id!r} would run as {[r.request_id for r in engine_requests]}, "
                             "and one of those is already running; give each live request its own id.")
        children: dict[str, RequestState] = {}
        for index, engine_request in enumerate(engine_requests):
            state = RequestState(engine_request.request_id, prompt_text, request.prompt_token_ids, self.tokenizer,
                                 request.arrival_time, sampling_params)
            state.completion.index = index
            children[engine_request.request_id] = state
        fanned_out = len(engine_requests) > 1
        if fanned_out:
            self.child_ids[request_id] = list(children)
        kind = sampling_params.output_kind
        stream: asyncio.Queue = asyncio.Queue()  # the children's outputs, all in one queue
        try:
            for engine_request in engine_requests:
                await self.client.add_request(engine_request, stream)
            while not all(state.completion.finished() for state in children.values()):
                items = [await stream.get()]
                while not stream.empty():  # whatever piled up while the consumer was busy
                    items.append(stream.get_nowait())
                changed: set[str] = set()
                for item in items:
                    if isinstance(item, EngineDeadError):
                        raise EngineDeadError(str(item))  # one exception object per stream
                    if (error := request_error(item)) is not None:
                        raise error  # its siblings (n > 1) are aborted on the way out
                    state = children[item.request_id]
                    if state.completion.finished():  # later items (after a stop string) don't count
                        continue
                    state.update(item)
                    changed.add(item.request_id)
                    if state.stopped_by_string:  # the engine knows no stop strings: stop it there
                        self.client.abort_requests([item.request_id], drop_streams=True)
                if not changed:  # only leftovers of a completion a stop string ended
                    continue
                if fanned_out:
                    output = gather_stream_output(request_id, list(children.values()), changed, kind)
                else:
                    output = children[request_id].to_stream_output(kind)
                if output is not None:
                    yield output
        finally:
            # Cancelled, broken out of (GeneratorExit) or failed: stop what still runs in the engine.
            self.child_ids.pop(request_id, None)
            unfinished = [child_id for child_id, state in children.items() if not state.completion.finished()]
            if unfinished:
                self.client.abort_requests(unfinished, drop_streams=True)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop requests by id; the engine frees their KV blocks at once. Their streams end with
        an output with finish_reason "abort" and the tokens made so far. Finished or unknown ids
        are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ids += [child for i in ids for child in self.child_ids.get(i, ())]  # n > 1: its completions
        self.client.abort_requests(ids)

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_unfinished_request_ids(self) -> list[str]:
        """Ids of this AsyncLLM's requests the engine has not finished."""
        return self.client.get_unfinished_request_ids()

    async def get_num_unfinished_requests(self) -> int:
        """Requests the engine holds (running or waiting), this frontend's and any other's."""
        return await self.client.call_utility("get_num_unfinished_requests", type=int)

    async def get_stats(self) -> EngineStats:
        """The engine's scheduler stats (see LLM.get_stats)."""
        return await self.client.call_utility("get_stats", type=EngineStats)

    async def do_log_stats(self) -> None:
        """Have the engine log its stats line now."""
        await self.client.call_utility("log_stats")

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block; only possible while no request runs."""
        return await self.client.call_utility("reset_prefix_cache", type=bool)

    async def check_health(self) -> None:
        """Raises EngineDeadError unless the engine answers."""
        await self.client.call_utility("check_health")

    @property
    def errored(self) -> bool:
        return self.client.dead_reason is not None

    @property
    def is_running(self) -> bool:
        return not self.errored and self._finalizer.alive

    @property
    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(self.client.dead_reason or "the engine is dead")

    def shutdown(self) -> None:
        """Stop the engine this AsyncLLM spawned (or detach from an attached one)."""
        self._finalizer()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.shutdown()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed (`pip install minivllm[async]`), else on asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
