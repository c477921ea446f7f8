"""Which paths run a bf16 model's projections and decode attention on this CPU, chosen by
measurement once per CPU.

A bf16 projection of few rows reads its weight once: spanserve's C GEMM over bf16 panels
(kernels/bf16_gemm.py: bf16 dot products where the CPU has them) streams them at memory speed, while torch's
F.linear (oneDNN) is fastest where its rows fill a CPU's matrix units: on a 2-core AMX Xeon,
SmolLM2's 121 projections took 39.9 ms for one row in oneDNN bf16 and 26.5 in the C GEMM reading
float32 (twice the bytes), while from 64 rows oneDNN's AMX tiles took half the C GEMM's time.
Where the two cross depends on the CPU (AMX or not, AVX-512 BF16 or not, memory speed), so it is
measured: the C GEMM against F.linear on copies of one of the model's projections, enough to come
from memory as a forward pass's weights do (COLD_BYTES), at 1, 2, 4, ... 512 rows, the C GEMM
kept for the row counts up to the first where it is slower. The outcome is cached per
CPU, torch version, thread count, shape and kernel source (a second engine start reads it).

A calibration that cannot run (no C library: not cached, so a later start with it measures) or
whose C product differs from torch's gives 0 rows, logged once: every product stays with torch.

Decode attention over a bf16 cache has two C paths where the CPU has AVX-512 BF16: bf16 keys
dotted as stored (vdpbf16ps) or each block widened to float32 for the lanes path (csrc/
paged_decode.c). Which is faster depends on the CPU too (the lanes path on an AMD EPYC Zen 4), so
use_decode_bf16_dot times both on the model's head shapes and sets the library's choice.
Prefill attention over a bf16 cache likewise has bf16 dot products (csrc/paged_prefill.c: 1.6-2.1x
faster on the Zen 4 for 17 to 300 rows over 2,000 to 4,200 keys); use_prefill_bf16_dot times a
question over a long context both ways.
"""

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from spanserve.kernels import bf16_gemm, cpu_kernel, native
from spanserve.paths import cache_dir

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
REPEATS = 5  # best of, per path and row count
COLD_BYTES = 64 << 20  # weights a timed call reads: past the caches of the CPUs measured
# ... but at most this many multiply-adds a call: past a few dozen rows the product is bound by its
# arithmetic, not by where the weights come from, and a CPU whose oneDNN emulates bf16 (AVX2)
# would otherwise spend a minute calibrating
CALL_MACS = 500_000_000
TOLERANCE = 1e-2  # relative error of the C product, against F.linear in float32 on the same bf16 values


def bf16_gemm_rows(in_features: int, out_features: int) -> int:
    """The most rows of an [out_features, in_features] bf16 projection that the C GEMM runs faster
    than F.linear here (one of ROWS), or 0 where it is never faster or cannot be used."""
    key = _key(in_features, out_features)
    cached = _read().get(key)
    if cached is not None:
        return cached
    if cpu_kernel.load("gemm") is None:
        log.info("bf16 projections stay with torch: the C library is not built or not allowed")
        return 0
    rows, why = _measure(in_features, out_features)
    if why:
        log.info("bf16 projections stay with torch: %s", why)
    else:
        log.info("bf16 projections of up to %d rows run in spanserve's C GEMM (calibrated for %dx%d)",
                 rows, out_features, in_features)
    _write(key, rows)
    return rows


