"""`spanserve`: generate, chat, demo and bench from the terminal."""

import argparse
import dataclasses
import json
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from spanserve.attention import BACKENDS  # (the package sets OpenMP's wait policy first)
from spanserve.comb import calibrate as comb_calibrate
from spanserve.comb import train as comb_train
from spanserve.config import LOAD_FORMATS, EngineConfig
from spanserve.errors import InvalidRequestError, SpanserveError
from spanserve.pic.link import APE_SCALE, APE_TEMPERATURE, BLEND_LAYERS, POLICIES
from spanserve.sampling import SamplingParams
from spanserve.sessions import feed as session_feed
from spanserve.sessions.disk import SAVE_POLICIES, SessionDisk
from spanserve.tools import Tools
from spanserve.tools.conversation import chat_request
from spanserve.tools.stream import ToolStream


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF directory or .gguf file (default: SPANSERVE_MODEL "
                   "or the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    g.add_argument("--speculative-config", default=None, metavar="JSON", help="speculative decoding, as vLLM's: "
                   '\'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt_lookup_min/max: 2/4)')
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    g.add_argument("--sparse-flow", action="append", default=[], metavar="PACKAGE.MODULE.CLASS",
                   help="register a sparse decode flow of your own (repeatable); requests name it")
    g.add_argument("--background-chunk-tokens", type=int, default=EngineConfig.background_chunk_tokens,
                   help="session ingest: at most this many tokens per step, in steps no other request "
                        "needs (fewer while requests keep arriving)")
    g.add_argument("--session-tenant-share", type=float, default=0.9,
                   help="share of the KV pool one tenant's (API key's) sessions may hold (all sessions: 0.9)")
    g.add_argument("--session-flash-budget", type=int, default=EngineConfig.session_flash_budget,
                   help="tokens of flash work one append may set off in a session (each flash question's "
                        "tokens and its flash_max_tokens, summed)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--link-policy", default="auto", choices=["auto", *POLICIES],
                   help="default link policy of requests with position-independent spans (auto: comb where "
                   "a plug-in ships for the model, else none; both with a 48-token focus)")
    g.add_argument("--gap-length", type=int, default=32, help="tokens recomputed at each span's head (gap)")
    g.add_argument("--blend-ratio", type=float, default=0.15, help="fraction of span tokens recomputed (blend)")
    g.add_argument("--blend-layers", type=int, default=BLEND_LAYERS,
                   help="check layers of the blend probe: the picks shrink layer by layer to the ratio")
    g.add_argument("--ape-temperature", type=float, default=APE_TEMPERATURE,
                   help="attention temperature on span keys, in (0, 1] (ape)")
    g.add_argument("--ape-scale", type=float, default=APE_SCALE,
                   help="scaling factor S, in (0, 1]: the spans' summed weight Z counts as Z^(S*T) (ape)")
    g.add_argument("--focus-spans", type=int, default=0,
                   help="none, comb: recompute in context the spans the question attends to most, this many")
    g.add_argument("--focus-tokens", type=int, default=0,
                   help="none, comb: or recompute the span blocks it attends to most, up to this many tokens")
    g.add_argument("--comb-plugin", default=None,
                   help="COMB encoder plug-in file (comb; default: the one shipped for the model)")
    g.add_argument("--attention-backend", default="auto", choices=BACKENDS,
                   help="auto: the Triton paged-attention kernel on CUDA, else the torch reference")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode graphs")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights of the model's shape (benchmarks)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto: the model's dtype; bfloat16 under a float32 model (CPU): half the cache's bytes")
    g.add_argument("--quantization", default=None,
                   help="int8 or int4: weight-only quantized projections and LM head (CPU; faster decode); "
                        "w8a8: int8 weights and activations per block of 64 (CPU, our C kernel; fastest with VNNI)")
    g.add_argument("--gguf-block-activations", default="float32", choices=("float32", "int8"),
                   help="int8: decode multiplies a GGUF's 4-bit blocks by activations rounded to int8 per 32 "
                        "inputs, as llama.cpp does (faster where arithmetic bounds decode; answers drift a little)")
    g.add_argument("--no-gguf-blocks", action="store_true",
                   help="CPU: compute a GGUF's Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q6_K/Q8_0 projections from float copies, "
                        "not the file's own blocks")


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        num_blocks=args.num_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb, kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        background_chunk_tokens=args.background_chunk_tokens, sparse_flows=args.sparse_flow,
        session_tenant_share=args.session_tenant_share, session_flash_budget=args.session_flash_budget,
        enable_prefix_caching=not args.no_prefix_caching,
        link_policy=args.link_policy, gap_length=args.gap_length,
        blend_ratio=args.blend_ratio, comb_plugin=args.comb_plugin, blend_layers=args.blend_layers,
        ape_temperature=args.ape_temperature, ape_scale=args.ape_scale, focus_spans=args.focus_spans,
        focus_tokens=args.focus_tokens,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager, load_format=args.load_format,
        quantization=args.quantization, gguf_blocks=not args.no_gguf_blocks,
        gguf_block_activations=args.gguf_block_activations, speculative_config=args.speculative_config,
    )


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--system", default="You are a helpful assistant.", help="system prompt for chat")
    g.add_argument("--sparse", default=None, help="sparse decode flow: block_topk, quest, streaming, h2o, or one "
                   "given by --sparse-flow")
    g.add_argument("--sparse-budget", type=int, default=2048, help="tokens a sparse flow attends to per step")
    g.add_argument("--sparse-prefill", action="store_true", help="a short prompt suffix after cached KV (a session "
                   "question) attends sparsely too")
    s = p.add_argument_group("structured output (one of)")
    s.add_argument("--json-schema", default=None, metavar="SCHEMA", help="the answer is JSON matching this schema "
                   "(its text, or @FILE)")
    s.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    s.add_argument("--regex", default=None, help="the answer matches this regex")
    s.add_argument("--choice", action="append", default=None, help="the answer is one of these (repeat the flag)")
    s.add_argument("--grammar", default=None, help="the answer follows this Lark grammar (its text, or @FILE)")
    t = p.add_argument_group("tool calling (generate, chat)")
    t.add_argument("--tools", default=None, metavar="JSON|@FILE", help="functions the model may call: OpenAI's "
                   "tools list; the answer's calls are printed as JSON")
    t.add_argument("--tool-choice", default="auto", help="auto, none, required, or a function's name")
    t.add_argument("--no-parallel-tool-calls", action="store_true", help="at most one call per answer")


