"""CombPlugin: a trained encoder for position-independent spans (COMB, papers/comb-encoder-pic.txt).

A span computed alone never saw what comes before it; the frozen decoder then reads KV it was
never trained to read, and answers get lost. COMB adds an encoder, trained while the decoder stays
frozen, whose only job is to write span KV that the decoder's tokens read well.

Our encoder is the decoder's own layers plus trained low-rank deltas (W + B A on the q/k/v, output
and MLP projections), active only on rows that compute span tokens. Its KV goes where span KV
always goes (shared paged blocks, span-local hashes, repositioned by RoPE at read time), and the
decoder's self-attention reads it as the paper's cross-attention layers read encoder KV. So every
reuse mechanism keeps working, and the plug-in is small enough to ship (a few MB). With the
deltas at zero the encoder is the decoder: training starts from link policy "none".

The paper's decoder also gets trained cross-attention layers, its side of reading encoder KV.
Ours may carry reader deltas for that side (`reader.` names): low-rank deltas on the query part
of the q/k/v projection and on the output projection, active only on the rows of context tokens
at or after a request's first span (its question and answer), so the text before the spans stays
the plain decoder's and keeps sharing its prefix cache with every other request.

Differences from the paper, scaled to our models and a CPU: one encoder layer per decoder layer
(each decoder layer needs span KV of its own) instead of a few layers of full rank, and low-rank
reader deltas on the decoder's own attention instead of new cross-attention layers.
"""

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from spanserve.errors import InvalidRequestError
from spanserve.pic.voters import ProbeVoters

TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
READER_TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj")  # of qkv, only the query columns
READER = "reader."  # name prefix of reader deltas
FORMAT = "spanserve-comb-1"


def model_fingerprint(model: nn.Module) -> str:
    """Identifies a model's weights (shape and the first embedding rows, rounded to bf16 so a
    float32 and a bf16 load of the same weights agree): a plug-in only fits the model it was
    trained for."""
    cfg = model.cfg
    shape = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
             cfg.head_dim, cfg.vocab_size)
    digest = hashlib.sha256(repr(shape).encode())
    rows = model.embed_tokens.weight[:64].detach().to("cpu", torch.bfloat16).view(torch.int16)
    digest.update(rows.numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class CombPlugin:
    """Low-rank deltas per (layer, projection). While a step runs, encoder deltas apply to the
    flat-batch `rows` (span tokens) and reader deltas to `reader_rows` (see `active`); None: the
    plain decoder."""

    fingerprint: str
    rank: int
    alpha: float
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "layers.3.mlp.down_proj" -> (A [r, in], B [out, r])
    meta: dict = field(default_factory=dict)  # training facts: steps, data, wall time...
    probe_heads: list = field(default_factory=list)  # [layer, head] voters of the focus probe (pic/voters.py)
    rows: torch.Tensor | None = None
    reader_rows: torch.Tensor | None = None
    # (projection, its hook) of the model attached to; the hooks are on only while active: a
    # module with a hook takes PyTorch's slow call path, 2-5 us more a call (120 a SmolLM2 step)
    _hooks: list = field(default_factory=list, repr=False)
    _on: list = field(default_factory=list, repr=False)  # the handles while active
    _run: tuple[int, int] | None = field(default=None, repr=False)  # `rows` as one run start..stop - 1
    _scaled: dict = field(default_factory=dict, repr=False)  # name -> (B, its version, B^T x scaling)

    @classmethod
    def zeros(cls, model: nn.Module, rank: int = 16, alpha: float = 32.0, seed: int = 0,
              reader: bool = False) -> "CombPlugin":
        """Fresh deltas for `model`: A random, B zero (so the encoder starts as the decoder)."""
        plugin = cls(model_fingerprint(model), rank, alpha, {})
        plugin._add_zeros(_targets(model), "", torch.Generator().manual_seed(seed))
        if reader:
            plugin.add_reader(model, seed)
        return plugin

    def add_reader(self, model: nn.Module, seed: int = 0) -> None:
        """Zero reader deltas (a plug-in without them reads as the plain decoder does)."""
        self._add_zeros(_reader_targets(model), READER, torch.Generator().manual_seed(seed + 1))

    def _add_zeros(self, targets, prefix: str, gen: torch.Generator) -> None:
        for name, in_features, out_features in targets:
            a = torch.randn(self.rank, in_features, generator=gen) / in_features**0.5
            self.deltas[prefix + name] = (a, torch.zeros(out_features, self.rank))

    @property
    def has_reader(self) -> bool:
        return any(name.startswith(READER) for name in self.deltas)

    @contextmanager
    def active(self, rows: torch.Tensor | None, reader_rows: torch.Tensor | None = None):
        """Apply the encoder deltas to `rows` and the reader deltas to `reader_rows` meanwhile
        (its hooks are on the attached model's projections meanwhile, once however nested)."""
        previous, outermost = (self.rows, self.reader_rows, self._run), not self._on
        self.rows, self.reader_rows = rows, reader_rows if self.has_reader else None
        self._run = _one_run(rows)
        if outermost:
            self._on = [linear.register_forward_hook(hook) for linear, hook in self._hooks]
        try:
            yield
        finally:
            self.rows, self.reader_rows, self._run = previous
            if outermost:
                for handle in self._on:
                    handle.remove()
                self._on = []

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @cached_property
    def signature(self) -> str:
        """What changes span KV: part of the span blocks' hashes, so KV of different plug-ins
        (or of none) is never shared. Computed once: a plug-in serving requests is not trained."""
        digest = hashlib.sha256(self.fingerprint.encode())
        for name in sorted(self.deltas):
            for t in self.deltas[name]:
                digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def parameters(self) -> list[torch.Tensor]:
        return [t for pair in self.deltas.values() for t in pair]

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The low-rank update of projection `name` for inputs x [..., in]."""
        a, b = self.deltas[name]
        return (x @ a.to(x.dtype).t()) @ (b.to(x.dtype).t() * self.scaling)

    # ---- in the engine -------------------------------------------------------------------

    def attach(self, model: nn.Module, cast: bool = True) -> None:
        """Add the deltas to the model's projections on `rows` while active (forward hooks: the
        model's code stays the decoder's). With `cast`, deltas move to the model's device and
        dtype once (serving); training keeps its float32 tensors and casts at each use."""
        if model_fingerprint(model) != self.fingerprint:
            raise InvalidRequestError("this COMB plug-in was trained for another model (fingerprint "
                                      f"{self.fingerprint}, model {model_fingerprint(model)})")
        if cast:
            param = next(model.parameters())
            self.deltas = {n: (a.to(param.device, param.dtype), b.to(param.device, param.dtype))
                           for n, (a, b) in self.deltas.items()}
        self._hooks = [(linear, self._hook(name)) for name, linear in _linears(model)]

    def voters(self, model: nn.Module) -> ProbeVoters | None:
        """The focus probe's voters trained for this plug-in (`spanserve train probe`), if any."""
        if not self.probe_heads:
            return None
        try:
            return ProbeVoters.parse(self.probe_heads, model.cfg.num_layers, model.cfg.num_heads)
        except ValueError as e:
            raise InvalidRequestError(f"this COMB plug-in's {e}") from e

    def _hook(self, name: str):
        reader = READER + name
        def add_delta(module, inputs, out):
            x = inputs[0]
            in_place = self._run is not None and x.dtype == torch.float32 and not torch.is_grad_enabled()
            if self.rows is not None and in_place:
                self._add_in_place(name, x, out, *self._run)
            elif self.rows is not None:
                out.index_add_(0, self.rows, self.delta(name, x.index_select(0, self.rows)))
            if self.reader_rows is not None and reader in self.deltas:
                update = self.delta(reader, x.index_select(0, self.reader_rows))  # (qkv: the query columns)
                out[:, :update.shape[1]].index_add_(0, self.reader_rows, update)
            return out
        return add_delta

    def _add_in_place(self, name: str, x: torch.Tensor, out: torch.Tensor, start: int, stop: int) -> None:
        """out[start:stop] += delta(name, x[start:stop]) as one multiply-add into out's rows: in
        float32 the same sums as `delta` and index_add_ (tests/test_comb.py); in bf16 it would round
        once where they round twice, so bf16 keeps index_add_. A cold prompt's span rows are one
        such run: the delta's own output and its scatter, which read and wrote every row's output
        twice more, made 16 documents of 256 tokens 9% slower on SmolLM2 and 16% on Qwen 0.5B
        (AMD EPYC Zen 3)."""
        a, b = self.deltas[name]
        kept = self._scaled.get(name)  # scaled once while B stays the same tensor, unchanged, in x's dtype
        if kept is None or kept[0] is not b or kept[1] != b._version or kept[2].dtype != x.dtype:
            kept = self._scaled[name] = (b, b._version, b.to(x.dtype).t() * self.scaling)
        out[start:stop].addmm_(x[start:stop] @ a.to(x.dtype).t(), kept[2])

    # ---- files ----------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        tensors = {}
        for name, (a, b) in self.deltas.items():
            tensors[f"{name}.A"] = a.detach().to(torch.bfloat16).contiguous()
            tensors[f"{name}.B"] = b.detach().to(torch.bfloat16).contiguous()
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "rank": str(self.rank),
                "alpha": str(self.alpha), "meta": json.dumps(self.meta)}
        if self.probe_heads:
            meta["probe_heads"] = json.dumps(self.probe_heads)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: Path) -> "CombPlugin":
        try:
            return cls._read(path)
        except (OSError, ValueError, KeyError, SafetensorError) as e:  # any unusable file: a clear error
            raise InvalidRequestError(f"cannot read COMB plug-in {path}: {e}") from e

    @classmethod
    def _read(cls, path: Path) -> "CombPlugin":
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError("not a spanserve COMB plug-in")
            tensors = {k: f.get_tensor(k).float() for k in f.keys()}
        names = sorted({k.rsplit(".", 1)[0] for k in tensors})
        deltas = {n: (tensors[f"{n}.A"], tensors[f"{n}.B"]) for n in names}
        return cls(meta["fingerprint"], int(meta["rank"]), float(meta["alpha"]), deltas,
                   json.loads(meta.get("meta", "{}")), json.loads(meta.get("probe_heads", "[]")))


