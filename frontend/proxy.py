"""`minivllm proxy`: an OpenAI-compatible router for prefill/decode disaggregation.

    minivllm proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each /v1/completions or /v1/chat/completions request runs twice, as vLLM's disaggregated-serving
proxies do:
  1. on a prefill instance (`serve --kv-transfer-role producer`), with max_tokens=1, no streaming
     and kv_transfer_params {"do_remote_decode": true}: it computes the prompt's KV, keeps the
     blocks, and answers with the kv_transfer_params that say where to pull them from;
  2. on a decode instance (`serve --kv-transfer-role consumer`): the original request plus those
     kv_transfer_params; it pulls the KV into its own blocks and generates the answer, which is
     streamed (or returned) to the client as it is.
Instances are picked least-loaded (requests this proxy has in flight there), ties round-robin.
A prefill instance that fails (refused connection, 5xx, timeout, or a decode instance that could
not pull the KV from it) is marked down and the request retried on another; when none is left,
the client gets an OpenAI error JSON saying what failed, never a hang. /health checks every
backend (503 naming those that are down); /v1/models is a decode instance's.
"""

# No `from __future__ import annotations`: FastAPI must see the route signatures' real classes, which
# are imported inside build_proxy_app (building the CLI parser imports no web framework).

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

logger = logging.getLogger(__name__)

COMPLETION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# Request headers passed on to the instances (the rest belong to this hop).
_FORWARDED_HEADERS = ("authorization", "x-request-id")


@dataclass
class Backend:
    """One instance behind the proxy."""

    url: str
    role: str  # "prefill" | "decode"
    in_flight: int = 0
    # Set when a request or a health check failed on it; cleared by a later success.
    error: str | None = None
    failed_at: float = 0.0

    @property
    def healthy(self) -> bool:
        return self.error is None

    def mark_failed(self, error: str) -> None:
        if self.error is None:
            logger.warning("%s instance %s failed: %s", self.role, self.url, error)
        self.error, self.failed_at = error, time.monotonic()

    def mark_ok(self) -> None:
        if self.error is not None:
            logger.warning("%s instance %s is back", self.role, self.url)
        self.error = None


class BackendPool:
    """The instances of one role, picked least-loaded with round-robin ties, healthy ones first."""

    def __init__(self, urls: list[str], role: str) -> None:
        if not urls:
            raise ValueError(f"give at least one {role} instance URL")
        self.backends = [Backend(normalize_url(url), role) for url in urls]
        self.role = role
        self._turn = itertools.count()

    def pick(self, exclude: set[str] = frozenset()) -> Backend | None:
        """The instance to use next, or None when every one was tried (`exclude`). One marked down
        is used only when no healthy one is left (it may have come back)."""
        candidates = [b for b in self.backends if b.url not in exclude]
        if not candidates:
            return None
        turn = next(self._turn)
        n = len(self.backends)
        # Rotating the tie-break by `turn` spreads equal loads round-robin.
        return min(candidates, key=lambda b: (not b.healthy, b.in_flight, (self.backends.index(b) - turn) % n))


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"instance URL {url!r} must start with http:// or https://")
    return url


def split_urls(values: list[str]) -> list[str]:
    """--prefill A,B --prefill C -> [A, B, C]."""
    return [url for value in values for url in value.split(",") if url.strip()]


