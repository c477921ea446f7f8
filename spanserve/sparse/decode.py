"""Sparse decode in the engine: a request's flow and state (SparseDecode), and the step that narrows
each layer's attention to the blocks the flows pick (SparseStep).

The attention backends are untouched: a sparse sequence's block table is replaced, per layer, by
its chosen blocks in order (the blocks of the step's own queries last) and its context length by
theirs, and its queries' positions, which only mask keys by then (RoPE is applied), by their
indices in that shorter context; so every backend (torch, Triton) attends over them as over any
context. Prefill stays dense, but for a request that asks for `sparse_prefill`: its prefill chunks
of at most PREFILL_QUERIES tokens (a question after cached data: a session's, or a prompt whose
prefix is cached) attend to blocks the flow picks for all their queries together. A speculative
verify step comes as one sequence per row (runner.py), each picked for as its own decode step
would be; the flow's state is kept as it stood after each row and rolled back to the last row
the target accepted (`verified`), so drafting changes nothing of what the flow sees. A step stays
dense whose context before its queries is under NARROW_FROM budgets (selecting would cost more
than it saves), or whose keys need rotating at every step (span keys read in
place, pic/layout.py).
"""

import copy
import dataclasses
import importlib
import os
import sys
from typing import NamedTuple

import torch

from spanserve.attention.torch_ref import fold_query_heads
from spanserve.errors import InvalidRequestError
from spanserve.kernels import threads
from spanserve.sparse.builtins import BUILTINS
from spanserve.sparse.fields import FieldStore
from spanserve.sparse.flow import Flow, IndexerContext

PREFILL_QUERIES = 64  # the longest prefill chunk that `sparse_prefill` narrows
# A sequence is narrowed only when its context before the step's queries is at least this many
# times its budget: below, picking costs more than the attention it saves (SmolLM2 at 2k tokens,
# `spanserve bench sparse`: budget 1,024 ran as slow as 0.87x full attention at batch 1, budget
# 2,048 0.51-0.88x; at 4x, 4k and budget 1,024, every flow was faster).
NARROW_FROM = 4


class SparseDecode:
    """One request's sparse decode: its flow, budget, the flow's state per layer, and the error
    that ended it if its flow failed."""

    def __init__(self, flow: Flow, budget_tokens: int, block_size: int, prefill: bool = False):
        flow.check_budget(budget_tokens, block_size)
        self.flow, self.budget_blocks, self.prefill = flow, budget_tokens // block_size, prefill
        self.state: dict[int, dict] = {}
        self.steps = 0
        self.error: str | None = None
        self.base = 0  # steps before the current one
        # a verify step's states per layer, by row (-1: before its first row), to roll back to
        self.trail: dict[int, dict[int, dict]] | None = None

    def begin(self, rows: int) -> None:
        """A step computing `rows` of its decode rows (more than one: a verify step's drafts)."""
        self.base, self.steps = self.steps, self.steps + rows
        self.trail = {} if rows > 1 else None

    def picking(self, layer: int, row: int) -> tuple[dict, int]:
        """The state a pick at `layer` for the step's `row` reads and writes, and its step number."""
        state = self.state.setdefault(layer, {})
        if self.trail is not None and layer not in self.trail:
            self.trail[layer] = {-1: copy.deepcopy(state)}
        return state, self.base + row + 1

    def picked(self, layer: int, row: int) -> None:
        if self.trail is not None:
            self.trail[layer][row] = copy.deepcopy(self.state[layer])

    def verified(self, kept: int) -> None:
        """After a verify step of which the first `kept` rows stand (the real token's and the
        accepted drafts'): the flow's state and step count as after decoding those one by one."""
        for layer, states in (self.trail or {}).items():
            self.state[layer] = states[max(r for r in states if r < kept)]
        self.steps, self.trail = self.base + kept, None

    def covers(self, num_queries: int, samples: bool) -> bool:
        """Whether a step computing `num_queries` tokens of the request (`samples`: and sampling
        after them) may attend sparsely: a decode step, or with `prefill` a short prefill chunk."""
        return (num_queries == 1 and samples) or (self.prefill and num_queries <= PREFILL_QUERIES)


