"""Decode attention on CPU: the C kernel (kernels/csrc/paged_decode.c) against the torch path it
replaces (the context gathered head-major, two batched matmuls and a softmax), one query token per
sequence over the same paged cache, taking turns so the machine's noise hits both alike.

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
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="float32",
                        help="the model's dtype: its queries' and its cache's")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--layers", type=int, default=30,
                        help="each call reads the next of this many layers' caches, as a step does; 1: the "
                             "same layer's, from the CPU's caches")
    parser.add_argument("--cases", default="", metavar="TEXT", help="only the cases whose name holds this text")
    kernel_compare.add_baseline_argument(parser)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode_attention.json)")


def run(args: argparse.Namespace) -> dict:
    threads = harness.configure_threads(args.threads)
    import torch

    from spanserve.kernels import cpu_kernel
    if cpu_kernel.load("decode") is None:
        sys.exit("the C decode kernel is not available here (no compiler, or SPANSERVE_CPU_KERNELS)")
    baseline = kernel_compare.kernels_at(args.baseline) if args.baseline else None
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    rows, table = [], []
    for dtype_name in dtypes:
        for case in [c for c in CASES if args.cases.lower() in c[0].lower()]:
            row = _measure(case, getattr(torch, dtype_name), args.repeats, baseline, args.layers)
            rows.append({"dtype": dtype_name, **row})
            table.append([dtype_name, row["case"], f"{row['torch_ms']:.2f}", f"{row['kernel_ms']:.2f}",
                          f"{row['speedup']:.2f}x", f"{row['kernel_gb_s']:.1f}", f"{row['torch_error']:.1e}",
                          f"{row['kernel_error']:.1e}"]
                         + kernel_compare.baseline_cells(row, args.baseline))
    extra = kernel_compare.baseline_headers(args.baseline)
    layers = "one layer's cache" if args.layers == 1 else f"each call over the next of {args.layers} layers' caches"
    harness.print_table(["dtype", "case", "torch ms", "kernel ms", "speedup", "kernel GB/s", "torch max err",
                         "kernel max err", *extra], table, title=f"decode attention, {layers}, {threads} threads")
    result = {"benchmark": "decode_attention", "threads": threads, "repeats": args.repeats, "layers": args.layers,
              "baseline": args.baseline, "rows": rows, "machine": harness.machine_info()}
    harness.write_json(result, path=args.out or harness.result_path("decode_attention"))
    return result


def _measure(case: tuple, dtype, repeats: int, baseline=None, layers: int = 30) -> dict:
    import torch

    from spanserve.attention.torch_ref import head_major_rows
    from spanserve.kernels import cpu_kernel

    name, heads, kv_heads, dim, sequences, context = case
    gen = torch.Generator().manual_seed(0)
    per_sequence = -(-context // BLOCK)
    blocks = sequences * per_sequence
    caches = (torch.randn(layers, 2, blocks, BLOCK, kv_heads, dim, generator=gen) * 2).to(dtype)
    tables = torch.randperm(blocks, generator=gen).view(sequences, per_sequence)  # scattered, as a pool hands them out
    lens, scale, turn = torch.full((sequences,), context), dim**-0.5, itertools.count()
    q = torch.randn(sequences, heads, dim, generator=gen).to(dtype)
    rows = torch.stack([head_major_rows(table, context, BLOCK, kv_heads) for table in tables]).flatten()

    def layer_cache(layer):
        return caches[next(turn) % layers if layer is None else layer]

    def kernel(layer=None):
        k, v = layer_cache(layer)
        return cpu_kernel.paged_decode(q, k, v, tables, lens, scale)

    def torch_path(layer=None):  # as attention/torch_ref.py's _decode, every context of one length
        k, v = layer_cache(layer)
        keys, values = (torch.index_select(part.view(-1, dim), 0, rows).view(sequences, kv_heads, context, dim)
                        for part in (k, v))
        folded = (q * scale).view(sequences, kv_heads, heads // kv_heads, dim)
        return torch.matmul(torch.softmax(torch.matmul(folded, keys.transpose(-1, -2)), -1), values).view(q.shape)

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