def error_body(status: HTTPStatus, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape (as frontend/server/errors.py makes it)."""
    from minivllm.frontend.server.errors import APIError

    return APIError(status, message, param).body()


class UpstreamError(Exception):
    """An instance failed this request in a way another instance might not: retry elsewhere."""


class DisaggProxy:
    """The routing: prefill on one instance, decode on another, with retries and health."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *, request_timeout: float = 600.0,
                 connect_timeout: float = 5.0, health_timeout: float = 5.0) -> None:
        # No prefill instances: a plain load balancer over the (colocated) decode instances, for
        # comparing PD disaggregation with the same number of ordinary instances behind one proxy.
        self.prefill = BackendPool(prefill_urls, "prefill") if prefill_urls else None
        self.decode = BackendPool(decode_urls, "decode")
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.health_timeout = health_timeout
        self.session: Any = None  # aiohttp.ClientSession, made on the server's event loop

    async def start(self) -> None:
        import aiohttp

        # No total limit: a streamed answer may run long; a silent instance is caught by sock_read.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout, sock_read=self.request_timeout)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------ the two stages

    async def run_prefill(self, endpoint: str, body: dict, headers: dict, exclude: set[str]) -> tuple[Backend, dict]:
        """Prefill on some instance not in `exclude`; returns it and the kv_transfer_params of its
        answer. Raises UpstreamError when no instance could, ClientAnswer for the client's own errors."""
        import aiohttp

        prefill_body = dict(body)
        prefill_body.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        if prefill_body.get("min_tokens"):  # min_tokens <= max_tokens
            prefill_body["min_tokens"] = 0
        failures = []
        while (backend := self.prefill.pick(exclude)) is not None:
            exclude.add(backend.url)
            backend.in_flight += 1
            try:
                async with self.session.post(backend.url + endpoint, json=prefill_body, headers=headers) as response:
                    payload = await response.read()
                    if response.status >= 500:
                        raise UpstreamError(f"HTTP {response.status}: {_message_of(payload)}")
                    if response.status != 200:  # the request itself is wrong: every instance would say so
                        raise ClientAnswer(response.status, payload, response.content_type)
                    answer = json.loads(payload)
                    kv_transfer_params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                    if not isinstance(kv_transfer_params, dict):
                        raise UpstreamError("its answer has no kv_transfer_params: is it started with "
                                            "`--kv-transfer-role producer`?")
                backend.mark_ok()
                return backend, kv_transfer_params
            except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamError, ValueError) as e:
                reason = _describe(e)
                backend.mark_failed(reason)
                failures.append(f"{backend.url}: {reason}")
            finally:
                backend.in_flight -= 1
        raise UpstreamError("; ".join(failures) or "no prefill instance left to try")

    async def open_decode(self, endpoint: str, body: dict, headers: dict) -> tuple[Backend, Any]:
        """Send the request to a decode instance; returns it and the open aiohttp response (status
        200). An instance that cannot be reached is marked down and the next one tried; an error
        answer raises DecodeFailed (status, body) for the caller to retry from the prefill or pass on."""
        import aiohttp

        tried: set[str] = set()
        failures = []
        while (backend := self.decode.pick(tried)) is not None:
            tried.add(backend.url)
            backend.in_flight += 1
            try:
                response = await self.session.post(backend.url + endpoint, json=body, headers=headers)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                backend.in_flight -= 1
                reason = _describe(e)
                backend.mark_failed(reason)
                failures.append(f"{backend.url}: {reason}")
                continue
            if response.status != 200:
                try:
                    payload = await response.read()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    payload = b""
                finally:
                    response.release()
                    backend.in_flight -= 1
                raise DecodeFailed(backend, response.status, payload, response.content_type)
            backend.mark_ok()
            return backend, response
        raise UpstreamError("no decode instance could be reached: " + "; ".join(failures))

    async def handle(self, endpoint: str, body: dict, headers: dict):
        """Answer one completion request: a JSONResponse, or a StreamingResponse of the decode
        instance's Server-Sent Events."""
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        if not isinstance(body, dict):
            return JSONResponse(error_body(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object"), 400)
        stream = bool(body.get("stream"))
        tried_prefill: set[str] = set()
        failures: list[str] = []
        while self.prefill is None:  # colocated: no prefill stage
            try:
                backend, response = await self.open_decode(endpoint, body, headers)
            except UpstreamError as e:
                return JSONResponse(error_body(HTTPStatus.SERVICE_UNAVAILABLE, str(e)), status_code=503)
            except DecodeFailed as failed:
                return Response(failed.payload, status_code=failed.status, media_type=failed.content_type)
            break
        while self.prefill is not None:
            try:
                prefill_backend, kv_transfer_params = await self.run_prefill(endpoint, body, headers, tried_prefill)
            except ClientAnswer as answer:
                return Response(answer.payload, status_code=answer.status, media_type=answer.content_type)
            except UpstreamError as e:
                failures.append(str(e))
                return JSONResponse(error_body(HTTPStatus.SERVICE_UNAVAILABLE,
                                               "no prefill instance could serve this request: " + "; ".join(failures)),
                                    status_code=503)
            decode_body = {**body, "kv_transfer_params": kv_transfer_params}
            try:
                backend, response = await self.open_decode(endpoint, decode_body, headers)
            except UpstreamError as e:
                return JSONResponse(error_body(HTTPStatus.SERVICE_UNAVAILABLE, str(e)), status_code=503)
            except DecodeFailed as failed:
                if failed.status >= 500 and self.prefill.pick(tried_prefill) is not None:
                    # Most likely the KV could not be pulled from that prefill instance (it died
                    # mid-transfer): prefill again elsewhere.
                    reason = f"decode on {failed.backend.url} failed: {_message_of(failed.payload)}"
                    prefill_backend.mark_failed(reason)
                    failures.append(f"{prefill_backend.url}: {reason}")
                    continue
                return Response(failed.payload, status_code=failed.status, media_type=failed.content_type)
            break

        if not stream:
            try:
                payload = await response.read()
            except Exception as e:  # the decode instance died while answering
                backend.mark_failed(_describe(e))
                return JSONResponse(error_body(HTTPStatus.BAD_GATEWAY,
                                               f"decode instance {backend.url} failed mid-answer: {_describe(e)}"),
                                    status_code=502)
            finally:
                response.release()
                backend.in_flight -= 1
            return Response(payload, status_code=200, media_type=response.content_type)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            except Exception as e:  # the status is sent already: say it in the stream, as the server does
                backend.mark_failed(_describe(e))
                error = error_body(HTTPStatus.BAD_GATEWAY, f"decode instance {backend.url} failed mid-stream: "
                                   f"{_describe(e)}")
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            finally:
                response.close()  # a client that left: the instance sees the disconnect and aborts
                backend.in_flight -= 1

        return StreamingResponse(relay(), media_type="text/event-stream")

    # ------------------------------------------------------------ health and models

    async def check_backend(self, backend: Backend) -> None:
        import aiohttp

        try:
            async with self.session.get(backend.url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=self.health_timeout)) as response:
                if response.status != 200:
                    raise UpstreamError(f"/health answered {response.status}: {_message_of(await response.read())}")
            backend.mark_ok()
        except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamError) as e:
            backend.mark_failed(_describe(e))

    async def health(self) -> tuple[int, dict]:
        pools = [("prefill", self.prefill), ("decode", self.decode)] if self.prefill else [("decode", self.decode)]
        backends = [b for _, pool in pools for b in pool.backends]
        await asyncio.gather(*(self.check_backend(b) for b in backends))
        report = {role: {b.url: (b.error or "ok") for b in pool.backends} for role, pool in pools}
        down = [f"{b.role} {b.url} ({b.error})" for b in backends if not b.healthy]
        if not down:
            return 200, {"status": "ok", **report}
        body = error_body(HTTPStatus.SERVICE_UNAVAILABLE, "backends down: " + "; ".join(down))
        body["backends"] = report
        return 503, body

    async def models(self) -> tuple[int, bytes, str]:
        import aiohttp

        failures = []
        for backend in sorted(self.decode.backends, key=lambda b: not b.healthy):
            try:
                async with self.session.get(backend.url + "/v1/models") as response:
                    return response.status, await response.read(), response.content_type
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                backend.mark_failed(_describe(e))
                failures.append(f"{backend.url}: {_describe(e)}")
        body = error_body(HTTPStatus.SERVICE_UNAVAILABLE, "no decode instance answered: " + "; ".join(failures))
        return 503, json.dumps(body).encode(), "application/json"


