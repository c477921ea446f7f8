"""`spanserve train probe` (comb/calibrate.py): which heads vote in a plug-in's focus probe."""

import re
import shutil

import numpy as np
import pytest
from conftest import _TINY, _save_random_model
from helpers import bench_args
from test_comb import make_llm, random_plugin
from transformers import LlamaConfig

from spanserve import SamplingParams
from spanserve.comb import calibrate, data
from spanserve.comb.data import ExampleMaker
from spanserve.comb.plugin import CombPlugin
from spanserve.pic.focus import focus_blocks, span_blocks
from spanserve.pic.link import AUTO_FOCUS_TOKENS
from spanserve.pic.voters import ProbeVoters


def probed(answer: int, heads: list[np.ndarray]) -> calibrate.Probed:
    return calibrate.Probed(np.stack(heads), np.array([0, 0, 1, 1, 2, 2, 3, 3]), {answer})


def test_greedy_selection_takes_the_head_that_finds_the_answer_and_stops():
    """Head 0 reads by position (the last block), head 1 finds the answer's block but scores the
    last block second, head 2 is flat. Head 1 alone links every answer; adding any other
    links no more, so selection stops there."""
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(12):
        answer = int(rng.integers(0, 7))
        positional = np.eye(8)[7] + 0.01
        finder = np.eye(8)[answer] + 0.5 * np.eye(8)[7]
        prompts.append(probed(answer, [positional, finder, np.full(8, 0.1)]))
    assert calibrate.choose_heads(prompts, max_heads=3, budget_blocks=1) == [1]
    assert calibrate.linked(prompts, np.array([1]), 1)[0] == 12
    assert calibrate.linked(prompts, np.array([0, 1, 2]), 1)[0] < 12  # every head voting: position wins


def test_the_answer_positions_spell_the_answer(tokenizer_dir):
    from spanserve.models.loader import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    maker = ExampleMaker(tok, seed=5)
    for n in (2, 4, 3):
        lookup = maker.lookup(n)
        docs = lookup.example.messages[1]["content"][:n]
        ids, spans = [], []
        for d in docs:
            piece = tok.encode(d.text, add_special_tokens=False)
            spans.append((len(ids), len(ids) + len(piece)))
            ids += piece
        where = calibrate.answer_positions(tok, ids, spans[lookup.doc], docs[lookup.doc].text, lookup)
        spelled = tok.decode([ids[t] for t in where]).strip()
        assert spelled.startswith(lookup.value[:1]) and lookup.value in spelled
        assert len(spelled) <= len(lookup.value) + 1


def people(lookup) -> list[tuple[str, str]]:
    pattern = re.compile(rf"\b({'|'.join(data.FIRST)}) ({'|'.join(data.LAST)})\b")
    return [m for part in lookup.example.messages[1]["content"] if hasattr(part, "text")
            for m in pattern.findall(part.text)]


def test_similar_names_fill_the_other_documents_with_namesakes(tokenizer_dir):
    """With two first names, 16 documents hold facts about namesakes of the person asked; with
    three facts a document and one first name, there are still enough names; 0 draws as before."""
    from spanserve.models.loader import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    lookup = ExampleMaker(tok, seed=3, similar_names=2).lookup(16)
    found = people(lookup)
    asked = next((f, last) for f, last in found if f"{f} {last}" in lookup.sentence)
    assert len(found) == 16 and len({f for f, _ in found}) <= 2
    assert sum(f == asked[0] for f, _ in found) >= 4  # namesakes of the one asked, not only the asked
    crowded = ExampleMaker(tok, seed=3, max_docs=16, min_docs=16, max_facts=3, similar_names=1, fact_share=1.0)
    assert len(crowded.examples(2)) == 2
    plain, default = ExampleMaker(tok, seed=3).lookup(16), ExampleMaker(tok, seed=3, similar_names=0).lookup(16)
    assert plain.sentence == default.sentence and len({f for f, _ in people(plain)}) > 2


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory, tokenizer_dir):
    """Room for lookups over real documents (the shared tiny models stop at 512 positions)."""
    config = LlamaConfig(**{**_TINY, "num_hidden_layers": 3, "max_position_embeddings": 2048},
                         tie_word_embeddings=False, initializer_range=0.1)
    return _save_random_model(config, tokenizer_dir, tmp_path_factory.mktemp("long-llama"))


def test_calibration_reports_its_choice_and_writes_only_the_heads(long_llama, tmp_path):
    """End to end on a tiny model: the report holds pairs of the model; rewriting the plug-in
    keeps its deltas (and so its span KV's hashes) and adds the heads, which an engine loads."""
    path = tmp_path / "plugin.safetensors"
    random_plugin(make_llm(long_llama), seed=2).save(path)
    args = bench_args(calibrate, ["--model", str(long_llama), "--comb-plugin", str(path), "--prompts", "3",
                                  "--held-out", "2", "--docs", "2,3", "--max-heads", "2", "--dry-run",
                                  "--dtype", "float32", "--num-blocks", "512", "--similar-names", "2"])
    report = calibrate.calibrate(args)
    assert 1 <= len(report["heads"]) <= 2 and all(0 <= layer < 3 and 0 <= head < 4 for layer, head in report["heads"])
    assert not report["written"] and CombPlugin.load(path).probe_heads == []
    for side in ("default", "chosen"):
        assert set(report["linked"][side]) == {"train", "held_out"}
    before = CombPlugin.load(path)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(path, copy)
    calibrate.save_heads(report, copy)
    after = CombPlugin.load(copy)
    assert after.probe_heads == report["heads"] and after.signature == before.signature
    assert after.meta["probe"]["heads"] == report["heads"]
    llm = make_llm(long_llama, comb_plugin=str(copy))
    assert llm.engine.runner.encoder_voters.pairs == tuple(map(tuple, sorted(report["heads"])))


def test_recorded_scores_pick_the_blocks_the_engine_linked(long_llama, tmp_path):
    """What calibration records is what the probe saw: its scores, summed over the voters the
    engine used, choose exactly the blocks the engine recomputed in context (the span keys are
    read before the choice moves them into context, or the chosen blocks would score zero)."""
    path = tmp_path / "plugin.safetensors"
    random_plugin(make_llm(long_llama), seed=3).save(path)
    llm = make_llm(long_llama, comb_plugin=str(path))
    engine, runner = llm.engine, llm.engine.runner
    cfg, bs = runner.model.cfg, runner.block_size
    every = {pair: i for i, pair in enumerate(ProbeVoters.of_layers(range(cfg.num_layers), cfg.num_heads).pairs)}
    params = SamplingParams(temperature=0, max_tokens=1, link_policy="comb", focus_tokens=AUTO_FOCUS_TOKENS)
    maker = ExampleMaker(llm.get_tokenizer(), seed=4)
    for docs in (3, 4):
        prompt = engine.chat_prompt(maker.lookup(docs).example.messages)
        seen: list = []
        with calibrate.every_head_probed(runner, seen):
            llm.generate({"prompt_token_ids": prompt["prompt_token_ids"], "spans": prompt["spans"]}, params)
        (req, weights, span_keys), = seen
        linked = span_keys.numpy() & ~req.layout.independent[:req.num_prompt_tokens]
        assert linked.any()
        voters = [every[pair] for pair in runner.probe_voters(req).pairs]
        scores, span_of_block = span_blocks((weights[voters] * span_keys.float()).sum(0).numpy(), req.layout.spans, bs)
        picked = focus_blocks(scores, span_of_block, -(-AUTO_FOCUS_TOKENS // bs))
        assert set(picked) == {t // bs for t in np.flatnonzero(linked)}
