"""Prefill attention on CPU: the C kernel (kernels/csrc/paged_prefill.c) against the torch path
it replaces (a head-major gather of the cached context, two matmuls and a masked softmax), on the
same queries over the same paged cache, taking turns so the machine's noise hits both alike.

Cases are the chunks the engine meets, at the head shapes of the models we judge on: a session's
question over its cached data (34 query tokens), a prompt after a prefix-cache hit, a whole
prompt, and a warm RAG prompt's calls over 16 reused documents whose keys move to new positions
as they are read (its focus probe's question rows; its relink's 48 span tokens and the question).
Each time is the best of --repeats calls; the error is each path's largest difference from a
float64 softmax over the same inputs (accuracy beside speed). --baseline REV adds the
kernel as it was at git revision REV (its csrc/ built beside today's, in the same turns): a change
to the kernel measured against its earlier self in one process, on this machine's noise alike.
--layers N gives each case N layers' caches, read in turn as a prompt's pass reads them: a
layer's keys then come from memory, not from the CPU's caches.

    spanserve bench prefill_attention [--dtype float32|bfloat16|both] [--repeats 10] [--baseline REV] [--layers 30]
                                      [--cases RAG]
"""

import argparse
import itertools
import sys

from benchmarks import harness, kernel_compare

# name, query heads, kv heads, head dim, context tokens, query tokens (the context's last ones),
# relinked 16-token blocks spread over the context (their rows before the query tokens), moved keys
# (the context's first ones, in documents of 256 that each move by their own distance)
CASES = [
    ("SmolLM2: question, 34 over 7.5k", 9, 3, 64, 7500, 34, 0, 0),
    ("Qwen 0.5B: question, 34 over 7.7k", 14, 2, 64, 7700, 34, 0, 0),
    ("Qwen 1.5B: question, 34 over 7.7k", 12, 2, 128, 7700, 34, 0, 0),
    ("SmolLM2: 512 after a 3.5k prefix", 9, 3, 64, 4096, 512, 0, 0),
    ("SmolLM2: whole prompt, 2,048", 9, 3, 64, 2048, 2048, 0, 0),
    ("Qwen 0.5B: whole prompt, 2,048", 14, 2, 64, 2048, 2048, 0, 0),
    ("SmolLM2: RAG probe, 18 over 4,096 moved", 9, 3, 64, 4160, 18, 0, 4096),
    ("SmolLM2: RAG relink, 48 + 18 over 4,096 moved", 9, 3, 64, 4160, 18, 3, 4096),
]
DOCUMENT = 256  # tokens of a moved document: its keys share one distance


def add_arguments(parser: argparse.ArgumentParser) -> None:
    kernel_compare.add_arguments(
        parser, "prefill_attention", dtype="both", layers=1,
        layers_help="each call reads the next of this many layers' caches, as a prompt's pass does: at 30 a "
                    "layer's keys are out of the CPU's caches when it is read again",
        cases_help="only the cases whose name holds this text (e.g. RAG)")


def run(args: argparse.Namespace) -> dict:
    return kernel_compare.run(args, kernel_compare.KernelBench(
        "prefill_attention", "prefill", CASES, _measure, headers=[], cells=lambda row: [], baseline=_baseline))


def _baseline(rev: str):
    """The kernels as they were at git revision `rev`, if its prefill kernel takes today's arguments."""
    if b"rot_ids" not in kernel_compare.source_at(rev, "paged_prefill.c"):
        sys.exit(f"--baseline {rev}: its paged_prefill takes one row of angles per moved key, not this "
                 "revision's distinct angles; time it from a checkout of a revision of its time")
    return kernel_compare.kernels_at(rev)


def _measure(case: tuple, dtype, repeats: int, baseline=None, layers: int = 1) -> dict:
    import torch

    from spanserve.attention.torch_ref import _matmul_attention, gather_head_major, head_major_rows, key_rotations
    from spanserve.kernels import cpu_kernel

    name, heads, kv_heads, dim, context, queries, relinked, moved = case
    gen = torch.Generator().manual_seed(0)
    blocks = -(-context // 16)
    caches = (torch.randn(layers, 2, blocks + 8, 16, kv_heads, dim, generator=gen) * 2).to(dtype)
    cache, turn = caches[0], itertools.count()
    table = torch.randperm(blocks + 8, generator=gen)[:blocks][None]  # scattered blocks, as a pool hands them out
    positions, scale = _positions(context, queries, relinked), dim**-0.5
    q = torch.randn(len(positions), heads, dim, generator=gen).to(dtype)
    starts, lens = torch.tensor([0, len(positions)]), torch.tensor([context])
    rows = head_major_rows(table[0], context, 16, kv_heads)
    rotation = _rotation(moved, dim, kv_heads, gen) if moved else None
    angles = key_rotations([rotation]) if rotation else None

    def kernel(layer=None):
        k, v = caches[next(turn) % layers if layer is None else layer]
        return cpu_kernel.paged_prefill(q, k, v, table, starts, positions, lens, scale, rotations=angles)

    def torch_path(layer=None):
        k, v = caches[next(turn) % layers if layer is None else layer]
        keys, values = gather_head_major(k, v, table[0], context, None, rows)
        if rotation is not None:
            rotation.rotate_(keys, head_major=True)
        return _matmul_attention(q, keys, values, positions, scale)

    expected = _reference(q, cache, table[0], context, positions, scale, rotation)
    return {"case": name, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "context": context,
            "queries": len(positions), "moved_keys": moved,
            **kernel_compare.compare(kernel, torch_path, expected, repeats, baseline)}


def _positions(context: int, queries: int, relinked: int):
    """The rows' positions: `relinked` blocks of 16 spread evenly over the context, then its last `queries`."""
    import torch

    blocks = [torch.arange(16) + (i + 1) * context // (relinked + 1) // 16 * 16 for i in range(relinked)]
    return torch.cat([*blocks, torch.arange(context - queries, context)])


def _rotation(moved: int, dim: int, kv_heads: int, gen):
    """The first `moved` keys rotated as reused documents are: each DOCUMENT of them by its own distance."""
    import torch

    from spanserve.attention.backend import KeyRotation

    distances = torch.randint(-moved, moved, (-(-moved // DOCUMENT),), generator=gen).repeat_interleave(DOCUMENT)
    angles = distances[:moved, None].double() * 10000.0 ** (-torch.arange(dim // 2).double() / (dim // 2))
    return KeyRotation.from_angles(angles.cos(), angles.sin(), kv_heads)


def _reference(q, cache, table, context: int, positions, scale: float, rotation=None):
    """Each query over the keys up to its position (moved by `rotation`): an explicit softmax in float64."""
    import torch

    keys, values = (part[table].flatten(0, 1)[:context].double() for part in cache)
    if rotation is not None:
        keys = rotation.rotate_(keys.float()).double()
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    hidden = torch.arange(context)[None, :] > positions[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden[None], float("-inf")).softmax(-1), values)


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("prefill_attention", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
