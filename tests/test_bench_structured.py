"""`spanserve bench structured` (benchmarks/structured.py), tiny and fast on a random model: every
section reports, and every constrained output that finished is valid against its schema; the tool
prompt set (benchmarks/tool_prompts.py) is well formed."""

import json

import jsonschema_rs
import pytest
from helpers import bench_args

from benchmarks import structured, tool_prompts


@pytest.fixture(scope="module")
def result(tiny_llama_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("structured") / "structured.json"
    args = bench_args(structured, ["--model", str(tiny_llama_path), "--dtype", "float32", "--quick",
                                   "--out", str(out)])
    data = structured.run(args)
    return data, json.loads(out.read_text())


def test_every_section_is_reported(result):
    data, written = result
    assert written["benchmark"] == "structured" and written["quick"] is True
    assert set(written) >= {"decode", "validity", "compile", "ttft", "tools", "goals", "machine", "machine_tag"}
    decoded = written["decode"]["tokens_per_request"] - 1  # each request's tokens after its first
    for batch in ("1", "8"):
        row = written["decode"]["per_batch"][batch]
        assert row["free_tok_s"] > 0 and row["constrained_tok_s"] > 0 and row["ratio"] > 0
        assert row["free_tokens_decoded"] == [int(batch) * decoded] * written["decode"]["repeats"]
        # the schema's minItems keeps the grammar live: constrained requests decode as many
        assert row["constrained_tokens_decoded"] == row["free_tokens_decoded"]
    compile_ = written["compile"]
    assert compile_["properties"] == 50 and compile_["first_compile_ms"] > 0 and compile_["cached_compile_ms"] > 0
    assert set(written["ttft"]["wall_ms_median"]) == {"none", "cached_schema"}
    assert set(written["goals"]) == set(structured.GOALS)


def test_every_finished_constrained_output_is_valid(result):
    _, written = result
    validity = written["validity"]
    assert set(validity["per_schema"]) == set(structured.VALIDITY_SCHEMAS)
    for name, s in validity["per_schema"].items():
        assert s["outputs"] == 2 and s["finished_stop"] + s["cut_by_max_tokens"] == s["outputs"]
        assert s["valid"] == s["finished_stop"], (name, s["records"])
    if validity["finished_stop"]:
        assert validity["valid_fraction"] == 1.0


def test_tool_calls_are_scored_per_mode(result):
    _, written = result
    tools = written["tools"]
    assert tools["prompts"] == 3 and tools["no_tool_prompts"] == 3
    auto, required = tools["modes"]["auto"], tools["modes"]["required"]
    for mode in (auto, required):
        assert len(mode["records"]) == 3
        for key in ("called_pct", "right_function_pct", "valid_arguments_pct", "right_values_pct"):
            assert 0 <= mode[key] <= 100
        assert mode["right_values_pct"] <= mode["right_function_pct"] <= mode["called_pct"]
    assert auto["called_pct"] + auto["answered_as_text_pct"] == 100
    assert 0 <= auto["no_tool_correctly_not_called_pct"] <= 100
    # required holds the answer to a call by a grammar: a call that finished has valid arguments
    for record in required["records"]:
        if record["called"] is not None:
            assert record["valid_arguments"], record


def test_the_tool_prompt_set_is_well_formed():
    prompts = tool_prompts.PROMPTS
    assert len(prompts) >= 50 and len(tool_prompts.NO_TOOL_PROMPTS) >= 10
    assert len({text for text, _, _ in prompts}) == len(prompts)
    assert {fn for _, fn, _ in prompts} == set(tool_prompts.FUNCTIONS)  # every function is expected somewhere
    for i, (text, fn, expected) in enumerate(prompts):
        offered = tool_prompts.offered(i, fn)
        assert fn in offered and len(set(offered)) == tool_prompts.OFFERED, text
        schema = tool_prompts.FUNCTIONS[fn]["parameters"]
        assert set(expected) <= set(schema["properties"]), text
        assert set(schema["required"]) <= set(expected) or fn == "send_email", text  # an email's body is free
        partial = {k: v for k, v in schema.items() if k != "required"}
        assert jsonschema_rs.validator_for(partial).is_valid(tool_prompts.canonical(expected)), text
        assert tool_prompts.values_match(expected, tool_prompts.canonical(expected)), text
    for i, _ in enumerate(tool_prompts.NO_TOOL_PROMPTS):
        assert len(set(tool_prompts.offered(1000 + i, None))) == tool_prompts.OFFERED


def test_values_match_leniently():
    assert tool_prompts.values_match({"city": "Paris"}, {"city": "paris, France", "unit": "celsius"})
    assert tool_prompts.values_match({"expression": "12 * 7"}, {"expression": "12*7"})
    assert tool_prompts.values_match({"value": 5, "to_unit": {"one_of": ["miles", "mi"]}},
                                     {"value": 5.0, "to_unit": "MI"})
    assert not tool_prompts.values_match({"value": 5}, {"value": 6})
    assert not tool_prompts.values_match({"city": "Paris"}, {"town": "Paris"})
    assert not tool_prompts.values_match({"symbol": "AAPL"}, None)
