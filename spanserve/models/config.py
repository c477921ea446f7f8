"""ModelConfig: the few numbers our Llama-family model needs, read from an HF config.json."""

import json
from dataclasses import dataclass, field
from pathlib import Path

from spanserve.errors import UnsupportedModelError

# Architectures that share the Llama block (RMSNorm, RoPE, GQA, SwiGLU); they differ only
# in the flags below.
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; spanserve runs "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama/Qwen3 have them only with attention_bias.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            qk_norm=model_type == "qwen3",
            rope_theta=float(theta),
            rope_scaling=rope,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))