def sampling_params(args) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
        sparse=args.sparse, sparse_budget=args.sparse_budget, sparse_prefill=args.sparse_prefill,
        structured_outputs=_structured(args),
    )


def _structured(args) -> dict | None:
    """The structured-output flags given, as SamplingParams' structured_outputs (it checks there is one)."""
    given = {"json": _text_or_file(args.json_schema), "json_object": args.json_object or None,
             "regex": args.regex, "choice": args.choice, "grammar": _text_or_file(args.grammar)}
    given = {kind: value for kind, value in given.items() if value is not None}
    return given or None


def _text_or_file(value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {value[1:]}: {exc.strerror}") from None


def stream_text(engine, prompt, params: SamplingParams, finished: list | None = None) -> Iterator[str]:
    """Run one request on the synchronous engine, yielding text as it is produced; its final
    output is appended to `finished`, if given."""
    request_id = engine.add_request(prompt, params)
    # Hold back what could be the start of a stop string: it is cut from the final text.
    hold = max((len(s) for s in params.stop), default=1) - 1
    shown = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    text = out.outputs[0].text
                    ready = len(text) if out.finished else max(shown, len(text) - hold)
                    yield text[shown:ready]
                    shown = ready
                    if out.finished and finished is not None:
                        finished.append(out.outputs[0])
    finally:
        engine.abort_request(request_id)


def tools_of(args) -> Tools | None:
    """The --tools flags as Tools (None without --tools)."""
    if args.tools is None:
        return None
    try:
        tools = json.loads(_text_or_file(args.tools))
    except ValueError as exc:
        raise InvalidRequestError(f"--tools is not valid JSON: {exc}") from None
    return Tools(tools, args.tool_choice, parallel=not args.no_parallel_tool_calls)


def _print_content(deltas: list[dict]) -> None:
    print("".join(d.get("content", "") for d in deltas), end="", flush=True)


def answer(engine, messages: list[dict], params: SamplingParams, tools: Tools | None) -> dict:
    """Stream a chat answer to the terminal and return it as an assistant message; with tools,
    its calls are printed as JSON lines (OpenAI's tool_calls items) and kept in the message."""
    prompt, params = chat_request(engine, messages, params, tools)
    if tools is None:
        text = "".join(print(delta, end="", flush=True) or delta for delta in stream_text(engine, prompt, params))
        print()
        return {"role": "assistant", "content": text}
    stream, finished, text = ToolStream(tools), [], ""
    for delta in stream_text(engine, prompt, params, finished):  # the content as it comes, calls at the end
        text += delta
        _print_content(stream.feed(text))
    reply = tools.reply(text, finished[0].finish_reason)
    _print_content(stream.end(text, finished[0].finish_reason)[0])
    print()
    for call in reply.tool_calls:
        print(json.dumps(call.openai(), ensure_ascii=False))
    return {"role": "assistant", "content": reply.content,
            **({"tool_calls": [c.openai() for c in reply.tool_calls]} if reply.tool_calls else {})}


def chat_prompt(engine, messages: list[dict]) -> dict:
    return engine.chat_prompt(messages)


def read_docs(docs: list[str]) -> list:
    """--doc values as Spans: literal text, or @PATH for a file's contents."""
    from spanserve.pic.prompt import Span

    return [Span(Path(d[1:]).read_text() if d.startswith("@") else d) for d in docs]


def cmd_generate(args) -> None:
    from spanserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(args))
    docs = read_docs(args.doc)
    if args.raw:
        if args.tools is not None:
            raise InvalidRequestError("--tools goes with the chat template: drop --raw")
        for delta in stream_text(engine, [*docs, args.prompt] if docs else args.prompt, sampling_params(args)):
            print(delta, end="", flush=True)
        print()
        return
    messages = [{"role": "system", "content": args.system}] if args.system else []
    content = [*docs, args.prompt] if docs else args.prompt
    answer(engine, [*messages, {"role": "user", "content": content}], sampling_params(args), tools_of(args))


