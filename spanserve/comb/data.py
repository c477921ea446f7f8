"""Training prompts for the COMB encoder: documents as spans, a question over them.

Documents are real prose (spanserve/corpus.py, split "train" only: the benchmark's real-text task
reads "eval") of 60 to 230 tokens. Two kinds of questions, both answered by the model itself with
the documents in full context (self-distillation: the targets are on-policy, see train.py):
- fact lookup: made-up facts in every document, one to `max_facts` each about different people
  (locker numbers, birth years, code names, cities, meeting days: never the access codes the
  benchmark asks for), the question asks for one; several per document teach the encoder to keep
  many name-value bindings in one span apart;
- reading: summarise, quote or compare documents: open answers that need the documents' text.
Nothing here is ever the benchmark's prompt: other facts, other names, other text.
"""

import random
from dataclasses import dataclass

from spanserve.corpus import paragraphs
from spanserve.pic.prompt import Span

FIRST = ["Amara", "Bastian", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kalani",
         "Lucia", "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Soren", "Tamsin", "Ulla", "Viktor",
         "Wanjiru", "Xavier", "Yara", "Zoltan", "Aiko", "Bram", "Cosima", "Dario", "Emeka", "Freya"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Haddad", "Kowalczyk", "Tanaka", "Brennan", "Ferreira", "Novak",
        "Castellanos", "Ivanova", "Mbeki", "Sorensen", "Yilmaz", "Achterberg", "Delacroix", "Nakamura",
        "Petrov", "Quispe", "Rasmussen", "Szabo", "Varga", "Whitfield", "Zamora"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Tallinn", "Cordoba", "Winnipeg", "Perth", "Bergen", "Valparaiso",
          "Tbilisi", "Hanoi", "Quebec", "Marrakesh", "Dunedin", "Krakow", "Bilbao"]
