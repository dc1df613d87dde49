"""The user's side of minivllm: the LLM and AsyncLLM classes, tokenization, detokenization and the CLI."""

from frontend.async_llm import AsyncLLM
from frontend.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from frontend.core_client import EngineDeadError
from frontend.llm import LLM
from frontend.outputs import CompletionOutput, Logprob, RequestOutput
from protocol.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "Logprob", "EngineDeadError", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
