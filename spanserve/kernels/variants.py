"""Every build of the kernels that some CPU runs, so that tests run each one on any x86-64 CPU.

The engine builds one library, -march=native, whose code paths follow the CPU: 8 or 16 vector
lanes (common.h's LANES) and AVX2, AVX-512, VNNI or AVX-512 BF16 intrinsics where the CPU has
them, plain C where it has none. A CPU runs only its own paths, so the others would go untested
on it. Here each path gets a build of its own: the portable C (x86-64, no intrinsics), the
16-lane vector code lowered to pairs of narrower registers (SPANSERVE_LANES=16: its indexing,
tiling and tails run on any CPU), AVX2 with either width, AVX-512, AVX-512 with VNNI, and with
BF16 too. A test runs each variant the CPU can execute against torch; the others it compiles with
their -march, so a build break shows, as do the real CPUs' own -march (Sapphire Rapids, Zen 4)
where the compiler knows them. `sanitized` is the native build under AddressSanitizer and
UBSan, for the kernel tests run with the sanitizers' runtime preloaded (tests/test_kernel_sanitizers.py).
"""

import ctypes
import subprocess
from dataclasses import dataclass
from pathlib import Path

from spanserve.kernels import native

X86_64_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]  # -march, -m and -D flags
    needs: frozenset[str]  # the /proc/cpuinfo flags a CPU must have to run it
    paths: str  # the code paths it takes, for the test output

    def runs_here(self) -> bool:
        return self.needs <= native.cpu_flags()


VARIANTS = (
    Variant("portable", ("-march=x86-64",), frozenset(), "plain C tiles, 8-lane vectors"),
    Variant("portable-16", ("-march=x86-64", "-DSPANSERVE_LANES=16"), frozenset(), "plain C tiles, 16-lane vectors"),
    Variant("avx2", ("-march=x86-64-v3",), X86_64_V3, "AVX2/FMA intrinsics, 8-lane vectors"),
    Variant("avx2-16", ("-march=x86-64-v3", "-DSPANSERVE_LANES=16"), X86_64_V3,
            "AVX2/FMA intrinsics, 16-lane vectors in register pairs"),
    Variant("avx512", ("-march=x86-64-v4",), X86_64_V4, "AVX-512 GEMM tile, AVX2 int8 GEMM, 16 lanes"),
    Variant("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni"), X86_64_V4 | {"avx512_vnni"},
            "AVX-512 VNNI int8 GEMM"),
    Variant("avx512-bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
            X86_64_V4 | {"avx512_vnni", "avx512_bf16"}, "VNNI int8 GEMM, bf16 dot products in decode"),
    Variant("native", native.NATIVE, frozenset(), "what the engine runs on this CPU"),
)
# Real CPUs' own targets, compiled only (the runnable variants above cover their code paths).
COMPILE_ONLY = (
    Variant("sapphirerapids", ("-march=sapphirerapids",), frozenset({"amx_tile"}), "Intel Xeon 4th gen (AMX)"),
    Variant("znver4", ("-march=znver4",), frozenset({"avx512_bf16"}), "AMD Zen 4"),
    Variant("znver5", ("-march=znver5",), frozenset({"avx_vnni", "avx512_vp2intersect"}), "AMD Zen 5"),
)
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g")
SANITIZED = Variant("sanitized", (*native.NATIVE, *SANITIZE), frozenset(), "native under ASan and UBSan")


def library(variant: Variant) -> ctypes.CDLL:
    """The kernels built as `variant`, typed (not self-checked: tests hold them to torch)."""
    extra_link = SANITIZE[:1] if variant is SANITIZED else ()
    return native.typed(ctypes.CDLL(str(native.build(target=variant.flags, extra_link=extra_link))))


def compile_only(variant: Variant) -> Path:
    """Compile `variant` without linking or loading it: its objects' folder."""
    return native.build(target=variant.flags, link=False)


def compiler_knows(variant: Variant) -> bool:
    """Whether the C compiler accepts the variant's -march (gcc 12 knows no znver4)."""
    command = [native.compiler_path() or "cc", *variant.flags, "-x", "c", "-c", "-", "-o", "/dev/null"]
    probe = subprocess.run(command, input="",
                           capture_output=True, text=True)
    return probe.returncode == 0


def sanitizer_runtime() -> list[str]:
    """The shared runtimes to preload for a process that loads the sanitized build through ctypes
    (ASan must come first in the process)."""
    compiler = native.compiler_path() or "gcc"
    found = [subprocess.run([compiler, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
             for lib in ("libasan.so", "libubsan.so")]
    return [path for path in found if Path(path).is_absolute() and Path(path).exists()]
