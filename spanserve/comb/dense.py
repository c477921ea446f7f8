"""A differentiable forward of one prompt with COMB spans, on plain tensors (no paged cache).

What the engine computes for `link_policy="comb"`, written out densely so it can be trained
and serve as the engine's reference:
- each span is a sequence of its own, after the anchor (when it has one) at span-local positions,
  through the encoder (the decoder's layers with the plug-in's deltas on every row);
- every other token ("context") goes through the frozen decoder at its real position (with the
  plug-in's reader deltas from the first span on, if it has them) and attends to all keys before
  it: its own context's and the spans' encoder keys, moved to their real positions (RoPE:
  rotating a key to local position i and then by the span's shift is rotating it to its real
  position at once).
"""

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spanserve.comb.plugin import CombPlugin
from spanserve.models.llama import LlamaModel


@dataclass
class DenseLayout:
    token_ids: list[int]
    spans: list[tuple[int, int, int]]  # (start, end, offset): tokens [start, end) at offset + i in their sequence
    anchor_ids: list[int]  # what a span with offset > 0 is computed after
    linked: tuple[int, ...] = ()  # span tokens recomputed in context (a link policy's picks)

    @classmethod
    def for_engine(cls, engine, token_ids: list[int], spans) -> "DenseLayout":
        """The layout the engine gives `spans` ([start, end) pairs): after its anchor, but for a
        span at the prompt's start."""
        anchor = engine.anchor_tokens if engine.anchor else []
        return cls(token_ids, [(s, e, len(anchor) if s else 0) for s, e in spans], anchor)


def _project(layer, x: torch.Tensor, positions: torch.Tensor):
    """q, k (rotated at `positions`), k before rotation, and v of hidden states x [T, hidden]."""
    attn = layer.self_attn
    q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split(attn.split, dim=-1)
    q = q.view(-1, attn.num_heads, attn.head_dim)
    k = k.view(-1, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q_rot, k_rot = attn.rope(positions, q, k)
    return q_rot, k_rot, k, v.view(-1, attn.num_kv_heads, attn.head_dim)


def _attend(layer, q, keys, values, mask) -> torch.Tensor:
    """q [B, Q, heads, D] over keys/values [B, L, kv_heads, D] with a bool mask [B, Q, L]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=layer.self_attn.scale, enable_gqa=True)
    return out.transpose(1, 2).flatten(2)


def _finish_layer(layer, x, attn_out):
    x = x + layer.self_attn.o_proj(attn_out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _anchor_kv(model: LlamaModel, anchor_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the anchor's rotated keys and values (computed by the plain decoder)."""
    n = len(anchor_ids)
    positions = torch.arange(n)
    x = model.embed_tokens(torch.tensor(anchor_ids))
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    out = []
    for layer in model.layers:
        q, k, _, v = _project(layer, x, positions)
        out.append((k, v))
        x = _finish_layer(layer, x, _attend(layer, q[None], k[None], v[None], causal)[0])
    return out


def _on_model_device(fn):
    """Tensors the function makes land on the model's device (CPU or GPU alike)."""
    @functools.wraps(fn)
    def run(model: LlamaModel, *args, **kwargs):
        with torch.device(model.embed_tokens.weight.device):
            return fn(model, *args, **kwargs)
    return run


@_on_model_device
def encode_spans(model: LlamaModel, plugin: CombPlugin | None, layout: DenseLayout):
    """Per layer, every span's keys before rotation and values, [span tokens, kv_heads, D] in
    span order: the encoder's output, what the cache stores."""
    if not layout.spans:
        return [(None, None)] * len(model.layers)
    anchor = _anchor_kv(model, layout.anchor_ids) if any(off for _, _, off in layout.spans) else None
    lengths = [end - start for start, end, _ in layout.spans]
    width, num = max(lengths), len(lengths)
    n_anchor = len(layout.anchor_ids) if anchor else 0
    ids = torch.zeros(num, width, dtype=torch.long)
    positions = torch.zeros(num, width, dtype=torch.long)
    mask = torch.zeros(num, width, n_anchor + width, dtype=torch.bool)
    for s, ((start, end, offset), length) in enumerate(zip(layout.spans, lengths)):
        ids[s, :length] = torch.tensor(layout.token_ids[start:end])
        positions[s, :length] = torch.arange(offset, offset + length)
        mask[s, :, :n_anchor] = bool(offset)
        mask[s, :, n_anchor:] = torch.ones(width, width, dtype=torch.bool).tril()
    valid = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).flatten()
    x = model.embed_tokens(ids.flatten())
    out = []
    with plugin.active(torch.arange(num * width)) if plugin else contextlib.nullcontext():
        for i, layer in enumerate(model.layers):
            q, k_rot, k, v = _project(layer, x, positions.flatten())
            out.append((k[valid], v[valid]))
            keys, values = k_rot.view(num, width, *k.shape[1:]), v.view(num, width, *v.shape[1:])
            if anchor:
                ak, av = anchor[i]
                keys = torch.cat([ak[None].expand(num, *ak.shape), keys], 1)
                values = torch.cat([av[None].expand(num, *av.shape), values], 1)
            attn = _attend(layer, q.view(num, width, *q.shape[1:]), keys, values, mask)
            x = _finish_layer(layer, x, attn.flatten(0, 1))
    return out


