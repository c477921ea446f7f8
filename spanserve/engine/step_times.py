"""Where the engine's time goes: per kind of step, how many steps ran, the tokens they computed,
their time, and the part of it inside the model (the forward pass and the LM head).

A step's time less its model time is the engine's host work around the model: scheduling,
building the inputs, sampling, detokenizing, stop checks. A server's /metrics exposes the
totals, and `spanserve bench serve` reads them before and after a run to say how much of the run
the engine spent computing, in host work, or idle (spanserve.server.metrics)."""

import time
from dataclasses import dataclass, field

STEP_KINDS = ("decode", "prefill", "mixed")


@dataclass
class StepTotals:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    model_seconds: float = 0.0


@dataclass
class StepTimes:
    totals: dict[str, StepTotals] = field(default_factory=lambda: {kind: StepTotals() for kind in STEP_KINDS})

    def add(self, kind: str, tokens: int, seconds: float, model_seconds: float) -> None:
        total = self.totals[kind]
        total.steps += 1
        total.tokens += tokens
        total.seconds += seconds
        total.model_seconds += model_seconds


def step_kind(decoding: int, prefilling: int) -> str:
    """A step whose requests all decode (one token each, or a draft to verify), all prefill, or both."""
    if prefilling == 0:
        return "decode"
    return "prefill" if decoding == 0 else "mixed"


class ModelClock:
    """Time inside the model, summed: `with clock:` around a forward pass and its LM head. A step's
    model time is what `seconds` gained during it, so a draft model's passes inside the step count
    too where its runner shares the target's clock. Not reentrant: the passes it times never nest."""

    def __init__(self):
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> "ModelClock":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self._start
