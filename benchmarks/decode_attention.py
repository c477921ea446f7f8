"""Decode attention on CPU: the C kernel (kernels/csrc/paged_decode.c) against the torch path it
replaces (attention/torch_ref.py's: the context gathered head-major, two batched matmuls and a
masked softmax), one query token per sequence over the same paged cache, taking turns so the
machine's noise hits both alike.

Cases are the decode steps a server runs, at the head shapes of the models we judge on: one
sequence after a long prompt, and batches of 8 and 16 sequences. Decode attention reads every
cached key and value once per layer, so by default each call reads the next of 30 layers' caches,
as a step does, and the keys come from memory; --layers 1 reads one layer's from the CPU's caches.
Each time is the best of --repeats calls, with the rate at which it read the cache; the error is
each path's largest difference from a float64 softmax over the same inputs. --baseline REV adds the
kernel as it was at git revision REV (its csrc/ built beside today's, timed in the same turns).

    spanserve bench decode_attention [--dtype float32|bfloat16|both] [--repeats 10] [--layers 30]
                                     [--baseline REV] [--cases TEXT]
"""

import argparse
import itertools
import sys

from benchmarks import harness, kernel_compare

BLOCK = 16  # tokens a cache block
# name, query heads, kv heads, head dim, sequences, context tokens of each
CASES = [
    ("SmolLM2: 1 x 2,048", 9, 3, 64, 1, 2048),
    ("SmolLM2: 8 x 1,024", 9, 3, 64, 8, 1024),
    ("SmolLM2: 16 x 512", 9, 3, 64, 16, 512),
    ("Qwen 0.5B: 8 x 1,024", 14, 2, 64, 8, 1024),
    ("Qwen 1.5B: 1 x 2,048", 12, 2, 128, 1, 2048),
    ("Qwen 1.5B: 8 x 1,024", 12, 2, 128, 8, 1024),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    kernel_compare.add_arguments(
        parser, "decode_attention", dtype="float32", layers=30,
        layers_help="each call reads the next of this many layers' caches, as a step does; 1: the same layer's, "
                    "from the CPU's caches",
        cases_help="only the cases whose name holds this text")


def run(args: argparse.Namespace) -> dict:
    return kernel_compare.run(args, kernel_compare.KernelBench(
        "decode_attention", "decode", CASES, _measure, headers=["kernel GB/s"],
        cells=lambda row: [f"{row['kernel_gb_s']:.1f}"], baseline=kernel_compare.kernels_at))


def _measure(case: tuple, dtype, repeats: int, baseline=None, layers: int = 30) -> dict:
    import torch

    from spanserve.attention import torch_ref
    from spanserve.attention.backend import AttentionMetadata
    from spanserve.kernels import cpu_kernel

    name, heads, kv_heads, dim, sequences, context = case
    gen = torch.Generator().manual_seed(0)
    per_sequence = -(-context // BLOCK)
    blocks = sequences * per_sequence
    caches = (torch.randn(layers, 2, blocks, BLOCK, kv_heads, dim, generator=gen) * 2).to(dtype)
    tables = torch.randperm(blocks, generator=gen).view(sequences, per_sequence)  # scattered, as a pool hands them out
    lens, scale, turn = torch.full((sequences,), context), dim**-0.5, itertools.count()
    q = torch.randn(sequences, heads, dim, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), query_lens=[1] * sequences,
                             context_lens=[context] * sequences, block_tables=tables, context_lens_tensor=lens,
                             positions=torch.full((sequences,), context - 1))

    def layer_cache(layer):
        return caches[next(turn) % layers if layer is None else layer]

    def kernel(layer=None):
        k, v = layer_cache(layer)
        return cpu_kernel.paged_decode(q, k, v, tables, lens, scale)

    def torch_path(layer=None):  # attention/torch_ref.py's own decode, with the C kernel barred
        k, v = layer_cache(layer)
        with cpu_kernel.only_kernels(set()):
            return torch_ref._decode(q, k, v, meta, list(range(sequences)), scale)

    expected = _reference(q, caches[0], tables, context, scale)
    row = kernel_compare.compare(kernel, torch_path, expected, repeats, baseline)
    read = 2 * sequences * context * kv_heads * dim * caches.element_size()  # bytes of keys and values a call
    return {"case": name, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "sequences": sequences,
            "context": context, **row, "kernel_gb_s": read / row["kernel_ms"] / 1e6}


def _reference(q, cache, tables, context: int, scale: float):
    """Each sequence's query over its whole context: an explicit softmax in float64."""
    import torch

    out = []
    for b, table in enumerate(tables):
        keys, values = (part[table].flatten(0, 1)[:context].double() for part in cache)
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        scores = torch.einsum("hd,khd->hk", q[b].double(), keys) * scale
        out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values))
    return torch.stack(out)


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("decode_attention", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
