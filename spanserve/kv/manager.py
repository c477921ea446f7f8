"""KVCacheManager: block tables of requests, cache lookup and publication.

A request's blocks come in two views (pic/layout.py): the context view (`block_table`) and,
for each position-independent span, the span's own view. Plain prompts have only the first,
and then this is ordinary hash-chained prefix caching.
"""

from spanserve.kv.block_pool import Block, BlockPool
from spanserve.kv.hashing import extend_block_hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.queried_tokens = 0  # hit rate = hit_tokens / queried_tokens (prompt tokens)
        self.hit_tokens = 0
        self.span_queried_tokens = 0  # the same, for tokens inside spans' shared blocks
        self.span_hit_tokens = 0
        self.anchor_blocks: list[Block] = []  # pinned for good by pin()

    def pin(self, num_blocks: int) -> list[Block]:
        """Blocks the engine keeps for good (never freed, never cached): the span anchor."""
        self.anchor_blocks = self.pool.allocate(num_blocks)
        return self.anchor_blocks

    # ---- admission ----------------------------------------------------------------------

    def admit(self, req) -> bool:
        """Give a waiting request blocks for all its tokens: cache hits where found, fresh
        blocks elsewhere; set where its computation resumes. False, changing nothing, if the
        pool is short."""
        if req.held is not None:
            return self._admit_held(req)
        self._hash(req)
        table, num_context = self._context_hits(req)
        shadows, span_done, num_context = self._span_hits(req, table, num_context)
        layout = req.layout
        missing_shadows = [i for s, span in enumerate(layout.spans) if span_done[s] < span.sub_end
                           for i in layout.shadow_blocks(s) if i not in shadows]
        hits = [b for b in table if b is not None] + list(shadows.values())
        revived = len({b.block_id for b in hits if b.ref_cnt == 0})
        spares = layout.max_focus_links()
        if table.count(None) + len(missing_shadows) + spares + revived > self.pool.num_free:
            return False
        self.pool.touch(hits)
        req.block_table = [b if b is not None else self.pool.allocate(1)[0] for b in table]
        shadows.update(zip(missing_shadows, self.pool.allocate(len(missing_shadows))))
        req.spare_blocks = self.pool.allocate(spares)
        req.shadows, req.span_done, req.span_cached_until = shadows, span_done, list(span_done)
        req.anchor_blocks = self.anchor_blocks if layout.anchor else []
        req.span_hashed = [d // self.block_size for d in span_done]
        req.num_computed_tokens = num_context * self.block_size
        req.num_hashed_blocks = num_context
        self._count(req)
        return True

    def _admit_held(self, req) -> bool:
        """A request that continues KV someone else owns (req.held): those blocks, then fresh
        ones. Nothing is looked up or published: the owner may move that KV later."""
        held = list(req.held.blocks)
        needed = cdiv(req.num_tokens, self.block_size) - len(held)
        if needed > self.pool.num_free:
            return False
        self.pool.touch(held)
        req.block_table = held + self.pool.allocate(needed)
        req.num_computed_tokens = req.held.num_tokens
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_computed_tokens
        return True

    def _hash(self, req) -> None:
        if not self.enable_prefix_caching:
            return
        layout = req.layout
        marker = layout.block_marker if layout.has_spans else None
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, req.cache_salt, marker)
        if req.local_hashes is None:
            req.local_hashes = layout.local_hashes(req.prompt_token_ids, req.cache_salt)

    def _key(self, req, i: int) -> bytes:
        """Block i's key in the context view: span-local inside a span, else the context chain."""
        return req.local_hashes[i] if req.layout.span_of_block(i) is not None else req.block_hashes[i]

    def _context_hits(self, req) -> tuple[list[Block | None], int]:
        """The longest run of cached blocks from the start of the context view (the last token
        is always left to compute; a selecting link policy decides the context view of its
        spans later, so its run stops at the first span). Returns the table, None for blocks
        still to allocate, and the run's length."""
        table: list[Block | None] = [None] * cdiv(req.num_tokens, self.block_size)
        if not self.enable_prefix_caching:
            return table, 0
        limit = (req.num_tokens - 1) // self.block_size
        if req.layout.awaiting_selection:
            limit = min(limit, req.layout.spans[0].start // self.block_size)
        num = 0
        for i in range(limit):
            block = self.pool.lookup(self._key(req, i))
            if block is None:
                break
            table[i], num = block, i + 1
        return table, num

    def _span_hits(self, req, table: list, num_context: int) -> tuple[dict[int, Block], list[int], int]:
        """Continue each span's own chain past the context run: its cached blocks wherever they
        are in the pool. Returns the shadow blocks found, each span's progress, and the context
        run, cut back where a span must be recomputed under blocks the run had adopted."""
        shadows, done, bs = {}, [], self.block_size
        if not self.enable_prefix_caching:
            return shadows, [span.start for span in req.layout.spans], 0
        for s, span in enumerate(req.layout.spans):
            if span.sub_end <= num_context * bs:  # the context run already covers it
                done.append(span.sub_end)
                continue
            shadow_ids, d = set(req.layout.shadow_blocks(s)), span.start
            for i in range(span.start // bs, span.sub_end // bs):
                view = shadows if i in shadow_ids else table
                block = (shadows.get(i) if i in shadow_ids else table[i]) or self.pool.lookup(req.local_hashes[i])
                if block is None:
                    break
                view[i], d = block, (i + 1) * bs
            if d < num_context * bs:  # never recompute into adopted blocks: drop them from the run
                table[d // bs:num_context] = [None] * (num_context - d // bs)
                num_context = d // bs
            done.append(d)
        return shadows, done, num_context

    def _count(self, req) -> None:
        """Hit-rate counters; also fixes req.num_cached_tokens at its first admission."""
        layout, n = req.layout, req.num_prompt_tokens
        o = min(req.num_computed_tokens, n)
        computed = layout.count_in_context(o, n)
        for span, d in zip(layout.spans, req.span_done):
            independent = layout.independent[span.start:span.end]
            hit = int(independent[:max(0, max(d, o) - span.start)].sum())
            computed += int(independent.sum()) - hit
            self.span_queried_tokens += int(independent.sum())
            self.span_hit_tokens += hit
        self.queried_tokens += n
        self.hit_tokens += n - computed
        if req.num_cached_tokens is None:
            req.num_cached_tokens = n - computed

    def relink(self, req, linked: list[int]) -> list[tuple[int, int]]:
        """After a selecting policy's probe: move `linked` span tokens into context. Blocks left
        with no linked token go back to their shared span-local block; blocks with some get a
        private copy (returned as (source, destination) block ids for the runner to copy)."""
        req.layout.link_tokens(linked)
        copies = []
        keep = set(i for s in range(len(req.layout.spans)) for i in req.layout.shadow_blocks(s))
        for i, shadow in list(req.shadows.items()):
            if i in keep:
                copies.append((shadow.block_id, req.block_table[i].block_id))
            else:
                self.pool.release([req.block_table[i]])
                req.block_table[i] = req.shadows.pop(i)
        for i in sorted(keep - req.shadows.keys()):  # a focus probe read the shared block: copy it now
            req.shadows[i], req.block_table[i] = req.block_table[i], req.spare_blocks.pop()
            copies.append((req.shadows[i].block_id, req.block_table[i].block_id))
        self.pool.release(req.spare_blocks)
        req.spare_blocks = []
        # Linked tokens whose span KV was a cache hit at admission were counted as cached.
        spans = req.layout.spans
        was_cached = sum(1 for t in linked for s, span in enumerate(spans)
                         if span.start <= t < req.span_cached_until[s])
        req.num_cached_tokens = max(0, (req.num_cached_tokens or 0) - was_cached)
        return copies

    def privatize(self, req, indices: list[int]) -> list[tuple[int, int]] | None:
        """Give `req` private copies of its context blocks at `indices` (copy on write), or None,
        changing nothing, if the pool is short. Returns (source, copy) block ids for the runner,
        which must copy before anything else is allocated: the sources are released here."""
        if len(indices) > self.pool.num_free:
            return None
        copies = self.pool.allocate(len(indices))
        pairs = [(req.block_table[i].block_id, copy.block_id) for i, copy in zip(indices, copies)]
        self.pool.release([req.block_table[i] for i in indices])
        for i, copy in zip(indices, copies):
            req.block_table[i] = copy
        return pairs

    # ---- growth, publication, release ---------------------------------------------------

    def allocate_slots(self, req, end: int) -> bool:
        """Make room in the context view for tokens up to `end`. False, changing nothing, if
        the pool is short."""
        needed = cdiv(end, self.block_size) - len(req.block_table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        req.block_table.extend(self.pool.allocate(needed))
        return True

    def cache_computed_blocks(self, req) -> None:
        """Publish the blocks of `req` that became full and computed in the last step."""
        if not self.enable_prefix_caching or req.held is not None:
            return
        bs = self.block_size
        for s, span in enumerate(req.layout.spans):
            for i in range(req.span_hashed[s], min(req.span_done[s], span.end) // bs):
                self.pool.cache(req.shadows.get(i) or req.block_table[i], req.local_hashes[i])
            req.span_hashed[s] = max(req.span_hashed[s], min(req.span_done[s], span.end) // bs)
        num_full = req.num_computed_tokens // bs
        self._hash(req)
        for i in range(req.num_hashed_blocks, num_full):
            self.pool.cache(req.block_table[i], self._key(req, i))
        req.num_hashed_blocks = max(req.num_hashed_blocks, num_full)

    def free(self, req) -> None:
        self.pool.release(reversed(req.block_table))
        self.pool.release(req.shadows.values())
        self.pool.release(req.spare_blocks)
        req.block_table, req.shadows, req.spare_blocks = [], {}, []
        req.num_hashed_blocks = 0
        # Rotated private copies of span keys (ModelRunner.settle_keys) went with the blocks: a
        # preempted request that comes back reads shared keys again, even if it gets the same ids.
        req.layout.derived.pop("settled_blocks", None)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
