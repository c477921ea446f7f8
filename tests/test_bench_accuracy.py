"""The accuracy benchmark (benchmarks/accuracy.py) runs both tasks end to end on a tiny random model, with
every condition's warm-shuffled TTFT; its real-text documents are held-out prose holding one fact each."""

import json
import random

import pytest
from helpers import bench_args

from benchmarks import accuracy, fact_docs
from benchmarks.accuracy_prompts import answer_tokens
from spanserve import LLM
from spanserve.comb.plugin import CombPlugin
from spanserve.corpus import paragraphs
from spanserve.errors import InvalidRequestError
from spanserve.models.loader import load_tokenizer

TASKS = ("generated", "real")


@pytest.fixture(scope="module")
def accuracy_result(tiny_llama_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("accuracy") / "accuracy.json"
    args = bench_args(accuracy, [
        "--model", str(tiny_llama_path), "--dtype", "float32", "--docs", "2,3", "--doc-tokens", "48",
        "--real-doc-tokens", "64", "--questions", "2", "--max-tokens", "3", "--ttft-repeats", "2", "--out", str(out)])
    return accuracy.run(args), out


def test_accuracy_reports_every_condition_of_both_tasks_in_range(accuracy_result):
    data, out = accuracy_result
    assert set(accuracy.CONDITIONS) <= set(data["conditions"])
    for task in TASKS:
        summary = data["tasks"][task]["summary"]["prefix"]
        assert set(summary["overall"]) == set(data["conditions"])
        for condition, row in summary["overall"].items():
            assert row["questions"] == 2 * 2 * len(accuracy.DEPTHS)
            for key in ("accuracy", "first_token_agreement", "answer_agreement", "output_agreement"):
                assert 0.0 <= row[key] <= 1.0, (task, condition, key)
        assert {n: s["spans_off"]["questions"] for n, s in summary["per_n"].items()} == {"N=2": 6, "N=3": 6}
        assert set(summary["cells"]) == {f"N={n} {d}" for n in (2, 3) for d in accuracy.DEPTHS}
    written = json.loads(out.read_text())
    assert written["benchmark"] == "accuracy" and written["complete"] is True


def test_each_answer_names_whose_code_it_is(accuracy_result):
    """The asked person's code, another person's in the same prompt (which fact the model read
    instead), or nobody's."""
    q = {"docs": [{"text": "", "facts": {"Felix Kasheim": "18717"}}, {"text": "", "facts": {"Felix Yarirvia": "4856"}}]}
    item = {"n": 2, "depth": "first", "set": 0, "name": "Felix Kasheim", "answer": "18717",
            "prompt": {"ids": [1, 2], "spans": [], "answer_tokens": []}, "owners": accuracy.code_owners(q)}
    answers = {"right": "18717.", "namesake": "The code is 4856", "nobody": "5", "none": "no idea"}
    results = {c: [{"text": t, "correct": c == "right", "cached_tokens": 0, "token_ids": [], "answer_linked": None}]
               for c, t in answers.items()}
    record, = accuracy._records([item], results)
    assert {c: record[c]["code_of"] for c in answers} == {
        "right": "Felix Kasheim", "namesake": "Felix Yarirvia", "nobody": None, "none": None}
    data, _ = accuracy_result
    assert all("code_of" in r[c] for task in TASKS for r in data["tasks"][task]["questions"]["prefix"]
               for c in data["conditions"])


def test_a_run_stopped_in_its_second_task_keeps_the_first_on_disk(tiny_llama_path, tmp_path, monkeypatch):
    out = tmp_path / "accuracy.json"
    run_task = accuracy.run_task

    def stopped_in_real(llm, task, *rest):
        if task == "real":
            raise KeyboardInterrupt
        return run_task(llm, task, *rest)

    monkeypatch.setattr(accuracy, "run_task", stopped_in_real)
    args = bench_args(accuracy, ["--model", str(tiny_llama_path), "--dtype", "float32", "--docs", "2",
                                 "--doc-tokens", "48", "--questions", "1", "--max-tokens", "2", "--ttft-repeats", "0",
                                 "--conditions", "spans_off,none", "--out", str(out)])
    with pytest.raises(KeyboardInterrupt):
        accuracy.run(args)
    kept = json.loads(out.read_text())
    assert kept["complete"] is False and list(kept["tasks"]) == ["generated"]
    assert kept["tasks"]["generated"]["summary"]["prefix"]["overall"]["none"]["questions"] == len(accuracy.DEPTHS)


def test_focus_conditions_report_whether_the_probe_linked_the_answer(tiny_llama_path, tmp_path):
    """A budget covering every span links every answer; one block links some answers at most; the
    answer tokens spell the code inside its document's span; conditions without a probe report none."""
    args = bench_args(accuracy, [
        "--model", str(tiny_llama_path), "--dtype", "float32", "--tasks", "real", "--docs", "3",
        "--real-doc-tokens", "64", "--questions", "2", "--max-tokens", "2", "--ttft-repeats", "0",
        "--conditions", "spans_off,none+focus16t,none+focus4096t", "--out", str(tmp_path / "a.json")])
    data = accuracy.run(args)
    overall = data["tasks"]["real"]["summary"]["prefix"]["overall"]
    assert overall["none+focus4096t"]["answer_linked"] == 1.0
    assert 0.0 <= overall["none+focus16t"]["answer_linked"] <= 1.0 and "answer_linked" not in overall["spans_off"]
    records = data["tasks"]["real"]["questions"]["prefix"]
    assert len(records) == 6
    for record in records:
        assert record["spans_off"]["answer_linked"] is None
        first, last = record["answer_tokens"][0], record["answer_tokens"][-1]
        assert any(start <= first and last < end for start, end in record["spans"])


def test_the_json_names_the_comb_plugin_that_answered(tiny_llama_path, tmp_path, accuracy_result):
    """Two plug-ins that differ only in their probe heads give different answers: the run must say which."""
    plugin = CombPlugin.zeros(LLM(model=str(tiny_llama_path), dtype="float32").engine.runner.model, rank=4)
    plugin.probe_heads, plugin.meta = [[1, 0]], {"steps": 7}
    plugin.save(tmp_path / "p.safetensors")
    args = bench_args(accuracy, [
        "--model", str(tiny_llama_path), "--dtype", "float32", "--tasks", "generated", "--docs", "2",
        "--doc-tokens", "48", "--questions", "1", "--max-tokens", "2", "--ttft-repeats", "0",
        "--conditions", "spans_off,comb+focus16t", "--comb-plugin", str(tmp_path / "p.safetensors"),
        "--out", str(tmp_path / "a.json")])
    accuracy.run(args)
    written = json.loads((tmp_path / "a.json").read_text())
    stored = CombPlugin.load(tmp_path / "p.safetensors")  # saved in bf16: its signature is the file's
    assert written["comb_plugin"] == {"signature": stored.signature, "probe_heads": [[1, 0]], "steps": 7}
    assert json.loads(accuracy_result[1].read_text())["comb_plugin"] is None  # the tiny model has none


def test_answer_tokens_are_the_tokens_spelling_the_code(tiny_llama_path):
    tok = load_tokenizer(tiny_llama_path)
    text = "It rained. The access code of Ada Byron is 40712. Then it stopped.\n\n"
    ids = tok.encode(text, add_special_tokens=False)
    found = answer_tokens(tok, ids, text, "Ada Byron", "40712", start=32)
    spelled = tok.decode(ids[found[0] - 32:found[-1] - 32 + 1])
    assert "40712" in spelled and found == list(range(found[0], found[-1] + 1))
    assert "40712" not in tok.decode(ids[found[0] - 32 + 1:found[-1] - 32 + 1])  # no token to spare at either end
    assert "40712" not in tok.decode(ids[found[0] - 32:found[-1] - 32])


def test_real_task_documents_stay_within_their_limit(accuracy_result):
    data, _ = accuracy_result
    tokens = data["tasks"]["real"]["doc_tokens"]
    assert tokens["limit"] == 64 and 0.75 * (64 - fact_docs.RealFactMaker.FACT_ROOM) < tokens["min"]
    assert tokens["max"] <= 64


def test_every_condition_is_timed_warm_shuffled_at_the_largest_n(accuracy_result):
    data, _ = accuracy_result
    for task in TASKS:
        ttft = data["tasks"][task]["ttft"]
        assert set(ttft) == set(data["conditions"])
        assert ttft["spans_off"]["speedup_vs_spans_off"] == 1.0
        for condition, t in ttft.items():
            assert len(t["runs"]) == 2 and t["median_ttft_s"] > 0 and t["speedup_vs_spans_off"] > 0, condition
            assert all(r["warm_cached_tokens"] > 0 and len(r["order"]) == 3 for r in t["runs"])
        # Reordered, spans off reuses the system prompt only; spans reuse every document as well.
        for off, spans in zip(ttft["spans_off"]["runs"], ttft["none"]["runs"]):
            assert off["cached_tokens"] < spans["cached_tokens"]
            assert off["prompt_tokens"] == spans["prompt_tokens"]


def test_the_timed_order_opens_with_a_document_no_accuracy_prompt_opened():
    q = {"docs": [{}] * 8, "target": 5}
    firsts = {accuracy.order_for(q, d)[0] for d in accuracy.DEPTHS}
    for seed in range(20):
        order = accuracy.new_order(random.Random(seed), q)
        assert sorted(order) == list(range(8)) and order[0] not in firsts


def test_real_documents_are_held_out_prose_with_one_fact(tiny_llama_path):
    tokenizer = load_tokenizer(tiny_llama_path)
    maker = fact_docs.RealFactMaker(tokenizer, 256, seed=1)
    held_out = "\n".join(paragraphs("eval"))
    for _ in range(20):
        doc = maker.document()
        [(name, code)] = doc["facts"].items()
        fact = fact_docs.FACT.format(name=name, code=code)
        assert doc["text"].count(fact) == 1 and doc["text"].count(code) == 1
        assert len(tokenizer.encode(doc["text"], add_special_tokens=False)) <= 256
        for line in doc["text"].replace(fact, "").split("\n"):
            assert all(sentence in held_out for sentence in fact_docs.sentences(" ".join(line.split())))


def test_sentences_end_at_stops_but_not_at_abbreviations_or_initials():
    text = 'Mr. J. M. Chambers reached the U.S. Capitol. He said "Enough." Gen. Grant agreed! Did he? Yes.'
    assert fact_docs.sentences(text) == ["Mr. J. M. Chambers reached the U.S. Capitol.", 'He said "Enough."',
                                         "Gen. Grant agreed!", "Did he?", "Yes."]


def test_passages_are_whole_sentences_within_budget_and_not_too_short():
    words = lambda s: len(s.split())  # noqa: E731
    paras = ["One two three four. Five six seven eight.", "Nine ten eleven twelve thirteen fourteen fifteen.",
             "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma.", "End."]
    passages = fact_docs.pack(paras, words, budget=12)  # the 18-word sentence cannot fit: dropped
    assert passages == [[["One two three four.", "Five six seven eight."]],
                        [["Nine ten eleven twelve thirteen fourteen fifteen."], ["End."]]]
    assert fact_docs.pack(["Too short."], words, budget=12) == []  # under 3/4 of the budget


def test_default_conditions_skip_policies_the_engine_cannot_serve(tiny_llama_path):
    from spanserve.pic.link import POLICIES

    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=64)
    conditions, skipped = accuracy.choose_conditions(llm, None, lambda msg: None, (*POLICIES, "unserved"))
    assert conditions[:len(accuracy.CONDITIONS)] == list(accuracy.CONDITIONS) and "unserved" in skipped
    with pytest.raises(InvalidRequestError):
        accuracy.choose_conditions(llm, "spans_off,unserved", lambda msg: None)


