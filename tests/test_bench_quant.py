"""`spanserve bench quant` on a tiny model: every engine timed, drift measured over every prompt."""

import json

import pytest
from helpers import bench_args

from benchmarks import quant


def test_quant_bench_compares_int8_and_int4_with_bf16(tiny_llama_path, tmp_path):
    out = tmp_path / "q.json"
    quant.run(bench_args(quant, ["--model", str(tiny_llama_path), "--context", "64", "--prefill", "64", "--tokens", "4",
                                 "--answer", "4", "--repeats", "1", "--out", str(out)]))
    result = json.loads(out.read_text())
    assert set(result["best"]) == {"bf16", "int8", "int4"}
    for method in ("int8", "int4"):
        drift = result["drift"][method]
        assert drift["prompts"] == len(quant.PROMPTS) and 0 <= drift["identical"] <= len(quant.PROMPTS)
        assert result["decode_ratio"][method] == result["best"][method]["decode"] / result["best"]["bf16"]["decode"]


def test_a_method_may_name_the_kv_cache_dtype_too():
    assert quant.engine_options("int4") == {"quantization": "int4", "gguf_blocks": False}
    assert quant.engine_options("w8a8+kv-bf16") == {"quantization": "w8a8", "kv_cache_dtype": "bf16",
                                                    "gguf_blocks": False}
    assert quant.engine_options("gguf-blocks+kv-bf16") == {"gguf_blocks": True, "kv_cache_dtype": "bf16"}
    with pytest.raises(SystemExit, match="names two of quantization"):
        quant.engine_options("int8+int4")
