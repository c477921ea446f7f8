"""SpeculativeConfig: vLLM's speculative_config, checked when the engine starts."""

import json
from dataclasses import dataclass

from spanserve.errors import InvalidRequestError

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfigError(InvalidRequestError):
    code = "invalid_speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2  # ngram: the shortest suffix looked up in the context
    prompt_lookup_max: int = 4  # ngram: the longest
    model: str | None = None  # draft_model: the draft's weights

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """From a dict (vLLM's speculative_config), its JSON text, itself or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise SpeculativeConfigError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("speculative_config is an object: {'method': 'ngram', "
                                         "'num_speculative_tokens': 4, ...}")
        unknown = set(value) - {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        if unknown:
            raise SpeculativeConfigError(f"speculative_config: unknown field {', '.join(sorted(unknown))}")
        if "num_speculative_tokens" not in value:
            raise SpeculativeConfigError("speculative_config needs num_speculative_tokens")
        return cls(**{"method": "ngram", **value})

    def __post_init__(self):
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"unknown speculative method {self.method!r}; use one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                                         f"got {k!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high)) or not 1 <= low <= high <= 64:
            raise SpeculativeConfigError(f"prompt_lookup_min and prompt_lookup_max must be integers with "
                                         f"1 <= min <= max <= 64, got {low!r} and {high!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise SpeculativeConfigError("speculative method draft_model takes the draft's model (a name, directory "
                                         "or .gguf), and only it does")
