"""SamplingParams: how one request turns logits into tokens, in vLLM's shape."""

from dataclasses import dataclass, field

from spanserve.errors import InvalidRequestError, InvalidSparseError
from spanserve.structured.params import StructuredOutputs
from spanserve.utils import strict_kwargs


@strict_kwargs
@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    skip_special_tokens: bool = True
    # Position-independent spans (pic/link.py): None takes the engine's default.
    link_policy: str | None = None  # none | gap | blend | full | comb | ape
    gap_length: int | None = None
    blend_ratio: float | None = None
    blend_layers: int | None = None
    ape_temperature: float | None = None
    ape_scale: float | None = None
    focus_spans: int | None = None  # none, comb: spans recomputed in context, picked by the question
    focus_tokens: int | None = None  # none, comb: or a budget of span tokens it picks, in 16-token blocks
    # Sparse decode (spanserve/sparse/): a flow's name, and the tokens it may attend to per step;
    # sparse_prefill: a prompt's short suffix after cached KV (a session's question) attends sparsely too.
    sparse: str | None = None
    sparse_budget: int = 2048
    sparse_prefill: bool = False
    # Constrained decoding (spanserve/structured/): a StructuredOutputs, or a dict of its fields
    # (json, json_object, regex, choice, grammar), as vLLM spells it.
    structured_outputs: "StructuredOutputs | dict | None" = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
            ),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            # Beyond these a logit divided or multiplied by it overflows to inf (then NaN)
            (0.01 <= self.repetition_penalty <= 100,
             f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}"),
            (self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64),
             f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be a non-empty string or a list of non-empty strings"),
            (isinstance(self.sparse_prefill, bool), f"sparse_prefill must be a boolean, got {self.sparse_prefill!r}"),
        ]
        link_fields = ("gap_length", "blend_ratio", "blend_layers", "ape_temperature", "ape_scale", "focus_spans",
                       "focus_tokens")
        given = {f: getattr(self, f) for f in link_fields if getattr(self, f) is not None}
        if self.link_policy is not None or given:
            from spanserve.pic.link import LinkPolicy

            LinkPolicy(self.link_policy or "none", **given)  # raises if bad
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        if self.sparse_prefill and self.sparse is None:
            raise InvalidSparseError("sparse_prefill needs a sparse flow (sparse=...)")
        self.structured_outputs = StructuredOutputs.of(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
