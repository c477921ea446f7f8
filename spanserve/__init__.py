"""spanserve: an LLM inference engine whose KV cache goes beyond prefix caching."""

from spanserve.config import EngineConfig
from spanserve.errors import InvalidRequestError, SpanserveError
from spanserve.llm import LLM
from spanserve.outputs import CompletionOutput, RequestOutput
from spanserve.pic.prompt import Span
from spanserve.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "Span", "RequestOutput", "CompletionOutput", "EngineConfig",
           "SpanserveError", "InvalidRequestError", "AsyncLLM", "__version__"]


def __getattr__(name):  # AsyncLLM pulls in asyncio/threading only when asked for
    if name == "AsyncLLM":
        from spanserve.engine.async_engine import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
