"""A step's decoder layers in one C call (kernels/csrc/fused_layers.c).

Through the model's Python code a decode step of SmolLM2 is some 300 calls of C kernels and
small torch ops, and each costs more between kernels than within: about 7 of a 17 ms batch-1
step on an AMD EPYC went to Python. A prefill step of a few dozen rows pays the same per call: a
warm RAG prompt's relinked tokens and question, and its focus probe. Where every layer's
projections compute from a GGUF's blocks (models/gguf_blocks.py) in a float32 model on CPU,
fused_layers.c runs the same kernels in the same order on the same data, so the hidden states
it returns are those of the Python layers to the bit (tests/test_fused_layers.py). It takes a
decode step over caches as stored, and a step of prefill chunks the attention backend would give
the prefill kernel whole (span keys moved as they are read). Any other step (a decode step over
moved span keys, decode rows beside prefill chunks, a span share, a sparse flow, forward hooks
on a layer's modules such as a COMB plug-in's deltas, a projection's weight edited in place,
more rows than a projection's C kernel takes) runs the Python layers.

In a bf16 model it takes decode steps alone, and computes them as the float32 model would over
the same bf16 cache and the bf16 norm weights: the hidden states are widened once on the way in
and rounded once on the way out, where the Python layers round every op's output. Its BlockLinear
projections already widen x to float32 for the kernel; what the fused step saves is a decode
step's some 300 calls (about half a batch-1 step of SmolLM2 in bf16 on an AMD EPYC Zen 3). A
prefill step keeps the Python layers, whose bf16 queries take the calibrated bf16 GEMM and
attention paths (docs/cpu.md), which float32 rows would not.
"""

import ctypes

import torch
from torch import nn

from spanserve.attention.backend import AttentionMetadata, plain_decode
from spanserve.attention.torch_ref import prefill_plan, step_rotations
from spanserve.kernels import cpu_kernel, native, threads
from spanserve.models.gguf_blocks import BlockLinear

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Projection(ctypes.Structure):
    pass


_Projection._fields_ = [("codes", _ptr), ("scale", _ptr), ("offset", _ptr), ("factors", _ptr), ("bias", _ptr),
                        ("n", _i64), ("n_padded", _i64), ("k", _i64), ("bits", _i64), ("group", _i64),
                        ("int8_x", _i64), ("next", ctypes.POINTER(_Projection))]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", _Projection), ("o", _Projection),
                ("gate_up", _Projection), ("down", _Projection), ("k_cache", _ptr), ("v_cache", _ptr)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("dim", _i64), ("num_slots", _i64),
                ("block_size", _i64), ("max_blocks", _i64), ("max_position", _i64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("kv_dtype", _i64)]


class _Chunks(ctypes.Structure):
    _fields_ = [("query_starts", _ptr), ("num_seqs", _i64), ("rot_starts", _ptr), ("rot_ids", _ptr),
                ("rot_cos", _ptr), ("rot_sin", _ptr), ("num_angles", _i64)]


