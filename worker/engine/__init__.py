"""The inference engine: sequences, scheduler, model runner, sampler and the LLMEngine API."""

from ..config import EngineConfig
from .llm_engine import LLMEngine
from .outputs import EngineStats, LayerWrite, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "LayerWrite", "RequestOutput", "SamplingParams"]
