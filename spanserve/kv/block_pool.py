"""A fixed pool of KV blocks with reference counts and an LRU cache of freed full blocks."""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from spanserve.kv.hashing import BlockHash


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and computed


class BlockPool:
    """Owns every block. A block with ref_cnt 0 sits in the free queue; if it still has a
    hash it can be revived by a cache hit until it is handed out again (LRU order)."""

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Rewrites of each block's content (allocations, keys moved in place): what was derived
        # from a block under an older count is stale (sparse/fields.py).
        self.generation = torch.zeros(num_blocks, dtype=torch.long)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: BlockHash) -> Block | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def allocate(self, count: int) -> list[Block]:
        """Take `count` blocks from the front of the free queue (least recently freed first)."""
        assert count <= len(self._free), "caller must check num_free"
        taken = []
        for _ in range(count):
            block = self.blocks[self._free.popitem(last=False)[0]]
            if block.block_hash is not None:  # evict: its old content is about to be overwritten
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            self.generation[block.block_id] += 1
            taken.append(block)
        return taken

    def rewritten(self, blocks: list[Block]) -> None:
        """Blocks whose content changed in place (a session moving its keys)."""
        for block in blocks:
            self.generation[block.block_id] += 1

    def touch(self, blocks: list[Block]) -> None:
        """Add a reference to cache-hit blocks, reviving them from the free queue if needed."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop a reference; blocks reaching zero join the back of the free queue, so pass a
        request's blocks tail-first: its tail is then evicted before its shared prefix."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} released twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        """Publish a full, computed block under its hash (first writer wins on duplicates)."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block.block_id

    def reset_cache(self) -> None:
        """Forget every hash (e.g. after the weights change); blocks in use are untouched."""
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()

    @property
    def num_cached(self) -> int:
        return len(self._cached)
