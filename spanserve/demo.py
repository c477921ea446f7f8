"""`spanserve demo` (`make demo`): each capability in a few lines, each answer checked.

Every step takes the one LLM, runs greedily, and returns a StepResult: whether its answer is right
and the lines it prints. tests/test_demo.py runs the same steps.
"""

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spanserve.llm import LLM
from spanserve.pic.prompt import Span
from spanserve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@dataclass
class StepResult:
    ok: bool
    lines: list[str] = field(default_factory=list)


# ---- 1. position-independent spans ---------------------------------------------------------

DOCS = [
    "Harbor notes. The harbor of Port Elsin has fourteen piers. Its harbor master is Tomas Reyk.",
    "Mill notes. The old mill on the Vesk river grinds rye. The miller is Anna Brell.",
    "Bridge notes. The stone bridge at Dunmar has nine arches. It was built by Owen Tarr.",
    "Lighthouse notes. The lighthouse at Cape Ilsa has a red lamp. Its keeper is Mira Solberg.",
]
SPANS_SYSTEM = "Answer from the documents, briefly."
SPANS_WARMUP = "Who is the miller?"
SPANS_QUESTION = "Who is the keeper of the lighthouse?"
SPANS_EXPECTED = "Mira Solberg"


def _spans_chat(llm: LLM, order: list[int], question: str, params: SamplingParams):
    content = [*(Span(DOCS[i]) for i in order), question]
    return llm.chat([{"role": "system", "content": SPANS_SYSTEM}, {"role": "user", "content": content}], params)[0]


def step_spans(llm: LLM) -> StepResult:
    """Four documents as spans; a second request reuses them in another order, behind another
    question, and answers as the same prompt computed whole (spans off)."""
    params = GREEDY
    _spans_chat(llm, [0, 1, 2, 3], SPANS_WARMUP, params)
    order = [3, 1, 0, 2]
    warm = _spans_chat(llm, order, SPANS_QUESTION, params)
    # spans off: the same prompt computed whole, as if it held no spans (the accuracy reference)
    off = _spans_chat(llm, order, SPANS_QUESTION, dataclasses.replace(params, link_policy="full"))
    answer, reference = warm.outputs[0].text.strip(), off.outputs[0].text.strip()
    ok = SPANS_EXPECTED in answer and answer == reference
    link = llm.engine.link_policy(params)
    policy = link.name + (f" with a {link.focus_tokens}-token focus" if link.focus_tokens else "")
    return StepResult(ok, [
        f"4 documents as spans, reused in a new order: {warm.num_cached_tokens} of "
        f"{len(warm.prompt_token_ids)} prompt tokens cached (link policy {policy})",
        f"> {SPANS_QUESTION}",
        f"spans: {answer!r}  spans off (link_policy='full': computed whole): {reference!r}",
    ])


# ---- 2. a span-query judge -----------------------------------------------------------------

PEOPLE = [("Anna Brell", "the miller"), ("Mira Solberg", "the keeper of the lighthouse"),
          ("Owen Tarr", "the bridge builder")]
JUDGE_QUESTION = "Who is the keeper of the lighthouse?"
JUDGE_EXPECTED = "Mira Solberg"
VERDICT = {"type": "object", "required": ["name"],
           "properties": {"name": {"type": "string", "enum": [name for name, _ in PEOPLE]}}}


def step_judge(llm: LLM) -> StepResult:
    """Three generated candidates, read as spans by a judge whose verdict is held to a JSON schema."""
    from spanserve.spans.ir import cross, g, plus, system, user

    candidates = [g(user(f"Write one sentence about {name}, {role}."), max_tokens=16) for name, role in PEOPLE]
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    judge = g(cross(system("You read the replies and answer in JSON."), plus(*candidates), user(JUDGE_QUESTION)),
              max_tokens=24, response_format=fmt)
    result = llm.run_query(judge)
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.decode(ids[0], skip_special_tokens=True).strip()
             for path, ids in sorted(result.outputs.items()) if path != "$"]
    try:
        verdict = json.loads(result.text).get("name")
    except ValueError:
        verdict = None
    root = result.calls[-1]
    return StepResult(verdict == JUDGE_EXPECTED, [
        *(f"candidate: {t[:90]}" for t in texts),
        f"> {JUDGE_QUESTION}  judge: {result.text}  ({root.cached_tokens} of {root.prompt_tokens} prompt "
        f"tokens reused from the candidates' calls)",
    ])


