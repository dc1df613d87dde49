"""The user's side of minivllm: the LLM class, tokenization, detokenization and the CLI."""

from frontend.core_client import EngineDeadError
from frontend.llm import LLM
from frontend.outputs import CompletionOutput, RequestOutput
from protocol.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineDeadError"]
