"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM) over a paged KV cache.

One flat batch of tokens from many sequences goes through each layer at once; only
attention needs to know which token belongs to which sequence (AttentionMetadata).
"""

from collections.abc import Callable, Iterable

import torch
from torch import nn

from spanserve.attention import AttentionBackend, AttentionMetadata
from spanserve.attention.torch_ref import store_kv
from spanserve.models import layer_ops
from spanserve.models.config import ModelConfig
from spanserve.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_ops.rms_norm(x, self.weight, self.eps)  # normalized in float32, scaled in x's dtype


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, backend: AttentionBackend, layer: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope, self.backend, self.layer = rope, backend, layer
        self.scale = self.head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None  # bound by the runner

    def key_values(self, x, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K (rotated) and V for hidden states x, without attending (a probe)."""
        _, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        _, k = self.rope(positions, k, k)
        return k, v.view(-1, self.num_kv_heads, self.head_dim)

    def queries(self, x, positions) -> torch.Tensor:
        """This layer's Q (rotated) for hidden states x, without attending (a probe)."""
        q = self.qkv_proj(x)[:, :self.split[0]].view(-1, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q, _ = self.rope(positions, q, q)
        return q

    def forward(self, x, positions, meta: AttentionMetadata, rope_tables=None, keep: torch.Tensor | None = None):
        """The attention output of every row, or of rows `keep` alone; the keys and values of
        every row are stored all the same."""
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, stored = layer_ops.rope_store(self.rope, positions, q, k, v, self.kv_cache, meta.slot_mapping,
                                            rope_tables)
        if keep is not None and not keep.numel():  # no row's output is read: only the cache changes
            if not stored:
                store_kv(self.kv_cache[0], self.kv_cache[1], k, v, meta.slot_mapping)
            return x[:0]
        if meta.sparse is not None:  # decode over the blocks sparse flows pick, at this layer
            meta = meta.sparse.restrict(self.layer, q, meta)
        out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale, stored=stored)
        return self.o_proj((out if keep is None else out[keep]).flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(layer_ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, backend: AttentionBackend, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, backend, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, meta, rope_tables=None, keep: torch.Tensor | None = None):
        """The layer's output for every row, or for rows `keep` alone (Attention.forward)."""
        attended = self.self_attn(self.input_layernorm(x), positions, meta, rope_tables, keep)
        if keep is not None:
            x = x[keep]
            if not x.shape[0]:
                return x
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))


class ForwardStopped(Exception):
    """A forward pass left between two layers because its caller's `stop()` turned true; what
    it computed so far (some layers' K and V of its tokens) is to be recomputed."""


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.rope = rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, backend, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Set where a step's layers may run in one C call (models/fused_layers.py): a callable
        # (hidden states, positions, meta, layers) -> those layers' output, or None to run them here.
        self.fused_layers: Callable | None = None

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                stop: Callable[[], bool] | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token in the flat batch, or with `keep` (row
        indices) of those rows alone: the last layer computes its output for them only, after
        storing every row's keys and values (the rows sampled from: a session question's one row
        of 29, none in a prefill chunk before a prompt's last). With `stop`, asked before every
        layer: raises ForwardStopped once it returns True."""
        x = self.embed_tokens(input_ids)
        first = 0
        # a prefill step that may stop runs layer by layer, to stop between two
        if self.fused_layers is not None and (stop is None or max(meta.query_lens) == 1):
            if stop is not None and stop():
                raise ForwardStopped
            whole = keep is None or keep.shape[0] == x.shape[0]
            # the last layer's output for `keep` alone is the Python layer's to compute
            first = len(self.layers) - (0 if whole else 1)
            fused = self.fused_layers(x, positions, meta, range(first))
            if fused is None:
                first = 0
            elif whole:
                return self.norm(fused if keep is None else fused[keep])
            else:
                x = fused
        tables = self.rope.tables(positions, x.dtype)  # the same in every layer
        last = len(self.layers) - 1
        for i in range(first, len(self.layers)):
            if stop is not None and stop():
                raise ForwardStopped
            x = self.layers[i](x, positions, meta, tables, keep if i == last else None)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """kv_cache: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
        for layer, cache in zip(self.layers, kv_cache):
            layer.self_attn.kv_cache = cache

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up into our packed projections."""
        if self.cfg.tie_word_embeddings:  # re-tie: moving a module off "meta" unties it
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            target, shard = _packed_target(name)
            if target not in params:
                continue
            param = params[target]
            rows = _shard_rows(self.cfg, target, shard)
            (param[rows] if rows else param).copy_(tensor)
            loaded.add((target, shard))
        missing = {n for n in params if not any(t == n for t, _ in loaded)}
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}...")


_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _packed_target(name: str) -> tuple[str, int | None]:
    for hf_name, (ours, shard) in _PACKED.items():
        if f".{hf_name}." in name:
            return name.replace(hf_name, ours), shard
    return name, None


def _shard_rows(cfg: ModelConfig, target: str, shard: int | None) -> slice | None:
    if shard is None:
        return None
    if "gate_up_proj" in target:
        size = cfg.intermediate_size
        return slice(shard * size, (shard + 1) * size)
    sizes = [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
    start = sum(sizes[:shard])
    return slice(start, start + sizes[shard])
