"""pagedserve's inference engine: a library with no gRPC or HTTP inside.

from engine import LLM, SamplingParams
LLM().generate(["Hello"], SamplingParams(max_tokens=16))
"""

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.engine import LLMEngine
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine

__all__ = [
    "LLM",
    "AsyncEngine",
    "CacheConfig",
    "EngineConfig",
    "LLMEngine",
    "SamplingParams",
    "SchedulerConfig",
]
