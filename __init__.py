"""minivllm: a small LLM inference engine built the way vLLM V1 is (multi-process, ZMQ IPC, paged KV).

    from minivllm import LLM, SamplingParams

The repository's top-level folders are this package's subpackages: `minivllm.frontend` (LLM,
AsyncLLM, CLI), `minivllm.core` (the EngineCore: scheduler, KV cache manager, executor),
`minivllm.worker` (model, kernels, sampler) and `minivllm.protocol` (messages and configs).

The public names resolve on first use, so a process that imports only `minivllm.core` (the
EngineCore runs without torch) does not pay for the frontend's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "minivllm.frontend.llm",
    "AsyncLLM": "minivllm.frontend.async_llm",
    "SamplingParams": "minivllm.protocol.sampling_params",
    "RequestOutputKind": "minivllm.protocol.sampling_params",
    "RequestOutput": "minivllm.frontend.outputs",
    "CompletionOutput": "minivllm.frontend.outputs",
    "Logprob": "minivllm.frontend.outputs",
    "BeamSearchParams": "minivllm.frontend.beam_search",
    "BeamSearchOutput": "minivllm.frontend.beam_search",
    "BeamSearchSequence": "minivllm.frontend.beam_search",
    "EngineDeadError": "minivllm.frontend.core_client",
    "EngineOverloadedError": "minivllm.frontend.core_client",
    "EngineConfig": "minivllm.protocol.config",
}
_SUBPACKAGES = ("frontend", "core", "worker", "protocol")

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "EngineDeadError", "EngineOverloadedError",
           "EngineConfig", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, *_SUBPACKAGES])


if TYPE_CHECKING:  # what type checkers and IDEs see
    from minivllm.frontend.async_llm import AsyncLLM
    from minivllm.frontend.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from minivllm.frontend.core_client import EngineDeadError, EngineOverloadedError
    from minivllm.frontend.llm import LLM
    from minivllm.frontend.outputs import CompletionOutput, Logprob, RequestOutput
    from minivllm.protocol.config import EngineConfig
    from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams
