"""spanserve.kv on its own: chained block hashes, the block pool's LRU, the cache manager."""

import pytest

from spanserve import SamplingParams
from spanserve.engine.request import Request
from spanserve.kv.block_pool import BlockPool
from spanserve.kv.hashing import ROOT_HASH, extend_block_hashes, hash_block
from spanserve.kv.manager import KVCacheManager

BLOCK = 4


def hashes(token_ids, salt=None, block_size=BLOCK) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, token_ids, block_size, salt)
    return out


def make_request(token_ids, salt=None) -> Request:
    return Request("r", prompt_token_ids=list(token_ids), params=SamplingParams(), cache_salt=salt)


def computed(manager: KVCacheManager, token_ids, salt=None) -> Request:
    """A request whose tokens all went through the model: its full blocks are published."""
    req = make_request(token_ids, salt)
    assert manager.admit(req)
    req.num_computed_tokens = len(token_ids)
    manager.cache_computed_blocks(req)
    return req


def cache_hits(manager: KVCacheManager, token_ids, salt=None) -> list:
    """The cached blocks a new request with these tokens adopts (then released again)."""
    req = make_request(token_ids, salt)
    assert manager.admit(req)
    hits = req.block_table[: req.num_computed_tokens // BLOCK]
    manager.free(req)
    return hits


def cached_pool(num_blocks: int) -> tuple[BlockPool, list]:
    """A pool whose blocks are all allocated, each published under hash b'<id>'."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_blocks)
    for b in blocks:
        pool.cache(b, bytes([b.block_id]))
    return pool, blocks


# ---- hashing --------------------------------------------------------------------------------


def test_block_hash_is_deterministic():
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) == hash_block(ROOT_HASH, [1, 2, 3, 4])


def test_same_tokens_under_a_different_parent_hash_differently():
    parent_a, parent_b = hash_block(ROOT_HASH, [1, 2, 3, 4]), hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block(parent_a, [7, 7, 7, 7]) != hash_block(parent_b, [7, 7, 7, 7])


def test_only_full_blocks_are_hashed():
    assert len(hashes(range(11))) == 2
    assert len(hashes(range(12))) == 3


def test_second_block_hash_chains_on_the_first():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    first, second = hashes(tokens)
    assert first == hash_block(ROOT_HASH, tokens[:4])
    assert second == hash_block(first, tokens[4:])


def test_a_shared_prefix_gives_shared_hashes_up_to_the_first_difference():
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    b = hashes([1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12])
    assert a[0] == b[0]
    assert a[1] != b[1]
    assert a[2] != b[2]  # identical tokens, but the chain carries the earlier difference


def test_identical_blocks_at_different_positions_hash_differently():
    first, second = hashes([5, 5, 5, 5, 5, 5, 5, 5])
    assert first != second


def test_cache_salt_changes_the_first_block_and_hence_all_later():
    tokens = list(range(12))
    plain, salted, other = hashes(tokens), hashes(tokens, salt="a"), hashes(tokens, salt="b")
    assert all(p != s for p, s in zip(plain, salted))
    assert all(s != o for s, o in zip(salted, other))
    assert salted == hashes(tokens, salt="a")


def test_extending_hashes_block_by_block_equals_hashing_at_once():
    tokens = list(range(20))
    out: list[bytes] = []
    for end in range(len(tokens) + 1):
        extend_block_hashes(out, tokens[:end], BLOCK, "salt")
    assert out == hashes(tokens, salt="salt")


# ---- block pool -----------------------------------------------------------------------------


def test_fresh_pool_hands_out_blocks_in_id_order_with_one_reference():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [(b.block_id, b.ref_cnt) for b in blocks] == [(0, 1), (1, 1), (2, 1)]
    assert pool.num_free == 1


def test_freed_block_keeps_its_hash_and_can_be_hit_until_reallocated():
    pool, blocks = cached_pool(2)
    pool.release([blocks[0]])
    assert pool.num_free == 1
    assert pool.lookup(b"\x00") is blocks[0]
    assert pool.allocate(1) == [blocks[0]]
    assert pool.lookup(b"\x00") is None
    assert blocks[0].block_hash is None


def test_touch_revives_a_freed_cached_block_out_of_the_free_queue():
    pool, blocks = cached_pool(2)
    pool.release([blocks[1]])
    pool.touch([pool.lookup(b"\x01")])
    assert (blocks[1].ref_cnt, pool.num_free) == (1, 0)


def test_eviction_takes_the_least_recently_freed_block_first():
    pool, blocks = cached_pool(3)
    for block_id in (2, 0, 1):
        pool.release([blocks[block_id]])
    assert [b.block_id for b in pool.allocate(2)] == [2, 0]
    assert [pool.lookup(h) for h in (b"\x00", b"\x01", b"\x02")] == [None, blocks[1], None]


def test_never_used_blocks_are_handed_out_before_cached_ones():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    pool.release([block])
    assert [b.block_id for b in pool.allocate(2)] == [1, 2]
    assert pool.lookup(b"h") is block


def test_a_block_returns_to_the_free_queue_only_when_its_last_reference_is_released():
    pool, blocks = cached_pool(2)
    pool.touch([blocks[0]])  # a second request shares block 0
    pool.release([blocks[0]])
    assert (blocks[0].ref_cnt, pool.num_free) == (1, 0)
    pool.release([blocks[0]])
    assert (blocks[0].ref_cnt, pool.num_free) == (0, 1)


def test_a_shared_block_is_never_handed_out_while_referenced():
    pool, blocks = cached_pool(4)
    pool.touch([blocks[1]])
    pool.release(blocks)  # block 1 keeps one reference
    handed_out = pool.allocate(pool.num_free)
    assert sorted(b.block_id for b in handed_out) == [0, 2, 3]
    assert pool.lookup(b"\x01") is blocks[1]


def test_releasing_a_free_block_again_is_an_error():
    pool = BlockPool(1)
    block = pool.allocate(1)
    pool.release(block)
    with pytest.raises(AssertionError, match="released twice"):
        pool.release(block)


def test_the_first_block_published_under_a_hash_wins():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache(first, b"h")
    pool.cache(second, b"h")
    assert pool.lookup(b"h") is first
    assert second.block_hash is None


def test_reset_cache_forgets_every_hash():
    pool, blocks = cached_pool(2)
    pool.release([blocks[0]])
    pool.reset_cache()
    assert (pool.num_cached, pool.lookup(b"\x00"), pool.lookup(b"\x01")) == (0, None, None)


# ---- cache manager --------------------------------------------------------------------------


def test_cache_computed_blocks_publishes_only_computed_full_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    req = make_request(range(10))
    manager.admit(req)
    req.num_computed_tokens = 7
    manager.cache_computed_blocks(req)
    assert manager.pool.num_cached == 1
    req.num_computed_tokens = 10
    manager.cache_computed_blocks(req)
    assert manager.pool.num_cached == 2
    assert [manager.pool.lookup(h) for h in hashes(range(8))] == req.block_table[:2]


def test_admit_returns_the_blocks_of_the_longest_cached_prefix():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first = computed(manager, range(12))
    blocks = list(first.block_table)
    manager.free(first)
    assert cache_hits(manager, [*range(8), 99, 99, 99, 99, 99]) == blocks[:2]


def test_admit_always_leaves_the_last_token_to_compute():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first = computed(manager, range(12))
    assert cache_hits(manager, range(12)) == first.block_table[:2]
    assert cache_hits(manager, range(13)) == first.block_table[:3]


def test_admit_stops_at_the_first_miss():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first = computed(manager, range(12))
    blocks = list(first.block_table)
    manager.free(first)  # released tail first: the LRU order is 3..7, then block 2, 1, 0
    manager.pool.touch([blocks[2]])
    taken = manager.pool.allocate(6)  # blocks 3..7 and block 1: evicted; 0 and 2 stay cached
    manager.pool.release(taken + [blocks[2]])
    assert manager.pool.lookup(hashes(range(12))[2]) is blocks[2]
    assert cache_hits(manager, range(13)) == blocks[:1]


def test_freeing_a_request_evicts_its_tail_before_its_prefix():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    req = computed(manager, range(12))
    blocks = list(req.block_table)
    manager.free(req)
    taken = manager.pool.allocate(2)  # the never-used block 3, then the request's tail
    assert taken == [manager.pool.blocks[3], blocks[2]]
    manager.pool.release(taken)
    assert cache_hits(manager, range(13)) == blocks[:2]


def test_cache_salt_keeps_requests_from_sharing_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    computed(manager, range(12), salt="a")
    assert cache_hits(manager, range(12), salt="b") == []
    assert cache_hits(manager, range(12)) == []
    assert len(cache_hits(manager, range(12), salt="a")) == 2


def test_disabled_prefix_caching_neither_publishes_nor_finds_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    computed(manager, range(12))
    assert manager.pool.num_cached == 0
    assert cache_hits(manager, range(12)) == []


def test_admit_adopts_cached_blocks_and_allocates_the_rest_of_the_prompt():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first = computed(manager, range(8))
    req = make_request(range(14))
    assert manager.admit(req)
    assert (req.num_computed_tokens, req.num_cached_tokens) == (8, 8)
    assert req.block_table[:2] == first.block_table
    assert len(req.block_table) == 4
    assert [b.ref_cnt for b in req.block_table] == [2, 2, 1, 1]


def test_admit_fails_without_side_effects_when_the_pool_is_short():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    first = computed(manager, range(8))
    blocks = list(first.block_table)
    manager.free(first)
    req = make_request(range(20))
    # 2 cached blocks must be revived from the free queue and 3 more allocated: 5 > 4 free.
    assert not manager.admit(req)
    assert (req.block_table, manager.pool.num_free) == ([], 4)
    assert [b.ref_cnt for b in blocks] == [0, 0]


def test_free_releases_every_block_and_resets_the_table():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    req = computed(manager, range(10))
    manager.free(req)
    assert (req.block_table, req.num_hashed_blocks, manager.pool.num_free) == ([], 0, 4)


def test_hit_rate_counters_count_queried_and_hit_tokens():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    computed(manager, range(12))
    cache_hits(manager, range(10))
    assert (manager.queried_tokens, manager.hit_tokens) == (12 + 10, 8)


def test_allocate_slots_grows_the_table_for_generated_tokens():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    req = computed(manager, range(6))
    assert len(req.block_table) == 2
    assert manager.allocate_slots(req, 8) and len(req.block_table) == 2
    assert manager.allocate_slots(req, 9) and len(req.block_table) == 3
    assert not manager.allocate_slots(req, 17) and len(req.block_table) == 3
