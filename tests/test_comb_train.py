"""Training the COMB encoder: the self-distillation loss falls when only the plug-in learns."""

import pytest
import torch
from helpers import greedy

from spanserve import LLM, Span
from spanserve.cli import main
from spanserve.comb import dense, train
from spanserve.comb.data import FACTS, FIRST, LAST, ExampleMaker
from spanserve.comb.plugin import CombPlugin


def test_training_steps_lower_the_kl_to_the_full_context_model_and_touch_only_the_plugin(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)
    model = llm.engine.runner.model
    model.requires_grad_(False)
    before = {n: p.clone() for n, p in model.named_parameters()}
    plugin = CombPlugin.zeros(model, rank=4)
    for t in plugin.parameters():
        t.requires_grad_(True)
    plugin.attach(model, cast=False)
    maker = ExampleMaker(llm.get_tokenizer(), seed=3, min_docs=2, max_docs=3)
    questions = train.build(llm, maker, max_answer=4)
    layout = questions[0].layout
    assert layout.spans and all(offset for _, _, offset in layout.spans)  # documents after the anchor
    opt = torch.optim.Adam(plugin.parameters(), lr=1e-3)
    losses = []
    for _ in range(20):
        loss = train.kl_loss(model, plugin, questions)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[0] > 1e-5, losses  # independent spans do change this random model's predictions
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_questions_over_one_document_set_share_its_encoding_and_get_full_context_targets(tiny_llama_path):
    """build() computes the documents once for several questions: each teacher target equals the
    plain full-context forward of its own prompt, and backward() (one encoder pass, each question's
    graph differentiated alone) gives the gradient of the mean loss."""
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)
    model = llm.engine.runner.model
    model.requires_grad_(False)
    plugin = CombPlugin.zeros(model, rank=4, seed=1, reader=True)  # both sides learn
    for a, b in plugin.deltas.values():
        b.normal_(0, 0.05)  # not the decoder: the student differs from the teacher
        a.requires_grad_(True), b.requires_grad_(True)
    plugin.attach(model, cast=False)
    questions = train.build(llm, ExampleMaker(llm.get_tokenizer(), seed=5, min_docs=3, max_docs=3), 4, questions=3)
    assert len(questions) == 3 and len({tuple(q.layout.token_ids) for q in questions}) == 3
    assert all(q.layout.spans == questions[0].layout.spans for q in questions)
    for q in questions:
        with torch.no_grad():
            full = dense.forward(model, None, dense.DenseLayout(q.layout.token_ids, [], []), q.positions)
        torch.testing.assert_close(q.teacher, full.log_softmax(-1), atol=1e-4, rtol=0)
    train.kl_loss(model, plugin, questions).backward()
    grads = lambda: [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in plugin.parameters()]  # noqa: E731
    expected = grads()  # (the last layer's MLP and output deltas never reach span KV: no gradient)
    for t in plugin.parameters():
        t.grad = None
    loss = train.backward(model, plugin, questions)
    assert loss == pytest.approx(train.kl_loss(model, plugin, questions).item(), rel=1e-5)
    assert sum(g.abs().sum() for g in expected) > 0
    for got, want in zip(grads(), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_examples_hold_one_fact_per_document_and_ask_for_one_of_them(tiny_llama_path):
    tok = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=64).get_tokenizer()
    maker = ExampleMaker(tok, seed=0, min_docs=3, max_docs=3)
    sentences = [f[1].split("{name}")[-1].split("{value}")[0] for f in FACTS]
    for _ in range(10):
        examples = maker.examples(2)
        docs = [part.text for part in examples[0].messages[1]["content"][:-1]]
        assert len(docs) == 3 and all(e.messages[1]["content"][:-1] == examples[0].messages[1]["content"][:-1]
                                      for e in examples)
        fact_docs = [d for d in docs if any(s in d for s in sentences)]
        assert len(fact_docs) in (0, 3)  # a reading question, or one fact in every document
        assert all("access code" not in d for d in docs)  # the benchmark's facts stay out of training
        if fact_docs:  # two different people asked about
            assert examples[0].messages[1]["content"][-1] != examples[1].messages[1]["content"][-1]


def test_examples_can_hold_several_facts_per_document_about_different_people(tiny_llama_path):
    tok = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=64).get_tokenizer()
    maker = ExampleMaker(tok, seed=1, min_docs=4, max_docs=4, max_facts=3, fact_share=1.0)
    counts = []
    for _ in range(8):
        example = maker.examples(1)[0]
        docs = [part.text for part in example.messages[1]["content"][:-1]]
        sentence = next(f for f in FACTS if f[1].split("{name}")[-1].split("{value}")[0] in docs[0])[1]
        middle = sentence.split("{name}")[-1].split("{value}")[0]
        counts += [d.count(middle) for d in docs]
        question = example.messages[1]["content"][-1]
        asked = next(f"{first} {last}" for first in FIRST for last in LAST if f"{first} {last}" in question)
        assert sum(asked in d for d in docs) == 1  # the person asked about is in one document only
    assert set(counts) == {1, 2, 3}


