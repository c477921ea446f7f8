"""StructuredOutputs: what a request's output must match (vLLM's StructuredOutputsParams)."""

import json
from dataclasses import dataclass

from spanserve.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


class InvalidGrammarError(InvalidRequestError):
    """A schema, regex or grammar that is malformed or that the grammar library cannot compile."""

    code = "invalid_grammar"


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: `json` a JSON schema (a dict or its text), `json_object` any JSON object,
    `regex`, `choice` one of these strings, `grammar` a Lark grammar (llguidance's dialect)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidGrammarError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                                      f"{', '.join(given) or 'none'}")
        if not isinstance(self.json_object, bool):
            raise InvalidGrammarError("structured_outputs.json_object must be a boolean")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise InvalidGrammarError(f"structured_outputs.json is not valid JSON: {exc}") from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, dict):
            raise InvalidGrammarError("structured_outputs.json must be a JSON schema object")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidGrammarError(f"structured_outputs.{kind} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidGrammarError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @classmethod
    def of(cls, value) -> "StructuredOutputs | None":
        """A StructuredOutputs from itself, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict) or not set(value) <= set(KINDS):
            raise InvalidGrammarError(f"structured_outputs must be a StructuredOutputs or a dict of {', '.join(KINDS)}")
        return cls(**value)

    def key(self) -> str:
        """Its grammar's source, canonical: equal constraints share one compiled grammar."""
        kind = next(k for k in KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        return f"{kind}:{json.dumps(value, sort_keys=True) if kind in ('json', 'choice') else value}"


def from_response_format(value) -> StructuredOutputs | None:
    """OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", "json_schema":
    {"schema": ...}}) as a constraint; None for free text."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    spec = value.get("json_schema") if kind == "json_schema" else None
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidGrammarError("response_format is {'type': 'text'}, {'type': 'json_object'} or "
                                  "{'type': 'json_schema', 'json_schema': {'schema': {...}}}")
    return StructuredOutputs(json=spec["schema"])
