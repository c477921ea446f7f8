"""One error hierarchy for the whole project.

Everything a caller can get wrong raises an `InvalidRequestError` (a ValueError),
so the server maps it to HTTP 400 and the CLI prints it without a traceback.
"""


class SpanserveError(Exception):
    """Base class of every error spanserve raises on purpose."""


class InvalidRequestError(SpanserveError, ValueError):
    """The caller asked for something that cannot be served (bad parameter, prompt too long...)."""


class PromptTooLongError(InvalidRequestError):
    code = "context_length_exceeded"

    def __init__(self, num_tokens: int, max_len: int, counted: str = ""):
        super().__init__(
            f"prompt has {counted + ' ' if counted else ''}{num_tokens} tokens but max_model_len={max_len}: a "
            f"prompt may have at most {max_len - 1} tokens so that one can be generated (prompts are never truncated)"
        )
        self.num_tokens = num_tokens
        self.max_len = max_len


class InvalidSpanError(InvalidRequestError):
    """Position-independent spans that do not fit their prompt (overlapping, outside, empty...)."""

    code = "invalid_span"


class EmptyPromptError(InvalidRequestError):
    """A prompt with no tokens: empty, or text the tokenizer turns into none (a lone control
    character, for one)."""

    code = "empty_prompt"

    def __init__(self):
        super().__init__("prompt is empty: it has no tokens")


class InvalidLinkPolicyError(InvalidRequestError):
    """Link policy settings that are each valid but do not go together (focus_spans with gap,
    focus_spans with focus_tokens): no schema of single fields can say so."""

    code = "invalid_link_policy"


class ModelNotFoundError(SpanserveError, FileNotFoundError):
    """The model path or name does not point to a loadable model."""


class UnsupportedModelError(SpanserveError, ValueError):
    """The model exists but uses an architecture or option we do not implement."""


class CacheFullError(InvalidRequestError):
    """The KV pool cannot hold what is asked (a request larger than the pool, sessions beyond
    their share of it, a session's backlog)."""

    code = "cache_full"


class BacklogFullError(CacheFullError):
    """A session's backlog holds too much data computed yet for this append: a 429, retried once
    it is computed."""

    code = "backlog_full"
    status = 429
    retry_after = 1


class CorpusNotFoundError(SpanserveError, FileNotFoundError):
    """The real-text corpus package (spanserve/corpus.py) is not installed."""


class PluginNotLoadedError(InvalidRequestError):
    """The request asks for a plug-in the engine does not have (link policy comb without one)."""

    code = "plugin_not_loaded"


class TokenIdError(InvalidRequestError):
    """Token ids outside the model's vocabulary."""

    code = "invalid_token_ids"


class InputTooLongError(InvalidRequestError):
    """An input longer than the model takes whole (it is never truncated)."""

    code = "context_length_exceeded"


class UnknownModelError(InvalidRequestError):
    """A request names a model this server does not serve for that route (404)."""

    code = "model_not_found"
    status = 404


class SessionNotFoundError(InvalidRequestError):
    """No open session with this id is visible to the caller (404: another key's session looks
    exactly like one that does not exist)."""

    code = "session_not_found"
    status = 404


class InvalidSessionError(InvalidRequestError):
    """Session settings that cannot work (a retention that leaves no room for data or questions)."""

    code = "invalid_session"


class InvalidSparseError(InvalidRequestError):
    """An unknown sparse flow, or a budget it cannot work with."""

    code = "invalid_sparse"


class SessionFullError(InvalidRequestError):
    """A question and its answer do not fit in the positions a session leaves."""

    code = "context_length_exceeded"


class SessionClosedError(InvalidRequestError):
    code = "session_closed"


class RequestFailedError(SpanserveError):
    """The engine ended one request because its own part of a step raised (a bug, not the
    client's doing): the others in the step went on."""

    code = "request_failed"


class RetryLaterError(SpanserveError):
    """Not the request's fault, and not for now: the server answers `status` with a Retry-After
    of `retry_after` seconds."""

    code = "retry_later"
    status = 503
    retry_after = 5

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        if retry_after is not None:
            self.retry_after = max(1, round(retry_after))


class AdmissionTimeoutError(RetryLaterError):
    """A request waited longer than the engine's admission_timeout_s for room to start (the KV
    pool held by running work and sessions)."""

    code = "admission_timeout"


class TooSoonError(RetryLaterError):
    """The same costly operation again before its interval (a session's save): 429."""

    code = "rate_limited"
    status = 429


class SessionFailedError(InvalidRequestError):
    """The session's background work failed: it was stopped and its memory freed. It answers
    this until its owner deletes it (409: the request is fine, the session's state is not)."""

    code = "session_failed"
    status = 409
