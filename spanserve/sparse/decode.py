"""Sparse decode in the engine: a request's flow and state (SparseDecode), and the step that narrows
each layer's attention to the blocks the flows pick (SparseStep).

The attention backends are untouched: a sparse sequence's block table is replaced, per layer, by
its chosen blocks in order (the newest token's block last) and its context length by theirs, so
every backend (torch, Triton) attends over them as over any context. Prefill stays dense, and so
does a decode step whose context fits the budget (selecting would cost more than it saves), or
whose keys need rotating at every step (span keys read in place, pic/layout.py).
"""

import dataclasses
import importlib
import os
import sys

import torch

from spanserve.errors import InvalidRequestError
from spanserve.sparse.builtins import BUILTINS
from spanserve.sparse.fields import FieldStore
from spanserve.sparse.flow import Flow, IndexerContext


class SparseDecode:
    """One request's sparse decode: its flow, budget, the flow's state per layer, and the error
    that ended it if its flow failed."""

    def __init__(self, flow: Flow, budget_tokens: int, block_size: int):
        flow.check_budget(budget_tokens, block_size)
        self.flow, self.budget_blocks = flow, budget_tokens // block_size
        self.state: dict[int, dict] = {}
        self.steps = 0
        self.error: str | None = None


class SparseStep:
    """The sparse sequences of one step (batch index -> SparseDecode)."""

    def __init__(self, fields: FieldStore, sequences: dict[int, SparseDecode], block_size: int):
        self.fields, self.sequences, self.block_size = fields, sequences, block_size
        self._rows: list[int] | None = None  # each sequence's first query row, the same in every layer
        for decode in sequences.values():
            decode.steps += 1

    def restrict(self, layer: int, q: torch.Tensor, meta):
        """`meta` with each sparse sequence's context narrowed to its flow's blocks at `layer`."""
        narrowed = [i for i, decode in self.sequences.items() if self._narrows(i, decode, meta)]
        if not narrowed:
            return meta
        tables, lens, first = meta.block_tables.clone(), list(meta.context_lens), list(meta.contiguous_from or [])
        if self._rows is None:
            self._rows = torch.tensor([0, *meta.query_lens]).cumsum(0).tolist()
        rows = self._rows
        changed = False
        for i in narrowed:
            decode, newest = self.sequences[i], (lens[i] - 1) // self.block_size  # full blocks come before it
            chosen = self._choose(decode, layer, q[rows[i]], tables[i, :newest], newest)
            if chosen is None:
                continue
            picked = torch.cat([chosen.to(tables.device), torch.tensor([newest], device=tables.device)])
            tables[i, :len(picked)] = meta.block_tables[i, picked]
            lens[i] = len(chosen) * self.block_size + lens[i] - newest * self.block_size
            if first:
                first[i] = None
            changed = True
        if not changed:
            return meta
        return dataclasses.replace(meta, block_tables=tables, context_lens=lens, contiguous_from=first or None,
                                   context_lens_tensor=torch.tensor(lens, device=meta.context_lens_tensor.device),
                                   derived={})

    def _narrows(self, i: int, decode: SparseDecode, meta) -> bool:
        """Whether sequence i attends to fewer blocks than its context: not when the context fits
        the budget (selecting would cost more than it saves), its flow failed, or its keys need
        moving at every step."""
        if decode.error or (meta.key_rotation and meta.key_rotation[i] is not None) or \
                (meta.span_share and meta.span_share[i] is not None):
            return False
        return (meta.context_lens[i] - 1) // self.block_size + 1 > decode.budget_blocks

    def _choose(self, decode: SparseDecode, layer: int, q: torch.Tensor, block_ids: torch.Tensor,
                num_blocks: int) -> torch.Tensor | None:
        """The flow's picks, checked; None (full attention this step) if it failed, which ends the
        request with the error after the step."""
        kv_heads = self.fields.kv_cache.shape[-2]
        ctx = IndexerContext(num_blocks, decode.budget_blocks, layer, decode.steps)
        try:
            fields = self.fields.get(decode.flow, layer, block_ids)
            chosen = decode.flow.forward_indexer(q.view(kv_heads, -1, q.shape[-1]), fields,
                                                 decode.state.setdefault(layer, {}), ctx)
            return _checked(chosen, num_blocks, decode.budget_blocks - 1)
        except Exception as exc:  # a user's flow: the request fails, the batch goes on
            decode.error = f"sparse flow {decode.flow.name!r} failed at layer {layer}: {exc}"
            return None


def _checked(chosen, num_blocks: int, most: int) -> torch.Tensor:
    if not isinstance(chosen, torch.Tensor) or chosen.dim() != 1 or chosen.dtype.is_floating_point:
        raise ValueError("forward_indexer must return a 1-D integer tensor of block indices")
    chosen = chosen.long().unique()  # sorted
    if len(chosen) and (chosen[0] < 0 or chosen[-1] >= num_blocks):
        raise ValueError(f"block indices must be in [0, {num_blocks}), got {chosen.min()}..{chosen.max()}")
    if len(chosen) > most:
        raise ValueError(f"{len(chosen)} blocks picked, the budget allows {most}")
    return chosen


def load_flows(paths: list[str]) -> dict[str, Flow]:
    """The built-in flows and user flows given by dotted path (`package.module.ClassName`, found
    from the working directory too, as uvicorn finds apps), by name."""
    flows = {name: cls() for name, cls in BUILTINS.items()}
    if paths and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for path in paths:
        module, _, attr = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise InvalidRequestError(f"cannot load sparse flow {path!r}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Flow)):
            raise InvalidRequestError(f"{path!r} is not a subclass of spanserve.sparse.flow.Flow")
        flow = cls()
        flows[flow.name] = flow
    return flows
