"""Structured outputs (spanserve/structured/): every sampled output of a constrained request matches
its JSON schema, JSON object, regex, choice or grammar, on a random model that knows none of them;
constrained and unconstrained requests share batches; a bad constraint is a clear error."""

import json
import re

import jsonschema_rs
import pytest
from helpers import assert_engine_idle, greedy, random_prompt

from spanserve import LLM, SamplingParams
from spanserve.structured.params import InvalidGrammarError, StructuredOutputs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
GRAMMAR = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[a-z]{2,5}/'


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        return jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(text))
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) is not None
    if kind == "choice":
        return text in ("red", "green", "blue")
    return re.fullmatch(r"(hi|hello) [a-z]{2,5}", text) is not None


CASES = {"json": {"json": SCHEMA}, "json_object": {"json_object": True}, "regex": {"regex": r"[0-9]{3}-[a-z]{2}"},
         "choice": {"choice": ["red", "green", "blue"]}, "grammar": {"grammar": GRAMMAR}}


@pytest.mark.parametrize("kind", list(CASES))
def test_every_sampled_output_matches_its_constraint(llm, kind):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=120, structured_outputs=CASES[kind])
    outs = llm.generate([{"prompt_token_ids": random_prompt(12, seed=s)} for s in range(3)], params)
    completions = [completion for out in outs for completion in out.outputs]
    finished = [c for c in completions if c.finish_reason == "stop"]
    # enough of them checked (a random model's free JSON strings can run past max_tokens: then "length")
    assert len(finished) >= len(completions) // 3
    for completion in finished:
        assert _valid(kind, completion.text), (kind, completion.text)
    assert_engine_idle(llm)


def test_constrained_and_free_requests_share_a_batch_and_the_free_one_is_unchanged(llm):
    free = {"prompt_token_ids": random_prompt(16, seed=1)}
    alone = llm.generate(free, greedy(8))[0].outputs[0].token_ids
    constrained = {"prompt_token_ids": random_prompt(16, seed=2)}
    together = llm.generate([free, constrained], [greedy(8), SamplingParams(
        temperature=0, max_tokens=40, structured_outputs={"choice": ["red", "green", "blue"]})])
    assert together[0].outputs[0].token_ids == alone
    assert together[1].outputs[0].text in ("red", "green", "blue")


def test_a_constraint_cut_by_max_tokens_says_length(llm):
    out = llm.generate({"prompt_token_ids": random_prompt(8, seed=3)},
                       SamplingParams(temperature=0, max_tokens=3, structured_outputs={"json": SCHEMA}))[0]
    assert out.outputs[0].finish_reason == "length"  # never a cut JSON presented as complete


def test_a_constrained_request_survives_preemption(tiny_llama_path):
    small = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=24, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=150, structured_outputs={"json": SCHEMA})
    outs = small.generate([{"prompt_token_ids": random_prompt(120, seed=s)} for s in range(3)], params)
    assert small.engine.scheduler.num_preemptions > 0
    for out in outs:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "length" or _valid("json", text), text


def test_a_session_question_can_be_constrained(llm):
    session = llm.create_session(system="Answer from the log.")
    session.append("t=1, sensor=A, value=7\n")
    session.wait()
    answer = session.query("Which sensor?", SamplingParams(temperature=0, max_tokens=8,
                                                           structured_outputs={"choice": ["A", "B", "C"]}))
    assert answer.text in ("A", "B", "C")
    session.close()


def test_grammars_are_compiled_once_per_source(llm):
    grammars = llm.engine.grammars
    first = grammars.grammar(StructuredOutputs(json=SCHEMA))
    assert grammars.grammar(StructuredOutputs(json=json.dumps(SCHEMA))) is first  # the same schema as text


@pytest.mark.parametrize("constraint, message", [
    ({"regex": "([0-9"}, "structured_outputs"),
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "structured_outputs"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"xml": "<a/>"}, "a dict of"),
])
def test_a_bad_constraint_is_a_clear_error(llm, constraint, message):
    with pytest.raises(InvalidGrammarError, match=message):
        llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert_engine_idle(llm)


def test_the_cli_constrains_the_answer(tiny_llama_path, tmp_path, capsys):
    from spanserve.cli import main

    common = ["--model", str(tiny_llama_path), "--dtype", "float32", "--num-blocks", "64", "--raw",
              "--temperature", "0", "--max-tokens", "40"]
    main(["generate", "Pick a colour:", *common, "--choice", "red", "--choice", "blue"])
    assert capsys.readouterr().out.strip() in ("red", "blue")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["n"], "additionalProperties": False,
                                  "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}))
    main(["generate", "A number:", *common, "--json-schema", f"@{schema}"])
    assert json.loads(capsys.readouterr().out)["n"] in range(100)
    with pytest.raises(SystemExit, match="error: .*structured_outputs"):
        main(["generate", "x", *common, "--regex", "([0-9"])
    with pytest.raises(SystemExit, match="exactly one"):
        main(["generate", "x", *common, "--regex", "a", "--json-object"])


VERDICT = {"type": "object", "additionalProperties": False, "required": ["best", "why"],
           "properties": {"best": {"type": "integer", "minimum": 0, "maximum": 3}, "why": {"type": "string",
                                                                                     "maxLength": 40}}}


def test_a_span_query_judge_returns_json_its_caller_can_parse(llm):
    """A g node's response_format holds the judge to a schema; the candidates it reads stay free text."""
    from spanserve.spans.ir import cross, g, plus, system, user

    candidates = [g(user(f"Write idea number {i}."), max_tokens=12, temperature=0.7, seed=i) for i in range(4)]
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    judge = g(cross(system("You judge ideas."), plus(*candidates), user("Which idea is best?")),
              max_tokens=80, temperature=0.8, seed=3, response_format=fmt)
    result = llm.run_query(judge)
    assert jsonschema_rs.validator_for(VERDICT).is_valid(json.loads(result.text)), result.text
    with pytest.raises(Exception, match="response_format"):
        g(user("x"), response_format={"type": "xml"})
    assert_engine_idle(llm)


def test_object_schemas_that_list_their_properties_allow_no_others():
    from spanserve.structured.schema import closed

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                                               "any": {"type": "object"},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True},
                                               "list": {"type": "array", "items": {"properties": {"y": {}}}}},
              "$defs": {"d": {"anyOf": [{"properties": {"z": {}}}, {"type": "string"}]}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in out["properties"]  # a property's name
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["any"]  # any object: stays any
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema untouched


def test_warming_builds_the_librarys_view_of_the_vocabulary(tiny_llama_path):
    from spanserve.structured.grammars import Grammars

    grammars = Grammars(LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=16).get_tokenizer(), 49152)
    assert grammars._tokenizer is None
    grammars.warm()  # (`spanserve serve` runs it in a thread at start)
    assert grammars._tokenizer is not None


def test_a_prompt_with_spans_can_be_constrained(llm):
    """Spans cached by one request, reused in another order by a constrained one."""
    from spanserve import Span

    docs = [f"Document {i}: " + " ".join(f"word{i}{j}" for j in range(40)) for i in range(3)]
    llm.generate([Span(d) for d in docs] + ["Which?"], greedy(2))
    params = SamplingParams(temperature=0.9, seed=1, max_tokens=60, structured_outputs={"json": SCHEMA})
    out = llm.generate([Span(docs[2]), Span(docs[0]), Span(docs[1]), "Answer as JSON:"], params)[0]
    assert out.num_cached_tokens > 0
    assert out.outputs[0].finish_reason == "length" or _valid("json", out.outputs[0].text), out.outputs[0].text
    assert_engine_idle(llm)
