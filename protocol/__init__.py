"""Messages and configs shared by the frontend, the EngineCore and the workers (no torch here)."""

from minivllm.protocol.config import EngineConfig
from minivllm.protocol.sampling_params import SamplingParams

__all__ = ["EngineConfig", "SamplingParams"]
