"""Convert a llama.cpp GGUF file into an HF-style directory (config, tokenizer, safetensors).

Quantized tensors are dequantized to float32 once; the result is cached so later starts
read plain safetensors. The blocks of the types the CPU kernels read are kept beside them
(models/gguf_blocks.py).
"""

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from spanserve.errors import UnsupportedModelError
from spanserve.models.gguf_blocks import blocks_of, save_blocks

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# The transformers class of each model type: what other servers (vLLM) read to pick a model (as
# LlamaForCausalLM, a Qwen2 ran without its q/k/v biases there and answered noise).
_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, tokenizer files and model.safetensors for `gguf_path` into `out_dir`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
    arch = meta["general.architecture"]
    if arch not in _ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported")
    tensors = {_hf_name(t.name): _dequantize(t) for t in reader.tensors}
    blocks = {_hf_name(t.name): b for t in reader.tensors if (b := blocks_of(t)) is not None}
    # The embedding's rows are the vocabulary: `<arch>.vocab_size` is optional (qwen2 GGUFs omit it).
    config = _hf_config(meta, arch, tie="lm_head.weight" not in tensors,
                        vocab_size=tensors["model.embed_tokens.weight"].shape[0])
    if arch == "llama":  # llama.cpp interleaves q/k rows for its RoPE; undo it.
        for name in list(tensors):
            heads = {"q_proj.weight": config["num_attention_heads"], "k_proj.weight": config["num_key_value_heads"]}
            for suffix, n_head in heads.items():
                if name.endswith(suffix):
                    tensors[name] = _unpermute(tensors[name], n_head)
                    if name in blocks:  # the same rows: a block never spans two
                        blocks[name] = {part: _unpermute(a, n_head) for part, a in blocks[name].items()}

    with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
        tmp_dir = Path(tmp) / "model"
        tmp_dir.mkdir()
        _save_tokenizer(gguf_path, tmp_dir)
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2))
        save_blocks(blocks, tensors, tmp_dir)
        # Unquantized tensors are read-only views of the file; a writable copy keeps torch quiet.
        save_file({k: torch.from_numpy(np.require(v, requirements="W")).contiguous() for k, v in tensors.items()},
                  str(tmp_dir / "model.safetensors"))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)  # atomic: a half-written cache is never picked up


def _dequantize(tensor) -> np.ndarray:
    from gguf import quants

    data = quants.dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(data.reshape([int(d) for d in reversed(tensor.shape)]),
                                dtype=np.float32)


def _hf_name(name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(meta: dict, arch: str, tie: bool, vocab_size: int) -> dict:
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    config = {
        "model_type": _ARCHS[arch],
        "architectures": [_CLASSES[_ARCHS[arch]]],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": tie,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return {k: v for k, v in config.items() if v is not None}


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
