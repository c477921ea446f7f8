"""PromptLayout: where a prompt's position-independent spans sit, and what follows for its KV.

A span [start, end) is computed as its own little sequence: its tokens attend only to earlier
tokens of the span, at positions counted from the span's start (0, 1, ...). Its full blocks
are then the same bytes wherever the span appears, so they are cached under a span-local hash
and shared. Every other token ("in context") attends to all tokens before it at its real
position; reading a span's keys it first rotates them by the span's start (RoPE is a rotation,
so R(start) R(i) = R(start + i): exact repositioning, no copies, blocks stay shared).

A link policy (pic/link.py) moves the first tokens of each span back into context: they are
recomputed with full attention into blocks private to the request, while the span-local
version of those blocks ("shadows") still exists for the span itself and for other requests.

Two views of the same token indices:
- the context view (`Request.block_table`): what in-context queries read. Block i is a shared
  span block if it lies wholly in a span's independent part, else the request's own block;
- a span's view: the blocks its own sub-sequence reads and writes (shadows, then the shared
  blocks, then a partial last block that lives in the context view).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from spanserve.kv.hashing import ROOT_HASH, BlockHash, hash_block
from spanserve.pic.link import LinkPolicy


@dataclass(frozen=True)
class SpanRange:
    start: int  # a multiple of the block size
    end: int  # exclusive; before the prompt's last token
    link_end: int  # [start, link_end) is recomputed in context; [link_end, end) stays independent
    sub_end: int  # the span's own sub-sequence computes [start, sub_end)

    def independent(self, t: int) -> bool:
        return self.link_end <= t < self.end


class PromptLayout:
    def __init__(self, num_tokens: int, spans: Sequence[tuple[int, int]] = (),
                 link: LinkPolicy | None = None, block_size: int = 16):
        """`spans` must already be valid (see validate_spans); a span reaching the last prompt
        token is cut before it, since that token's logits must see the whole prompt."""
        self.num_tokens, self.block_size = num_tokens, block_size
        link = link or LinkPolicy()
        self.link = link
        self.spans: list[SpanRange] = []
        for start, end in spans if link.uses_spans else ():
            end = min(end, num_tokens - 1)
            if end - start < 1:
                continue
            link_end = link.link_end(start, end, block_size)
            sub_end = end if link_end < end else end // block_size * block_size
            self.spans.append(SpanRange(start, end, link_end, sub_end))
        self._deltas: torch.Tensor | None = None

    @property
    def has_spans(self) -> bool:
        return bool(self.spans)

    # ---- which tokens are computed where ------------------------------------------------

    def span_of_block(self, i: int) -> int | None:
        """Index of the span whose independent part holds all of block i, else None."""
        lo, hi = i * self.block_size, (i + 1) * self.block_size
        for s, span in enumerate(self.spans):
            if span.link_end <= lo and hi <= span.end:
                return s
        return None

    def shadow_blocks(self, s: int) -> range:
        """Blocks of span s recomputed in context: their span-local version lives apart."""
        span, bs = self.spans[s], self.block_size
        return range(span.start // bs, min(-(-span.link_end // bs), span.sub_end // bs))

    def in_context(self, start: int, end: int) -> list[int]:
        """Token indices in [start, end) that are computed in context (not inside a span)."""
        indices, t = [], start
        for span in self.spans:
            if span.end <= t:
                continue
            if span.link_end >= end:
                break
            indices.extend(range(t, max(t, span.link_end)))
            t = max(t, span.end)
        indices.extend(range(t, end))
        return indices

    def advance(self, start: int, budget: int, limit: int) -> int:
        """The end e <= limit such that [start, e) holds `budget` in-context tokens (or fewer
        if the limit comes first); independent tokens inside are skipped for free."""
        t = start
        for span in self.spans:
            if span.end <= t:
                continue
            room = span.link_end - t
            if room >= budget or span.link_end >= limit:
                break
            budget -= max(room, 0)
            t = span.end
        return min(t + budget, limit)

    def ready_limit(self, done: Sequence[int]) -> int:
        """How far in-context computation may go given each span's progress `done[s]`: up to
        the start of the independent part of the first span still being computed."""
        for span, d in zip(self.spans, done):
            if d < span.sub_end:
                return span.link_end
        return 1 << 62

    # ---- keys -----------------------------------------------------------------------------

    def key_deltas(self, length: int, device: torch.device) -> torch.Tensor | None:
        """Per key in [0, length): how far its cached rotation lags its real position."""
        if not self.spans:
            return None
        if self._deltas is None:
            deltas = torch.zeros(self.num_tokens, dtype=torch.long)
            for span in self.spans:
                deltas[span.link_end:span.end] = span.start
            self._deltas = deltas.to(device)
        if length <= self.num_tokens:
            return self._deltas[:length]
        return torch.cat([self._deltas, self._deltas.new_zeros(length - self.num_tokens)])

    # ---- hashes -------------------------------------------------------------------------

    def block_marker(self, i: int) -> tuple:
        """Extra hash key of block i in the context chain: the span geometry inside it, so the
        same tokens laid out differently (or linked differently) never share a key."""
        lo, hi = i * self.block_size, (i + 1) * self.block_size
        return tuple((s.start - lo, s.end - lo, s.link_end - lo) for s in self.spans
                     if s.start < hi and lo < s.end)

    def local_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> dict[int, BlockHash]:
        """Span-local hash of every full block inside a span, keyed by block index: each span's
        chain restarts at the root, exactly as if the span were a prompt of its own."""
        bs, out = self.block_size, {}
        for span in self.spans:
            parent = ROOT_HASH
            for i in range(span.start // bs, span.end // bs):
                extra = (cache_salt,) if i == span.start // bs and cache_salt else ()
                parent = out[i] = hash_block(parent, token_ids[i * bs:(i + 1) * bs], extra)
        return out


def validate_spans(spans, num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """Check user-given [start, end) spans; returns them as sorted tuples."""
    from spanserve.errors import InvalidRequestError

    if not isinstance(spans, (list, tuple)):
        raise InvalidRequestError("spans must be a list of [start, end] pairs")
    out = []
    for span in spans:
        if not (isinstance(span, (list, tuple)) and len(span) == 2 and all(isinstance(x, int) for x in span)):
            raise InvalidRequestError(f"each span must be a pair of integers [start, end], got {span!r}")
        start, end = span
        if not 0 <= start < end <= num_tokens:
            raise InvalidRequestError(
                f"span [{start}, {end}) must be non-empty and inside the prompt of {num_tokens} tokens")
        if start % block_size:
            raise InvalidRequestError(
                f"span [{start}, {end}) must start on a block boundary (a multiple of {block_size}); "
                "text parts are padded for you, token prompts must be padded by the caller")
        out.append((start, end))
    out.sort()
    for (_, end), (start, _) in zip(out, out[1:]):
        if start < end:
            raise InvalidRequestError(f"spans overlap: one ends at {end} after the next starts at {start}")
    return out
