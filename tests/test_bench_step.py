"""`spanserve bench step`: the decode step timed per batch size, and a profile of it split into
projections, attention, the layer's small ops and the rest."""

import json

from helpers import bench_args

from benchmarks import step


def test_step_bench_times_each_batch_and_splits_its_profile(tiny_llama_path, tmp_path):
    out = tmp_path / "s.json"
    step.run(bench_args(step, ["--model", str(tiny_llama_path), "--batch", "1,3", "--context", "40",
                               "--steps", "3", "--dtype", "float32", "--quantization", "w8a8", "--out", str(out)]))
    result = json.loads(out.read_text())
    assert result["dtype"] == "float32" and result["quantization"] == "w8a8" and result["context"] == 40
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["step_ms"] > 0 and abs(row["tok_s"] - row["batch"] * 1000 / row["step_ms"]) < 1e-6
        assert row["model_ms"] > 0 and row["host_ms"] > 0  # the engine's counters over the timed steps
        parts = row["profiled_ms"]
        assert set(parts) == set(step.PARTS) and all(ms > 0 for ms in parts.values())


def test_profile_entries_fall_in_their_parts():
    assert step._part("/x/spanserve/models/quant.py", "forward") == "projections"
    assert step._part("~", "<built-in method torch._C._nn.linear>") == "projections"
    assert step._part("/x/spanserve/kernels/cpu_kernel.py", "paged_decode") == "attention"
    assert step._part("/x/spanserve/models/layer_ops.py", "rms_norm") == "layer ops"
    assert step._part("/x/spanserve/engine/scheduler.py", "schedule") == "rest"