class FusedLayers:
    """The decoder layers of `model` as fused_layers.c reads them; call it with a step's hidden
    states to get a run of layers' output, or None for a step it does not take."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: ctypes.Array | None = None  # built at the first step: the runner binds the caches after
        self.bound_cache = None
        self.modules = list(model.layers.modules())
        self.projections = [m for m in self.modules if isinstance(m, BlockLinear)]
        self.max_rows = min(p.max_rows for p in self.projections)
        self.dtype = model.embed_tokens.weight.dtype  # float32, or bf16: decode steps alone
        self.float_norms: list[torch.Tensor] = []  # a bf16 model's norm weights widened, as C reads them

    @classmethod
    def of(cls, model: nn.Module) -> "FusedLayers | None":
        """A FusedLayers where `model` qualifies: float32 or bf16 on CPU, the C kernels built and
        allowed, no q/k norms, every projection of every layer in blocks; else None."""
        cfg = model.cfg
        weight = model.embed_tokens.weight
        if (cfg.qk_norm or weight.dtype not in (torch.float32, torch.bfloat16) or weight.is_cuda
                or any(cpu_kernel.load(name) is None for name in ("gemm", "layer", "decode"))
                or 2 * model.rope.cos.shape[-1] != cfg.head_dim):
            return None
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(p, BlockLinear) for p in projections):
                return None
        return cls(model)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 layers: range | None = None) -> torch.Tensor | None:
        """The output of model layers `layers` (all of them by default) for the step's hidden
        states x at `positions`, or None where the Python layers must run it."""
        layers = range(len(self.model.layers)) if layers is None else layers
        caches = self.model.layers[0].self_attn.kv_cache
        kernel = cpu_kernel.load("gemm")
        if (caches is None or kernel is None or torch.is_grad_enabled() or x.shape[0] > self.max_rows
                or self._hooked() or any(p.stale for p in self.projections)):
            return None
        decode = plain_decode(meta, x.device)
        if decode is not None and x.shape[0] == len(meta.query_lens):
            tables, lens, _ = decode
            run = lambda *args: kernel.decode_layers(*args)  # noqa: E731
        elif self.dtype != torch.float32:
            return None
        else:
            prefill = self._prefill(x, positions, meta)
            if prefill is None:
                return None
            chunks, tables, lens = prefill
            run = lambda *args: kernel.prefill_layers(*args, ctypes.addressof(chunks))  # noqa: E731
        if self.layers is None or caches.data_ptr() != self.bound_cache:
            self._bind(caches)
        rope = self.model.rope
        hidden = x.contiguous().clone() if x.dtype == torch.float32 else x.float().contiguous()
        positions = positions.long().contiguous()
        slots = meta.slot_mapping.long().contiguous()
        self.shape.max_blocks = tables.shape[1]
        first = ctypes.addressof(self.layers) + layers.start * ctypes.sizeof(_Layer)
        with threads.whole_step_threads():
            status = run(first, len(layers), ctypes.addressof(self.shape), hidden.data_ptr(), hidden.shape[0],
                         positions.data_ptr(), rope.cos.data_ptr(), rope.sin.data_ptr(), slots.data_ptr(),
                         tables.data_ptr(), lens.data_ptr())
        if status != 0:  # -1 shapes, -2 positions or slots, -3 out of memory
            raise RuntimeError(f"fused layers failed ({status}) for {tuple(x.shape)}")
        return hidden.to(x.dtype)

    def _prefill(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """A step of prefill chunks as prefill_layers reads it: (its chunks, block tables, context
        lengths), kept in meta.derived with the tensors they point at (the same in every call of the
        step). None where the attention backend would not give the whole step to the prefill kernel
        (torch_ref.prefill_plan: a decode row, a span share), for a sparse flow (its attention reads
        other blocks at each layer), or where the prefill kernel is not allowed."""
        if (positions is not meta.positions or cpu_kernel.load("prefill") is None
                or x.shape[0] != sum(meta.query_lens) or meta.sparse is not None):
            return None
        plan = prefill_plan(meta, x.device)
        if plan is None or plan[1] is not None:  # no chunk, or not every sequence one
            return None
        if "fused_prefill" not in meta.derived:
            seqs, _, tables, query_starts, _, lens, _ = plan
            rotations = step_rotations(meta, seqs)  # the attention backend's, made once per step
            chunks = _Chunks(query_starts.data_ptr(), len(seqs), *cpu_kernel.rotation_args(rotations))
            meta.derived["fused_prefill"] = (chunks, tables.long().contiguous(), lens.long().contiguous(),
                                             query_starts, rotations)
        return meta.derived["fused_prefill"][:3]

    def _hooked(self) -> bool:
        """Whether a module of the layers has forward hooks now, other than the thread policy's
        (kernels/threads.py, which this call's own threads replace): a COMB plug-in's deltas while
        it encodes, for one. Those run in the Python layers only."""
        return any(not threads.is_thread_policy(hook) for m in self.modules
                   for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))

    def _bind(self, caches: torch.Tensor) -> None:
        """The layers' weights and caches as C structs (pointers: the tensors stay the model's)."""
        model, cfg = self.model, self.model.cfg
        layers, self.later_pieces = [], []  # the structs a projection's `next` points at, kept alive
        widen = self.dtype != torch.float32
        self.float_norms = [norm.weight.detach().float() if widen else norm.weight for layer in model.layers
                            for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        for i, layer in enumerate(model.layers):
            attn, mlp, cache = layer.self_attn, layer.mlp, layer.self_attn.kv_cache
            norms = (self.float_norms[2 * i].data_ptr(), self.float_norms[2 * i + 1].data_ptr())
            projections = [self._projection(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            layers.append(_Layer(*norms, *projections, cache[0].data_ptr(), cache[1].data_ptr()))
        self.layers = (_Layer * len(layers))(*layers)
        attn = model.layers[0].self_attn
        self.shape = _Shape(cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                            caches.shape[1] * caches.shape[2], caches.shape[2], 0, model.rope.cos.shape[0],
                            model.layers[0].input_layernorm.eps, attn.scale, native.DTYPES[caches.dtype])
        self.bound_cache = caches.data_ptr()

    def _projection(self, p: BlockLinear) -> _Projection:
        """p's first piece, chained to the others (fused_layers.c computes each into its columns)."""
        head = None
        for piece in reversed(p.pieces):
            codes, bits, group, scale, offset, factors, bias = piece.kernel_args
            later = None if head is None else ctypes.pointer(head)
            head = _Projection(codes, scale, offset, factors, bias, piece.n, piece.padded_out, p.in_features, bits,
                               group, int(p.int8_activations), later)
            self.later_pieces.append(head)
        return head
