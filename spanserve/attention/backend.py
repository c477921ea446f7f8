"""The seam between the model and attention kernels.

A backend stores the new keys/values of a batch into the paged cache and computes
attention for the batch's queries over each sequence's cached context. The torch
reference runs everywhere; a Triton/CUDA kernel is another subclass with the same call.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class KeyRotation:
    """Rotates cached keys by a per-key angle (RoPE's rotate-half layout).

    Stored compactly, one row of half-width angles per key; the torch path expands them to the
    keys' shape once per dtype and layout (broadcasting in every layer was 10x slower), a fused
    kernel reads `deltas` and the rotary tables instead."""

    half_cos: torch.Tensor  # [n, head_dim/2] float32: cos of the first n keys' angles
    half_sin: torch.Tensor  # [n, head_dim/2] float32, the angle's sign folded in
    kv_heads: int
    # [n] int32: the positions each key moves by, when the rotation is exactly RoPE's by them
    # (no extra factor, as APE's temperature is), and the rotary cos/sin tables [positions,
    # head_dim/2] they index: what a fused kernel reads instead of the angles.
    deltas: torch.Tensor | None = None
    rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    _tables: dict = field(default_factory=dict, repr=False)  # expanded cos/sin per (dtype, layout)

    @classmethod
    def from_angles(cls, cos: torch.Tensor, sin: torch.Tensor, kv_heads: int) -> "KeyRotation":
        """cos/sin: [n, head_dim/2] from the rotary tables."""
        return cls(cos.float(), sin.float(), kv_heads)

    def __len__(self) -> int:
        return self.half_cos.shape[0]

    def apply(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys [context_len, kv_heads, head_dim] with the first n rotated, as a new tensor."""
        return self.rotate_(keys.clone())

    def rotate_(self, keys: torch.Tensor, head_major: bool = False) -> torch.Tensor:
        """Rotate the first n keys in place: keys [context_len, kv_heads, head_dim], or [kv_heads,
        context_len, head_dim] if head_major. Half-precision keys rotate in their own precision
        (2x faster than a float32 round trip; the error is that of storing them)."""
        cos, sin = self._table(keys.dtype, head_major)
        axis = 1 if head_major else 0
        n, half = min(keys.shape[axis], cos.shape[axis]), keys.shape[-1] // 2
        head, cos, sin = (t.narrow(axis, 0, n) for t in (keys, cos, sin))
        swapped = torch.cat([head[..., half:], head[..., :half]], -1)
        head.mul_(cos).addcmul_(swapped, sin)
        return keys

    def distinct_angles(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [n] int32, cos, sin [angles, head_dim/2]): each key's row among the distinct rows of
        half_cos and half_sin. The keys of one reused document move alike, so a fused kernel can
        move a run of them through the queries instead (kernels/csrc/paged_prefill.c)."""
        if "distinct" not in self._tables:
            if self.deltas is not None:  # one row per delta: cheaper to find than distinct rows
                _, ids = torch.unique(self.deltas, return_inverse=True)
            else:
                _, ids = torch.unique(torch.cat([self.half_cos, self.half_sin], 1), dim=0, return_inverse=True)
            first = torch.zeros(int(ids.max()) + 1 if len(ids) else 0, dtype=torch.long, device=ids.device)
            first.scatter_(0, ids, torch.arange(len(ids), device=ids.device))  # a key of each row (all alike)
            self._tables["distinct"] = (ids.int(), self.half_cos[first], self.half_sin[first])
        return self._tables["distinct"]

    def _table(self, dtype: torch.dtype, head_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos as [cos, cos] and sin as [-sin, sin], expanded to [n, kv_heads, head_dim]
        (or head-major), in `dtype`."""
        if (dtype, head_major) not in self._tables:
            shape = (len(self), self.kv_heads, 2 * self.half_cos.shape[1])
            expand = lambda t: t[:, None, :].expand(shape).to(dtype)  # noqa: E731
            cos = expand(torch.cat([self.half_cos, self.half_cos], -1))
            sin = expand(torch.cat([-self.half_sin, self.half_sin], -1))
            layout = (lambda t: t.transpose(0, 1).contiguous()) if head_major else (lambda t: t.contiguous())
            self._tables[dtype, head_major] = (layout(cos), layout(sin))
        return self._tables[dtype, head_major]


@dataclass
class SpanShare:
    """APE's scaling factor for one sequence (pic/link.py span_weighting): which cached keys are
    span keys, and the power their summed weight takes in each query's softmax. Their division
    by the attention temperature is folded into the sequence's KeyRotation."""

    keys: torch.Tensor  # [n] bool: key j < n is a span key; keys from n on are not
    power: float  # S * T
    _masks: dict = field(default_factory=dict, repr=False)  # by context length

    def mask(self, length: int) -> torch.Tensor:
        """[length] bool: which of a context's first `length` keys are span keys."""
        if length not in self._masks:
            mask = torch.zeros(length, dtype=torch.bool, device=self.keys.device)
            n = min(length, len(self.keys))
            mask[:n] = self.keys[:n]
            self._masks = {length: mask}  # contexts grow by one token a step: keep the newest
        return self._masks[length]


@dataclass
class AttentionMetadata:
    """Where a flat batch of tokens sits in the paged cache.

    Tokens of all sequences are concatenated; sequence i owns `query_lens[i]` query rows
    and, after this step, `context_lens[i]` cached tokens (its earlier ones plus these).
    """

    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each new token
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # [B, max_blocks], padded with 0
    context_lens_tensor: torch.Tensor  # [B]
    # [T] each query's index among its sequence's keys (its RoPE position too): a query sees
    # keys up to its own index. Usually contiguous per sequence; with spans it skips ahead.
    positions: torch.Tensor
    # Per sequence, None or the rotation its cached keys need before use: span keys are stored
    # at span-local positions (pic/layout.py).
    key_rotation: list[KeyRotation | None] | None = None
    # Per sequence, None or how its queries weigh span keys against the others (APE).
    span_share: list[SpanShare | None] | None = None
    # First block id of each sequence whose blocks are one contiguous run of ids (the common
    # case for a fresh request), else None: lets a backend slice the cache instead of gathering.
    contiguous_from: list[int | None] | None = None
    # Decode sequences whose flows narrow each layer's attention to some blocks (sparse/decode.py).
    sparse: "object | None" = None
    # What a backend derives from this metadata once per step and reuses in every layer.
    derived: dict = field(default_factory=dict, repr=False)


def plain_decode(meta: AttentionMetadata, device) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """For a step whose every sequence decodes one token over its cache as stored (no moved span
    keys, no span share, no sparse flow) on CPU: its block tables and context lengths for the C
    decode kernel, and the context summed; else None. Made once per step, read in every layer:
    the general paths' Python, run again in every layer, took a twentieth of a SmolLM2 decode step."""
    if "plain_decode" not in meta.derived:
        plain = (device.type == "cpu" and all(n == 1 for n in meta.query_lens) and not any(meta.key_rotation or ())
                 and not meta.span_share and meta.sparse is None)
        seqs = list(range(len(meta.query_lens)))
        meta.derived["plain_decode"] = (*decode_tables(meta, seqs), sum(meta.context_lens)) if plain else None
    return meta.derived["plain_decode"]


def decode_tables(meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The block tables and context lengths of sequences `seqs`, made once per step."""
    key = ("decode_tables", tuple(seqs))
    if key not in meta.derived:
        index = torch.tensor(seqs, device=meta.block_tables.device)
        meta.derived[key] = (meta.block_tables[index].long().contiguous(),  # int64: what the C kernels read
                             meta.context_lens_tensor[index].long().contiguous())
    return meta.derived[key]


class AttentionBackend(ABC):
    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim], already rotated
        k: torch.Tensor,  # [T, kv_heads, head_dim], already rotated
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        stored: bool = False,  # k and v are in the cache's slots already (models/layer_ops.rope_store)
    ) -> torch.Tensor:  # [T, heads, head_dim]
        ...