# ---- 3. a streaming session with a flash question ---------------------------------------------

ROWS = [
    "10:01 Pump P1 reports pressure 3.1 bar.\n10:01 Pump P2 reports pressure 3.0 bar.\n",
    "10:02 Pump P1 reports pressure 3.2 bar.\n10:02 Pump P2 reports pressure 3.1 bar.\n",
    "10:03 Pump P1 reports pressure 3.1 bar.\n10:03 ALARM: pump P7 overheated.\n",
]
FLASH = "Which pump overheated?"
FLASH_EXPECTED = "P7"


def step_session(llm: LLM) -> StepResult:
    """A session computes rows as they arrive; its flash question is answered again after each
    append. Shown: the answer once the alarm row is in (before it, a small model names a pump
    anyway: SmolLM2 does not answer "none")."""
    session = llm.create_session(system="You watch a pump log. Answer briefly.", flash=[FLASH], flash_max_tokens=24)
    try:
        for rows in ROWS:
            t0 = time.perf_counter()
            version = session.append(rows)
            session.wait()  # ingested, and the flash question answered for this version
            seconds = time.perf_counter() - t0
        answer = (session.flash_answers()[FLASH][1] or "").strip()
    finally:
        session.close()
    return StepResult(FLASH_EXPECTED in answer, [
        f"{len(ROWS)} appends of log rows, the flash question answered again after each (version {version}: "
        f"the alarm row, ingested and answered {seconds * 1000:.0f} ms after its append)",
        f"> {FLASH}  {answer!r}",
    ])


# ---- 4. sparse decode ---------------------------------------------------------------------------

SPARSE_BUDGET = 384
NEEDLE_SYSTEM = "You answer from the document. Reply with the number only."


