"""`spanserve bench cpu_paths` on a tiny model: both modes timed at each batch, drift over every
prompt, and torch's paths really taken in the torch mode."""

import json

from helpers import bench_args

from benchmarks import cpu_paths
from spanserve.kernels import cpu_kernel
from spanserve.models import layout


def test_cpu_paths_bench_times_both_modes_and_measures_drift(tiny_llama_path, tmp_path):
    out = tmp_path / "paths.json"
    cpu_paths.run(bench_args(cpu_paths, ["--model", str(tiny_llama_path), "--batch", "1,2", "--context", "32",
                                         "--tokens", "4", "--answer", "4", "--repeats", "1", "--out", str(out)]))
    result = json.loads(out.read_text())
    assert set(result["best"]) == {"torch", "chosen"} and set(result["best"]["torch"]) == {"batch 1", "batch 2"}
    assert result["drift"]["prompts"] == len(cpu_paths.PROMPTS)
    assert set(result["drift_vs_float32"]) == {"torch", "chosen"}


def test_the_torch_mode_runs_no_c_gemm(tiny_llama_path, monkeypatch):
    from spanserve import LLM

    monkeypatch.setattr("spanserve.kernels.calibration.bf16_gemm_rows", lambda i, o: 8)
    llm = LLM(model=str(tiny_llama_path), dtype="bfloat16", num_blocks=16)
    packed = llm.engine.runner.model.lm_head
    assert isinstance(packed, layout.PackedLinear) and cpu_kernel.load("gemm") is not None
    with cpu_paths._torch_paths(llm.engine):
        assert packed._gemm_for(1) is None
    assert packed._gemm_for(1) is not None
