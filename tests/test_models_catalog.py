"""Named models assembled from split PyPI packages, and GGUF conversion of a qwen2 file."""

import hashlib
import json
import sys

import numpy as np
import pytest
import torch
from helpers import greedy
from transformers import AutoModelForCausalLM

from spanserve import LLM
from spanserve.errors import ModelNotFoundError
from spanserve.models.catalog import CATALOG, SplitGGUF, assembled_gguf
from spanserve.models.gguf import convert_gguf
from spanserve.models.loader import model_name, resolve_model

PARTS = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A three-part model installed as packages fakeparts_1..3 (each data/partNN.bin)."""
    root = tmp_path / "site"
    for i, data in enumerate(PARTS, 1):
        pkg = root / f"fakeparts_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    whole = b"".join(PARTS)
    model = SplitGGUF("fake-model", "fakeparts_{part}", "fake-parts-{part}", "1.0", len(PARTS), len(whole),
                      hashlib.sha256(whole).hexdigest())
    yield model, root
    for i in range(1, len(PARTS) + 1):
        sys.modules.pop(f"fakeparts_{i}", None)


def test_parts_are_concatenated_in_order_and_verified(fake_model, tmp_path):
    model, _ = fake_model
    out = assembled_gguf(model, tmp_path / "cache")
    assert out.read_bytes() == b"".join(PARTS)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["fake-model.gguf"]  # no temp file left


def test_missing_part_names_the_part_and_make_models(fake_model, tmp_path):
    model, root = fake_model
    (root / "fakeparts_2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelNotFoundError, match=r"missing part\(s\) 2 of 3.*make models"):
        assembled_gguf(model, tmp_path / "cache")


def test_corrupt_part_is_an_error_and_leaves_no_file(fake_model, tmp_path):
    model, root = fake_model
    part = root / "fakeparts_3" / "data" / "part03.bin"
    part.write_bytes(b"TAIL")  # same size, other bytes
    with pytest.raises(ModelNotFoundError, match="corrupt.*make models"):
        assembled_gguf(model, tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())


def test_catalog_names_resolve_case_insensitively_to_the_missing_parts_error(monkeypatch, tmp_path):
    monkeypatch.setenv("SPANSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(SplitGGUF, "part_path", lambda self, part: None)
    for name in ("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct"):
        with pytest.raises(ModelNotFoundError, match="make models"):
            resolve_model(name)
    assert set(CATALOG) == {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"}


# ---- a qwen2 GGUF without <arch>.vocab_size (as the Qwen2.5-Coder files are) -----------------

_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    hf = hf.removeprefix("model.")
    base, _, kind = hf.rpartition(".")
    if base.startswith("layers."):
        _, layer, part = base.split(".", 2)
        return f"blk.{layer}.{_GGUF_LAYER[part]}.{kind}"
    return {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[base] + f".{kind}"


def write_qwen2_gguf(hf_dir, path) -> None:
    """The tiny HF qwen2 model as a float32 GGUF with its BPE tokenizer and no vocab_size key."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        w.add_tensor(_gguf_name(name), tensor.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen2_gguf_without_vocab_size_takes_it_from_the_embedding(tiny_qwen2_path, tmp_path):
    gguf_path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(tiny_qwen2_path, gguf_path)
    out = tmp_path / "converted"
    convert_gguf(gguf_path, out)
    config = json.loads((out / "config.json").read_text())
    expected = json.loads((tiny_qwen2_path / "config.json").read_text())["vocab_size"]
    assert config["vocab_size"] == expected and config["model_type"] == "qwen2"
    # the class other servers pick the model by (as LlamaForCausalLM vLLM dropped the q/k/v biases)
    assert config["architectures"] == ["Qwen2ForCausalLM"]

    prompt = [1, 504, 3575, 2001, 77, 901, 12]
    ours = LLM(model=str(gguf_path), dtype="float32", num_blocks=16)
    tokens = ours.generate({"prompt_token_ids": prompt}, greedy(8))[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_path), dtype=torch.float32)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert tokens == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("model,name", [("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
                                        ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),
                                        ("/models/Qwen2.5-1.5B-Instruct/", "Qwen2.5-1.5B-Instruct"),
                                        (None, "SmolLM2-135M-Instruct")])
def test_a_model_goes_by_its_whole_name(monkeypatch, model, name):
    """A server's model id: dots in a catalog name are part of it (not a file suffix)."""
    monkeypatch.delenv("SPANSERVE_MODEL", raising=False)
    assert model_name(model) == name
