"""Documents holding access-code facts ("The access code of <name> is <number>."), for the accuracy benchmark.

Two makers with one interface (`rng`, `document()` -> {"text", "facts": {name: code}}):
  FactMaker      generated: made-up encyclopedia sentences (benchmarks/rag.py) around --facts-per-doc facts
  RealFactMaker  real: consecutive prose of the held-out corpus split (spanserve/corpus.py, "eval") with
                 one fact inserted between two of its sentences

Names are made up and unique within a maker; codes are 4-6 digit numbers that appear nowhere else in
their document, so the first number of an answer can only match by retrieving the fact.
"""

import re

from benchmarks.rag import _TEMPLATES, DocumentMaker

FACT = "The access code of {name} is {code}."
# A sentence ends at . ! or ? (closing quotes or brackets may follow) before a space and a capital...
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])(?<!\.\.\.)([\"'\u201d\u2019)]*)\s+(?=[\"'\u201c\u2018(]?[A-Z0-9])")
# ...unless the period closes an abbreviation or an initial ("Mr.", "Gen.", "J. M.", "U.S.").
_ABBREVIATION = re.compile(r"(?:\b(?:[A-Z]|Mr|Mrs|Messrs|Dr|St|Gen|Lt|Col|Capt|Adm|Jr|Sr|No|Nos|Hon|Gov|Rev|Sec|"
                           r"Ft|Mt|vs|viz|etc|ult|inst)|[A-Z]\.[A-Z])\.$")


def sentences(paragraph: str) -> list[str]:
    """A paragraph cut into sentences (abbreviations and initials do not end one)."""
    pieces = _SENTENCE_BREAK.sub(lambda m: m.group(1) + "\n", paragraph).split("\n")
    out: list[str] = []
    for piece in pieces:
        if out and _ABBREVIATION.search(out[-1]):
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


class _Codes:
    """Unique made-up names and numeric codes from one seeded DocumentMaker."""

    def __init__(self, tokenizer, doc_tokens: int, seed: int):
        self.filler = DocumentMaker(tokenizer, doc_tokens, seed)
        self.rng, self.doc_tokens = self.filler.rng, doc_tokens

    def person(self) -> str:
        return self.filler.person(unique=True)

    def code(self, avoid: str = "") -> str:
        """4-6 digits, not found in `avoid` (the text the fact goes into)."""
        while True:
            digits = self.rng.randrange(4, 7)
            code = str(self.rng.randrange(10 ** (digits - 1), 10 ** digits))
            if code not in avoid:
                return code


class FactMaker(_Codes):
    """Documents of generated filler sentences with `facts` access-code facts each."""

    def __init__(self, tokenizer, doc_tokens: int, facts: int, seed: int = 0):
        super().__init__(tokenizer, doc_tokens, seed)
        self.facts = facts

    def document(self) -> dict:
        """{"text", "facts": {name: code}}: facts spread among filler sentences, ~doc_tokens tokens."""
        f = self.filler
        slots = {"E": f.name(unique=False), "C": f.name(unique=False)}
        facts = {self.person(): self.code() for _ in range(self.facts)}
        parts = [FACT.format(name=name, code=code) for name, code in facts.items()]
        templates = list(_TEMPLATES)
        self.rng.shuffle(templates)
        for template in templates:
            sentence = f.fill(template, slots)
            at = self.rng.randrange(len(parts) + 1)
            candidate = parts[:at] + [sentence] + parts[at:]
            if f.count(" ".join(candidate)) > self.doc_tokens:
                break
            parts = candidate
        return {"text": " ".join(parts), "facts": facts}


class RealFactMaker(_Codes):
    """Real prose of ~doc_tokens tokens per document, one access-code fact in each.

    The split's paragraphs are cut into sentences and packed, in order, into passages of whole
    sentences that leave room for the fact (paragraph breaks kept as newlines; passages under 3/4 of
    the room dropped, so lengths stay close: at most doc_tokens, median ~0.9 of it); the passages are
    then dealt out in a seeded random order, so one question's documents come from different
    addresses and eras. A passage is used once per maker until all are used.
    """

    FACT_ROOM = 20  # tokens kept free for the fact sentence (a long name and a 6-digit code take ~16)

    def __init__(self, tokenizer, doc_tokens: int, seed: int = 0, split: str = "eval"):
        from spanserve.corpus import paragraphs

        super().__init__(tokenizer, doc_tokens, seed)
        self.passages = pack(paragraphs(split), self.filler.count, doc_tokens - self.FACT_ROOM)
        self.rng.shuffle(self.passages)
        self.used = 0

    def document(self) -> dict:
        """{"text", "facts": {name: code}}: the next passage with the fact between two of its sentences."""
        passage = self.passages[self.used % len(self.passages)]
        self.used += 1
        name = self.person()
        code = self.code(avoid=" ".join(" ".join(p) for p in passage))
        paragraph = self.rng.randrange(len(passage))
        at = self.rng.randrange(len(passage[paragraph]) + 1)
        with_fact = [list(p) for p in passage]
        with_fact[paragraph].insert(at, FACT.format(name=name, code=code))
        return {"text": "\n".join(" ".join(p) for p in with_fact), "facts": {name: code}}


def pack(paragraphs: list[str], count, budget: int, min_fill: float = 0.75) -> list[list[list[str]]]:
    """Consecutive sentences packed into passages of at most `budget` tokens (by `count`, per
    sentence plus one for each join); a passage is a list of paragraphs, each a list of sentences.
    A sentence longer than the budget is dropped, and so is a passage under `min_fill` of it (one
    cut short by a long next sentence): the documents' lengths stay close together."""
    passages: list[list[list[str]]] = []
    current: list[list[str]] = [[]]
    used = 0

    def close() -> None:
        if used >= min_fill * budget:
            passages.append([p for p in current if p])

    for paragraph in paragraphs:
        if current[-1]:
            current.append([])
        for sentence in sentences(paragraph):
            tokens = count(sentence) + 1
            if tokens > budget:
                continue
            if used + tokens > budget:
                close()
                current, used = [[]], 0
            current[-1].append(sentence)
            used += tokens
    close()
    return passages
