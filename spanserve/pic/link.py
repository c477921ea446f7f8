"""Link policies: which tokens of each independently computed span to recompute in context.

A span computed alone never saw the text before it, so its tokens carry no link to it. The
policies, per request:
- none: reuse every span block as cached;
- gap: recompute the first `gap_length` tokens of each span with full attention (EPIC /
  Legolink), rounded up to whole 16-token blocks: the KV cache's unit of sharing;
- blend: recompute the `blend_ratio` fraction of span tokens whose KV would change most in
  context, measured by a cheap probe at the second layer (CacheBlend; engine/runner.py);
- full: recompute everything, i.e. ignore the spans (the accuracy reference);
- comb: span KV written by a trained encoder plug-in (spanserve/comb/), read by the frozen
  decoder as it is: nothing recomputed.
Recomputed tokens land in blocks private to the request; the shared span blocks are never
written.
"""

from dataclasses import dataclass

from spanserve.errors import InvalidRequestError

POLICIES = ("none", "gap", "blend", "full", "comb")


@dataclass(frozen=True)
class LinkPolicy:
    name: str = "none"
    gap_length: int = 0
    blend_ratio: float = 0.0
    plugin: str = ""  # comb: the signature of the encoder plug-in that computes span KV

    def __post_init__(self):
        if self.name not in POLICIES:
            raise InvalidRequestError(f"link_policy must be one of {', '.join(POLICIES)}, got {self.name!r}")
        if not isinstance(self.gap_length, int) or self.gap_length < 0:
            raise InvalidRequestError(f"gap_length must be an integer >= 0, got {self.gap_length!r}")
        if not isinstance(self.blend_ratio, (int, float)) or not 0 <= self.blend_ratio <= 1:
            raise InvalidRequestError(f"blend_ratio must be in [0, 1], got {self.blend_ratio!r}")

    @property
    def uses_spans(self) -> bool:
        return self.name != "full"

    @property
    def selects(self) -> bool:
        """True if the linked tokens are chosen by a probe of the request's own KV."""
        return self.name == "blend" and self.blend_ratio > 0

    @property
    def signature(self) -> tuple:
        """What decides the linked tokens, given the same context (part of cache keys)."""
        return {"none": ("none",), "gap": ("gap", self.gap_length), "blend": ("blend", self.blend_ratio),
                "full": ("full",), "comb": ("comb", self.plugin)}[self.name]

    @property
    def span_key(self) -> tuple:
        """What changes a span's own KV (part of its span-local hashes): the encoder, if any."""
        return ("comb", self.plugin) if self.name == "comb" else ()

    def linked(self, start: int, end: int, block_size: int) -> int:
        """How many tokens at the head of span [start, end) are recomputed in context."""
        if self.name != "gap":
            return 0
        return min(-(-self.gap_length // block_size) * block_size, end - start)
