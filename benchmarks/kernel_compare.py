"""A C kernel against the torch path it replaces, and against itself at an earlier git revision
(--baseline REV: that revision's kernels built beside today's), timed in turns in one process so
the machine's noise hits all alike, each with its error against a float64 reference."""

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness

REPO = Path(__file__).resolve().parents[1]


@dataclass
class KernelBench:
    """What one kernel's bench has of its own; run() does the rest."""
    name: str  # the bench's: decode_attention
    kernel: str  # cpu_kernel.load's name for the kernel's library: decode
    cases: list[tuple]  # each (name, ...): what measure() takes
    measure: Callable  # (case, dtype, repeats, baseline library or None, layers) -> a compare() row and "case"
    headers: list[str]  # the bench's own columns, after "speedup"
    cells: Callable  # row -> those columns' cells
    baseline: Callable  # rev -> that revision's kernel library (kernels_at, or a check before it)


def add_arguments(parser: argparse.ArgumentParser, bench: str, dtype: str, layers: int, layers_help: str,
                  cases_help: str) -> None:
    """The flags every kernel bench takes, with its own defaults and help."""
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default=dtype,
                        help="the model's dtype: its queries' and its cache's")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--layers", type=int, default=layers, help=layers_help)
    parser.add_argument("--cases", default="", metavar="TEXT", help=cases_help)
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also time the kernel of this git revision (needs a git checkout)")
    parser.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{bench}.json)")


def run(args: argparse.Namespace, bench: KernelBench) -> dict:
    """Every case whose name holds --cases, in each --dtype: printed as a table and written as JSON."""
    threads = harness.configure_threads(args.threads)
    import torch

    from spanserve.kernels import cpu_kernel
    if cpu_kernel.load(bench.kernel) is None:
        sys.exit(f"the C {bench.kernel} kernel is not available here (no compiler, or SPANSERVE_CPU_KERNELS)")
    baseline = bench.baseline(args.baseline) if args.baseline else None
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    rows, table = [], []
    for dtype_name in dtypes:
        for case in [c for c in bench.cases if args.cases.lower() in c[0].lower()]:
            row = bench.measure(case, getattr(torch, dtype_name), args.repeats, baseline, args.layers)
            rows.append({"dtype": dtype_name, **row})
            table.append([dtype_name, row["case"], f"{row['torch_ms']:.2f}", f"{row['kernel_ms']:.2f}",
                          f"{row['speedup']:.2f}x", *bench.cells(row), f"{row['torch_error']:.1e}",
                          f"{row['kernel_error']:.1e}", *baseline_cells(row, args.baseline)])
    layers = "one layer's cache" if args.layers == 1 else f"each call over the next of {args.layers} layers' caches"
    harness.print_table(["dtype", "case", "torch ms", "kernel ms", "speedup", *bench.headers, "torch max err",
                         "kernel max err", *baseline_headers(args.baseline)], table,
                        title=f"{bench.name.replace('_', ' ')}, {layers}, {threads} threads")
    result = {"benchmark": bench.name, "threads": threads, "repeats": args.repeats, "layers": args.layers,
              "baseline": args.baseline, "rows": rows, "machine": harness.machine_info()}
    harness.write_json(result, path=args.out or harness.result_path(bench.name))
    return result


def compare(kernel: Callable, torch_path: Callable, expected, repeats: int, baseline=None) -> dict:
    """kernel(layer=None) and torch_path(layer=None) (and kernel under the `baseline` library) timed
    in turns: best ms, speedup, and each one's largest error on layer 0 against `expected`."""
    from spanserve.kernels import cpu_kernel

    def baseline_kernel(layer=None):
        with cpu_kernel.using(baseline):
            return kernel(layer)

    def error(path) -> float:
        return float((path(0).double() - expected).abs().max())

    paths = {"kernel": kernel, "torch": torch_path, **({"baseline": baseline_kernel} if baseline else {})}
    best = harness.best_ms_in_turns(paths, repeats)
    row = {"kernel_ms": best["kernel"], "torch_ms": best["torch"], "speedup": best["torch"] / best["kernel"],
           "kernel_error": error(kernel), "torch_error": error(torch_path)}
    if baseline:
        row.update(baseline_ms=best["baseline"], over_baseline=best["baseline"] / best["kernel"],
                   baseline_error=error(baseline_kernel))
    return row


def baseline_cells(row: dict, rev: str | None) -> list[str]:
    """The table's baseline columns of a compare() row (none without --baseline)."""
    return [f"{row['baseline_ms']:.2f}", f"{row['over_baseline']:.2f}x"] if rev else []


def baseline_headers(rev: str | None) -> list[str]:
    return [f"{rev} ms", f"over {rev}"] if rev else []


def kernels_at(rev: str):
    """The kernel library of revision `rev`: its kernels/csrc/ (or csrc/) files, built (native.library_at)."""
    from spanserve.kernels import native

    with tempfile.TemporaryDirectory(prefix="spanserve-baseline-") as tmp:  # the build lands in the cache
        for path in [*native.SOURCES, *native.HEADERS]:
            (Path(tmp) / path.name).write_bytes(source_at(rev, path.name))
        return native.library_at(Path(tmp))


def source_at(rev: str, name: str) -> bytes:
    """A C source as it was at `rev`: under spanserve/kernels/csrc/, or spanserve/csrc/ before the kernels' package."""
    for folder in ("spanserve/kernels/csrc", "spanserve/csrc"):
        try:
            shown = subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], cwd=REPO, capture_output=True)
        except FileNotFoundError:
            sys.exit("--baseline needs git")
        if shown.returncode == 0:
            return shown.stdout
    sys.exit(f"--baseline {rev}: cannot read {name} under spanserve/kernels/csrc/ or spanserve/csrc/ there: "
             f"{shown.stderr.decode(errors='replace').strip()}")
