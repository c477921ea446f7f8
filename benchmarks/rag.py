"""RAG time to first token: N retrieved documents + a question, with and without position-independent spans.

A chat: a system message, then a user message holding N documents (made-up encyclopedia entries from a
seeded generator, --doc-tokens each, all distinct) and a question about one of them. Time to first token
(greedy, max_tokens=1; the engine's own ttft, the wall time of the call is in the JSON too), per N:

  spans off, cold          documents as plain text, empty cache
  spans off, warm-shuffled the same documents were sent once in another order: a prefix cache reuses
                           only the chat template and system message (the realistic "spans off" case)
  spans cold               documents as Spans, empty cache: each document is computed on its own
  spans warm-shuffled      documents as Spans, cached by the earlier request in another order
  vLLM warm-shuffled       (--vllm-url) the plain-text chat, streamed from a real vLLM server after one
                           request in the original order; TTFT measured by the client

Spans are measured for each --link-policies entry (default, the default: the engine's own policy,
comb+focus48t where the model has a COMB plug-in; none: reuse the cached span KV as is; gapK: also
recompute the first K tokens of every span in context; blendR: CacheBlend, recompute a fraction R).
The table's title names the CPU.
Every repeat draws a new question and a new shuffle whose first document differs from the original's,
starts from an empty cache (a fresh cache_salt for vLLM), and runs every condition in turn, so load
from other processes hits them alike; each figure is the median of --repeats. Afterwards a 16-token
answer per condition is recorded, to check that the answers are sensible (not graded), with our
decode time per token after the first (span keys are repositioned in every decode step).

    python -m benchmarks.rag [--quick] [--vllm-url http://127.0.0.1:8011/v1]
    spanserve bench rag --quick
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness

SYSTEM = "You are a helpful assistant. Answer the question using the documents."
# Goals at the largest N (16 by default): (numerator, denominator, at least).
GOALS = [("spans_off_warm_shuffled", "spans_warm_shuffled", 30.0),
         ("vllm_warm_shuffled", "spans_warm_shuffled", 30.0),
         ("spans_off_cold", "spans_cold", 1.5)]

# ---- documents -------------------------------------------------------------------------------

_ONSETS = ["Vel", "Tar", "Mor", "Kel", "Ash", "Bri", "Cal", "Dun", "Eld", "Fen", "Gal", "Hal", "Ith", "Jor",
           "Kas", "Lun", "Mar", "Nor", "Ost", "Pel", "Quen", "Ros", "Sel", "Tor", "Ul", "Var", "Wen", "Yar", "Zel"]
_MIDDLES = ["a", "e", "i", "o", "an", "en", "or", "ir", "el", "u", "ar", ""]
_ENDINGS = ["ia", "wick", "mont", "dale", "holm", "stad", "ford", "heim", "grad", "via", "land", "mere", "ton",
            "burg", "sk", "ora"]
_FIRST = ["Anna", "Boris", "Clara", "Dmitri", "Elena", "Felix", "Greta", "Hugo", "Ingrid", "Jonas", "Karin", "Lukas",
          "Mira", "Nils", "Olga", "Pavel", "Rosa", "Stefan", "Tilda", "Viktor", "Wilma", "Yusuf", "Zora", "Emil"]
_WORDS = {
    "kind": ["province", "island", "mountain county", "river valley", "coastal region", "highland district"],
    "size": ["small", "large", "sparsely populated", "densely populated", "remote", "prosperous"],
    "dir": ["north", "south", "east", "west", "northeast", "southwest"],
    "product": ["woollen cloth", "blue cheese", "copper tools", "glass beads", "smoked fish", "apple brandy",
                "painted tiles", "silver jewellery", "salted butter", "oak barrels"],
    "profession": ["merchant", "priest", "soldier", "surveyor", "poet", "shipbuilder", "physician", "astronomer"],
    "industry": ["farming", "fishing", "mining", "tourism", "forestry", "textile weaving", "shipbuilding",
                 "salt production", "dairy farming", "trade"],
    "sea": ["Grey", "Amber", "Northern", "Silent", "Western", "Pale"],
    "season": ["spring", "summer", "autumn", "winter"],
    "festival": ["Lantern", "Harvest", "River", "Bread", "Lantern Boat", "First Snow", "Bell"],
    "activity": ["music and dancing in the main square", "a long procession of decorated boats",
                 "horse races along the beach", "a market that lasts three days", "bonfires on the hills"],
    "language": ["Old Tarvish", "Lowland Morric", "Eastern Selic", "Coastal Vennish", "High Dunic"],
    "disaster": ["great fire", "flood", "earthquake", "storm", "plague"],
    "style": ["a baroque", "a neoclassical", "a plain wooden", "an ornate brick", "a modern"],
    "building": ["National Museum", "Old Library", "Cathedral", "Town Hall", "Maritime Museum"],
    "collection": ["coins", "maps", "manuscripts", "paintings", "ship models", "clocks"],
    "era": ["early medieval", "late medieval", "colonial", "industrial", "classical"],
    "climate": ["mild and wet", "cold and dry", "temperate", "continental", "maritime"],
    "weather": ["warm", "cool", "short", "long", "rainy", "dry"],
    "transport": ["railway", "ferry", "tram", "canal", "highway"],
    "field": ["Engineering", "Medicine", "Agriculture", "Navigation", "Arts", "Mining"],
    "dish": ["barley soup", "fried herring", "lamb stew", "rye dumplings", "mushroom pie", "sweet cabbage rolls"],
    "side": ["dark bread", "pickled beets", "sour cream", "boiled potatoes", "lingonberry jam"],
    "animal": ["red deer", "grey seals", "wild horses", "white storks", "mountain goats", "beavers"],
}
# {E}: the entry's place; {C}: its capital (the fact a question asks for); the rest from _WORDS or numbers.
_TEMPLATES = [
    "{E} is a {size} {kind} in the {dir} of the Republic of {P1}, known for its {product}.",
    "It was first settled in {year} by {person}, a {profession} from {P2}.",
    "The population was about {num} at the census of {year2}.",
    "Its economy depends mainly on {industry} and {industry2}.",
    "The {P3} River flows through {E} before it reaches the {sea} Sea.",
    "Every {season}, the people of {E} celebrate the {festival} Festival with {activity}.",
    "The local dialect borrows many words from {language}.",
    "In {year3}, a {disaster} destroyed much of the old town, which was rebuilt in {style} style.",
    "The {building} in {C} houses a collection of {collection} from the {era} period.",
    "Notable people born in {E} include the {profession} {person2} and the {profession2} {person3}.",
    "The climate is {climate}, with {weather} summers and {weather2} winters.",
    "{E} is linked to {P2} by a {transport} line that opened in {year4}.",
    "The {E} Institute of {field} was founded in {year5}.",
    "Traditional dishes include {dish}, usually served with {side}.",
    "The forests of {E} are home to {animal} and {animal2}.",
    "Visitors often buy {product2} at the weekly market in {C}.",
    "A treaty signed in {year6} settled the border between {E} and {P3}.",
]
_FACT = "The capital of {E} is {C}."


class DocumentMaker:
    """Distinct made-up encyclopedia entries, ~`tokens` tokens each, from one seeded generator."""

    def __init__(self, tokenizer, tokens: int, seed: int = 0):
        self.tokenizer, self.tokens = tokenizer, tokens
        self.rng = random.Random(seed)
        self.used: set[str] = set()

    def name(self, unique: bool = True) -> str:
        """A made-up name; unique ones (what questions ask about) never repeat within this maker."""
        r = self.rng
        for _ in range(10_000):
            name = r.choice(_ONSETS) + r.choice(_MIDDLES) + r.choice(_ENDINGS)
            if not unique:
                return name
            if name not in self.used:
                self.used.add(name)
                return name
        raise RuntimeError(f"out of unique names after {len(self.used)}")

    def person(self, unique: bool = False) -> str:
        return f"{self.rng.choice(_FIRST)} {self.name(unique)}"

    def fill(self, template: str, slots: dict) -> str:
        r = self.rng
        values = dict(slots)
        for key in ("P1", "P2", "P3"):
            if key not in values:
                values[key] = self.name(unique=False)
        for key in ("person", "person2", "person3"):
            values[key] = self.person()
        for key in ("year", "year2", "year3", "year4", "year5", "year6"):
            values[key] = str(r.randrange(1100, 1990))
        values["num"] = f"{r.randrange(2, 900) * 1000 + r.randrange(1000):,}"
        for key, words in _WORDS.items():
            values[key], values[key + "2"] = r.sample(words, 2)
        return template.format(**values)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def document(self) -> dict:
        """{"text", "place", "capital", "question"}: the capital fact at a random place in the text."""
        place, capital = self.name(), self.name()
        slots = {"E": place, "C": capital, "P1": self.name(), "P2": self.name(), "P3": self.name()}
        rest = _TEMPLATES[1:]
        self.rng.shuffle(rest)
        fact, at = _FACT.format(E=place, C=capital), self.rng.randrange(1, 5)
        sentences = [self.fill(_TEMPLATES[0], slots)]  # opens with "{E} is a ..."
        title = f"{place}\n"
        for template in rest * 4:
            sentence = self.fill(template, slots)
            if self.count(title + " ".join([*sentences, sentence, fact])) > self.tokens:
                break
            sentences.append(sentence)
        sentences.insert(min(at, len(sentences)), fact)
        return {"text": title + " ".join(sentences), "place": place, "capital": capital,
                "question": f"What is the capital of {place}?"}

    def documents(self, n: int) -> list[dict]:
        return [self.document() for _ in range(n)]


def shuffled(rng: random.Random, n: int) -> list[int]:
    """A permutation of range(n) whose first element is not 0 (n >= 2): no document-level prefix hit."""
    order = list(range(n))
    while n > 1 and order[0] == 0:
        rng.shuffle(order)
    return order


# ---- prompts and measurement -----------------------------------------------------------------


def messages(docs: list[dict], order: list[int], question: str, spans: bool) -> list[dict]:
    from spanserve import Span

    texts = [docs[i]["text"] for i in order]
    if spans:
        content = [Span(t + "\n\n") for t in texts] + [f"Question: {question}"]
    else:
        content = "".join(t + "\n\n" for t in texts) + f"Question: {question}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]


def ask_engine(llm, msgs: list[dict], params) -> dict:
    start = time.perf_counter()
    out = llm.chat(msgs, params)[0]
    wall = time.perf_counter() - start
    m, generated = out.metrics, len(out.outputs[0].token_ids)
    decode = (m.finish_time - m.first_token_time) / (generated - 1) if generated > 1 else None
    return {"ttft_s": m.ttft_s, "wall_s": wall, "prompt_tokens": len(out.prompt_token_ids),
            "cached_tokens": out.num_cached_tokens, "text": out.outputs[0].text, "decode_s_per_token": decode}


class VLLMClient:
    """A streamed chat completion against an OpenAI-compatible server; TTFT = first content chunk."""

    def __init__(self, url: str, settle_s: float = 2.0, timeout: float = 600.0):
        import httpx

        # vLLM's CPU worker stays busy for about a second after answering: wait that out, or it runs
        # on the cores of whatever is measured next.
        self.settle_s = settle_s
        self.httpx = httpx
        self.client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout)
        models = self.client.get("/models")
        models.raise_for_status()
        self.model = models.json()["data"][0]["id"]
        self.version = self._version(url)

    def _version(self, url: str) -> str | None:
        try:
            r = self.client.get(url.rstrip("/").removesuffix("/v1") + "/version")
            return r.json().get("version") if r.status_code == 200 else None
        except (self.httpx.HTTPError, ValueError):
            return None

    def ask(self, msgs: list[dict], salt: str, max_tokens: int = 1) -> dict:
        body = {"model": self.model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
        rec = {"ttft_s": None, "wall_s": None, "prompt_tokens": None, "cached_tokens": None, "text": ""}
        start = time.perf_counter()
        with self.client.stream("POST", "/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RuntimeError(f"vLLM answered HTTP {resp.status_code}: {resp.text[:300]}")
            for line in resp.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        rec["ttft_s"] = rec["ttft_s"] or time.perf_counter() - start
                        rec["text"] += text
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    rec["prompt_tokens"] = usage.get("prompt_tokens")
                    rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        rec["wall_s"] = time.perf_counter() - start
        time.sleep(self.settle_s)
        if rec["ttft_s"] is None:  # a first token that is empty text (e.g. a lone space piece): count the end
            rec["ttft_s"] = rec["wall_s"]
        return rec


def parse_policy(policy: str) -> dict:
    """SamplingParams fields of a policy name: default (none: the engine's default), none, full, gapK
    (K tokens) or blend / blendR (a fraction), or any other policy; a suffix +focusK (none, comb)
    recomputes the K spans the question reads most, +focusKt the blocks it reads most, K tokens at
    most."""
    from spanserve.errors import InvalidRequestError

    if policy == "default":
        return {}
    if "+focus" in policy:
        policy, _, k = policy.partition("+focus")
        tokens = k.endswith("t")
        if not k.removesuffix("t").isdigit():
            raise InvalidRequestError(f"bad focus suffix in {policy!r}+focus{k}: use +focusK (K spans) "
                                      "or +focusKt (K tokens), K an integer")
        return {**parse_policy(policy), "focus_tokens" if tokens else "focus_spans": int(k.removesuffix("t"))}
    try:
        if policy.startswith("gap"):
            return {"link_policy": "gap", "gap_length": int(policy[3:] or 32)}
        if policy.startswith("blend"):
            return {"link_policy": "blend", **({"blend_ratio": float(policy[5:])} if policy[5:] else {})}
    except ValueError:
        raise InvalidRequestError(f"bad link policy {policy!r}: use none, full, gapK or blendR") from None
    return {"link_policy": policy}


def policy_params(policy: str, max_tokens: int):
    """Greedy SamplingParams for a --link-policies entry (see parse_policy)."""
    from spanserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, **parse_policy(policy))


def measure_n(llm, vllm, docs: list[dict], args, rng: random.Random) -> dict:
    """Every condition for one document count: {condition: [run records]}, plus answers."""
    from spanserve import SamplingParams

    pool = llm.engine.kv.pool
    plain = SamplingParams(temperature=0, max_tokens=1)
    runs: dict[str, list] = {"spans_off_cold": [], "spans_off_warm_shuffled": []}
    for policy in args.policies:
        runs[f"spans_cold[{policy}]"], runs[f"spans_warm_shuffled[{policy}]"] = [], []
    if vllm:
        runs["vllm_cold"], runs["vllm_warm_shuffled"] = [], []
    original = list(range(len(docs)))
    for r in range(args.repeats):
        question = docs[rng.randrange(len(docs))]["question"]
        order = shuffled(rng, len(docs))
        pool.reset_cache()
        runs["spans_off_cold"].append(ask_engine(llm, messages(docs, original, question, False), plain))
        runs["spans_off_warm_shuffled"].append(ask_engine(llm, messages(docs, order, question, False), plain))
        for policy in args.policies:
            params = policy_params(policy, 1)
            pool.reset_cache()
            runs[f"spans_cold[{policy}]"].append(ask_engine(llm, messages(docs, original, question, True), params))
            runs[f"spans_warm_shuffled[{policy}]"].append(
                ask_engine(llm, messages(docs, order, question, True), params))
        if vllm:
            salt = f"rag-{os.getpid()}-{time.time_ns()}-{r}"  # a cache namespace of its own: cold, then warm
            runs["vllm_cold"].append(vllm.ask(messages(docs, original, question, False), salt))
            runs["vllm_warm_shuffled"].append(vllm.ask(messages(docs, order, question, False), salt))
        for name, rs in runs.items():
            rs[-1].update(repeat=r, question=question, order=order if "shuffled" in name else original)
    answers = check_answers(llm, vllm, docs, order, question, args.policies, args.answer_tokens)
    return {"runs": runs, "answers": answers}


def _per_token(answer: dict) -> str:
    decode = answer.get("decode_s_per_token")
    return f" ({decode * 1000:.0f} ms/token)" if decode else ""


def check_answers(llm, vllm, docs, order, question, policies, max_tokens: int) -> dict:
    """A short greedy answer to the last repeat's question, per condition (untimed)."""
    from spanserve import SamplingParams

    capital = next(d["capital"] for d in docs if d["question"] == question)
    answers = {"question": question, "expected": capital}
    outs = {"spans_off": ask_engine(llm, messages(docs, order, question, False),
                                    SamplingParams(temperature=0, max_tokens=max_tokens))}
    for policy in policies:
        outs[f"spans[{policy}]"] = ask_engine(llm, messages(docs, order, question, True),
                                              policy_params(policy, max_tokens))
    if vllm:
        outs["vllm"] = vllm.ask(messages(docs, order, question, False), f"rag-answer-{time.time_ns()}", max_tokens)
    for name, rec in outs.items():
        answers[name] = {"text": rec["text"], "contains_expected": capital.lower() in rec["text"].lower(),
                         "decode_s_per_token": rec.get("decode_s_per_token")}
    return answers


def git_state() -> dict:
    """The commit measured, and the files that differed from it (the engine may be changing under us)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    import spanserve

    # porcelain lines are "XY path": not stripped, or the first line's X (a space) goes
    return {"spanserve_path": str(Path(spanserve.__file__).parent), "commit": git("rev-parse", "HEAD").strip() or None,
            "modified": [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()]}


def median(records: list[dict], key: str = "ttft_s") -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


# ---- CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--docs", default="1,2,4,8,16", help="document counts N, comma-separated")
    parser.add_argument("--doc-tokens", type=int, default=256, help="tokens per document (at most)")
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs per figure")
    parser.add_argument("--link-policies", default="none,default",
                        help="span link policies to time: default (the engine's: comb+focus48t where the model has "
                        "a COMB plug-in), none, gapK (recompute the first K tokens of each span), blendR "
                        "(CacheBlend, recompute the fraction R of span tokens), comb, ...")
    parser.add_argument("--vllm-url", default=None, help="also time a vLLM server, e.g. http://127.0.0.1:8011/v1")
    parser.add_argument("--vllm-settle", type=float, default=2.0,
                        help="seconds to wait after each vLLM request (its CPU worker keeps running ~1 s)")
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="engine dtype (auto: bf16 on CPUs with native bf16)")
    parser.add_argument("--max-batched-tokens", type=int, default=None, help="engine chunked-prefill budget")
    parser.add_argument("--answer-tokens", type=int, default=16, help="tokens of the untimed answer check")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="smoke run: N=1,2, 64-token documents, 1 repeat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/rag.json)")
    parser.add_argument("--no-chart", action="store_true")


def run(args: argparse.Namespace) -> dict:
    loadavg_before = list(os.getloadavg())
    threads = harness.configure_threads(args.threads)
    git = git_state()  # at the start: the engine is imported now, edits during the run do not count
    from spanserve import LLM
    from spanserve.models.loader import DEFAULT_MODEL

    if args.quick:
        args.docs, args.doc_tokens, args.repeats = "1,2", 64, 1
    counts = [int(x) for x in str(args.docs).split(",")]
    args.policies = [p.strip() for p in args.link_policies.split(",") if p.strip()]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.perf_counter()
    model_name = Path(args.model).name if args.model else DEFAULT_MODEL
    engine_kwargs = {"dtype": args.dtype}
    if args.max_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_batched_tokens
    llm = LLM(model=args.model, **engine_kwargs)
    vllm = VLLMClient(args.vllm_url, args.vllm_settle) if args.vllm_url else None
    maker = DocumentMaker(llm.get_tokenizer(), args.doc_tokens, args.seed)
    rng = random.Random(args.seed + 1)
    warm_up(llm, maker, vllm)

    per_n = {}
    for n in counts:
        log(f"N={n}: measuring (load average {os.getloadavg()[0]:.2f})")
        docs = maker.documents(n)
        per_n[n] = {"load_before": list(os.getloadavg()), "doc_tokens": [maker.count(d["text"]) for d in docs],
                    **measure_n(llm, vllm, docs, args, rng)}
        per_n[n]["summary"] = summarize(per_n[n]["runs"], args.policies, bool(vllm))
        s = per_n[n]["summary"]
        log(f"  spans off warm-shuffled {s['spans_off_warm_shuffled'] * 1000:.0f} ms, spans warm-shuffled "
            + ", ".join(f"{p} {s[f'spans_warm_shuffled[{p}]'] * 1000:.0f} ms" for p in args.policies))

    rows, headers = table(per_n, args.policies, bool(vllm))
    title = (f"RAG time to first token, ms ({model_name}, {llm.engine.dtype}, {threads} threads on "
             f"{harness.machine_info().get('cpu_model', 'an unknown CPU')}, "
             f"{args.doc_tokens}-token documents, median of {args.repeats}{', quick' if args.quick else ''})")
    harness.print_table(headers, rows, title=title)
    print("off: spans off (plain text, prefix caching); shuf: warm, the same documents cached in another order; "
          "spans[P]: documents as spans, link policy P")
    goals = check_goals(per_n, args.policies, bool(vllm))
    if goals:
        print(f"\ngoals at N={max(counts)}:")
        for key, g in goals.items():
            ratio = "-" if g["ratio"] is None else f"{g['ratio']:.1f}x"
            print(f"  {key}: {ratio} (need >= {g['need']:g}x) -> {'met' if g['met'] else 'NOT met'}")
    print("\nanswers (last question at each N, 16 tokens greedy; our decode ms per token after the first):")
    for n, r in per_n.items():
        a = r["answers"]
        print(f"  N={n} {a['question']} expected {a['expected']}: "
              + "; ".join(f"{k} {v['text']!r}{_per_token(v)}" for k, v in a.items() if isinstance(v, dict)))

    data = {
        "benchmark": "rag",
        "model": model_name,
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "quick": args.quick,
        "args": {k: v for k, v in vars(args).items()},
        "vllm": {"url": args.vllm_url, "model": vllm.model, "version": vllm.version} if vllm else None,
        "machine": harness.machine_info(),
        "git": git,
        "loadavg_before": loadavg_before,
        "loadavg_after": list(os.getloadavg()),
        "elapsed_s": time.perf_counter() - started,
        "metric": "median time to first token in seconds (engine metric; wall_s in runs is the whole call)",
        "summary": {n: r["summary"] for n, r in per_n.items()},
        "goals": goals,
        "results": {n: {k: v for k, v in r.items() if k != "summary"} for n, r in per_n.items()},
    }
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    out = harness.write_json(data, name="rag", path=args.out)
    if not args.no_chart:
        chart(per_n, args.policies, bool(vllm), out.with_suffix(".png"), model_name, args.doc_tokens)
    return data


def warm_up(llm, maker: DocumentMaker, vllm) -> None:
    """First calls allocate and pick kernels; keep that out of the first measurement (not of the cache:
    every measurement resets it)."""
    from spanserve import SamplingParams

    docs = DocumentMaker(llm.get_tokenizer(), maker.tokens, seed=12345).documents(2)
    for spans in (False, True):
        llm.chat(messages(docs, [0, 1], docs[0]["question"], spans), SamplingParams(temperature=0, max_tokens=2))
    if vllm:
        vllm.ask(messages(docs, [0, 1], docs[0]["question"], False), f"rag-warmup-{time.time_ns()}", 2)
    llm.engine.kv.pool.reset_cache()


def summarize(runs: dict, policies: list[str], with_vllm: bool) -> dict:
    s = {name: median(rs) for name, rs in runs.items()}
    s.update({f"{name}_wall": median(rs, "wall_s") for name, rs in runs.items()})
    s["prompt_tokens"] = runs["spans_off_cold"][0]["prompt_tokens"]
    s["span_prompt_tokens"] = runs[f"spans_cold[{policies[0]}]"][0]["prompt_tokens"] if policies else None
    for p in policies:
        s[f"off_warm/spans_warm[{p}]"] = _ratio(s["spans_off_warm_shuffled"], s[f"spans_warm_shuffled[{p}]"])
        s[f"off_cold/spans_cold[{p}]"] = _ratio(s["spans_off_cold"], s[f"spans_cold[{p}]"])
        if with_vllm:
            s[f"vllm_warm/spans_warm[{p}]"] = _ratio(s["vllm_warm_shuffled"], s[f"spans_warm_shuffled[{p}]"])
    return s


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def table(per_n: dict, policies: list[str], with_vllm: bool) -> tuple[list, list[str]]:
    """Columns: TTFT in ms per condition ("shuf": warm, documents reordered), then the ratios."""
    headers = ["N", "prompt tok", "off cold", "off shuf"]
    for p in policies:
        headers += [f"spans cold[{p}]", f"spans shuf[{p}]"]
    if with_vllm:
        headers += ["vLLM cold", "vLLM shuf"]
    for p in policies:
        headers += [f"off shuf/spans[{p}]"] + ([f"vLLM/spans[{p}]"] if with_vllm else [])
        headers += [f"off cold/spans cold[{p}]"]
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    x = lambda v: None if v is None else f"{v:.1f}x"  # noqa: E731
    rows = []
    for n, r in per_n.items():
        s = r["summary"]
        row = [n, s["prompt_tokens"], ms(s["spans_off_cold"]), ms(s["spans_off_warm_shuffled"])]
        for p in policies:
            row += [ms(s[f"spans_cold[{p}]"]), ms(s[f"spans_warm_shuffled[{p}]"])]
        if with_vllm:
            row += [ms(s["vllm_cold"]), ms(s["vllm_warm_shuffled"])]
        for p in policies:
            row += [x(s[f"off_warm/spans_warm[{p}]"])] + ([x(s[f"vllm_warm/spans_warm[{p}]"])] if with_vllm else [])
            row += [x(s[f"off_cold/spans_cold[{p}]"])]
        rows.append(row)
    return rows, headers


def check_goals(per_n: dict, policies: list[str], with_vllm: bool) -> dict:
    if not per_n:
        return {}
    n = max(per_n)
    s = per_n[n]["summary"]
    goals = {}
    for p in policies:
        for num, den, need in GOALS:
            if num.startswith("vllm") and not with_vllm:
                continue
            ratio = _ratio(s[num], s[f"{den}[{p}]"])
            goals[f"N={n} {num} / {den}[{p}]"] = {"ratio": ratio, "need": need,
                                                  "met": ratio is not None and ratio >= need}
    return goals


def chart(per_n: dict, policies: list[str], with_vllm: bool, path: Path, model: str, doc_tokens: int) -> None:
    plt = harness.pyplot()
    if plt is None:
        return
    ns = list(per_n)
    series = {"spans off, cold": "spans_off_cold", "spans off, warm shuffled": "spans_off_warm_shuffled"}
    for p in policies:
        series[f"spans {p}, cold"] = f"spans_cold[{p}]"
        series[f"spans {p}, warm shuffled"] = f"spans_warm_shuffled[{p}]"
    if with_vllm:
        series["vLLM, warm shuffled"] = "vllm_warm_shuffled"
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label, key in series.items():
        values = [per_n[n]["summary"][key] for n in ns]
        style = "--" if "cold" in label else "-"
        ax.plot(ns, [v * 1000 if v else float("nan") for v in values], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_yscale("log")
    ax.set_xlabel(f"documents ({doc_tokens} tokens each)")
    ax.set_ylabel("time to first token, ms (log)")
    ax.set_title(f"RAG TTFT, {model}: documents reordered between requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    harness.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("rag", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
