"""spanserve's C kernels (csrc/): attention over the paged cache, the w8a8 and float32
projections and a layer's elementwise ops (RMSNorm, silu(gate) * up).

They are compiled on first use with the system C compiler (gcc or $CC, -march=native for this
CPU) into one library in spanserve's cache directory, and called through ctypes: no Python
headers, no build step at install. A build is cached by its sources, flags and the CPU's
features, so a cache directory shared by machines keeps one per kind of CPU. Before the engine
uses a build, it passes selfcheck.py's known products; tests build the other variants
(variants.py) with the same function.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from spanserve.kernels.layouts import DTYPES  # noqa: F401 - the kernels' dtype codes, as native.DTYPES
from spanserve.kernels.selfcheck import check
from spanserve.paths import cache_dir

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_decode.c", CSRC / "paged_prefill.c", CSRC / "int8_gemm.c", CSRC / "f32_gemm.c",
           CSRC / "block_gemm.c", CSRC / "layer_ops.c", CSRC / "block_pick.c", CSRC / "fused_layers.c"]
HEADERS = [CSRC / "common.h", CSRC / "f32_gemm.h", CSRC / "fused_kernels.h", CSRC / "team.h"]
# Compiled with -ffast-math (for glibc's vector expf), linked without it: gcc 12 links a shared
# library built with it to code that sets flush-to-zero for the whole process at load.
# -Wno-psabi: vectors wider than the target's registers (a portable variant) only warn of an ABI
# that static inline functions never expose.
COMPILE_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-Wno-psabi", "-c"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
NATIVE = ("-march=native",)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None  # why the library could not be built or failed its check, once tried


class NativeUnavailable(RuntimeError):
    """The kernels could not be built here (no compiler, or it failed), or failed their self-check."""


def library() -> ctypes.CDLL:
    """The compiled kernels for this CPU with typed entry points, built on the first call (seconds,
    once per machine) and checked (selfcheck.py). Raises NativeUnavailable, with the reason, if
    they cannot be built or give a wrong product; the outcome is kept, so it is not retried on
    every call."""
    global _library, _failure
    if _library is None and _failure is None:
        with _lock:
            if _library is None and _failure is None:
                try:
                    _require_vectors()
                    lib = typed(ctypes.CDLL(str(build())))
                    problem = check(lib)
                    if problem:
                        raise RuntimeError(f"the build failed its self-check: {problem}")
                    _library = lib
                except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
                    _failure = str(exc).strip()[-500:]
    if _library is None:
        raise NativeUnavailable(_failure)
    return _library


def _require_vectors() -> None:
    """On x86, a CPU without AVX2 and FMA would run the kernels' portable C, which is tested
    (variants.py) but slower than torch's own paths there: torch's paths it is."""
    if platform.machine().lower() in ("x86_64", "amd64") and not {"avx2", "fma"} <= cpu_flags():
        raise RuntimeError("this CPU has no AVX2 and FMA, where torch's paths are faster than the kernels' portable C")


def build(csrc: Path = CSRC, target: tuple[str, ...] = NATIVE, extra_link: tuple[str, ...] = (),
          link: bool = True) -> Path:
    """Compile the kernels (SOURCES as they are in `csrc`: the package's, or a copy of an earlier
    revision's) with the target flags (-march, -D, -fsanitize) unless a build of the same sources
    and flags is cached; the shared library's path, or (link=False, a build for another CPU that
    is only compiled) the folder of its objects."""
    compiler = compiler_path()
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc or set CC)")
    sources = [csrc / path.name for path in SOURCES]
    compile_flags, link_flags = [*COMPILE_FLAGS, *target], [*LINK_FLAGS, *extra_link]
    identity = " ".join([compiler, *compile_flags, *link_flags, cpu_features_line()])  # -march=native: per CPU
    code = b"".join(path.read_bytes() for path in [*sources, *(csrc / path.name for path in HEADERS)])
    digest = hashlib.sha256(code + identity.encode()).hexdigest()[:16]
    built = cache_dir() / "kernels" / (f"spanserve-{digest}.so" if link else f"spanserve-{digest}-objects")
    if built.exists():
        return built
    built.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=built.parent) as tmp:  # concurrent builds: the last rename wins
        objects = [Path(tmp) / f"{source.stem}.o" for source in sources]
        steps = [[*compile_flags, str(source), "-o", str(obj)] for source, obj in zip(sources, objects)]
        _run_all(compiler, steps)  # one process per source: a build takes the longest file's time
        if link:
            _run_all(compiler, [[*map(str, objects), *link_flags, "-o", str(Path(tmp) / built.name)]])
            os.replace(Path(tmp) / built.name, built)
        else:
            os.replace(tmp, built)
            os.mkdir(tmp)  # for the context's cleanup
    return built


def compiler_path() -> str | None:
    """$CC, else gcc or cc on the PATH; None if there is none."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def library_at(csrc: Path) -> ctypes.CDLL:
    """The kernels built from another copy of csrc/ (an earlier revision's), typed as the package's:
    a benchmark compares a kernel with its earlier self in one process (cpu_kernel.using)."""
    return typed(ctypes.CDLL(str(build(csrc))))


