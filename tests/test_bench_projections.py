"""`spanserve bench projections`: float32 (the packed GEMM), float32 in MKL and each quantization
timed in turn over the model's own projections, with each one's error against float32."""

import json

from helpers import bench_args

from benchmarks import projections


def test_projections_bench_times_every_method_with_its_error(tiny_llama_path, tmp_path):
    out = tmp_path / "p.json"
    projections.run(bench_args(projections, ["--model", str(tiny_llama_path), "--rows", "1,7",
                                             "--repeats", "1", "--out", str(out)]))
    result = json.loads(out.read_text())
    assert result["methods"] == ["mkl", "int8", "int4", "w8a8"] and result["projections"] == 2 * 4 + 1
    assert [r["rows"] for r in result["rows"]] == [1, 7]
    for row in result["rows"]:
        assert all(row[f"{m}_ms"] > 0 for m in ("float32", "mkl", "int8", "int4", "w8a8"))
        assert row["mkl_error"] < 1e-5  # float32 both: the sums in another order
        # quantized, so not exact; int8 weights and int8 activations, so close (int4 coarser)
        assert 0 < row["int8_error"] < row["int4_error"] < 0.2 and 0 < row["w8a8_error"] < 0.05