def test_accuracy_puts_the_answer_at_each_depth():
    q = {"docs": [{}] * 5, "target": 3}
    assert [accuracy.order_for(q, d).index(3) for d in accuracy.DEPTHS] == [0, 2, 4]
    assert all(sorted(accuracy.order_for(q, d)) == list(range(5)) for d in accuracy.DEPTHS)
    assert accuracy.first_number(" 4821. The") == "4821" and accuracy.first_number("none") is None


def test_accuracy_diagnostics_keep_the_spans_they_name_and_whole_document_gaps_set_no_goal():
    prompt = {"ids": list(range(64)), "spans": [[16, 32], [32, 48], [48, 64]], "text_ids": []}
    assert accuracy.condition_prompt(prompt, "first_in_context")["spans"] == [[32, 48], [48, 64]]
    assert accuracy.condition_prompt(prompt, "first_span_only")["spans"] == [[16, 32]]
    assert accuracy.condition_prompt(prompt, "gap16")["spans"] == prompt["spans"]
    assert accuracy.condition_params("first_in_context", 4).link_policy == "none"
    overall = {c: {"accuracy": 0.5} for c in ("spans_off", "gap16", "gap128")}
    assert list(accuracy.check_goals({"overall": overall}, doc_tokens=128)) == ["gap16 within 2 points of spans off"]


