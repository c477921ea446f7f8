"""Training the COMB encoder: the self-distillation loss falls when only the plug-in learns."""

import torch
from helpers import greedy

from spanserve import LLM, Span
from spanserve.cli import main
from spanserve.comb import train
from spanserve.comb.data import FACTS, ExampleMaker
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
    layout, positions, teacher = train.build(llm, maker, max_answer=4)
    assert layout.spans and all(offset for _, _, offset in layout.spans)  # documents after the anchor
    opt = torch.optim.Adam(plugin.parameters(), lr=1e-3)
    losses = []
    for _ in range(20):
        loss = train.kl_loss(model, plugin, layout, positions, teacher)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[0] > 1e-5, losses  # independent spans do change this random model's predictions
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_examples_hold_one_fact_per_document_and_ask_for_one_of_them(tiny_llama_path):
    tok = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=64).get_tokenizer()
    maker = ExampleMaker(tok, seed=0, min_docs=3, max_docs=3)
    sentences = [f[1].split("{name}")[-1].split("{value}")[0] for f in FACTS]
    for _ in range(10):
        example = maker.example()
        docs = [part.text for part in example.messages[1]["content"][:-1]]
        assert len(docs) == 3
        fact_docs = [d for d in docs if any(s in d for s in sentences)]
        assert len(fact_docs) in (0, 3)  # a reading question, or one fact in every document
        assert all("access code" not in d for d in docs)  # the benchmark's facts stay out of training


def test_train_comb_from_the_cli_writes_a_plugin_the_engine_serves(tiny_llama_path, tmp_path):
    out = tmp_path / "plugin.safetensors"
    main(["train", "comb", "--model", str(tiny_llama_path), "--dtype", "float32", "--steps", "3", "--rank", "2",
          "--max-docs", "2", "--max-answer", "2", "--log-every", "1", "--save-every", "2", "--val-examples", "1",
          "--out", str(out)])
    plugin = CombPlugin.load(out)
    assert plugin.meta["steps"] == 3 and plugin.rank == 2 and plugin.meta["previous"] is None
    assert [h["step"] for h in plugin.meta["history"] if "val_kl" in h] == [2, 3]
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=128, comb_plugin=str(out))
    reply = llm.generate([["Intro\n", Span("a document " * 20), "question"]], greedy(2, link_policy="comb"))[0]
    assert reply.num_cached_tokens == 0 and len(reply.outputs[0].token_ids) == 2
    main(["train", "comb", "--model", str(tiny_llama_path), "--dtype", "float32", "--steps", "1", "--seed", "1",
          "--init", str(out), "--max-docs", "2", "--max-answer", "2", "--val-examples", "1", "--out", str(out)])
    continued = CombPlugin.load(out)
    assert continued.meta["steps"] == 1 and continued.meta["previous"]["steps"] == 3
    assert continued.rank == 2 and any(not torch.equal(a, b) for a, b in zip(continued.parameters(),
                                                                               plugin.parameters()))
