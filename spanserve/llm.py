"""LLM: the offline Python API, shaped like vLLM's."""

from collections.abc import Sequence

from spanserve.config import EngineConfig
from spanserve.engine.llm_engine import LLMEngine, PromptInput
from spanserve.errors import InvalidRequestError
from spanserve.outputs import RequestOutput
from spanserve.pic.prompt import is_parts_prompt
from spanserve.sampling import SamplingParams


class LLM:
    """`LLM()` loads the embedded SmolLM2; `LLM(model=DIR_OR_GGUF, **EngineConfig fields)` another."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs keep input order.
        A list holding a Span is one prompt made of parts: [text, Span(doc), ..., question]."""
        if isinstance(prompts, (str, dict)) or is_parts_prompt(prompts):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise InvalidRequestError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        params = _per_prompt(sampling_params, len(prompts))
        # Validate everything first so one bad prompt does not leave others half-run.
        groups = [self.engine.make_group(p, sp) for p, sp in zip(prompts, params)]
        for group in groups:
            self.engine.add_group(group)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[g.request_id] for g in groups]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them. A content may be
        a list of parts, some of them spans: [Span(doc1), Span(doc2), "question"]."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.chat_prompt(c) for c in conversations]
        return self.generate(prompts, sampling_params)

    def run_query(self, query, judge_arity: int | None = None, retriever=None):
        """Run a span query (a tree from spanserve.spans, its JSON form, or JSON text) and return
        a QueryResult: the root call's text and per-call token counts and TTFTs. Given a list of
        queries, runs them together (their calls share steps) and returns a list of results."""
        from spanserve.spans.api import run_sync

        queries = query if isinstance(query, list) else [query]
        results = run_sync(self.engine, queries, retriever=retriever, judge_arity=judge_arity)
        return results if isinstance(query, list) else results[0]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.engine.chat_prompt(messages)["prompt_token_ids"]


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} sampling_params for {count} prompts")
    return list(params)
