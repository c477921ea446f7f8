"""Ready-position speculative exit (papers/stateful-streaming-sessions.txt, section 3.9.4), for
sessions that ask for it.

After each ingest the session computes one position more: its data closed as a user turn that
asks nothing, and the answer opened (the ready position). The logits there are the model's
standing assessment of the data before any question. A question may then be answered from them
with no forward pass at all: when the top token is one of the session's fast answers and leads
the second token by more than `threshold` in logits.

Such an answer has not read the question. It fits sessions whose instructions pose one standing
question ("reply ALERT or OK"); every answer says whether it was speculative.
"""

from dataclasses import dataclass

from spanserve.errors import InvalidSessionError
from spanserve.sampling import SamplingParams

DEFAULT_THRESHOLD = 2.0  # the paper's tau
# One greedy token with the two best logprobs: their difference is the logit gap (the
# softmax's normalizer cancels).
PARAMS = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)


@dataclass
class ReadyExit:
    answers: tuple[str, ...]  # the fast-answer vocabulary: token texts, without surrounding spaces
    threshold: float = DEFAULT_THRESHOLD
    version: int = -1  # the data version the kept assessment is for
    token: str | None = None  # the top token's text there, stripped
    gap: float = 0.0  # its logit lead over the second token
    running: object | None = None  # the RequestGroup computing it now
    asking: int = -1  # the data version it sees

    @classmethod
    def make(cls, answers, threshold: float = DEFAULT_THRESHOLD) -> "ReadyExit | None":
        """The exit a session asked for, checked; None for no answers (off)."""
        if not answers:
            return None
        if not isinstance(answers, (list, tuple)) or not all(isinstance(a, str) and a.strip() for a in answers):
            raise InvalidSessionError("exit_answers must be a list of non-empty strings")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise InvalidSessionError(f"exit_threshold must be a number >= 0, got {threshold!r}")
        return cls(tuple(a.strip() for a in answers), float(threshold))

    def answer(self, version: int) -> str | None:
        """The speculative answer at data `version`, if the assessment there is confident enough."""
        if self.version == version and self.token in self.answers and self.gap > self.threshold:
            return self.token
        return None

    def record(self, output) -> None:
        """Keep the assessment a finished ready-position request computed."""
        completion = output.outputs[0]
        top = sorted(completion.logprobs[0].values(), reverse=True)
        self.version, self.token, self.gap = self.asking, completion.text.strip(), top[0] - top[1]

    def info(self) -> dict:
        return {"answers": list(self.answers), "threshold": self.threshold, "version": self.version,
                "token": self.token, "gap": self.gap}
