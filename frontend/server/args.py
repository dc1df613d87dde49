"""`minivllm serve`'s own flags (kept apart from the server so building the CLI's parser imports
no web framework)."""

from __future__ import annotations

import argparse

API_KEY_ENV = "MINIVLLM_API_KEY"

# `--kv-transfer-role` -> vLLM's kv_role, and the prefill/decode connectors it picks from.
KV_TRANSFER_ROLES = {"producer": "kv_producer", "consumer": "kv_consumer"}
# The connector --kv-transfer-role picks: on GPUs the blocks go device to device over NCCL; on CPU
# over ZMQ/TCP as raw buffer frames. (--kv-transfer-config names either explicitly.)
ZMQ_PD_CONNECTOR = "ZmqTcpConnector"
NCCL_PD_CONNECTOR = "P2pNcclConnector"


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
    k = parser.add_argument_group("prefill/decode disaggregation")
    k.add_argument("--kv-transfer-role", default=None, choices=sorted(KV_TRANSFER_ROLES),
                   help="producer: a prefill instance that keeps a finished prompt's KV for a decode instance "
                        "to pull; consumer: a decode instance that pulls it (see `minivllm proxy`). Short for "
                        f"--kv-transfer-config with kv_role kv_producer / kv_consumer and the connector "
                        f"{NCCL_PD_CONNECTOR} on CUDA (GPU to GPU), {ZMQ_PD_CONNECTOR} on CPU")
    k.add_argument("--kv-ip", default=None,
                   help="producer: the address its KV server listens on and tells decode instances "
                        "(default 127.0.0.1)")
    k.add_argument("--kv-port", type=int, default=None,
                   help="producer: the KV server's first port (tensor-parallel rank r uses port + r; default 14579)")


def resolve_kv_transfer_config(args: argparse.Namespace) -> dict | None:
    """--kv-transfer-role / --kv-ip / --kv-port folded into --kv-transfer-config (whose explicit
    values win; a conflicting role is an error)."""
    role = args.kv_transfer_role
    config = dict(args.kv_transfer_config) if args.kv_transfer_config else None
    if config is None and role is None:
        if args.kv_ip is not None or args.kv_port is not None:
            raise ValueError("--kv-ip / --kv-port need --kv-transfer-role (or --kv-transfer-config)")
        return None
    config = config or {}
    if role is not None:
        kv_role = KV_TRANSFER_ROLES[role]
        if config.setdefault("kv_role", kv_role) != kv_role:
            raise ValueError(f"--kv-transfer-role {role} means kv_role {kv_role!r}, but --kv-transfer-config says "
                             f"{config['kv_role']!r}; give one of them")
        if "kv_connector" not in config:
            from minivllm.protocol.config import runs_on_cuda

            config["kv_connector"] = NCCL_PD_CONNECTOR if runs_on_cuda(args.device) else ZMQ_PD_CONNECTOR
    for key, value in (("kv_ip", args.kv_ip), ("kv_port", args.kv_port)):
        if value is not None:
            config.setdefault(key, value)
    return config
