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
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, cache_salt: str | None,
    marker: Callable[[int], tuple] | None = None,
) -> None:
    """Append the hashes of every full block of `token_ids` not yet in `hashes`; `marker(i)`
    adds block i's span geometry (pic/layout.py) to its key."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        # The salt joins the first block only: the chain carries it to every later block.
        extra = (cache_salt,) if i == 0 and cache_salt else ()
        if marker is not None:
            extra += marker(i)
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
