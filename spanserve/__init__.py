"""spanserve: an LLM inference engine whose KV cache goes beyond prefix caching."""

import os as _os
import sys as _sys

if "torch" not in _sys.modules:  # OpenMP reads these once, as torch loads it
    # Threads that spin ~0.2 ms after a parallel op, then sleep: the ops of one model step come
    # back to back, and waking a sleeping thread for each costs more than a small op (decode
    # steps 1.5x faster here), while idle threads still sleep (spinning ones starve a shared
    # machine's other work). The spin count bounds ACTIVE; PASSIVE would also cut it to 100
    # spins in a thread other than the main one (the server's engine thread), where libgomp
    # counts more threads than cores on 2 cores: 1.4x slower matmuls there.
    _os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from spanserve.config import EngineConfig  # noqa: E402
from spanserve.errors import InvalidRequestError, SpanserveError  # noqa: E402
from spanserve.llm import LLM  # noqa: E402
from spanserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from spanserve.pic.prompt import Span  # noqa: E402
from spanserve.sampling import SamplingParams  # noqa: E402
from spanserve.structured import StructuredOutputs  # noqa: E402
from spanserve.tools import Tools  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "Span", "RequestOutput", "CompletionOutput", "EngineConfig",
           "StructuredOutputs", "Tools", "SpanserveError", "InvalidRequestError", "AsyncLLM", "__version__"]


def __getattr__(name):  # AsyncLLM pulls in asyncio/threading only when asked for
    if name == "AsyncLLM":
        from spanserve.engine.async_engine import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
