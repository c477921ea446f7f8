"""A C kernel against the torch path it replaces, and against itself at an earlier git revision
(--baseline REV: that revision's kernels built beside today's), timed in turns in one process so
the machine's noise hits all alike, each with its error against a float64 reference."""

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks import harness

REPO = Path(__file__).resolve().parents[1]


def add_baseline_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also time the kernel of this git revision (needs a git checkout)")


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
