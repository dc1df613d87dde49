"""What the completions and chat endpoints share: admission (the in-flight bound), running a
request's prompts on the engine as one merged stream, client-disconnect detection, error mapping,
and Server-Sent Events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from minivllm.frontend.async_llm import AsyncLLM
from minivllm.frontend.core_client import EngineDeadError, EngineOverloadedError, KVTransferError
from minivllm.frontend.input_processor import PromptType
from minivllm.frontend.outputs import RequestOutput
from minivllm.frontend.server.errors import APIError
from minivllm.frontend.server.metrics import RequestTimer, ServerMetrics
from minivllm.protocol.sampling_params import SamplingParams

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready (its requests are aborted)."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def as_api_error(error: BaseException) -> APIError:
    """What an exception from the engine or the input checks means for the client."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, (ValueError, TypeError)):
        return APIError(HTTPStatus.BAD_REQUEST, str(error))
    if isinstance(error, EngineOverloadedError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, f"the engine is overloaded, try again later: {error}")
    if isinstance(error, KVTransferError):  # the producer failed; a proxy may retry on another
        return APIError(HTTPStatus.BAD_GATEWAY, f"KV transfer failed: {error}")
    if isinstance(error, EngineDeadError):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, f"the engine is dead: {error}")
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(error).__name__}: {error}")


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has closed its connection (the request body was read already, so
    the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (and raise ClientDisconnected) if the client goes away first,
    so a non-streaming request does not keep generating for nobody."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


@dataclass
class PromptRun:
    """One prompt of a request in the engine, with what its completions gathered so far."""

    prompt_index: int
    timer: RequestTimer
    prompt_text: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: Any = None
    kv_transfer_params: dict[str, Any] | None = None  # from the KV connector, with the last output


class MergedStream:
    """The engine streams of a request's prompts as one async iterator of (prompt index,
    RequestOutput) pairs in arrival order. Several prompts are pumped by one task each into a
    queue; a single prompt (the usual case) is read directly, without the extra hop. close()
    stops them all, which aborts whatever still runs in the engine and frees its KV blocks."""

    def __init__(self, streams: list[AsyncGenerator[RequestOutput, None]]) -> None:
        self.streams = streams
        self.closed = False
        self.single = streams[0] if len(streams) == 1 else None
        self.num_open = len(streams)
        self.queue: asyncio.Queue | None = None
        self.tasks: list[asyncio.Task] = []
        if self.single is None:
            self.queue = asyncio.Queue()
            self.tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                self.queue.put_nowait((index, output))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the reader, which answers with it
            self.queue.put_nowait((index, e))
            return
        self.queue.put_nowait((index, None))  # this prompt is done

    def __aiter__(self) -> "MergedStream":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self.single is not None:
            return 0, await self.single.__anext__()
        while self.num_open:
            index, item = await self.queue.get()
            if item is None:
                self.num_open -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return index, item
        raise StopAsyncIteration

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for stream in self.streams:
            await stream.aclose()


class OpenAIServing:
    """State every endpoint shares: the engine, the model's names, metrics, the in-flight bound."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], model_path: str, metrics: ServerMetrics,
                 max_in_flight: int, chat_template: str | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.model_path = model_path
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # engine requests (prompts x n) of this server now running
        self.chat_template = chat_template

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist; this server serves "
                           f"{self.served_model_names}.", "model")

    def check_engine(self) -> None:
        if self.engine.errored:
            raise as_api_error(self.engine.dead_error)

    def admit(self, num_requests: int):
        """Take `num_requests` of the in-flight bound (max_pending_requests) and return the
        function that gives them back (safe to call twice). Past the bound the request is refused
        at once (429), never queued."""
        if self.in_flight + num_requests > self.max_in_flight:
            raise APIError(HTTPStatus.TOO_MANY_REQUESTS,
                           f"the server is at its limit of {self.max_in_flight} requests in flight "
                           f"(--max-pending-requests); {self.in_flight} are running; try again later.")
        self.in_flight += num_requests
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= num_requests

        return release

    def start(self, request_id: str, prompts: list[PromptType], params: SamplingParams, priority: int,
              arrival: float) -> tuple[MergedStream, list[PromptRun]]:
        """Start every prompt of a request (engine ids "<request_id>-<i>"); returns the merged stream."""
        runs = [PromptRun(i, RequestTimer(self.metrics, arrival)) for i in range(len(prompts))]
        streams = [self._timed(self.engine.generate(p, params, f"{request_id}-{i}", priority=priority), runs[i],
                               params.n)
                   for i, p in enumerate(prompts)]
        return MergedStream(streams), runs

    async def _timed(self, stream: AsyncGenerator[RequestOutput, None], run: PromptRun,
                     n: int) -> AsyncGenerator[RequestOutput, None]:
        """Observe the prompt's metrics from its outputs as they pass (DELTA outputs)."""
        first = True
        totals: dict[int, int] = {}
        finished: set[int] = set()
        try:
            async for output in stream:
                now = time.monotonic()
                if first:
                    first = False
                    run.prompt_text = output.prompt
                    run.prompt_token_ids = output.prompt_token_ids
                    run.timer.prompt(len(output.prompt_token_ids))
                if output.prompt_logprobs is not None:
                    run.prompt_logprobs = output.prompt_logprobs
                if output.kv_transfer_params is not None:
                    run.kv_transfer_params = output.kv_transfer_params
                for completion in output.outputs:
                    totals[completion.index] = totals.get(completion.index, 0) + len(completion.token_ids)
                    run.timer.tokens(completion.index, len(completion.token_ids), now)
                    if completion.finish_reason is not None:
                        finished.add(completion.index)
                        run.timer.finished(completion.index, completion.finish_reason, totals[completion.index], now)
                yield output
        finally:
            await stream.aclose()  # aborts in the engine whatever has not finished
            if not first:  # left early (client gone, shutdown timeout, error): those count as aborted
                for index in range(n):
                    if index not in finished:
                        run.timer.finished(index, "abort", totals.get(index, 0))

    async def first_outputs(self, request: Request, merged: MergedStream,
                            num_prompts: int) -> list[tuple[int, RequestOutput]]:
        """Wait (watching for a disconnect) until every prompt has its first output, so errors
        (bad input, overload, a dead engine) still become an HTTP status before a stream opens."""

        async def collect() -> list[tuple[int, RequestOutput]]:
            items, seen = [], set()
            while len(seen) < num_prompts:
                try:
                    index, output = await merged.__anext__()
                except StopAsyncIteration:
                    break
                items.append((index, output))
                seen.add(index)
            return items

        return await unless_disconnected(request, collect())



@dataclass
class ChoiceState:
    """One choice (a prompt's completion) as the deltas add up."""

    index: int  # in the response: prompt index x n + completion index
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # streaming: the first chunk (role / echo) was sent

    def add(self, text: str, token_ids: list[int], logprobs: list | None, finish_reason: str | None,
            stop_reason: int | str | None) -> None:
        self.text.append(text)
        self.token_ids.extend(token_ids)
        if logprobs:
            self.logprobs.extend(logprobs)
        self.finish_reason, self.stop_reason = finish_reason, stop_reason


def decoded(tokenizer: Any, token_id: int, entry: Any) -> str:
    """A token's text, as its Logprob carries it (or decoded here)."""
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def kv_transfer_params_of(runs: list[PromptRun]) -> dict[str, Any] | None:
    """The response's top-level kv_transfer_params (vLLM's field): the KV connector's, for the
    request's one prompt (kv_transfer_params requests have one prompt and n=1)."""
    return next((run.kv_transfer_params for run in runs if run.kv_transfer_params is not None), None)


def disconnected_response() -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


Items = AsyncIterator[tuple[int, RequestOutput]]


async def run_request(serving: OpenAIServing, raw_request: Request, prompts: list[PromptType],
                      params: SamplingParams, priority: int, request_id: str, stream: bool,
                      stream_chunks: Callable[[list[PromptRun], Items], AsyncIterator[str]],
                      build_response: Callable[[list[PromptRun], list[tuple[int, RequestOutput]]], dict]):
    """Run a request's prompts and answer: a JSON body (build_response over every output) or an
    SSE stream (stream_chunks over the outputs as they come; it ends with [DONE]). Bad input,
    overload or a dead engine found before the first token is an HTTP error status; later, an
    error event in the stream. A client that leaves aborts everything its request runs."""
    release = serving.admit(len(prompts) * params.n)
    merged: MergedStream | None = None

    async def cleanup() -> None:
        if merged is not None:
            await merged.close()
        release()

    try:
        merged, runs = serving.start(request_id, prompts, params, priority, time.monotonic())
        first = await serving.first_outputs(raw_request, merged, len(prompts))
    except ClientDisconnected:
        await cleanup()
        return disconnected_response()
    except BaseException as e:
        await cleanup()
        if isinstance(e, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
            raise
        raise as_api_error(e) from e

    async def items() -> Items:
        for item in first:
            yield item
        async for item in merged:
            yield item

    if not stream:
        async def consume() -> list[tuple[int, RequestOutput]]:
            return [item async for item in items()]

        try:
            outputs = await unless_disconnected(raw_request, consume())
        except ClientDisconnected:
            return disconnected_response()
        except Exception as e:
            raise as_api_error(e) from e
        finally:
            await cleanup()
        return JSONResponse(build_response(runs, outputs))

    async def body() -> AsyncGenerator[str, None]:
        try:
            async for chunk in stream_chunks(runs, items()):
                yield chunk
        except Exception as e:  # the status is sent already: say it in the stream
            yield sse(as_api_error(e).body())
            yield SSE_DONE
        finally:
            await cleanup()

    # The background task runs even when the client left before the body started.
    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(cleanup))