def test_reused_answers_are_the_earlier_runs_and_only_for_the_same_questions(accuracy_result, tiny_llama_path,
                                                                              tmp_path, monkeypatch):
    data, written = accuracy_result
    earlier = tmp_path / "earlier.json"  # as older runs wrote it: no token ids, no answer_linked
    stored = json.loads(written.read_text())
    for r in stored["tasks"]["generated"]["questions"]["prefix"]:
        for key in ("token_ids", "answer_linked"):
            del r["spans_off"][key]
    earlier.write_text(json.dumps(stored))
    asked = []
    prompt = accuracy.condition_prompt
    monkeypatch.setattr(accuracy, "condition_prompt", lambda p, c: asked.append(c) or prompt(p, c))
    common = ["--model", str(tiny_llama_path), "--dtype", "float32", "--docs", "2,3", "--doc-tokens", "48",
              "--real-doc-tokens", "64", "--questions", "2", "--max-tokens", "3", "--ttft-repeats", "0",
              "--tasks", "generated", "--conditions", "spans_off,none", "--reuse-answers", str(earlier)]
    again = accuracy.run(bench_args(accuracy, [*common, "--out", str(tmp_path / "a.json")]))
    assert set(asked) == {"none"}  # spans_off (the default reused condition) was not asked again
    before, after = (d["tasks"]["generated"]["questions"]["prefix"] for d in (data, again))
    assert [r["spans_off"]["text"] for r in after] == [r["spans_off"]["text"] for r in before]
    assert again["reused_answers"] == {"file": str(earlier), "conditions": ["spans_off"]}
    with pytest.raises(SystemExit, match="differs"):  # other questions: nothing to reuse
        accuracy.run(bench_args(accuracy, [*common, "--seed", "5", "--out", str(tmp_path / "b.json")]))
    with pytest.raises(SystemExit, match="dtype"):
        accuracy.run(bench_args(accuracy, [*common, "--dtype", "bfloat16", "--out", str(tmp_path / "c.json")]))