def _run_all(compiler: str, steps: list[list[str]]) -> None:
    try:
        running = [subprocess.Popen([compiler, *step], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for step in steps]
    except OSError as exc:
        raise RuntimeError(f"no C compiler at {compiler} ({exc.strerror})") from None
    errors = [err for proc in running for _, err in [proc.communicate()] if proc.returncode != 0]
    if errors:
        raise RuntimeError(f"{compiler} failed: {errors[0]}")


def cpu_features_line() -> str:
    """The CPU's feature flags (Linux)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (avx2, avx512f, avx512_vnni, amx_tile...)."""
    return frozenset(cpu_features_line().partition(":")[2].split())


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with every entry point's argument and result types set. An earlier revision's build
    (library_at) may lack the newer ones: those are left out."""
    pointer, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    entries = {
        "paged_decode": ([pointer] * 6 + [i64, i64, i32, i32, i32, i32, f32, i32, i32], i32),
        "paged_prefill": ([pointer] * 12 + [i64, i64, i64, i64, i32, i32, i32, i32, f32, i32, i32], i32),
        "paged_scores": ([pointer] * 5 + [i64] + [pointer] * 4 + [i64, i64, i64, i32, i32, i32, i32, f32, i32, i32],
                         i32),
        "int8_gemm": ([pointer] * 6 + [i64, i64, i64, i64, i32], i32),
        "f32_gemm": ([pointer] * 4 + [i64, i64, i64, i64], i32),
        "f32_gemm_int8w": ([pointer] * 5 + [i64, i64, i64, i64], i32),
        "f32_gemm_bf16w": ([pointer] * 4 + [i64, i64, i64, i64], i32),
        "bf16_pairs_gemm": ([pointer] * 4 + [i64, i64, i64, i64], i32),
        "block_gemm": ([pointer, pointer, i32, i32] + [pointer] * 5 + [i64, i64, i64, i64, i32], i32),
        "block_gemm_part": ([pointer, pointer, i32, i32] + [pointer] * 5 + [i64] * 5 + [i32, i32, i32], i32),
        "decode_layers": ([pointer, i64, pointer, pointer, i64] + [pointer] * 6, i32),
        "prefill_layers": ([pointer, i64, pointer, pointer, i64] + [pointer] * 7, i32),
        "rms_norm": ([pointer] * 3 + [i64, i64, f32, i32], i32),
        "silu_mul": ([pointer] * 2 + [i64, i64, i32], i32),
        "rope_store": ([pointer] * 3 + [i64] * 3 + [pointer] * 3 + [i64] + [pointer] * 5
                       + [i64, i64, i32, i32, i32, i32, i32], i32),
        "set_bf16_dot": ([i32], i32),
        "set_prefill_bf16_dot": ([i32], i32),
        "centroid_topk": ([pointer, i32, pointer, i64, pointer, i64, pointer, i32] + [i64] * 8 + [pointer], i64),
    }
    for name, (argtypes, restype) in entries.items():
        entry = getattr(lib, name, None)
        if entry is not None:
            entry.argtypes, entry.restype = argtypes, restype
    return lib
