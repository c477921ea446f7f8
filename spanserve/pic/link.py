"""Link policies: how much of each independently computed span to recompute in context.

A span computed alone never saw the text before it, so its first tokens (where attention
to the context matters most) carry no link to it. The policies, per request:
- none: reuse every span block as cached;
- gap: recompute the first `gap_length` tokens of each span with full attention (EPIC /
  Legolink), rounded up to whole 16-token blocks: the KV cache's unit of sharing;
- full: recompute everything, i.e. ignore the spans (the accuracy reference).
Recomputed tokens land in blocks private to the request; the shared span blocks are never
written.
"""

from dataclasses import dataclass

from spanserve.errors import InvalidRequestError

POLICIES = ("none", "gap", "full")


@dataclass(frozen=True)
class LinkPolicy:
    name: str = "none"
    gap_length: int = 0

    def __post_init__(self):
        if self.name not in POLICIES:
            raise InvalidRequestError(f"link_policy must be one of {', '.join(POLICIES)}, got {self.name!r}")
        if not isinstance(self.gap_length, int) or self.gap_length < 0:
            raise InvalidRequestError(f"gap_length must be an integer >= 0, got {self.gap_length!r}")

    @property
    def uses_spans(self) -> bool:
        return self.name != "full"

    def link_end(self, start: int, end: int, block_size: int) -> int:
        """End of the recomputed run at the head of span [start, end)."""
        if self.name != "gap" or self.gap_length == 0:
            return start
        blocks = -(-self.gap_length // block_size)
        return min(start + blocks * block_size, end)