def cmd_chat(args) -> None:
    from spanserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(args))
    tools = tools_of(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("spanserve chat: empty line or Ctrl-D to quit, /reset to clear the history."
          + (" You answer the model's tool calls: type each result." if tools else ""))
    while True:
        try:
            line = input("\n> ").strip()
        except (EOFError, KeyboardInterrupt):
            break
        if not line:
            break
        if line == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        history.append(answer(engine, history, sampling_params(args), tools))
        # the user plays the tools; the model goes on from their results, free to answer in text
        followup = Tools([f.openai() for f in tools.functions], "auto") if tools else None
        while history[-1].get("tool_calls"):
            for call in history[-1]["tool_calls"]:
                try:
                    result = input(f"{call['function']['name']} result> ")
                except (EOFError, KeyboardInterrupt):
                    return
                history.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            history.append(answer(engine, history, sampling_params(args), followup))


def cmd_demo(args) -> None:
    """Each capability in a few lines, each answer checked (spanserve/demo.py); exits 1 if one is wrong."""
    from spanserve import demo

    demo.main(engine_config(args))


def session_disk(args, replicated: bool = False) -> SessionDisk | None:
    """Where `spanserve serve` keeps sessions. A cluster's replicas save each session once its data
    is computed, and restore one only when its replica has died (cluster/ingress.py)."""
    if not args.session_dir:
        if args.session_save:
            raise InvalidRequestError("--session-save needs --session-dir")
        return None
    try:
        return SessionDisk(Path(args.session_dir), args.session_save or ("ingest" if replicated else "stop"),
                           args.session_save_interval, restore_at_start=not replicated)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None


def cmd_serve(args) -> None:
    if args.replicas is not None:  # Ray Serve (spanserve/cluster/): imported only here
        from spanserve.cluster.launch import serve_cluster

        config = dataclasses.replace(engine_config(args), admission_timeout_s=args.queue_timeout or None)
        return serve_cluster(args, config, session_disk(args, replicated=True))
    import uvicorn

    from spanserve.engine.async_engine import AsyncLLM
    from spanserve.engine.llm_engine import LLMEngine
    from spanserve.models.loader import model_name
    from spanserve.server.app import create_app
    from spanserve.server.tenants import Tenants
    from spanserve.spans.limits import QueryLimits

    name = args.served_model_name or model_name(args.model)
    tenants = Tenants.load(args.api_key, args.api_keys)  # a bad keys file fails before the model loads
    config = dataclasses.replace(engine_config(args), admission_timeout_s=args.queue_timeout or None)
    llm = AsyncLLM(lambda: LLMEngine(config))  # built on the thread that steps it
    retriever = None
    if args.corpus:
        from spanserve.spans.retrieval import Retriever

        retriever = Retriever(args.corpus, confine=True)
    limits = QueryLimits(args.max_query_depth, args.max_query_fanout, args.max_query_calls)
    app = create_app(llm, name, max_queued=args.max_queued, retriever=retriever, tenants=tenants,
                     max_body_bytes=int(args.max_body_mb * (1 << 20)), query_limits=limits,
                     metrics_public=args.metrics_public, session_dir=session_disk(args))
    # the grammar library's view of the vocabulary, built now rather than in the first structured request
    warm = threading.Thread(target=llm.engine.grammars.warm, name="grammar-warmup", daemon=True)
    warm.start()
    print(f"spanserve serving {name} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning")
    warm.join()  # a server stopped during the warm-up: the interpreter must not exit under the grammar library
    llm.shutdown()


BENCHES = ["throughput", "serve", "rag", "accuracy", "nested", "locality", "gpu", "soak", "span_decode", "quant",
           "session", "session_server", "sparse", "sparse_pick", "prefill_attention", "decode_attention",
           "linear_layout", "projections", "step", "structured", "speculative", "cpu_paths", "cluster"]


def cmd_query(args) -> None:
    from spanserve.spans.api import as_tree, prepare
    from spanserve.spans.ir import pretty
    from spanserve.spans.retrieval import Retriever

    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    retriever = Retriever(args.corpus)  # loads the embedding model only if the query retrieves
    if args.bulk:
        return query_bulk(args, text, retriever)
    query = json.loads(text)
    if args.explain:
        optimized = prepare(query, retriever=retriever, judge_arity=args.judge_arity)
        print("before:\n" + pretty(as_tree(query)))
        print("\nafter:\n" + pretty(optimized.tree))
        print("\nrules fired: " + (", ".join(optimized.fired) or "none"))
        return
    from spanserve.llm import LLM

    llm = LLM(**engine_config(args).__dict__)
    result = llm.run_query(query, judge_arity=args.judge_arity, retriever=retriever)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return
    print(result.text)
    for call in result.calls:
        ttft = f"{call.ttft_s * 1000:.0f} ms" if call.ttft_s is not None else "-"
        print(f"  {call.path}: {call.prompt_tokens} prompt ({call.cached_tokens} cached), "
              f"{call.generated_tokens} generated, TTFT {ttft}", file=sys.stderr)


def query_bulk(args, text: str, retriever) -> None:
    """Run every query of a JSONL file twice, in the given order and clustered by shared
    fragments, each from an empty cache; report time and cache hit rate of both."""
    import json

    from spanserve.llm import LLM
    from spanserve.spans.api import prepare
    from spanserve.spans.bulk import greedy_order, run_bulk, shared_units

    lines = [line for line in text.splitlines() if line.strip()]
    trees = [prepare(json.loads(line), retriever, args.judge_arity).tree for line in lines]
    llm = LLM(**engine_config(args).__dict__)
    results = None
    for name, order in (("given", list(range(len(trees)))), ("clustered", greedy_order(map(shared_units, trees)))):
        llm.engine.kv.pool.reset_cache()
        report, results = run_bulk(llm, trees, order)
        print(f"{name:>9} order: {report.seconds:7.2f} s, {report.prompt_tokens} prompt tokens, "
              f"hit rate {report.hit_rate:.1%}", file=sys.stderr)
    for result in results:
        print(json.dumps(result.to_json()) if args.json else result.text)


def cmd_index(args) -> None:
    from spanserve.spans.retrieval import build_index

    stats = build_index(args.dir, args.out, args.fragment_tokens)
    action = "reused" if stats.reused else f"built ({stats.embedded} fragments embedded)"
    print(f"{stats.index_dir}: {stats.files} files, {stats.fragments} fragments, {action} in {stats.seconds:.1f}s")


def cmd_bench(args, rest: list[str]) -> None:
    if args.bench is None:  # `spanserve bench [--help]`: the bench parser's own help, since it has no -h
        args.print_bench_help(None if args.bench_help else sys.stderr)
        sys.exit(0 if args.bench_help else 2)
    import importlib

    try:  # only the chosen one: each benchmark has its own dependencies (serve needs httpx)
        bench = importlib.import_module(f"benchmarks.{args.bench}")
    except ImportError as exc:
        sys.exit(f"cannot load benchmarks.{args.bench} ({exc}): run from a checkout with `make` (pip install -e .)")
    bench.main(["--help", *rest] if args.bench_help else rest)


def cmd_session(args) -> None:
    from spanserve import LLM

    session_feed.run(args, LLM(**vars(engine_config(args))), sampling_params(args))


def cmd_train(args) -> None:
    if args.plugin == "probe":
        logging.getLogger(comb_calibrate.__name__).setLevel(logging.INFO)
        print(json.dumps(comb_calibrate.calibrate(args), indent=1))
        return
    logging.getLogger(comb_train.__name__).setLevel(logging.INFO)  # progress, every --log-every steps
    out = comb_train.train(args)
    print(f"COMB plug-in written to {out}; use it with --link-policy comb --comb-plugin {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spanserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate a reply to one prompt, streamed to the terminal")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    p.add_argument("--doc", action="append", default=[], metavar="TEXT|@FILE",
                   help="a document placed before the prompt as a position-independent span (repeatable)")
    add_engine_args(p)
    add_sampling_args(p)

    p = sub.add_parser("chat", help="interactive chat that keeps the history")
    add_engine_args(p)
    add_sampling_args(p)

    p = sub.add_parser("demo", help="a short showcase on the default model")
    add_engine_args(p)

    p = sub.add_parser("query", help="run a span query (JSON) and print the answer")
    p.add_argument("file", help="the query as JSON (a file, or - for stdin)")
    p.add_argument("--explain", action="store_true", help="print the tree before and after optimization, and stop")
    p.add_argument("--json", action="store_true", help="print {text, calls: [...]} as JSON")
    p.add_argument("--judge-arity", type=int, default=None, help="judge at most k candidates per call (a tree)")
    p.add_argument("--bulk", action="store_true", help="FILE holds one query per line (JSONL): run them all, "
                   "in the given order and clustered by shared fragments, and compare")
    p.add_argument("--corpus", default=None, metavar="DIR", help="corpus or index directory of retrieve nodes "
                   "that name none (default: SPANSERVE_CORPUS)")
    add_engine_args(p)

    p = sub.add_parser("index", help="split a directory of .txt/.md files into fragments and embed them "
                       "(reuses the index if the files are unchanged)")
    p.add_argument("dir", help="the corpus directory")
    p.add_argument("--out", default=None, metavar="INDEX_DIR", help="where the index goes "
                   "(default: DIR/.spanserve-index)")
    p.add_argument("--fragment-tokens", type=int, default=200, help="fragment size, in embedding-model tokens")

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* and /metrics")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="keys by tenant, one `KEY TENANT` per line: tenants never share cached KV")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    p.add_argument("--session-dir", default=None,
                   help="where sessions are saved (POST /v1/sessions/{id}/save) and kept across a restart; "
                        "with --replicas, storage every replica reads: a dead replica's sessions are restored "
                        "on another")
    p.add_argument("--session-save", choices=list(SAVE_POLICIES), default=None,
                   help="with --session-dir, what else saves a session: " + "; ".join(
                       f"{k}: {v}" for k, v in SAVE_POLICIES.items()) + " (default: stop; with --replicas, ingest)")
    p.add_argument("--session-save-interval", type=float, default=1.0, metavar="S",
                   help="the save policy saves one session at most this often")
    p.add_argument("--served-model-name", default=None, help="the model name clients pass")
    p.add_argument("--max-queued", type=int, default=None,
                   help="answer 429 beyond this many waiting sequences (n of each prompt, each call of a span query)")
    p.add_argument("--queue-timeout", type=float, default=60,
                   help="seconds a request may wait for room in the KV pool to start before a 503 with "
                        "Retry-After (0: it waits as long as it takes)")
    p.add_argument("--max-body-mb", type=float, default=32, help="answer 413 to larger request bodies")
    p.add_argument("--max-query-calls", type=int, default=256, help="model calls of one span query (400 beyond)")
    p.add_argument("--max-query-depth", type=int, default=16, help="nesting of one span query (400 beyond)")
    p.add_argument("--max-query-fanout", type=int, default=256, help="children of one span query node (400 beyond)")
    p.add_argument("--corpus", default=None, metavar="DIR",
                   help="corpus (or index) directory that retrieve nodes of /v1/spans queries search")
    p.add_argument("--replicas", type=int, default=None, metavar="N", help="N engine replicas behind this "
                   "address, on Ray Serve, with span-aware routing (pip install spanserve[cluster]; docs/scale-out.md)")
    p.add_argument("--ray-address", default=None, help="with --replicas: join this Ray cluster (default: start "
                   "Ray in this process)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="with --replicas: CPUs Ray reserves for each")
    p.add_argument("--replica-gpus", type=float, default=0.0, help="with --replicas: GPUs Ray reserves for each "
                   "(its engine then runs on the GPU Ray gives it)")
    p.add_argument("--router", default="span", choices=["span", "round-robin", "pow2", "prefix"],
                   help="with --replicas: how a request's replica is chosen: span (where most of its KV blocks "
                        "are, in any order), or to compare: round-robin, pow2 (Ray Serve's default), prefix "
                        "(Ray's PrefixCacheAffinityRouter, by text prefix); sessions stay with their replica "
                        "under each")
    add_engine_args(p)

    p = sub.add_parser("session", help="stream a CSV file into a session and answer questions as rows arrive")
    session_feed.add_arguments(p)
    add_engine_args(p)
    add_sampling_args(p, max_tokens=48)

    p = sub.add_parser("train", help="train a plug-in: `spanserve train comb` (the span encoder "
                       "of link policy comb), `spanserve train probe` (its focus probe's voting heads)")
    kinds = p.add_subparsers(dest="plugin", required=True)
    comb_train.add_arguments(kinds.add_parser("comb", help=comb_train.__doc__.split("\n")[0]))
    comb_calibrate.add_arguments(kinds.add_parser("probe", help=comb_calibrate.__doc__.split("\n")[0]))

    # No -h of its own: `spanserve bench NAME --help` must reach NAME's parser, which owns the options.
    p = sub.add_parser("bench", add_help=False, help="benchmarks; `spanserve bench NAME --help` for options")
    p.add_argument("bench", nargs="?", choices=BENCHES, help="benchmark to run")
    p.add_argument("-h", "--help", action="store_true", dest="bench_help", help="show NAME's options (or this help)")
    p.set_defaults(print_bench_help=p.print_help)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    verbose = args.verbose or args.command == "serve"  # the server logs one line per request
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "bench":
            cmd_bench(args, rest)
        else:
            commands = {"generate": cmd_generate, "chat": cmd_chat, "demo": cmd_demo, "serve": cmd_serve,
                        "query": cmd_query, "index": cmd_index, "train": cmd_train, "session": cmd_session}
            commands[args.command](args)
    except SpanserveError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
