"""spanserve: an LLM inference engine whose KV cache goes beyond prefix caching."""

import os as _os
import sys as _sys

if "torch" not in _sys.modules:  # OpenMP reads these once, as torch loads it
    # Threads that sleep between ops (spinning ones starve a shared machine's other work), but
    # spin ~0.2 ms first: the ops of one model step come back to back, and waking a sleeping
    # thread for each costs more than a small op. 1.6x faster decode steps of 8 sequences here.
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from spanserve.config import EngineConfig  # noqa: E402
from spanserve.errors import InvalidRequestError, SpanserveError  # noqa: E402
from spanserve.llm import LLM  # noqa: E402
from spanserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from spanserve.pic.prompt import Span  # noqa: E402
from spanserve.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "Span", "RequestOutput", "CompletionOutput", "EngineConfig",
           "SpanserveError", "InvalidRequestError", "AsyncLLM", "__version__"]


def __getattr__(name):  # AsyncLLM pulls in asyncio/threading only when asked for
    if name == "AsyncLLM":
        from spanserve.engine.async_engine import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