def _one_run(rows: torch.Tensor | None) -> tuple[int, int] | None:
    """(start, stop) where `rows` are start .. stop - 1 in order, at least two of them; else None.
    (One row's product takes another BLAS path, whose sums differ in the last bit.)"""
    if rows is None or rows.dim() != 1 or len(rows) < 2:
        return None
    start = int(rows[0])
    if int(rows[-1]) - start != len(rows) - 1 or not torch.equal(rows, torch.arange(start, start + len(rows),
                                                                                    device=rows.device)):
        return None
    return start, start + len(rows)


def _linears(model: nn.Module):
    """(name, nn.Linear) of every projection the encoder adapts, in layer order."""
    for i, layer in enumerate(model.layers):
        for target in TARGETS:
            yield f"layers.{i}.{target}", layer.get_submodule(target)


def _targets(model: nn.Module):
    """(name, in, out) of the encoder's deltas."""
    for name, linear in _linears(model):
        yield name, linear.in_features, linear.out_features


def _reader_targets(model: nn.Module):
    """(name, in, out) of the reader's deltas: the query columns of q/k/v, the output projection."""
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        for target in READER_TARGETS:
            linear = layer.get_submodule(target)
            out = attn.num_heads * attn.head_dim if target == "self_attn.qkv_proj" else linear.out_features
            yield f"layers.{i}.{target}", linear.in_features, out


SHIPPED = Path(__file__).parent / "plugins"


def find_plugin(model: nn.Module, path: str | None = None) -> CombPlugin | None:
    """The plug-in at `path` (it must fit the model), else a shipped one trained for this model,
    else None."""
    if path:
        return CombPlugin.load(Path(path))
    shipped = shipped_plugin(model)
    return CombPlugin.load(shipped) if shipped else None


def shipped_plugin(model: nn.Module) -> Path | None:
    """The file of the plug-in shipped for this model, if any."""
    fingerprint = model_fingerprint(model)
    for candidate in sorted(SHIPPED.glob("*.safetensors")):
        with safe_open(str(candidate), "pt") as f:
            if (f.metadata() or {}).get("fingerprint") == fingerprint:
                return candidate
    return None