def test_answer_share_puts_that_share_of_the_loss_on_the_answers_positions(tiny_llama_path):
    """With --answer-share s a question's loss is s * (mean KL over its answer's positions) +
    (1 - s) * (mean KL over its question's positions); without it, the mean over all of them."""
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)
    model = llm.engine.runner.model
    plugin = CombPlugin.zeros(model, rank=4, seed=2)
    for _, b in plugin.deltas.values():
        b.normal_(0, 0.05)
    plugin.attach(model, cast=False)
    maker = lambda: ExampleMaker(llm.get_tokenizer(), seed=7, min_docs=2, max_docs=2)  # noqa: E731
    plain, shared = train.build(llm, maker(), 4)[0], train.build(llm, maker(), 4, answer_share=0.8)[0]
    assert plain.layout == shared.layout and plain.answer == shared.answer and len(plain.answer) == 4
    with torch.no_grad():
        student = dense.forward(model, plugin, plain.layout, plain.positions).log_softmax(-1)
        per_position = (plain.teacher.exp() * (plain.teacher - student)).sum(-1)
        answer, question = per_position[-4:], per_position[:-4]
        assert train.kl_loss(model, plugin, [plain]).item() == pytest.approx(per_position.mean().item(), rel=1e-5)
        want = 0.8 * answer.mean() + 0.2 * question.mean()
        assert train.kl_loss(model, plugin, [shared]).item() == pytest.approx(want.item(), rel=1e-5)
    assert train.loss_weights(5, 5, 0.8).tolist() == pytest.approx([0.2] * 5)  # no question positions: plain mean


def test_validation_agreement_is_the_share_of_greedy_answers_equal_to_the_teachers(tiny_llama_path):
    """validate() reads agreement teacher-forced; it must equal decoding the student greedily."""
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)
    model = llm.engine.runner.model
    model.requires_grad_(False)
    plugin = CombPlugin.zeros(model, rank=4, seed=2)
    for _, b in plugin.deltas.values():
        b.normal_(0, 0.004)  # small: a random model's answers are near ties
    plugin.attach(model, cast=False)
    sets = [train.build(llm, ExampleMaker(llm.get_tokenizer(), seed=s, min_docs=2, max_docs=2), 3, questions=2)
            for s in range(4)]
    expected = []
    for q in (q for questions in sets for q in questions):
        ids = q.layout.token_ids[:len(q.layout.token_ids) - len(q.answer)]
        for _ in q.answer:  # the student's own greedy answer, token by token
            layout = dense.DenseLayout(ids, q.layout.spans, q.layout.anchor_ids)
            with torch.no_grad():
                ids = ids + [int(dense.forward(model, plugin, layout, [len(ids) - 1]).argmax())]
        expected.append(ids[-len(q.answer):] == q.answer)
    got = train.validate(model, plugin, sets)
    assert got.agreement == sum(expected) / len(expected) and 0 < got.agreement < 1
    assert got.kl == pytest.approx(sum(train.kl_loss(model, plugin, [q]).item() for s in sets for q in s) / 8)


def test_train_comb_from_the_cli_writes_a_plugin_the_engine_serves(tiny_llama_path, tmp_path):
    out = tmp_path / "plugin.safetensors"
    main(["train", "comb", "--model", str(tiny_llama_path), "--dtype", "float32", "--steps", "3", "--rank", "2",
          "--max-docs", "2", "--max-answer", "2", "--log-every", "1", "--save-every", "2", "--val-examples", "1",
          "--out", str(out)])
    plugin = CombPlugin.load(out)
    assert plugin.rank == 2 and plugin.meta["previous"] is None
    checks = [h for h in plugin.meta["history"] if "val_kl" in h]
    assert [h["step"] for h in checks] == [0, 2, 3]  # the start, each --save-every and the end
    best = max(checks, key=lambda h: (h["val_agreement"], -h["val_kl"]))  # the file holds the best
    assert plugin.meta["steps"] == best["step"]
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=128, comb_plugin=str(out))
    reply = llm.generate([["Intro\n", Span("a document " * 20), "question"]], greedy(2, link_policy="comb"))[0]
    assert reply.num_cached_tokens == 0 and len(reply.outputs[0].token_ids) == 2
    main(["train", "comb", "--model", str(tiny_llama_path), "--dtype", "float32", "--steps", "1", "--seed", "1",
          "--init", str(out), "--max-docs", "2", "--max-answer", "2", "--val-examples", "1", "--out", str(out),
          "--reader", "--answer-share", "0.9"])
    continued = CombPlugin.load(out)
    assert continued.meta["previous"]["steps"] == plugin.meta["steps"] and continued.rank == 2
    assert continued.has_reader and not plugin.has_reader and continued.meta["reader"]
    assert continued.meta["answer_share"] == 0.9 and plugin.meta["answer_share"] is None
    checks = [h for h in continued.meta["history"] if "val_kl" in h]
    assert continued.meta["steps"] == max(checks, key=lambda h: (h["val_agreement"], -h["val_kl"]))["step"]
    changed = any(not torch.equal(a, b) for a, b in zip(continued.parameters(), plugin.parameters()))
    assert changed == (continued.meta["steps"] == 1)  # the start is kept unless the step did better
