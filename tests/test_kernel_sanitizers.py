"""The C kernels under AddressSanitizer and UBSan: the kernel tests (test_kernel_variants.py) run
in a child process on the native build compiled with -fsanitize=address,undefined, the
sanitizers' runtime preloaded (ctypes loads the library into a Python that was not built with
them), and end with zero reports. A planted out-of-bounds read shows the instrument works."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spanserve.kernels import native, variants

RUNTIME = variants.sanitizer_runtime() if native.compiler_path() else []
pytestmark = pytest.mark.skipif(len(RUNTIME) < 2 or sys.platform != "linux",
                                reason="needs gcc's libasan and libubsan (Linux)")
TESTS = Path(__file__).parent


def _sanitized_env(**more: str) -> dict[str, str]:
    return {**os.environ, "LD_PRELOAD": " ".join(RUNTIME), "SPANSERVE_KERNEL_VARIANTS": "sanitized",
            # Python and torch keep memory to exit on purpose: leaks are not what this run is for
            "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1", "OMP_WAIT_POLICY": "PASSIVE", **more}


def test_the_kernel_tests_pass_under_asan_and_ubsan_with_no_report():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(TESTS / "test_kernel_variants.py")], env=_sanitized_env(), capture_output=True,
                          text=True, timeout=1500, cwd=TESTS.parent)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "AddressSanitizer" not in output and "runtime error" not in output, output[-4000:]
    assert "passed" in done.stdout and "sanitized" in done.stdout  # the summary names the build that ran


def test_the_sanitized_build_reports_an_out_of_bounds_read():
    """f32_gemm told of 96 padded output channels over weights packed for 48: it reads past them."""
    script = """
import torch
from spanserve.kernels import variants
from spanserve.kernels.layouts import f32_panels
lib = variants.library(variants.SANITIZED)
x, w = torch.randn(2, 16), torch.randn(48, 16)
packed, out = f32_panels(w), torch.empty(2, 96)
lib.f32_gemm(x.data_ptr(), packed.data_ptr(), None, out.data_ptr(), 2, 96, 96, 16)
print("no report")
"""
    done = subprocess.run([sys.executable, "-c", script], env=_sanitized_env(), capture_output=True, text=True,
                          timeout=600, cwd=TESTS.parent)
    assert done.returncode != 0 and "AddressSanitizer" in done.stderr, (done.stdout + done.stderr)[-3000:]
    assert "heap-buffer-overflow" in done.stderr and "f32_gemm" in done.stderr
