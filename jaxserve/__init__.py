"""jaxserve: LLM serving on JAX/XLA — paged KV cache, ragged paged attention, continuous batching."""
__version__ = "0.1.0"   # the package's version (pyproject reads it): known also where jaxserve runs uninstalled

from jaxserve.config import EngineConfig
from jaxserve.engine.llm import LLM, StreamDelta
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.engine.sequence import CompletionOutput, RequestOutput

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "StreamDelta"]
