"""KVCacheManager: block tables of requests, prefix-cache lookup and publication."""

from spanserve.kv.block_pool import Block, BlockPool
from spanserve.kv.hashing import extend_block_hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.queried_tokens = 0  # prefix-cache hit rate = hit_tokens / queried_tokens
        self.hit_tokens = 0

    def cached_prefix(self, req) -> list[Block]:
        """Blocks holding the longest cached prefix of `req` (vLLM semantics: the lookup
        stops at the first miss, and the last token is always left to compute)."""
        if not self.enable_prefix_caching:
            return []
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, req.cache_salt)
        hits = []
        for block_hash in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.queried_tokens += req.num_tokens
        self.hit_tokens += len(hits) * self.block_size
        return hits

    def allocate_slots(self, req, num_new_tokens: int, cached_blocks: list[Block] = ()) -> bool:
        """Give `req` room for `num_new_tokens` more tokens after its computed ones (and after
        `cached_blocks`, prefix hits it adopts now). False, changing nothing, if the pool is short."""
        num_tokens = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        new_blocks = max(0, cdiv(num_tokens, self.block_size) - len(req.block_table) - len(cached_blocks))
        revived = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if new_blocks + revived > self.pool.num_free:
            return False
        self.pool.touch(cached_blocks)
        req.block_table.extend(cached_blocks)
        req.block_table.extend(self.pool.allocate(new_blocks))
        return True

    def cache_full_blocks(self, req) -> None:
        """Publish the blocks of `req` that became full and computed in the last step."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        extend_block_hashes(
            req.block_hashes, req.token_ids[: num_full * self.block_size], self.block_size, req.cache_salt
        )
        for i in range(req.num_hashed_blocks, num_full):
            self.pool.cache(req.block_table[i], req.block_hashes[i])
        req.num_hashed_blocks = max(req.num_hashed_blocks, num_full)

    def free(self, req) -> None:
        self.pool.release(reversed(req.block_table))
        req.block_table = []
        req.num_hashed_blocks = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
