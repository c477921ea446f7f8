"""PromptLayout: where a prompt's position-independent spans sit, and what follows for its KV.

A span [start, end) is computed as its own little sequence: its tokens attend only to earlier
tokens of the span, at positions counted from the span's start (0, 1, ...). Its full blocks
are then the same bytes wherever the span appears, so they are cached under a span-local hash
and shared. Every other token ("in context") attends to all tokens before it at its real
position; reading a span's keys it first rotates them by the span's start (RoPE is a rotation,
so R(start) R(i) = R(start + i): exact repositioning, no copies, blocks stay shared).

A link policy (pic/link.py) moves some tokens of each span back into context ("linked"): they
are recomputed with full attention into blocks private to the request, while the span-local
version of those blocks ("shadows") stays shared, for the span itself and other requests.

Two views of the same token indices:
- the context view (`Request.block_table`): what in-context queries read. Block i is a shared
  span block if all its tokens are independent span tokens, else the request's own block;
- a span's view: the blocks its own sub-sequence reads and writes (shadows where the context
  view has a private block, the shared blocks, and a partial last block of the context view).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spanserve.errors import InvalidSpanError
from spanserve.kv.hashing import ROOT_HASH, BlockHash, hash_chain
from spanserve.pic.link import LinkPolicy


@dataclass(frozen=True)
class SpanRange:
    start: int  # a multiple of the block size
    end: int  # exclusive; before the prompt's last token
    sub_end: int  # the span's own sub-sequence computes [start, sub_end)
    offset: int = 0  # position of its first token in its own sub-sequence (after the anchor)


@dataclass(frozen=True)
class Anchor:
    """Whole blocks of fixed tokens every span (but one at the prompt's start) is computed
    after, so a span's first token is not the sink its attention falls on: the anchor's is,
    as the prompt's first token is in context (spans then lose far less accuracy)."""

    num_tokens: int  # a multiple of the block size
    last_hash: bytes  # the chain hash of its last block: the parent of anchored spans' chains


class PromptLayout:
    def __init__(self, num_tokens: int, spans: Sequence[tuple[int, int]] = (),
                 link: LinkPolicy | None = None, block_size: int = 16, anchor: Anchor | None = None):
        """`spans` must already be valid (see validate_spans); a span reaching the last prompt
        token is cut before it, since that token's logits must see the whole prompt. A span at
        0 needs no anchor: it starts the prompt (and then equals a plain prefix)."""
        self.num_tokens, self.block_size, self.anchor = num_tokens, block_size, anchor
        self.link = link = link or LinkPolicy()
        self.independent = np.zeros(num_tokens, dtype=bool)  # computed alone, inside a span
        self.spans: list[SpanRange] = []
        for start, end in spans if link.uses_spans else ():
            end = min(end, num_tokens - 1)
            if end > start:
                linked = link.linked(start, end, block_size)
                self.independent[start:end] = True
                self.independent[start:start + linked] = False
                tail_independent = self.independent[end // block_size * block_size:end].any()
                sub_end = end if tail_independent else end // block_size * block_size
                offset = anchor.num_tokens if anchor and start > 0 else 0
                self.spans.append(SpanRange(start, end, sub_end, offset))
        self.awaiting_selection = link.selects and bool(self.spans)  # blend: the probe picks links
        # span_at_block[i]: the span wholly holding full block i, else -1 (per-block lookups of
        # a long prompt's thousands of blocks read arrays, not every span)
        self.span_at_block = np.full(num_tokens // block_size, -1, dtype=np.int64)
        for s, span in enumerate(self.spans):
            self.span_at_block[-(-span.start // block_size):span.end // block_size] = s
        self._refresh()

    def reset_selection(self) -> None:
        """Forget a selecting policy's choice (its private blocks are gone, e.g. on preemption)."""
        if self.link.selects and self.spans:
            for span in self.spans:
                self.independent[span.start:span.end] = True
            self.awaiting_selection = True
            self._refresh()

    def _refresh(self) -> None:
        # in_context_before[t]: how many tokens before t are computed in context
        self.in_context_before = np.concatenate([[0], np.cumsum(~self.independent)])
        full = len(self.span_at_block) * self.block_size
        self.block_independent = self.independent[:full].reshape(-1, self.block_size).all(1)  # per full block
        self._deltas: torch.Tensor | None = None
        self.derived: dict = {}  # what others build from this layout (a runner's key rotation)

    def link_tokens(self, indices: Sequence[int]) -> None:
        """Move span tokens into context (a selecting link policy's choice, after its probe)."""
        self.independent[np.asarray(indices, dtype=np.int64)] = False
        self.awaiting_selection = False
        self._refresh()

    @property
    def has_spans(self) -> bool:
        return bool(self.spans)

    # ---- which tokens are computed where ------------------------------------------------

    def span_of_block(self, i: int) -> int | None:
        """Index of the span holding block i with every token independent, else None."""
        if i >= len(self.block_independent) or self.awaiting_selection or not self.block_independent[i]:
            return None
        return int(self.span_at_block[i])

    def shadow_blocks(self, s: int) -> list[int]:
        """Full blocks of span s that have linked tokens: their span-local version lives apart
        from the request's private one. Before CacheBlend's probe: all of them, and a partial
        last block too, since that probe writes scratch KV of span tokens into the request's
        own version of every block it reads (engine/runner.py); after it, the partial block's
        span-local version becomes the request's (nothing else reads it). A focus probe writes
        only in-context rows, so before it the request reads the shared blocks themselves."""
        span, bs = self.spans[s], self.block_size
        if self.awaiting_selection and not self.link.focuses:
            return list(range(span.start // bs, -(-span.sub_end // bs)))
        first = span.start // bs
        return (np.flatnonzero(~self.block_independent[first:span.sub_end // bs]) + first).tolist()

    def probe_blocks(self) -> int:
        """Blocks a request holds beside its context view until its selecting policy's probe has
        run: CacheBlend's scratch copies of its span blocks, or a focus probe's spares."""
        if not self.awaiting_selection:
            return 0
        if self.link.focuses:
            return self.max_focus_links()
        return sum(len(self.shadow_blocks(s)) for s in range(len(self.spans)))

    def max_focus_links(self) -> int:
        """Before a focus probe: at most how many full span blocks it can link (each will need
        a private copy), 0 for any other layout."""
        if not (self.awaiting_selection and self.link.focuses):
            return 0
        bs = self.block_size
        sizes = sorted((span.sub_end // bs - span.start // bs for span in self.spans), reverse=True)
        if self.link.focus_spans:
            return sum(sizes[:self.link.focus_spans])
        return min(sum(sizes), -(-self.link.focus_tokens // bs))

    def in_context(self, start: int, end: int) -> list[int]:
        """Token indices in [start, end) that are computed in context (not alone in a span)."""
        n = self.num_tokens
        inside = (np.flatnonzero(~self.independent[start:min(end, n)]) + start).tolist() if start < n else []
        return inside + list(range(max(start, n), end))

    def count_in_context(self, start: int, end: int) -> int:
        """len(in_context(start, end)), without building the list."""
        return self._count_before(end) - self._count_before(start) if end > start else 0

    def advance(self, start: int, budget: int, limit: int) -> int:
        """The end e <= limit such that [start, e) holds `budget` in-context tokens (or fewer
        if the limit comes first); independent tokens inside are skipped for free."""
        counts, n = self.in_context_before, self.num_tokens
        target = self._count_before(start) + budget
        if target > counts[n]:
            end = n + target - counts[n]
        else:
            end = int(np.searchsorted(counts, target))  # first e with target tokens before it
        return min(end, limit)

    def _count_before(self, t: int) -> int:
        n = self.num_tokens
        return int(self.in_context_before[t]) if t <= n else int(self.in_context_before[n]) + t - n

    def ready_limit(self, done: Sequence[int]) -> int:
        """How far in-context computation may go given each span's progress `done[s]`: up to
        the first independent token of the first span still being computed (or, before a
        selecting policy's probe, up to the first span)."""
        if self.awaiting_selection:
            return self.spans[0].start
        for span, d in zip(self.spans, done):
            if d < span.sub_end:
                independent = np.flatnonzero(self.independent[span.start:span.end])
                if len(independent):
                    return span.start + int(independent[0])
        return 1 << 62

    # ---- keys -----------------------------------------------------------------------------

    def key_deltas(self) -> torch.Tensor | None:
        """How far each cached key's rotation lags its real position (negative for a span
        computed after an anchor longer than its start), for keys up to the last independent one
        (later keys: 0). None without spans. The same tensor until relinked."""
        if not self.independent.any():
            return None
        if self._deltas is None:
            deltas = torch.zeros(self.num_tokens, dtype=torch.long)
            for span in self.spans:
                deltas[span.start:span.end] = span.start - span.offset
            deltas[~torch.from_numpy(self.independent)] = 0
            self._deltas = deltas[:int(self.independent.nonzero()[0][-1]) + 1]
        return self._deltas

    def first_shifted_key(self) -> int:
        """Index of the first key that in-context queries must transform: rotate (its span was
        computed elsewhere) or, under APE, reweight (every span key). A large number if none."""
        if "first_shifted_key" not in self.derived:
            deltas = self.key_deltas()
            if deltas is not None and self.link.span_weighting:
                shifted = np.flatnonzero(self.independent)
            else:
                shifted = [] if deltas is None else deltas.nonzero()
            self.derived["first_shifted_key"] = int(shifted[0]) if len(shifted) else 1 << 62
        return self.derived["first_shifted_key"]

    # ---- hashes -------------------------------------------------------------------------

    def block_marker(self, i: int) -> tuple:
        """Extra hash key of block i in the context chain: the span geometry inside it and the
        link policy, so the same tokens laid out or linked differently never share a key."""
        lo, hi = i * self.block_size, (i + 1) * self.block_size
        inside = self.span_at_block[i] if i < len(self.span_at_block) else -1
        spans = [self.spans[inside]] if inside >= 0 else self.spans  # a block inside a span meets it alone
        return tuple((s.start - lo, s.end - lo, self.link.signature) for s in spans if s.start < hi and lo < s.end)

    def local_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> dict[int, BlockHash]:
        """Span-local hash of every full block inside a span, keyed by block index: each span's
        chain restarts at the root, exactly as if the span were a prompt of its own."""
        bs, out = self.block_size, {}
        first_key = ((cache_salt,) if cache_salt else ()) + self.link.span_key
        for span in self.spans:
            parent = self.anchor.last_hash if span.offset else ROOT_HASH
            chain = hash_chain(parent, token_ids[span.start:span.end // bs * bs], bs, lambda j: () if j else first_key)
            out.update(enumerate(chain, span.start // bs))
        return out


def validate_spans(spans, num_tokens: int, block_size: int) -> list[tuple[int, int]]:
    """Check user-given [start, end) spans; returns them as sorted tuples."""
    if not isinstance(spans, (list, tuple)):
        raise InvalidSpanError("spans must be a list of [start, end] pairs")
    out = []
    for span in spans:
        if not (isinstance(span, (list, tuple)) and len(span) == 2 and all(isinstance(x, int) for x in span)):
            raise InvalidSpanError(f"each span must be a pair of integers [start, end], got {span!r}")
        start, end = span
        if not 0 <= start < end <= num_tokens:
            raise InvalidSpanError(
                f"span [{start}, {end}) must be non-empty and inside the prompt of {num_tokens} tokens")
        if start % block_size:
            raise InvalidSpanError(
                f"span [{start}, {end}) must start on a block boundary (a multiple of {block_size}); "
                "text parts are padded for you, token prompts must be padded by the caller")
        out.append((start, end))
    out.sort()
    for (_, end), (start, _) in zip(out, out[1:]):
        if start < end:
            raise InvalidSpanError(f"spans overlap: one ends at {end} after the next starts at {start}")
    return out
