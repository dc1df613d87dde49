"""The user's side of minivllm: the LLM and AsyncLLM classes, tokenization, detokenization and the CLI."""

from minivllm.frontend.async_llm import AsyncLLM
from minivllm.frontend.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from minivllm.frontend.core_client import EngineDeadError, EngineOverloadedError
from minivllm.frontend.llm import LLM
from minivllm.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "Logprob", "EngineDeadError", "EngineOverloadedError", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