class ClientAnswer(Exception):
    """A prefill instance's 4xx answer: the client's request is wrong; pass it on as it is."""

    def __init__(self, status: int, payload: bytes, content_type: str) -> None:
        super().__init__(status)
        self.status, self.payload, self.content_type = status, payload, content_type


class DecodeFailed(Exception):
    def __init__(self, backend: Backend, status: int, payload: bytes, content_type: str) -> None:
        super().__init__(status)
        self.backend, self.status, self.payload, self.content_type = backend, status, payload, content_type


def _describe(error: BaseException) -> str:
    if isinstance(error, asyncio.TimeoutError):
        return "timed out"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _message_of(payload: bytes) -> str:
    """An error answer's message (OpenAI's shape), else its text, shortened."""
    try:
        message = json.loads(payload)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = payload.decode(errors="replace")
    return message[:500] or "(empty answer)"


def build_proxy_app(proxy: DisaggProxy):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await proxy.start()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="minivllm proxy", lifespan=lifespan)
    app.state.proxy = proxy

    def forwarded(request: Request) -> dict:
        return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}

    async def completion(endpoint: str, request: Request):
        try:
            body = await request.json()
        except ValueError as e:
            return JSONResponse(error_body(HTTPStatus.BAD_REQUEST, f"the request body is not JSON: {e}"), 400)
        return await proxy.handle(endpoint, body, forwarded(request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        status, payload, content_type = await proxy.models()
        return Response(payload, status_code=status, media_type=content_type)

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = await proxy.health()
        return JSONResponse(body, status_code=status)

    return app


def add_proxy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="route OpenAI requests over prefill and decode instances "
                       "(prefill/decode disaggregation)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", action="append", default=[], metavar="URL[,URL]",
                   help="prefill instance(s) (`minivllm serve --kv-transfer-role producer`); repeatable. Without "
                        "any, the proxy balances requests over the --decode instances as ordinary ones")
    p.add_argument("--decode", action="append", default=[], metavar="URL[,URL]",
                   help="decode instance(s) (`minivllm serve --kv-transfer-role consumer`); repeatable")
    r = p.add_argument_group("instances on Ray (instead of URLs)")
    r.add_argument("--ray-prefill-instances", type=int, default=0,
                   help="start this many prefill instances as Ray actors (one GPU each; CPU without GPUs)")
    r.add_argument("--ray-decode-instances", type=int, default=0, help="start this many decode instances")
    r.add_argument("--model", default=None, help="the model directory the Ray instances serve (on every node)")
    r.add_argument("--serve-args", default="",
                   help='flags every Ray instance\'s `minivllm serve` gets, as one string, e.g. "--dtype bfloat16"')
    r.add_argument("--ray-namespace", default=None,
                   help="Ray namespace of the instances (default minivllm-pd). Alone (no counts, no URLs): "
                        "route over the instances already running there, started by another proxy")
    r.add_argument("--ray-startup-timeout", type=float, default=600.0, help="seconds an instance may take to come up")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds an instance may stay silent (no answer, no stream chunk) before it counts as failed")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to an instance")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    p.set_defaults(func=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    for name in ("request_timeout", "connect_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    prefill_urls, decode_urls = split_urls(args.prefill), split_urls(args.decode)
    ray_instances = None
    on_ray = args.ray_prefill_instances or args.ray_decode_instances or args.ray_namespace
    if on_ray:
        ray_instances, prefill_urls, decode_urls = _ray_instances(args, prefill_urls, decode_urls)
    elif not decode_urls:
        raise ValueError("give the decode instances (--decode URL[,URL]), or start them on Ray "
                         "(--ray-decode-instances N --model DIR), or find them there (--ray-namespace NS)")
    try:
        return _serve_proxy(args, prefill_urls, decode_urls)
    finally:
        if ray_instances is not None:
            ray_instances.close()


def _ray_instances(args: argparse.Namespace, prefill_urls: list[str], decode_urls: list[str]):
    from minivllm.frontend.ray_pd import DEFAULT_NAMESPACE, RayPDInstances, parse_serve_args, urls_by_role

    if prefill_urls or decode_urls:
        raise ValueError("--prefill / --decode URLs and Ray instances (--ray-*) are two ways to name the "
                         "instances; use one")
    for name in ("ray_prefill_instances", "ray_decode_instances"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    launching = args.ray_prefill_instances or args.ray_decode_instances
    if launching:
        if args.ray_decode_instances < 1:
            raise ValueError("--ray-decode-instances must be >= 1 (decode instances answer every request)")
        if not args.model or not os.path.isdir(args.model):
            raise ValueError(f"--model must be a local model directory (the same path on every node), got {args.model!r}")
        serve_args = parse_serve_args(args.serve_args)
    instances = RayPDInstances(args.ray_namespace or DEFAULT_NAMESPACE)
    try:
        if launching:
            infos = instances.launch(args.model, args.ray_prefill_instances, args.ray_decode_instances, serve_args,
                                     args.ray_startup_timeout)
        else:
            infos = instances.discover()
        prefill_urls, decode_urls = urls_by_role(infos)
        if not decode_urls:
            raise ValueError(f"no decode instance runs in the Ray namespace {instances.namespace!r}")
    except BaseException:
        instances.close()
        raise
    return instances, prefill_urls, decode_urls


def _serve_proxy(args: argparse.Namespace, prefill_urls: list[str], decode_urls: list[str]) -> int:
    import uvicorn

    from minivllm.frontend.server.api_server import uvicorn_loop

    proxy = DisaggProxy(prefill_urls, decode_urls, request_timeout=args.request_timeout,
                        connect_timeout=args.connect_timeout)
    app = build_proxy_app(proxy)
    logger.warning("proxy at http://%s:%d: prefill %s, decode %s", args.host, args.port,
                   [b.url for b in proxy.prefill.backends] if proxy.prefill else "none (colocated)",
                   [b.url for b in proxy.decode.backends])
    config = uvicorn.Config(app, host=args.host, port=args.port, loop=uvicorn_loop(),
                            log_level=args.uvicorn_log_level, timeout_keep_alive=5)
    server = uvicorn.Server(config)
    # uvicorn drains on SIGTERM / SIGINT, then re-raises the signal to the handler in place before
    # it: a no-op one, so a drained proxy exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1
