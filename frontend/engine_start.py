"""How LLM and AsyncLLM reach their engine: attach to a running one, or spawn one, with the config
made (transformers' import, the model's config) while the engine starts and the tokenizer loading
meanwhile; then the input processor for what the engine serves."""

from __future__ import annotations

from typing import Any, TypeVar

from minivllm.frontend.core_client import AsyncEngineCoreClient, EngineCoreClient, config_beside_engine
from minivllm.frontend.input_processor import InputProcessor, TokenizerLoad
from minivllm.frontend.model_download import resolve_model
from minivllm.protocol.config import EngineConfig

Client = TypeVar("Client", EngineCoreClient, AsyncEngineCoreClient)


def start_engine(client_class: type[Client], model: str | None, engine_args: dict[str, Any], *,
                 skip_tokenizer_init: bool, engine_address: str | None, engine_key: str | None,
                 config_defaults: dict[str, Any] | None = None) -> tuple[Client, InputProcessor]:
    """(client, input processor). engine_address: attach to that engine (engine_args are then
    ignored); else spawn one from EngineConfig.create(model, **config_defaults, **engine_args). A
    failure after the engine is up stops it before raising."""
    if engine_address is not None:
        client = client_class.attach(engine_address, engine_key=engine_key)
        tokenizer_load = None
    else:
        # The engine processes only see HF directories: fetch / convert here, in the frontend.
        config, pending = config_beside_engine(
            lambda: EngineConfig.create(resolve_model(model), **{**(config_defaults or {}), **engine_args}),
            engine_args)
        tokenizer_load = None if skip_tokenizer_init else TokenizerLoad(config.tokenizer)
        client = client_class.spawn(config, pending)
    try:
        return client, InputProcessor.for_engine(client.engine_info, skip_tokenizer_init, tokenizer_load)
    except BaseException:
        client.shutdown()
        raise