def haystack(llm: LLM, tokens: int, needle: str, first: int = 0) -> str:
    """Real prose (State of the Union paragraphs from the `first`-th on) of about `tokens` tokens,
    `needle` in its middle."""
    from spanserve.corpus import paragraphs

    tokenizer, parts, count = llm.get_tokenizer(), [], 0
    for p in paragraphs("eval")[first:]:
        parts.append(p)
        count += len(tokenizer.encode(p))
        if count >= tokens:
            break
    parts.insert(len(parts) // 2, needle)
    return "\n\n".join(parts)


def step_sparse(llm: LLM) -> StepResult:
    """A needle in a long context, found while each decode step attends to a budget of its tokens;
    full attention (its prompt then cached) answers the same."""
    question = "What is the access code of Marta Lind?"
    text = haystack(llm, 2000, "The access code of Marta Lind is 583920.")
    messages = [{"role": "system", "content": NEEDLE_SYSTEM}, {"role": "user", "content": f"{text}\n\n{question}"}]
    dense = SamplingParams(temperature=0, max_tokens=16)
    sparse = dataclasses.replace(dense, sparse="block_topk", sparse_budget=SPARSE_BUDGET)
    out, full = (llm.chat(messages, p)[0] for p in (sparse, dense))
    answer, reference = out.outputs[0].text.strip(), full.outputs[0].text.strip()
    return StepResult("583920" in answer and answer == reference, [
        f"a {len(out.prompt_token_ids)}-token context; block_topk attends to {SPARSE_BUDGET} of its tokens a step",
        f"> {question}  sparse: {answer!r}  full attention: {reference!r}",
    ])


# ---- 5. the OpenAI-compatible server ----------------------------------------------------------


SERVER_QUESTION = "What is the gate code of the Birch depot?"


def _chat_completion(base_url: str, body: dict) -> dict:
    """One chat completion, through the openai client where installed (`make install` puts it in
    the venv), else plain HTTP; the response as JSON."""
    try:
        import openai
    except ImportError:
        import urllib.request

        request = urllib.request.Request(f"{base_url}/chat/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.load(response)
    client = openai.OpenAI(base_url=base_url, api_key="none")
    return client.chat.completions.create(**body).model_dump()


def step_server(llm: LLM) -> StepResult:
    """The same long prompt sent twice to the server (in-process, on a free port): the second is
    served from the prefix cache, which usage.prompt_tokens_details.cached_tokens reports."""
    import socket
    import threading

    import uvicorn

    from spanserve.engine.async_engine import AsyncLLM
    from spanserve.server.app import create_app

    async_llm = AsyncLLM(llm.engine)  # this engine, stepped on the server's engine thread meanwhile
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(async_llm, "demo"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started and thread.is_alive():
            time.sleep(0.05)
        text = haystack(llm, 800, "The gate code of the Birch depot is 4471.", first=200)
        body = {"model": "demo", "temperature": 0, "max_tokens": 24,
                "messages": [{"role": "system", "content": NEEDLE_SYSTEM},
                             {"role": "user", "content": f"{text}\n\n{SERVER_QUESTION}"}]}
        replies = [_chat_completion(f"http://127.0.0.1:{port}/v1", body) for _ in range(2)]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        async_llm.shutdown()
    usage = replies[1]["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    answer = replies[1]["choices"][0]["message"]["content"].strip()
    ok = "4471" in answer and cached >= usage["prompt_tokens"] // 2
    return StepResult(ok, [
        f"POST /v1/chat/completions twice (http://127.0.0.1:{port}), a {usage['prompt_tokens']}-token prompt: "
        f"cached_tokens {cached} the second time",
        f"> {SERVER_QUESTION}  {answer!r}",
    ])


# ---- 6. a tool call held by the grammar ---------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def step_tools(llm: LLM) -> StepResult:
    """tool_choice required: the grammar holds the answer to a call whose arguments match the schema."""
    from spanserve.tools import Tools

    tools = Tools([WEATHER], choice="required", parallel=False)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=48), tools=tools)[0].outputs[0]
    reply = tools.reply(out.text, out.finish_reason)
    calls = [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]
    ok = reply.finish_reason == "tool_calls" and any(n == "get_weather" and "Paris" in str(a.get("city"))
                                                     for n, a in calls)
    shown = ", ".join(f"{n}({json.dumps(a)})" for n, a in calls) or repr(out.text)
    return StepResult(ok, [f"> {messages[0]['content']}  calls: {shown}  (finish_reason {reply.finish_reason})"])


STEPS: list[tuple[str, Callable[[LLM], StepResult]]] = [
    ("Spans reused in a new order", step_spans),
    ("A span-query judge over generated candidates", step_judge),
    ("A streaming session answering a flash question as rows arrive", step_session),
    ("Sparse decode: a needle in a long context", step_sparse),
    ("A tool call held by the grammar", step_tools),
    ("The OpenAI-compatible server", step_server),
]


def run(llm: LLM, steps: list | None = None, out=print) -> bool:
    """Run the steps (default: all) in order, print each one's lines; whether every check passed."""
    ok = True
    for i, (title, step) in enumerate(STEPS if steps is None else steps, 1):
        t0 = time.perf_counter()
        try:
            result = step(llm)
        except Exception as exc:  # a step that breaks is a failed check; the others still run
            result = StepResult(False, [f"error: {type(exc).__name__}: {exc}"])
        out(f"{i}. {title} ({time.perf_counter() - t0:.1f}s) {'✓' if result.ok else '✗'}")
        for line in result.lines:
            out(f"   {line}")
        ok &= result.ok
    return ok


def main(config) -> None:
    t0 = time.perf_counter()
    llm = LLM(**config.__dict__)
    engine = llm.engine
    print(f"loaded {engine.model_path.name} ({engine.dtype}, {engine.device}) in {time.perf_counter() - t0:.1f}s\n")
    ok = run(llm)
    print(f"\n{'all checks passed' if ok else 'a check failed'} in {time.perf_counter() - t0:.0f}s")
    if not ok:
        sys.exit(1)

