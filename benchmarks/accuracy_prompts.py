"""The questions of the accuracy benchmark and how each condition sends them (benchmarks/accuracy.py).

A question set is N documents and a target fact in one of them; the prompt is the chat with the documents
as spans (each padded to whole KV blocks), its plain-text twin, and the start of the answer. A condition
is a way to send that prompt: spans off, the plain text, a link policy, or a diagnostic keeping some spans.
"""

from benchmarks.rag import parse_policy, policy_params

CONDITIONS = ("spans_off", "none", "gap16", "gap32", "blend0.15", "full", "text")
NOT_POLICIES = ("spans_off", "text")  # conditions that send no link policy
DEPTHS = ("first", "middle", "last")  # where the answer's document sits among the N

# Prompt styles tried on SmolLM2-135M with spans off (--styles all --questions 6 --max-tokens 24: 36 questions,
# N=4,8; chance is 1/(3N), 4-8%): bare 31%, question 39%, fewshot 36%, prefix 33%, fewshot_prefix 33%, all
# within noise of each other. Each is (system message, question, start of the assistant's answer placed after
# the chat template's generation prompt). "prefix" is the default: 8 tokens hold any answer, and the first
# generated token is the answer's first digit, so first-token agreement measures the answer itself.
STYLES = {
    "bare": ("Answer with the number only.", "What is the access code of {name}?", ""),
    "question": ("You answer questions about the documents. Answer with the number only.",
                 "Question: What is the access code of {name}?\nAnswer with the number only.", ""),
    "fewshot": ("You answer questions about the documents with the number only.\n"
                "Example: for \"The access code of Jane Doe is 40712.\", the access code of Jane Doe is 40712.",
                "What is the access code of {name}?", ""),
    "prefix": ("Answer with the number only.", "What is the access code of {name}?",
               "The access code of {name} is "),  # the trailing space is a token: the answer starts with a digit
}
STYLES["fewshot_prefix"] = (STYLES["fewshot"][0], STYLES["prefix"][1], STYLES["prefix"][2])
DEFAULT_STYLE = "prefix"


def make_questions(maker, n_docs: int, count: int) -> list[dict]:
    """`count` question sets for N documents: the documents, a target (name, code) in one of them."""
    out = []
    for _ in range(count):
        docs = [maker.document() for _ in range(n_docs)]
        target = maker.rng.randrange(n_docs)
        name = maker.rng.choice(list(docs[target]["facts"]))
        out.append({"docs": docs, "target": target, "name": name, "answer": docs[target]["facts"][name]})
    return out


def order_for(q: dict, depth: str) -> list[int]:
    """Document order putting the target first, in the middle or last; the others keep their order."""
    n = len(q["docs"])
    others = [i for i in range(n) if i != q["target"]]
    at = {"first": 0, "middle": n // 2, "last": n - 1}[depth]
    return others[:at] + [q["target"]] + others[at:]


def build_prompts(llm, q: dict, order: list[int], style: str) -> dict:
    """Token prompt with spans, and the plain-text version, of one question at one depth."""
    from spanserve import Span

    system, question, prefix = STYLES[style]
    name = q["name"]
    texts = [q["docs"][i]["text"] + "\n\n" for i in order]
    ask = question.format(name=name)
    span_msgs = [{"role": "system", "content": system},
                 {"role": "user", "content": [Span(t) for t in texts] + [ask]}]
    text_msgs = [{"role": "system", "content": system}, {"role": "user", "content": "".join(texts) + ask}]
    tok = llm.get_tokenizer()
    tail = tok.encode(prefix.format(name=name), add_special_tokens=False) if prefix else []
    spanned = llm.engine.chat_prompt(span_msgs)
    ids, spans = spanned["prompt_token_ids"] + tail, [list(s) for s in spanned["spans"]]
    holder = next(i for i in order if name in q["docs"][i]["facts"])  # (a timed prompt asks another document)
    start, end = spans[order.index(holder)]
    doc = q["docs"][holder]
    return {"ids": ids, "spans": spans, "text_ids": llm.apply_chat_template(text_msgs) + tail,
            "answer_tokens": answer_tokens(tok, ids[start:end], doc["text"], name, doc["facts"][name], start)}


def answer_tokens(tok, span_ids: list[int], text: str, name: str, code: str, start: int) -> list[int]:
    """Prompt indices of the tokens that spell `name`'s code in its document's span (which begins
    with the document's text): the tokens a link policy must recompute in context to hold the
    answer's KV as spans off computes it."""
    first = text.index(f"{name} is {code}") + len(name) + 4
    last = first + len(code)
    decoded = [len(tok.decode(span_ids[:k])) for k in range(1, len(span_ids) + 1)]  # text length after k tokens
    lo = next(k for k, n in enumerate(decoded) if n > first)  # the token holding the code's first character
    hi = next(k for k, n in enumerate(decoded) if n >= last)
    return list(range(start + lo, start + hi + 1))


DIAGNOSTICS = {"first_in_context": slice(1, None), "first_span_only": slice(0, 1)}  # which spans stay


def condition_prompt(prompt: dict, condition: str) -> dict:
    if condition == "text":
        return {"prompt_token_ids": prompt["text_ids"]}
    if condition == "spans_off":
        return {"prompt_token_ids": prompt["ids"]}
    return {"prompt_token_ids": prompt["ids"], "spans": prompt["spans"][DIAGNOSTICS.get(condition, slice(None))]}


def condition_params(condition: str, max_tokens: int):
    from spanserve import SamplingParams

    if condition in NOT_POLICIES:
        return SamplingParams(temperature=0, max_tokens=max_tokens)
    return policy_params("none" if condition in DIAGNOSTICS else condition, max_tokens)


def choose_conditions(llm, requested: str | None, log, policies: tuple[str, ...] | None = None
                      ) -> tuple[list[str], dict]:
    """The conditions to run, and {name: why} for the default extras the engine cannot serve. By default:
    CONDITIONS and every other of `policies` (the engine's link policies). An asked-for condition the
    engine refuses stops the run before any is measured."""
    from spanserve.errors import SpanserveError
    from spanserve.pic.link import POLICIES

    if requested:
        wanted, optional = [c.strip() for c in requested.split(",") if c.strip()], set()
    else:
        covered = {parse_policy(c)["link_policy"] for c in CONDITIONS if c not in NOT_POLICIES}
        optional = {p for p in (policies or POLICIES) if p not in covered}
        wanted = [*CONDITIONS, *sorted(optional)]
    chosen, skipped = [], {}
    for condition in wanted:
        try:
            probe(llm, condition)
            chosen.append(condition)
        except SpanserveError as exc:
            if condition not in optional:
                raise
            skipped[condition] = str(exc)
            log(f"skipping link policy {condition!r}: {exc}")
    llm.engine.kv.pool.reset_cache()
    return chosen, skipped


def probe(llm, condition: str) -> None:
    """One token of a one-span prompt under `condition`: raises what the engine would raise mid-run."""
    from spanserve import Span

    params = condition_params(condition, 1)
    if condition not in NOT_POLICIES:
        llm.generate(["Answer from the document.\n", Span("A short document.\n"), "What is it?"], params)
