"""LLM: the offline Python API, shaped like vLLM's."""

from collections.abc import Sequence

from spanserve.config import EngineConfig
from spanserve.engine.llm_engine import LLMEngine, PromptInput
from spanserve.errors import InvalidRequestError
from spanserve.outputs import RequestOutput
from spanserve.pic.prompt import is_parts_prompt
from spanserve.sampling import SamplingParams
from spanserve.sessions import persist
from spanserve.sessions.ready import DEFAULT_THRESHOLD
from spanserve.sessions.session import Answer, Session
from spanserve.tools import Tools
from spanserve.tools.conversation import chat_request


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
        return self._run(groups)

    def _run(self, groups: list) -> list[RequestOutput]:
        """Step the engine until `groups` finish (background work advances meanwhile)."""
        finished: dict[str, RequestOutput] = {}
        while not all(g.request_id in finished for g in groups):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
            failed = self.engine.take_failed()  # requests the engine ended with an error of their own
            if errors := [failed[g.request_id] for g in groups if g.request_id in failed]:
                for g in groups:
                    self.engine.abort_request(g.request_id)
                raise errors[0]
        return [finished[g.request_id] for g in groups]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: Tools | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them. A content may be
        a list of parts, some of them spans: [Span(doc1), Span(doc2), "question"]. With `tools`
        (spanserve.tools.Tools), messages may carry OpenAI's tool_calls and tool results, and
        `tools.reply(output.text, output.finish_reason)` reads an answer's calls."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if tools is not None and not isinstance(tools, Tools):
            raise InvalidRequestError("tools must be a spanserve.tools.Tools")
        params = _per_prompt(sampling_params, len(conversations))
        requests = [chat_request(self.engine, c, p, tools) for c, p in zip(conversations, params)]
        return self.generate([prompt for prompt, _ in requests], [p for _, p in requests])

    def run_query(self, query, judge_arity: int | None = None, retriever=None):
        """Run a span query (a tree from spanserve.spans, its JSON form, or JSON text) and return
        a QueryResult: the root call's text and per-call token counts and TTFTs. Given a list of
        queries, runs them together (their calls share steps) and returns a list of results."""
        from spanserve.spans.api import run_sync

        queries = query if isinstance(query, list) else [query]
        results = run_sync(self.engine, queries, retriever=retriever, judge_arity=judge_arity)
        return results if isinstance(query, list) else results[0]

    def apply_chat_template(self, messages: list[dict], tools: Tools | None = None) -> list[int]:
        return chat_request(self.engine, messages, SamplingParams(), tools)[0]["prompt_token_ids"]

    def create_session(self, system: str = "You are a helpful assistant.", retention_tokens: int | None = None,
                       flash: Sequence[str] = (), flash_max_tokens: int = 64, exit_answers: Sequence[str] = (),
                       exit_threshold: float = DEFAULT_THRESHOLD) -> "LLMSession":
        """A streaming session (sessions/session.py): append data as it arrives, ask questions that
        cost only their own tokens. `flash` questions are answered again after each ingest.
        `exit_answers` turns on ready-position speculative exit (sessions/ready.py): a question is
        answered, unread, with one of them when the model's assessment of the data alone is that
        confident (its top token leads by more than `exit_threshold` logits)."""
        return LLMSession(self, self.engine.sessions.create(system, retention_tokens, list(flash),
                                                            flash_max_tokens=flash_max_tokens,
                                                            exit_answers=exit_answers,
                                                            exit_threshold=exit_threshold))

    def restore_session(self, path: str) -> "LLMSession":
        """Open a session saved by LLMSession.save (same model and setup)."""
        return LLMSession(self, self.engine.sessions.restore(path))


class LLMSession:
    """A session driven by the offline LLM. Its data is computed in the background of the
    engine's steps: while a question (or generate()) runs, or in wait()."""

    def __init__(self, llm: LLM, session: Session):
        self._llm, self._session = llm, session

    @property
    def id(self) -> str:
        return self._session.id

    @property
    def version(self) -> int:
        """The data version questions see now (append() returns the version of its data)."""
        return self._session.state.visible_version

    def append(self, text: str) -> int:
        return self._session.append(text)

    def wait(self, version: int | None = None) -> None:
        """Step the engine until data `version` (default: all appended) is visible to questions and
        the registered questions are answered for it."""
        while not self._session.caught_up(version) and self._llm.engine.has_unfinished_requests():
            self._llm.engine.step()
        self._session.check_usable()  # a session that failed meanwhile says so

    def query(self, question: str, sampling_params: SamplingParams | None = None) -> Answer:
        """Answer over the data visible now (a registered question's kept answer, if current)."""
        result = self._session.query(question, sampling_params or SamplingParams())
        if isinstance(result, Answer):
            return result
        out = self._llm._run([result.group])[0]
        return Answer(out.outputs[0].text, result.version, output=out)

    def register(self, question: str) -> None:
        self._session.register(question)
        self._session.service()

    def flash_answers(self) -> dict[str, tuple[int, str | None]]:
        """Each registered question's latest answer and the data version it is for."""
        return {q: (f.version, f.answer) for q, f in self._session.flash.items()}

    def info(self) -> dict:
        return self._session.info()

    def save(self, path: str) -> None:
        """Write the session to one file (restore it with LLM.restore_session)."""
        persist.save(self._session, path)

    def close(self) -> None:
        self._llm.engine.sessions.close(self._session.id, self._session.tenant)


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} sampling_params for {count} prompts")
    return list(params)