def _measure(in_features: int, out_features: int) -> tuple[int, str]:
    """(rows, why none): the calibration's choice, or 0 and the reason."""
    kernel = cpu_kernel.load("gemm")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    copies = min(256, max(1, COLD_BYTES // weight.nbytes))  # a small shape: few calls
    weights = [weight.clone() for _ in range(copies)]
    packs = [bf16_gemm.pack(weight, kernel) for _ in range(copies)]
    chosen = 0
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=gen).bfloat16()

            count = max(1, min(copies, CALL_MACS // (rows * weight.numel())))

            def c_gemm(x=x, count=count):  # as PackedLinear calls it: bf16 in and out
                for panels in packs[:count]:
                    got = bf16_gemm.matmul(kernel, x, panels, None).bfloat16()
                return got

            def torch_linear(x=x, count=count):
                for w in weights[:count]:
                    F.linear(x, w)

            want = F.linear(x.float(), weight.float())
            error = float((c_gemm().float() - want).abs().max() / want.abs().max().clamp_min(1e-6))
            if error > TOLERANCE:
                return 0, f"the C GEMM's product is off by {error:.1e} at {rows} rows"
            if _best(c_gemm) > _best(torch_linear):
                break
            chosen = rows
    return chosen, "" if chosen else "F.linear is faster from one row"


def use_decode_bf16_dot(heads: int, kv_heads: int, dim: int) -> bool | None:
    """Set whether decode attention over a bf16 cache dots bf16 keys as stored, as measured here
    for these head shapes (cached like the projections' choice); None where the library has no
    such path (the CPU has no AVX-512 BF16, or there is no library)."""
    return _choose_dot("decode", "set_bf16_dot", heads, kv_heads, dim)


def use_prefill_bf16_dot(heads: int, kv_heads: int, dim: int) -> bool | None:
    """The same choice for prefill attention (a question, a chunk) over a bf16 cache."""
    return _choose_dot("prefill", "set_prefill_bf16_dot", heads, kv_heads, dim)


def _choose_dot(kind: str, setter: str, heads: int, kv_heads: int, dim: int) -> bool | None:
    kernel = cpu_kernel.load(kind)
    if kernel is None or not getattr(kernel, setter)(1):
        return None
    key = f"{kind}_bf16_dot {heads}/{kv_heads}x{dim} {_machine(f'paged_{kind}.c')}"
    dot = _read().get(key)
    if dot is None:
        dot = _dot_is_faster(getattr(kernel, setter), _attention_call(kind, heads, kv_heads, dim))
        log.info("bf16 %s attention: %s", kind, "bf16 dot products" if dot else "keys widened to float32")
        _write(key, dot)
    getattr(kernel, setter)(int(dot))
    return dot


def _dot_is_faster(set_dot, attend) -> bool:
    times = {}
    for on in (1, 0):
        set_dot(on)
        times[on] = _best(attend)
    return times[1] < times[0]


def _attention_call(kind: str, heads: int, kv_heads: int, dim: int):
    """Decode attention of 8 sequences over 1,024 keys, or prefill attention of a 32-token question
    over 4,096 keys, in each of enough caches to come from memory."""
    block, seqs, keys = 16, (8 if kind == "decode" else 1), (1024 if kind == "decode" else 4096)
    blocks = seqs * keys // block
    shape = (blocks, block, kv_heads, dim)
    layers = max(1, COLD_BYTES // (2 * torch.Size(shape).numel() * 2))
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16())
              for _ in range(layers)]
    tables = torch.randperm(blocks, generator=gen).view(seqs, -1)
    lens = torch.full((seqs,), keys, dtype=torch.long)
    if kind == "decode":
        q = torch.randn(seqs, heads, dim, generator=gen).bfloat16()
        return lambda: [cpu_kernel.paged_decode(q, k, v, tables, lens, dim ** -0.5) for k, v in caches]
    rows = 32
    q = torch.randn(rows, heads, dim, generator=gen).bfloat16()
    starts, positions = torch.tensor([0, rows]), torch.arange(keys - rows, keys)
    return lambda: [cpu_kernel.paged_prefill(q, k, v, tables, starts, positions, lens, dim ** -0.5) for k, v in caches]


def _best(call) -> float:
    call()  # warm: caches, the thread team
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def _key(in_features: int, out_features: int) -> str:
    return f"bf16_gemm_rows {out_features}x{in_features} {_machine('f32_gemm.c')}"  # its source: both paths


def _machine(source: str) -> str:
    """What a choice depends on beside the shapes: the CPU, torch, the threads and the kernel's source."""
    code = (native.CSRC / source).read_bytes()
    digest = hashlib.sha256((native.cpu_features_line() + torch.__version__).encode() + code).hexdigest()[:16]
    return f"threads={torch.get_num_threads()} {digest}"


def _path() -> Path:
    return cache_dir() / "kernels" / "calibration.json"


def _read() -> dict:
    try:
        return json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}


def _write(key: str, rows: int) -> None:
    """Best effort: a cache that cannot be written means calibrating again next time."""
    path = _path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**_read(), key: rows}, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.info("calibration not cached (%s)", exc)
