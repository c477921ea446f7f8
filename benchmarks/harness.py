"""Shared helpers for the benchmarks: threads, timing, tables, JSON results and charts.

Every benchmark writes `benchmarks/results/<name>.json` (raw numbers + machine info) and
optionally a PNG chart next to it. Nothing here imports torch at module load.
"""

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def configure_threads(threads: int | None = None) -> int:
    """Optionally pin torch's threads. OpenMP's wait policy is the package's (spanserve/__init__.py:
    threads that spin a bounded while, then sleep), set as spanserve is imported before torch;
    `OMP_WAIT_POLICY=PASSIVE` in the environment still wins."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


class Timer:
    """`with Timer() as t: ...` then `t.seconds`."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run fn() once; return (its result, elapsed seconds)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def best_of(fn: Callable[[int], float], repeats: int) -> tuple[float, list[float]]:
    """Call fn(i) `repeats` times; each returns a rate (higher is better). Returns (best, all)."""
    values = [fn(i) for i in range(repeats)]
    return max(values), values


def best_ms_in_turns(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Each call in turn, for repeats + 1 rounds (the first warms up; taking turns, machine noise
    hits all alike): each one's best time, in ms."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats + 1):
        for name, fn in calls.items():
            times[name].append(timed(fn)[1])
    return {name: min(t[1:]) * 1e3 for name, t in times.items()}


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned plain-text table; floats get 1 decimal (2 below 10), None prints as '-'."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(str(h)), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]  # rows may be none
    lines = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    if title:
        print(f"\n{title}")
    print(format_table(headers, rows), flush=True)


def result_path(name: str, suffix: str = ".json") -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{name}{suffix}"


def write_json(data: dict, name: str | None = None, path: str | Path | None = None) -> Path:
    """Write `data` to `path`, or to benchmarks/results/<name>.json. Returns the path written."""
    out = Path(path) if path else result_path(name or "results")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return out


def pyplot():
    """matplotlib.pyplot without a display, or None (saying so) if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the chart (pip install matplotlib)")
        return None
    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write and close a figure of pyplot()'s."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)

    plt.close(fig)
    print(f"wrote {path}")
    return path


def bar_chart(path: str | Path, title: str, categories: Sequence[str], series: dict[str, Sequence[float | None]],
              ylabel: str = "", log_scale: bool = False) -> Path | None:
    """Grouped bar chart: one group per category, one bar per series. Skips if matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    names = list(series)
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(categories) * max(1, len(names)) / 2), 4.5))
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(categories))]
        values = [v if v is not None else 0.0 for v in series[name]]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "" for v in values], fontsize=7, padding=1)
    ax.set_xticks(range(len(categories)), categories, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_scale:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def cli_main(name: str, doc: str, add_arguments: Callable, run: Callable, argv: list[str] | None) -> int:
    """`spanserve bench NAME`: parse the benchmark's arguments and run it."""
    parser = argparse.ArgumentParser(prog=f"spanserve bench {name}", description=doc.split("\n\n")[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


def machine_info() -> dict:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # Other processes' load: on a shared machine it explains most run-to-run noise.
        "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), None)
        flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), [])
        info["cpu_model"] = model
        info["cpu_bf16"] = {f: f in flags for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2", "amx_tile")}
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.is_available()
    except ImportError:
        pass
    for module in ("transformers", "spanserve"):
        try:
            info[module] = __import__(module).__version__
        except (ImportError, AttributeError):
            pass
    return info