class _Narrowing(NamedTuple):
    """A sequence the step narrows: its query rows, the ids of the blocks before its queries and
    of its queries' own blocks."""

    rows: slice
    before: torch.Tensor
    own: torch.Tensor


class SparseStep:
    """The sparse sequences of one step (batch index -> SparseDecode)."""

    def __init__(self, fields: FieldStore, sequences: dict[int, SparseDecode], block_size: int):
        self.fields, self.sequences, self.block_size = fields, sequences, block_size
        self._plan: dict[int, _Narrowing] | None = None
        self._shapes: dict[tuple, tuple] = {}  # the narrowed lengths -> what follows from them
        self._rows: dict[int, int] = {}  # batch index -> its row of its request's step (a verify step has several)
        rows: dict[SparseDecode, int] = {}  # of each request, in this step
        for i, decode in sequences.items():
            self._rows[i] = rows.get(decode, 0)
            rows[decode] = self._rows[i] + 1
        for decode, count in rows.items():
            decode.begin(count)

    def restrict(self, layer: int, q: torch.Tensor, meta):
        """`meta` with each sparse sequence's context narrowed to its flow's blocks at `layer`."""
        with threads.small_ops():
            return self._restricted(layer, q, meta)

    def _restricted(self, layer: int, q: torch.Tensor, meta):
        if self._plan is None:  # the same in every layer
            self._plan = self._planned(meta)
        narrowed = [i for i in self._plan if not self.sequences[i].error]
        if not narrowed:
            return meta
        tables, lens, done = meta.block_tables.clone(), list(meta.context_lens), []
        for i in narrowed:
            seq = self._plan[i]
            # the chosen blocks, then the blocks of the step's own queries (the newest token's at decode)
            chosen = self._choose(self.sequences[i], layer, self._rows[i], q[seq.rows], seq, tables[i])
            if chosen is None:  # full attention this step, over its row as it was (a failed flow may have written it)
                tables[i] = meta.block_tables[i]
                continue
            lens[i] += (chosen - seq.before.shape[0]) * self.block_size  # (shape, not len(): Python, 30 calls a step)
            done.append(i)
        if not done:
            return meta
        lens, first, lens_tensor, positions = self._shaped(meta, lens, done)
        return dataclasses.replace(meta, block_tables=tables, context_lens=lens, contiguous_from=first,
                                   context_lens_tensor=lens_tensor, positions=positions, derived={})

    def _shaped(self, meta, lens: list[int], done: list[int]) -> tuple:
        """What narrowing sequences `done` to context lengths `lens` changes besides the tables:
        the lengths as a tensor, the first blocks (no longer a run of ids) and the positions of
        prefill chunks' queries (their causal mask, in the shorter context). A flow picks as many
        blocks at every layer, as a rule: made once per step, not thirty times."""
        key = (*lens, *done)
        if key not in self._shapes:
            positions = meta.positions
            for i in done:
                if meta.query_lens[i] > 1 and lens[i] != meta.context_lens[i]:
                    positions = positions.clone() if positions is meta.positions else positions
                    positions[self._plan[i].rows] += lens[i] - meta.context_lens[i]
            first = None
            if meta.contiguous_from:
                first = [None if i in done else f for i, f in enumerate(meta.contiguous_from)]
            self._shapes[key] = (lens, first, torch.tensor(lens, device=meta.context_lens_tensor.device), positions)
        return self._shapes[key]

    def _planned(self, meta) -> dict[int, _Narrowing]:
        """For each sequence that narrows: its query rows, the blocks before its queries (fields
        refreshed at every layer) and its queries' own blocks."""
        bounds = torch.tensor([0, *meta.query_lens]).cumsum(0).tolist()
        firsts = meta.positions[bounds[:-1]].tolist() if meta.query_lens else []
        plan = {}
        for i, decode in self.sequences.items():
            num = firsts[i] // self.block_size  # full blocks before the queries
            if not self._narrows(i, decode, num, meta):
                continue
            before = meta.block_tables[i, :num]
            try:
                self.fields.refresh(decode.flow, before)
            except Exception as exc:  # a user's forward_cache: as a failing indexer (_choose)
                decode.error = f"sparse flow {decode.flow.name!r} failed computing its fields: {exc}"
                continue
            own = meta.block_tables[i, num:(meta.context_lens[i] - 1) // self.block_size + 1]
            plan[i] = _Narrowing(slice(bounds[i], bounds[i + 1]), before, own)
        return plan

    def _narrows(self, i: int, decode: SparseDecode, num_blocks: int, meta) -> bool:
        """Whether sequence i attends to fewer blocks than its context: not when the blocks before
        its queries are fewer than NARROW_FROM budgets (selecting would cost more than it saves),
        its flow failed, or its keys need moving at every step."""
        if decode.error or (meta.key_rotation and meta.key_rotation[i] is not None) or \
                (meta.span_share and meta.span_share[i] is not None):
            return False
        return num_blocks >= NARROW_FROM * decode.budget_blocks

    def _choose(self, decode: SparseDecode, layer: int, row: int, q: torch.Tensor, seq: _Narrowing,
                table: torch.Tensor) -> int | None:
        """The flow's picks written into `table` (the sequence's row), its own blocks after them:
        how many blocks before its queries it chose, or None (full attention this step) if it
        failed, which ends the request with the error after the step."""
        state, step = decode.picking(layer, row)
        count = self._picks(decode, layer, q, seq, table, state, step)
        decode.picked(layer, row)
        return count

    def _picks(self, decode: SparseDecode, layer: int, q: torch.Tensor, seq: _Narrowing, table: torch.Tensor,
               state: dict, step: int) -> int | None:
        num_blocks = seq.before.shape[0]
        ctx = IndexerContext(num_blocks, decode.budget_blocks, layer, step)
        try:
            count = decode.flow.pick_into(q, self.fields, layer, seq.before, seq.own, table, state, ctx)
            if count is not None:  # (the ids it wrote are the flow's to get right: checking them costs what it saves)
                if not 0 <= count <= min(num_blocks, decode.budget_blocks - 1):
                    raise ValueError(f"pick_into picked {count} of {num_blocks} blocks, the budget allows "
                                     f"{decode.budget_blocks - 1}")
                return count
            folded = fold_query_heads(q, self.fields.kv_cache.shape[-2])
            chosen = decode.flow.pick_blocks(folded, self.fields, layer, seq.before, state, ctx)
            chosen = _checked(chosen, num_blocks, decode.budget_blocks - 1)
        except Exception as exc:  # a user's flow: the request fails, the batch goes on
            decode.error = f"sparse flow {decode.flow.name!r} failed at layer {layer}: {exc}"
            return None
        picked = torch.cat([seq.before.index_select(0, chosen.to(table.device)), seq.own])
        table[:picked.shape[0]] = picked
        return chosen.shape[0]


def _checked(chosen, num_blocks: int, most: int) -> torch.Tensor:
    """A flow's picks as sorted, distinct block indices (int64), or ValueError. Checked as Python
    ints: a list of a few dozen is checked faster than torch's unique runs (a step checks thirty)."""
    if not isinstance(chosen, torch.Tensor) or chosen.dim() != 1 or chosen.dtype.is_floating_point:
        raise ValueError("forward_indexer must return a 1-D integer tensor of block indices")
    chosen = chosen.long()
    picks = chosen.tolist()
    distinct = sorted(set(picks))
    if distinct != picks:
        chosen = torch.tensor(distinct, dtype=torch.long, device=chosen.device)
    if distinct and (distinct[0] < 0 or distinct[-1] >= num_blocks):
        raise ValueError(f"block indices must be in [0, {num_blocks}), got {distinct[0]}..{distinct[-1]}")
    if len(distinct) > most:
        raise ValueError(f"{len(distinct)} blocks picked, the budget allows {most}")
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
