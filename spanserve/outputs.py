"""What generation returns, in vLLM's shape."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob} incl. the chosen one
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
