"""AsyncLLM: the engine on a background thread, streaming outputs to asyncio callers.

The model step blocks for milliseconds to seconds, so it runs on its own thread; asyncio
callers never wait on a lock. New requests and aborts reach the thread through an inbox
that it drains between steps, and outputs come back through each request's asyncio.Queue.

The engine is best built on that thread too (pass a function that builds it). OpenMP keeps one
thread team per thread that runs parallel ops: a model loaded on the main thread and stepped on
this one leaves two teams, more threads than the cores of a small machine, and libgomp then
cuts its workers' spin so that they sleep between the ops of a step (SmolLM2's bf16 decode
step at batch 8 on 2 cores: 42-47 ms against 29-31). Built here, the engine thread's team is the
only one; and a request is validated and tokenized on the caller's thread (a server's event loop)
with one torch thread, so that no op there starts a second team.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from spanserve.config import EngineConfig
from spanserve.engine.llm_engine import LLMEngine, PromptInput, RequestGroup
from spanserve.kernels.threads import helper_thread
from spanserve.outputs import RequestOutput
from spanserve.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]):
        """`engine`, or a function that builds it on the engine thread (the faster choice: see
        above); what it raises, this raises."""
        self.engine: LLMEngine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Set when a request is put in the inbox: a step of background work (session ingest) then
        # stops between layers, so that the request waits for a layer, not a whole chunk.
        self._arrived = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        built, failure = threading.Event(), []
        self._thread = threading.Thread(target=self._run, args=(engine, built, failure), name="spanserve-engine",
                                        daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            raise failure[0]

    @classmethod
    def from_config(cls, model: str | None = None, **kwargs) -> "AsyncLLM":
        return cls(lambda: LLMEngine(EngineConfig(model=model, **kwargs)))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(
        self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None, tenant: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs as tokens arrive; the last has finished=True.

        Invalid requests raise before anything is queued. Leaving the iteration early
        (client disconnect, cancellation) aborts the request and frees its blocks.
        """
        outputs = self.submit(prompt, params, request_id, tenant)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    def submit(
        self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None, tenant: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Like generate(), but an invalid request raises here, at once, rather than at the first
        iteration (a server must answer 400 before it starts streaming). The request reaches the
        engine when the iteration starts; an iterator never started costs nothing."""
        with helper_thread():
            group = self.engine.make_group(prompt, params, request_id, tenant=tenant)
        return self._outputs(group.request_id, lambda: self.engine.add_group(group))

    def submit_started(self, request_id: str, start: Callable[[], object]) -> AsyncIterator:
        """The outputs of request `request_id`, which `start()` adds to the engine on its thread (a
        request an extension builds from engine state: a question to a session). If `start` returns
        something other than None or a RequestGroup (an answer it had kept), that is the only item;
        if it raises, the iteration does."""
        return self._outputs(request_id, start)

    async def call(self, fn: Callable[[], object]):
        """Run `fn()` on the engine thread, between steps, and return (or raise) what it does."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(("call", (fn, loop, future)))
        return await future

    async def _outputs(self, request_id: str, start: Callable[[], object]) -> AsyncIterator:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._inbox.put(("start", (request_id, start)))
        self._arrived.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = not isinstance(item, RequestOutput) or item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=10)

    # ---- engine thread -----------------------------------------------------------------

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine], built: threading.Event, failure: list) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as exc:  # handed to the constructor, which raises it
            failure.append(exc)
            return
        finally:
            built.set()
        while not self._stopped:
            # Block for work only when idle; otherwise drain what arrived and step.
            self._handle(self._inbox.get() if not self.engine.has_unfinished_requests() else None)
            self._arrived.clear()  # before draining: a request put from now on sets it again
            while not self._inbox.empty():
                self._handle(self._inbox.get_nowait())
            if self.engine.has_unfinished_requests():
                self._step()

    def _handle(self, command) -> None:
        if command is None:
            return
        kind, arg = command
        if kind == "start":
            self._start(*arg)
        elif kind == "call":
            self._call(*arg)
        elif kind == "abort":
            self.engine.abort_request(arg)

    def _start(self, request_id: str, start: Callable[[], object]) -> None:
        stream = self._streams.get(request_id)
        if stream is None:  # aborted before it reached the engine
            return
        try:
            result = start()
        except Exception as exc:  # e.g. a duplicate request id
            stream.put(exc)
            return
        if result is not None and not isinstance(result, RequestGroup):
            self._streams.pop(request_id, None)
            stream.put(result)

    @staticmethod
    def _call(fn: Callable[[], object], loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        def settle(method, value):
            if not future.done():  # the caller may have been cancelled meanwhile
                method(value)
        try:
            result = fn()
        except Exception as exc:
            loop.call_soon_threadsafe(settle, future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(settle, future.set_result, result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step(interrupt=self._arrived.is_set)
        except Exception as exc:  # a bug, not a user error: fail the running requests, keep serving
            log.exception("engine step failed; aborting the running requests")
            for request_id in list(self.engine.groups):
                self.engine.abort_request(request_id)
                stream = self._streams.pop(request_id, None)
                if stream:
                    stream.put(RuntimeError(f"engine step failed: {exc}"))
            return
        for request_id, exc in self.engine.take_failed().items():  # e.g. no room to start in time
            stream = self._streams.pop(request_id, None)
            if stream:
                stream.put(exc)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