@_on_model_device
def forward(model: LlamaModel, plugin: CombPlugin | None, layout: DenseLayout,
            logit_positions: list[int], encoded=None, readers_from: int | None = None) -> torch.Tensor:
    """Logits [len(logit_positions), vocab] of context tokens at those positions. `encoded`: the
    spans' encode_spans output when already computed (prompts that share their spans).
    `readers_from`: where reader deltas start (default: the first span; the engine's request may
    have linked a span before it back into context, as a focus probe does)."""
    n = len(layout.token_ids)
    independent = torch.zeros(n, dtype=torch.bool)
    for start, end, _ in layout.spans:
        independent[start:end] = True
    span_idx = independent.nonzero()[:, 0]  # every span token is encoded; the linked ones are read fresh
    independent[list(layout.linked)] = False
    context = (~independent).nonzero()[:, 0]
    encoded = encode_spans(model, plugin, layout) if encoded is None else encoded
    ids = torch.tensor(layout.token_ids)
    x = model.embed_tokens(ids[context])
    mask = (torch.arange(n)[None, :] <= context[:, None])[None]
    if readers_from is None and layout.spans:
        readers_from = layout.spans[0][0]
    readers = (context >= readers_from).nonzero()[:, 0] if readers_from is not None else None  # reader deltas' rows
    with plugin.active(None, readers) if plugin else contextlib.nullcontext():
        x = _read(model, layout, x, context, span_idx, mask, encoded)
    where = {int(p): i for i, p in enumerate(context.tolist())}
    rows = torch.tensor([where[p] for p in logit_positions])
    return model.compute_logits(model.norm(x[rows]))


def _read(model: LlamaModel, layout: DenseLayout, x, context, span_idx, mask, encoded) -> torch.Tensor:
    """The decoder over the context tokens, reading the spans' encoded keys and values."""
    n = len(layout.token_ids)
    for layer, (span_k, span_v) in zip(model.layers, encoded):
        q, k, _, v = _project(layer, x, context)
        keys = k.new_empty(n, *k.shape[1:])
        values = v.new_empty(n, *v.shape[1:])
        if span_k is not None:
            _, moved = layer.self_attn.rope(span_idx, span_k[:, :1], span_k)  # to real positions
            keys[span_idx], values[span_idx] = moved, span_v
        keys[context], values[context] = k, v  # (over the linked span tokens' encoded KV)
        x = _finish_layer(layer, x, _attend(layer, q[None], keys[None], values[None], mask)[0])
    return x
