"""`minivllm serve`'s own flags (kept apart from the server so building the CLI's parser imports
no web framework)."""

from __future__ import annotations

import argparse

API_KEY_ENV = "MINIVLLM_API_KEY"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (the engine's come from cli.add_engine_args)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback unless you choose otherwise)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's name(s) in the API (the first is used in responses); default: --model as given")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file path or the template itself) instead of the tokenizer's")
    g.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on /v1 routes (also from ${API_KEY_ENV})")
    g.add_argument("--allowed-origins", default=None,
                   help="CORS: allowed origins, comma-separated or a JSON list (CORS is off without it)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let requests in flight finish before aborting them")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per request")
    g.add_argument("--engine-address", default=None,
                   help="attach to a running `minivllm engine` at this address instead of starting one")