WORDS = ["Falcon", "Juniper", "Basalt", "Meridian", "Quasar", "Tundra", "Lantern", "Saffron", "Obsidian",
         "Harbor", "Cobalt", "Willow", "Zephyr", "Granite", "Ember", "Nimbus"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SIMILAR_NAMES_HELP = ("fact lookups: draw a prompt's people from this many first names, so other documents "
                      "hold facts about namesakes of the person asked (0: from all of them)")

# (fact sentence, question, start of the answer) with {name} and {value}
FACTS = [
    (lambda r: str(r.randrange(100, 9999)), "{name}'s locker number is {value}.",
     "What is the locker number of {name}?", "The locker number of {name} is "),
    (lambda r: str(r.randrange(1901, 2015)), "{name} was born in {value}.",
     "In which year was {name} born?", "{name} was born in "),
    (lambda r: r.choice(WORDS), "The project led by {name} is code-named {value}.",
     "What is the code name of the project led by {name}?", "The code name is "),
    (lambda r: r.choice(CITIES), "Last spring {name} moved to {value}.",
     "To which city did {name} move?", "{name} moved to "),
    (lambda r: r.choice(DAYS), "The weekly meeting with {name} takes place on {value}.",
     "On which day is the weekly meeting with {name}?", "The meeting is on "),
]
READING = ["Summarize document {k} in one sentence.", "What is the main subject of document {k}?",
           "Quote the first sentence of document {k}.", "Which document talks about {topic}? Answer with its number.",
           "List three topics mentioned in the documents.", "What does document {k} say about {topic}?"]
SYSTEMS = ["You are a helpful assistant.", "Answer the question using the documents.",
           "You answer questions about the documents. Be brief.", "Answer with the value only."]


@dataclass
class Example:
    messages: list  # chat messages; the user's content holds Span parts
    answer_prefix: str  # placed after the generation prompt (may be empty)


@dataclass
class Lookup:
    """A fact lookup and where its answer is: the focus probe's calibration (comb/calibrate.py)
    checks which heads' attention finds the answer's tokens."""
    example: Example
    doc: int  # the document holding the fact
    sentence: str  # the fact as it stands in that document
    value: str  # the answer, at the sentence's end


class ExampleMaker:
    def __init__(self, tokenizer, seed: int = 0, min_docs: int = 2, max_docs: int = 8, max_facts: int = 1,
                 fact_share: float = 0.7, similar_names: int = 0):
        self.rng = random.Random(seed)
        self.tokenizer, self.min_docs, self.max_docs = tokenizer, min_docs, max_docs
        self.max_facts, self.fact_share = max_facts, fact_share  # facts per document; share of fact lookups
        # > 0: a prompt's people share this few first names, so most documents hold a fact about a
        # namesake of the one asked (the distractors real retrieval has: Felix Kasheim, Felix Yarirvia)
        self.similar_names = similar_names
        self.paragraphs = paragraphs("train")

    def document(self, tokens: int) -> str:
        """Consecutive paragraphs from a random place, cut at a sentence end near `tokens`."""
        at = self.rng.randrange(len(self.paragraphs))
        text = ""
        while len(self.tokenizer.encode(text)) < tokens and at < len(self.paragraphs):
            text = (text + " " + self.paragraphs[at]).strip()
            at += 1
        sentences = text.split(". ")
        while len(sentences) > 1 and len(self.tokenizer.encode(". ".join(sentences))) > tokens:
            sentences.pop()
        return ". ".join(sentences).rstrip(".") + "."

    def person(self, taken: set, first: list[str] = FIRST) -> str:
        while (name := f"{self.rng.choice(first)} {self.rng.choice(LAST)}") in taken:
            pass
        taken.add(name)
        return name

    def examples(self, questions: int = 1) -> list[Example]:
        """`questions` questions over one set of documents (the same documents, in the same order,
        in every example): training encodes the documents once for all of them."""
        rng = self.rng
        docs = [self.document(rng.randrange(60, 231)) for _ in range(rng.randint(self.min_docs, self.max_docs))]
        system = rng.choice(SYSTEMS)
        if rng.random() < self.fact_share:
            asked = self._fact_questions(docs, questions)
        else:
            asked = [self._reading_question(docs) for _ in range(questions)]
            docs = [f"Document {i + 1}: {d}" for i, d in enumerate(docs)]
        return [Example([{"role": "system", "content": system},
                         {"role": "user", "content": [Span(d + "\n\n") for d in docs] + [question]}], prefix)
                for question, prefix in asked]

    def _reading_question(self, docs: list[str]) -> tuple[str, str]:
        k = self.rng.randrange(len(docs))
        topic = self.rng.choice(docs[k].split()[:12]).strip(",.;:").lower()
        return self.rng.choice(READING).format(k=k + 1, topic=topic), ""

    def _fact_questions(self, docs: list[str], questions: int) -> list[tuple[str, str]]:
        return [(question, prefix) for question, prefix, _ in self._facts_asked(docs, questions)]

    def lookup(self, n_docs: int) -> Lookup:
        """One fact lookup over `n_docs` documents, one fact each, with where its answer is."""
        docs = [self.document(self.rng.randrange(60, 231)) for _ in range(n_docs)]
        system = self.rng.choice(SYSTEMS)
        (question, prefix, fact), = self._facts_asked(docs, 1)
        return Lookup(Example([{"role": "system", "content": system},
                               {"role": "user", "content": [Span(d + "\n\n") for d in docs] + [question]}], prefix),
                      *fact)

    def _facts_asked(self, docs: list[str], questions: int) -> list[tuple[str, str, tuple[int, str, str]]]:
        """Insert facts of one kind into every document (in place), 1 to max_facts each, about
        different people; ask for some of them (each once, while there are facts left to ask about):
        (question, answer prefix, (the fact's document, its sentence, its value))."""
        rng, taken, facts = self.rng, set(), {}
        value, sentence, question, prefix = rng.choice(FACTS)
        first = self._first_names(len(docs) * self.max_facts) if self.similar_names else FIRST  # (0: same draws)
        for i, doc in enumerate(docs):
            parts = doc.split(". ")
            for _ in range(rng.randint(1, self.max_facts) if self.max_facts > 1 else 1):  # (1: as before, same draws)
                name = self.person(taken, first)
                v = value(rng)
                fact = sentence.format(name=name, value=v).rstrip(".")
                facts[name] = (i, fact, v)
                parts.insert(rng.randrange(len(parts) + 1), fact)
            docs[i] = ". ".join(parts).replace("..", ".")
        names = list(facts)
        names = rng.sample(names, min(questions, len(names))) + rng.choices(names, k=max(0, questions - len(names)))
        return [(question.format(name=name), prefix.format(name=name) if rng.random() < 0.5 else "", facts[name])
                for name in names]

    def _first_names(self, people: int) -> list[str]:
        """`similar_names` first names, more if `people` would not fit (half the last names each)."""
        return self.rng.sample(FIRST, min(len(FIRST), max(self.similar_names, -(-people // (len(LAST) // 2)))))
