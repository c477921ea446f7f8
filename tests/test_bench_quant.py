"""`spanserve bench quant` on a tiny model: both engines timed, drift measured over every prompt."""

import json

from helpers import bench_args

from benchmarks import quant


def test_quant_bench_compares_int8_with_bf16(tiny_llama_path, tmp_path):
    out = tmp_path / "q.json"
    quant.run(bench_args(quant, ["--model", str(tiny_llama_path), "--context", "64", "--prefill", "64", "--tokens", "4",
                                 "--answer", "4", "--repeats", "1", "--out", str(out)]))
    result = json.loads(out.read_text())
    assert set(result["best"]) == {"bf16", "int8"} and result["drift"]["prompts"] == len(quant.PROMPTS)
    assert 0 <= result["drift"]["identical"] <= len(quant.PROMPTS)
    assert result["decode_ratio"] == result["best"]["int8"]["decode"] / result["best"]["bf16"]["decode"]
