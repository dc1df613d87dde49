"""Messages and configs shared by the frontend, the EngineCore and the workers (no torch here)."""

from protocol.config import EngineConfig
from protocol.sampling_params import SamplingParams

__all__ = ["EngineConfig", "SamplingParams"]
