"""The attention locality benchmark (benchmarks/locality.py) runs end to end on a tiny random model."""

import argparse
import json

from benchmarks import locality


def test_locality_quick_reports_both_variants(tiny_llama_path, tmp_path):
    parser = argparse.ArgumentParser()
    locality.add_arguments(parser)
    out = tmp_path / "locality.json"
    args = parser.parse_args(["--quick", "--model", str(tiny_llama_path), "--dtype", "float32", "--out", str(out)])
    data = locality.run(args)
    assert json.loads(out.read_text())["benchmark"] == "locality"
    assert [e["hay_words"] for e in data["results"]] == [5, 20]
    for entry in data["results"]:
        assert len(entry["needles"]) == data["runs"] == 3
        assert all(len(names) == 4 for names in entry["needles"])
        for variant in ("flat", "tree"):
            stats = entry[variant]
            assert 0 <= stats["all_found"] <= stats["mean_found"] <= 1
            assert len(stats["answers"]) == len(stats["found"]) == 3
        inner = entry["tree_inner"]
        assert 0 <= inner["all_found"] <= inner["mean_found"] <= 1
        assert all(len(judges) == 2 for judges in inner["found"])  # two first-level judges per tree
        # The flat query is one judge call; with judge_arity=2 four candidates take two inner judges and the root.
        assert entry["flat"]["calls"] == 1 and entry["tree"]["calls"] == 3
    short, long = data["results"]
    assert short["flat"]["root_prompt_tokens"] < long["flat"]["root_prompt_tokens"]  # more hay, longer prompt
    assert long["tree"]["max_judge_prompt_tokens"] < long["flat"]["root_prompt_tokens"]  # no judge reads all the hay


def test_found_matches_whole_names_case_insensitively():
    assert locality.found("1. noor\n2. Tobias", ["Noor", "Tobias", "Wren"]) == ["Noor", "Tobias"]
    assert locality.found("Wrenfield", ["Wren"]) == []
