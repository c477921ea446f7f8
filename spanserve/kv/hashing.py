"""Content hashes of full KV blocks, chained so a block's key covers everything before it.

hash(block i) = sha256(hash(block i-1), tokens of block i, extra keys). Two requests share a
cached block only if they agree on every token up to its end and on the extra keys
(a tenant's cache salt, later a span context). sha256 rather than Python's hash(): a
collision would silently serve one tenant's KV to another.
"""

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = bytes(32)  # parent of a chain's first block


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    return _hash(parent, array("q", token_ids).tobytes(), extra_keys)


def _hash(parent: BlockHash, tokens: bytes, extra_keys: tuple) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(tokens)
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def hash_chain(parent: BlockHash, token_ids: Sequence[int], block_size: int,
               extra_keys: Callable[[int], tuple]) -> list[BlockHash]:
    """The chained hashes of the full blocks of `token_ids`, the first block's parent `parent`,
    block j's extra keys `extra_keys(j)`. The tokens become bytes in one pass (a long prompt
    has thousands of blocks)."""
    width = 8 * block_size
    data = array("q", token_ids[:len(token_ids) // block_size * block_size]).tobytes()
    out = []
    for j in range(len(data) // width):
        parent = _hash(parent, data[j * width:(j + 1) * width], extra_keys(j))
        out.append(parent)
    return out


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None,
    marker: Callable[[int], tuple] | None = None,
) -> None:
    """Append the hashes of every full block of `token_ids` not yet in `hashes`; `marker(i)`
    adds block i's span geometry (pic/layout.py) to its key."""
    first = len(hashes)

    def extra_keys(j: int) -> tuple:
        # The salt joins the first block only: the chain carries it to every later block.
        extra = (cache_salt,) if first + j == 0 and cache_salt else ()
        return extra + marker(first + j) if marker is not None else extra

    hashes += hash_chain(hashes[-1] if hashes else ROOT_HASH, token_ids[first * block_size:], block_size, extra_keys)
