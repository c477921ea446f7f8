"""EngineConfig: every knob of the engine in one place."""

from dataclasses import dataclass, field

import torch

from spanserve.errors import InvalidRequestError
from spanserve.pic.link import APE_SCALE, APE_TEMPERATURE, BLEND_LAYERS, FOCUSABLE
from spanserve.utils import strict_kwargs

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32,
           "float": torch.float32}
KV_CACHE_DTYPES = (torch.bfloat16, torch.float32)  # what the CPU attention kernels read under any model dtype


LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights of the model's shape, nothing read


@strict_kwargs
@dataclass
class EngineConfig:
    model: str | None = None  # HF dir, .gguf file, or None for the embedded default
    dtype: str = "auto"  # auto: bf16 on CUDA and on CPUs with native bf16, else float32
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None  # KV pool size; default: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    # auto: the model's dtype. bfloat16 under a float32 model (CPU): half the bytes a decode step
    # reads from the cache and twice the tokens in the same memory, keys and values rounded once
    # as they are stored (vLLM's --kv-cache-dtype; llama.cpp keeps its cache in float16).
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens per step: the chunked-prefill budget
    # Background work (session ingest) runs only in steps nothing else needs, at most this many
    # tokens at a time (fewer while requests keep arriving: scheduler.BackgroundPace). A request
    # arriving meanwhile stops the step between two layers (engine.step's interrupt, served by
    # AsyncLLM), so it waits for a layer, not a chunk, and larger chunks cost questions little
    # while each step's weight reads are shared by more tokens: SmolLM2 (w8a8)
    # ingested 1.15-2.25x faster at 64 than at 16 between 4.1k and 6.6k tokens of data (the two
    # alternated in one process).
    # The offline LLM has no arrivals mid-step: its questions are queued before the steps run.
    background_chunk_tokens: int = 64
    # Sessions together may hold 90% of the KV pool; one tenant's (API key's) sessions this share
    # of it at most, so that one tenant cannot take the room every other tenant's sessions need.
    session_tenant_share: float = 0.9
    # Tokens of flash work one append may set off in a session: each flash question's tokens and
    # its flash_max_tokens, summed; a session asking more is refused when it registers them.
    session_flash_budget: int = 4096
    # A request that could not start within this many seconds (no room in the pool for it now)
    # ends with AdmissionTimeoutError rather than waiting on: a server answers 503 with Retry-After.
    # None: it waits as long as it takes (the offline LLM, which queues its whole batch at once).
    admission_timeout_s: float | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto: the Triton kernel on CUDA (where installed), else torch
    enforce_eager: bool = False  # CUDA: no decode graphs (as vLLM's flag)
    load_format: str = "auto"  # dummy: random weights of the model's shape, for benchmarks (as vLLM's)
    quantization: str | None = None  # int8, int4 (weight-only) or w8a8: quantized projections on CPU (models/quant.py)
    # CPU, no `quantization`: a GGUF's Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q6_K/Q8_0 projections compute from the file's own
    # blocks (models/gguf_blocks.py), its exact weights in a fifth of float32's bytes; False: from
    # their float copies, as on CUDA.
    gguf_blocks: bool = True
    # int8: with gguf_blocks, steps of up to 24 rows (decode) multiply 4-bit codes by activations rounded
    # to int8 per 32 inputs, as llama.cpp does: fewer instructions a weight, answers drift a little
    gguf_block_activations: str = "float32"
    seed: int = 0
    # Defaults for requests with position-independent spans (pic/link.py).
    # auto: comb where an encoder plug-in ships for the model (or comb_plugin names one), else none,
    # with focus_tokens=48 for requests that name no policy (unless focus sizes are set here): the
    # most accurate policy that keeps warm spans 10x faster (README, "focus_tokens")
    link_policy: str = "auto"
    gap_length: int = 32
    blend_ratio: float = 0.15
    blend_layers: int = BLEND_LAYERS  # check layers of the blend probe (gradual filtering)
    ape_temperature: float = APE_TEMPERATURE
    ape_scale: float = APE_SCALE
    focus_spans: int = 0  # none, comb: spans the question's attention picks to recompute (0: off)
    focus_tokens: int = 0  # none, comb: or a budget of span tokens it picks, in blocks (0: off)
    span_anchor: bool = True  # compute spans after a fixed anchor block (pic/layout.py)
    # Decode over private copies of a request's moved span keys, rotated once when its prompt is
    # computed (while the pool stays at least 10% free), instead of rotating the shared keys at
    # every step: memory for speed. False: span blocks stay shared for the whole request.
    span_key_copies: bool = True
    # Sparse decode flows of users, by dotted path (package.module.Class), beside the built-ins.
    sparse_flows: list[str] = field(default_factory=list)
    # link_policy="comb": the encoder plug-in's file; None: the one shipped for the model, if any
    comb_plugin: str | None = None
    # Speculative decoding, as vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens":
    # k, "prompt_lookup_min": a, "prompt_lookup_max": b} (spanserve/speculative/); None: off
    speculative_config: dict | str | None = None

    def __post_init__(self):
        if min(self.block_size, self.max_num_seqs, self.max_num_batched_tokens, self.background_chunk_tokens) < 1:
            raise InvalidRequestError(
                "block_size, max_num_seqs, max_num_batched_tokens and background_chunk_tokens must be >= 1")
        if not 0 < self.session_tenant_share <= 1:
            raise InvalidRequestError(f"session_tenant_share must be in (0, 1], got {self.session_tenant_share}")
        if self.session_flash_budget < 0:
            raise InvalidRequestError(f"session_flash_budget must be >= 0, got {self.session_flash_budget}")
        if self.admission_timeout_s is not None and not self.admission_timeout_s > 0:
            raise InvalidRequestError(f"admission_timeout_s must be > 0, got {self.admission_timeout_s}")
        from spanserve.speculative.config import SpeculativeConfig

        SpeculativeConfig.of(self.speculative_config)  # raises on a bad one, at start
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidRequestError(f"num_blocks must be >= 1, got {self.num_blocks}")
        from spanserve.pic.link import LinkPolicy

        name = "none" if self.link_policy == "auto" else self.link_policy  # the engine resolves auto
        LinkPolicy(name, self.gap_length, self.blend_ratio, blend_layers=self.blend_layers,
                   ape_temperature=self.ape_temperature, ape_scale=self.ape_scale,
                   focus_spans=self.focus_spans if name in FOCUSABLE else 0,
                   focus_tokens=self.focus_tokens if name in FOCUSABLE else 0)  # raises on bad values
        from spanserve.attention import BACKENDS

        if self.attention_backend not in BACKENDS:
            raise InvalidRequestError(f"unknown attention backend {self.attention_backend!r}; "
                                      f"use one of {', '.join(BACKENDS)}")
        from spanserve.models.quant import QUANTIZATIONS

        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(f"unknown quantization {self.quantization!r}; available: "
                                      f"{', '.join(QUANTIZATIONS)}")
        if self.gguf_block_activations not in ("float32", "int8"):
            raise InvalidRequestError(f"unknown gguf_block_activations {self.gguf_block_activations!r}; "
                                      "use float32 or int8")
        if self.gguf_block_activations == "int8" and (not self.gguf_blocks or self.quantization):
            raise InvalidRequestError("gguf_block_activations='int8' needs a GGUF's own blocks: "
                                      "gguf_blocks on and no quantization")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidRequestError(f"unknown load_format {self.load_format!r}; use auto or dummy")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise InvalidRequestError(f"unknown dtype {self.dtype!r}; use auto or one of {sorted(_DTYPES)}")
        if self.kv_cache_dtype != "auto" and _DTYPES.get(self.kv_cache_dtype) not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one the attention kernels read; "
                                      "use auto, bfloat16 or float32")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the model's (auto), or one the attention kernels read under any
        model dtype, on CPU; on CUDA the model's only (the Triton kernel reads its own dtype)."""
        model = self.torch_dtype()
        if self.kv_cache_dtype == "auto" or _DTYPES[self.kv_cache_dtype] == model:
            return model
        if self.torch_device().type != "cpu":
            raise InvalidRequestError(f"kv_cache_dtype {self.kv_cache_dtype!r} under a {str(model)[6:]} model runs on "
                                      "CPU only; use auto on CUDA")
        return _DTYPES[self.kv_cache_dtype]

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.torch_device().type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32


def cpu_has_native_bf16() -> bool:
    """bf16 matmuls are 3-5x faster than fp32 on CPUs with avx512_bf16/AMX, much slower without."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
