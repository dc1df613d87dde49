"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM, run by uvicorn (on uvloop
when installed), in one process with the frontend, as vLLM's api_server.

    minivllm serve --model DIR --host 127.0.0.1 --port 8000

Endpoints: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models,
/health, /metrics, /version. With --api-key (or MINIVLLM_API_KEY) every /v1 route needs
`Authorization: Bearer KEY`. SIGTERM / Ctrl-C: stop accepting connections, let requests in flight
finish (aborting them after --shutdown-timeout), stop the engine, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from minivllm.frontend.async_llm import AsyncLLM
from minivllm.frontend.core_client import EngineDeadError
from minivllm.frontend.server.args import API_KEY_ENV
from minivllm.frontend.server.errors import APIError, bad_request
from minivllm.frontend.server.metrics import ServerMetrics
from minivllm.frontend.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                               ModelCard, ModelList, TokenizeRequest)
from minivllm.frontend.server.serving_chat import OpenAIServingChat, render
from minivllm.frontend.server.serving_completions import OpenAIServingCompletion
from minivllm.frontend.server.serving_engine import OpenAIServing, as_api_error
from minivllm.protocol.gc_heap import freeze_gc_heap

logger = logging.getLogger(__name__)

def build_async_llm(args: argparse.Namespace) -> AsyncLLM:
    """The server's AsyncLLM: spawned from the engine flags, or attached with --engine-address.
    (The one place the server builds it, so engine-side options are threaded through here.)"""
    from minivllm.frontend.cli import engine_kwargs
    from minivllm.protocol.auth import resolve_engine_key

    if args.engine_address:  # a keyed engine (--engine-key-file / $MINIVLLM_ENGINE_KEY) needs its key
        return AsyncLLM(engine_address=args.engine_address,
                        engine_key=resolve_engine_key(key_file=args.engine_key_file))
    from minivllm.frontend.server.args import resolve_kv_transfer_config

    return AsyncLLM(args.model, **{**engine_kwargs(args), "kv_transfer_config": resolve_kv_transfer_config(args),
                                   "usage_context": "OPENAI_API_SERVER"})


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a path to a template file, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value and ("/" in value or value.endswith((".jinja", ".j2"))):
        raise ValueError(f"--chat-template {value!r}: no such file (and it does not look like a template)")
    return value


def parse_origins(value: str | None) -> list[str] | None:
    if value is None:
        return None
    value = value.strip()
    if value.startswith("["):
        origins = json.loads(value)
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError(f"--allowed-origins must be a JSON list of strings, got {value!r}")
        return origins
    return [o.strip() for o in value.split(",") if o.strip()]


def build_app(engine: AsyncLLM, *, served_model_names: list[str] | None = None, model_path: str | None = None,
              api_key: str | None = None, chat_template: str | None = None, allowed_origins: list[str] | None = None,
              max_in_flight: int = 4096) -> FastAPI:
    """The FastAPI app over `engine` (which the caller owns and shuts down)."""
    from minivllm import __version__

    import prometheus_client

    prometheus_client.disable_created_metrics()  # no *_created series (as vLLM)
    info = engine.engine_info
    model_path = model_path or info.model
    names = served_model_names or [model_path]
    metrics = ServerMetrics(names[0], info.max_model_len)
    serving = OpenAIServing(engine, names, model_path, metrics, max_in_flight, chat_template)
    completions = OpenAIServingCompletion(serving)
    chat = OpenAIServingChat(serving)

    app = FastAPI(title="minivllm", version=__version__)
    app.state.serving = serving
    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            # /v1 needs the key; /health, /metrics, /version, /tokenize stay open (as in vLLM).
            if request.method != "OPTIONS" and request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "").encode()
                if not secrets.compare_digest(given, expected):
                    return APIError(HTTPStatus.UNAUTHORIZED, "Unauthorized: missing or wrong API key "
                                    "(send `Authorization: Bearer KEY`).").response()
            return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                             for e in error.errors())
        param = next((str(e["loc"][1]) for e in error.errors() if len(e.get("loc", ())) > 1), None)
        return bad_request(f"invalid request: {problems}", param).response()

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return as_api_error(error).response()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request):
        return await completions.create(body, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
        return await chat.create(body, raw_request)

    @app.get("/v1/models")
    async def show_models() -> dict[str, Any]:
        cards = [ModelCard(id=name, root=model_path, max_model_len=info.max_model_len) for name in names]
        return ModelList(data=cards).model_dump()

    @app.get("/health")
    async def health() -> Response:
        try:
            if engine.errored:
                raise engine.dead_error
            await asyncio.wait_for(engine.check_health(), timeout=10.0)
        except (EngineDeadError, asyncio.TimeoutError) as e:
            return APIError(HTTPStatus.SERVICE_UNAVAILABLE, f"the engine is not healthy: {e or 'no answer'}").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if not engine.errored:
            try:
                metrics.engine.stats = await asyncio.wait_for(engine.get_stats(), timeout=5.0)
            except (EngineDeadError, asyncio.TimeoutError):
                pass  # the last stats stay; /health says what is wrong
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        tokenizer = engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages.")
        if body.messages is not None:
            try:
                ids = render(serving, body.messages, body.chat_template, body.add_generation_prompt,
                             body.chat_template_kwargs)["prompt_token_ids"]
            except ValueError as e:
                raise bad_request(str(e), "messages") from e
        else:
            ids = list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
        return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        serving.check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token {bad} is outside the vocabulary; ids must be in [0, {info.vocab_size}).",
                              "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return app


def uvicorn_loop() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        logger.warning("uvloop is not installed: serving on the asyncio event loop (pip install uvloop)")
        return "asyncio"
    return "uvloop"


def run_server(args: argparse.Namespace) -> int:
    """`minivllm serve`: start (or attach to) the engine, serve until SIGTERM / Ctrl-C, drain, exit 0."""
    import uvicorn

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    chat_template = load_chat_template(args.chat_template)
    origins = parse_origins(args.allowed_origins)
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    engine = build_async_llm(args)
    try:
        model_path = args.model if (args.model and not args.engine_address) else engine.engine_info.model
        app = build_app(engine, served_model_names=args.served_model_name, model_path=model_path, api_key=api_key,
                        chat_template=chat_template, allowed_origins=origins,
                        max_in_flight=args.max_pending_requests)
        config = uvicorn.Config(app, host=args.host, port=args.port, loop=uvicorn_loop(),
                                log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                                timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=5)
        server = uvicorn.Server(config)
        # uvicorn drains on SIGTERM / SIGINT, then re-raises the signal to the handler that was in
        # place before it: make that one a no-op, so a drained server exits 0 after the engine stops.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        logger.warning("serving %s at http://%s:%d (model name %r)", model_path, args.host, args.port,
                       app.state.serving.model_name)
        freeze_gc_heap("server")
        server.run()
        if not server.started:
            return 1  # e.g. the port was taken (uvicorn logged why)
    finally:
        engine.shutdown()
    return 0
