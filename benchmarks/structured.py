"""Structured outputs and tool calling: what constrained decoding costs, whether its outputs are
valid, how long a schema takes to compile, and how often the model calls the right function.

All in one run on --model (default the embedded SmolLM2):

  decode      decode tok/s of the same chat prompts (a list to write as JSON), greedy, EOS
              ignored, --tokens tokens each, without a constraint and held to a JSON schema (an
              object with an array of strings, minItems = --tokens, so the grammar is live for
              every token decoded), at batch 1 and 8 (--batch-sizes). Decode tok/s: tokens after
              each request's first / (last finish - first first token), from the engine's
              metrics (prefill excluded). --repeats rounds after a warm-up round, the two taking
              turns (which goes first alternates), new prompts each round; the median of each and
              their ratio (constrained / free), and the median of the rounds' paired ratios.
  validity    constrained outputs of four schemas (a short list, a person with a nested address,
              an event with a date pattern and enums, the 50-property form below), greedy and
              seeded sampling: every one that finished "stop" is validated by jsonschema_rs
              against its schema (outputs cut by max_tokens are counted apart, not judged).
  compile     a 50-property object schema (strings with maxLength, integers with ranges, enums,
              nested objects, arrays), each time a variant no cache has seen, on a fresh Grammars
              (llm.engine.grammars' class, its tokenizer built beforehand): first compile and
              check (grammar()), first constraint (matcher creation), its first mask (llguidance
              builds a grammar's states lazily); then cached: grammar() again and a constraint
              over it. Also the very first constraint of the process (llguidance.torch's import
              and its torch.compile'd mask kernel on the first mask).
  ttft        added by a cached schema: wall time of a max_tokens=1 chat request (a short
              prompt) with the cached 50-property schema vs none, --ttft-repeats times each,
              taking turns; the difference of the medians (and the engine's own TTFT metric,
              which starts after the constraint is made).
  tools       benchmarks/tool_prompts.py: function-calling prompts, each offered four functions
              (the right one among them), under tool_choice auto and required, greedy, parallel
              calls off (one call expected; only the first counts). Per mode: % with a call, %
              right function, % valid arguments (the called function's schema, jsonschema_rs), %
              right values (every expected value matches, leniently), and under auto % answered
              as text. Prompts no offered function fits, under auto: % correctly not called.

Goals: constrained decode within 5% of free at batch 1 and 10% at batch 8; a cached schema adds
< 1 ms to TTFT; first compile of the 50-property schema < 100 ms; 100% of finished constrained
outputs valid.

    spanserve bench structured [--model qwen2.5-coder-0.5b-instruct] [--quick] [--out PATH]
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness, tool_prompts

GOALS = {"decode_ratio_batch1": 0.95, "decode_ratio_batch8": 0.90, "cached_ttft_added_ms": 1.0,
         "first_compile_ms": 100.0, "valid_fraction": 1.0}
TOPICS = ["fruits", "European cities", "programming languages", "animals", "colours", "musical instruments",
          "rivers", "board games", "vegetables", "car brands", "sports", "flowers", "chemical elements",
          "planets and moons", "famous painters", "breakfast foods", "kitchen tools", "mountains",
          "birds", "fabrics", "card games", "dog breeds", "spices", "desserts"]
SHORT_NAMES = {"smollm2-135m-instruct": "smollm2", "qwen2.5-coder-0.5b-instruct": "qwen0.5b",
               "qwen2.5-coder-1.5b-instruct": "qwen1.5b"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
    parser.add_argument("--tokens", type=int, default=128, help="tokens decoded per request in the decode runs")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds of the decode runs (after a warm-up)")
    parser.add_argument("--compile-repeats", type=int, default=5, help="fresh compiles of the 50-property schema")
    parser.add_argument("--ttft-repeats", type=int, default=30)
    parser.add_argument("--validity-prompts", type=int, default=2, help="prompts per schema in the validity runs")
    parser.add_argument("--max-tool-prompts", type=int, default=None, help="at most this many tool prompts "
                        "(and as many no-tool prompts, at most)")
    parser.add_argument("--tool-max-tokens", type=int, default=160)
    parser.add_argument("--functions-offered", type=int, default=tool_prompts.OFFERED,
                        help="functions offered per tool prompt (the right one among them)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/structured-<model>-<machine>.json)")


def apply_quick(args: argparse.Namespace) -> None:
    args.tokens, args.repeats, args.compile_repeats, args.ttft_repeats = 6, 1, 2, 3
    args.validity_prompts, args.tool_max_tokens, args.functions_offered = 1, 48, 2  # (a tiny model's 512 tokens)
    args.max_tool_prompts = args.max_tool_prompts or 3


# --- schemas ---------------------------------------------------------------------------------------

def list_schema(min_items: int, max_items: int | None = None) -> dict:
    items = {"type": "array", "items": {"type": "string", "maxLength": 32}, "minItems": min_items}
    if max_items is not None:
        items["maxItems"] = max_items
    return {"type": "object", "additionalProperties": False, "required": ["items"], "properties": {"items": items}}


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 40},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "email": {"type": "string", "maxLength": 60},
              "tags": {"type": "array", "items": {"enum": ["friend", "family", "work", "other"]}, "maxItems": 3},
              "address": {"type": "object", "additionalProperties": False, "required": ["street", "city"],
                          "properties": {"street": {"type": "string", "maxLength": 60},
                                         "city": {"type": "string", "maxLength": 40},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
EVENT = {"type": "object", "additionalProperties": False, "required": ["title", "date", "attendees", "priority"],
         "properties": {
             "title": {"type": "string", "maxLength": 50},
             "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
             "attendees": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1,
                           "maxItems": 5},
             "priority": {"enum": ["low", "medium", "high"]},
             "online": {"type": "boolean"}}}


def form_schema(variant: int = 0) -> dict:
    """A 50-property object: strings with maxLength, integers with ranges, numbers, booleans,
    enums, nested objects and arrays; `variant` changes one enum, so its grammar is new."""
    props: dict = {}
    for i in range(50):
        kind = i % 7
        if kind == 0:
            prop = {"type": "string", "maxLength": 16 + 4 * (i % 5)}
        elif kind == 1:
            prop = {"type": "integer", "minimum": -10 * i, "maximum": 100 + 37 * i}
        elif kind == 2:
            prop = {"enum": ["red", "green", "blue", f"shade{i}"] + ([f"variant{variant}"] if i == 2 else [])}
        elif kind == 3:
            prop = {"type": "object", "additionalProperties": False, "required": ["id", "label"],
                    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                   "label": {"type": "string", "maxLength": 20},
                                   "active": {"type": "boolean"}}}
        elif kind == 4:
            prop = {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}
        elif kind == 5:
            prop = {"type": "number", "minimum": 0, "maximum": 1000}
        else:
            prop = {"type": "boolean"}
        props[f"field_{i:02d}"] = prop
    return {"type": "object", "additionalProperties": False, "properties": props,
            "required": [f"field_{i:02d}" for i in range(0, 50, 2)]}


VALIDITY_SCHEMAS = {  # name: (schema, what to ask for, max_tokens)
    "list": (list_schema(1, 8), "Give a JSON object listing a few {topic}.", 200),
    "person": (PERSON, "Invent a person who likes {topic} and describe them as JSON.", 200),
    "event": (EVENT, "Describe, as JSON, a meeting about {topic} in 2025.", 200),
    "form50": (form_schema(), "Fill in this form as JSON with plausible values about {topic}.", 900),
}


# --- helpers ------------------------------------------------------------------------------------

def model_short_name(model: str | None) -> str:
    from spanserve.models.loader import DEFAULT_MODEL

    name = Path(model).name if model else DEFAULT_MODEL
    return SHORT_NAMES.get(name.lower(), name.lower())


def machine_tag() -> str:
    """The tag docs/performance.md gives this machine."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = next((ln.split(":", 1)[1] for ln in cpuinfo.splitlines() if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), []))
    if "AMD" in model:
        return "amd-zen4" if "avx512_bf16" in flags else "epyc-avx512" if "avx512f" in flags else "epyc-avx2"
    if "Intel" in model or "Xeon" in model:
        return "xeon-amx" if "amx_tile" in flags else "xeon-avx512" if "avx512f" in flags else "xeon-avx2"
    return os.uname().machine


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _pct(count: int, total: int) -> float | None:
    return 100.0 * count / total if total else None


def _decode_rate(outs) -> tuple[int, float, list[str]]:
    """(tokens decoded after each request's first, seconds from the first first token to the last
    finish, finish reasons) of one batch's outputs."""
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    start = min(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finish_time for o in outs)
    return tokens, end - start, [o.outputs[0].finish_reason for o in outs]


def _messages(topic_index: int, template: str = "List as many {topic} as you can, as JSON: "
              "{{\"items\": [...]}}.") -> list[dict]:
    topic = TOPICS[topic_index % len(TOPICS)]
    suffix = "" if topic_index < len(TOPICS) else f" (list {topic_index // len(TOPICS) + 1})"
    return [{"role": "user", "content": template.format(topic=topic) + suffix}]


# --- sections -----------------------------------------------------------------------------------

def measure_decode(llm, args, log) -> dict:
    from spanserve import SamplingParams

    schema = list_schema(args.tokens)  # no output of --tokens tokens can complete it: live all along
    batches = [int(b) for b in args.batch_sizes.split(",")]
    conditions = {"free": None, "constrained": {"json": schema}}
    runs: dict = {b: {c: [] for c in conditions} for b in batches}
    next_prompt = 0
    for round_ in range(args.repeats + 1):  # the first repetition warms up (and builds the grammar's states)
        for b in batches:
            messages = [_messages(next_prompt + k) for k in range(b)]
            next_prompt += b
            order = list(conditions) if (round_ + b) % 2 == 0 else list(conditions)[::-1]
            for c in order:
                params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                        structured_outputs=conditions[c])
                outs = llm.chat(messages, params)
                tokens, seconds, reasons = _decode_rate(outs)
                if round_ == 0:
                    continue
                runs[b][c].append({"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                                   "finish_reasons": reasons,
                                   "sample_text": outs[0].outputs[0].text[:160] if c == "constrained" else None})
            if round_:
                log(f"decode batch {b} round {round_}: " + ", ".join(
                    f"{c} {runs[b][c][-1]['tok_s']:.1f} tok/s" for c in conditions))
    result = {"schema": schema, "tokens_per_request": args.tokens, "repeats": args.repeats, "per_batch": {}}
    for b in batches:
        free = [r["tok_s"] for r in runs[b]["free"]]
        held = [r["tok_s"] for r in runs[b]["constrained"]]
        result["per_batch"][str(b)] = {
            "free_tok_s": _median(free), "constrained_tok_s": _median(held),
            "ratio": _median(held) / _median(free),
            "paired_ratio_median": _median([h / f for h, f in zip(held, free)]),
            "constrained_tokens_decoded": [r["tokens"] for r in runs[b]["constrained"]],
            "free_tokens_decoded": [r["tokens"] for r in runs[b]["free"]],
            "runs": runs[b]}
    return result


def _validator(schema: dict):
    import jsonschema_rs

    return jsonschema_rs.validator_for(schema)


def measure_validity(llm, args, log) -> dict:
    from spanserve import SamplingParams

    per_schema, total_stop, total_valid = {}, 0, 0
    for s, (name, (schema, ask, max_tokens)) in enumerate(VALIDITY_SCHEMAS.items()):
        if args.quick:
            max_tokens = 24
        messages, params = [], []
        for p in range(args.validity_prompts):
            msg = _messages(7 * s + p, ask)
            for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 100 + p}):
                messages.append(msg)
                params.append(SamplingParams(max_tokens=max_tokens, structured_outputs={"json": schema}, **sampling))
        outs = llm.chat(messages, params)
        validator = _validator(schema)
        records = []
        for out in outs:
            c = out.outputs[0]
            record = {"finish_reason": c.finish_reason, "tokens": len(c.token_ids), "valid": None}
            if c.finish_reason == "stop":
                try:
                    record["valid"] = validator.is_valid(json.loads(c.text))
                except ValueError as exc:
                    record["valid"], record["error"] = False, f"not JSON: {exc}"
                if not record["valid"]:
                    record["text"] = c.text
            records.append(record)
        stopped = [r for r in records if r["finish_reason"] == "stop"]
        valid = sum(bool(r["valid"]) for r in stopped)
        total_stop, total_valid = total_stop + len(stopped), total_valid + valid
        per_schema[name] = {"outputs": len(records), "finished_stop": len(stopped), "valid": valid,
                            "cut_by_max_tokens": sum(r["finish_reason"] == "length" for r in records),
                            "max_tokens": max_tokens, "records": records,
                            "sample_text": next((o.outputs[0].text[:300] for o in outs), None)}
        log(f"validity {name}: {valid}/{len(stopped)} valid of {len(records)} ({per_schema[name]['cut_by_max_tokens']}"
            " cut by max_tokens)")
    return {"per_schema": per_schema, "finished_stop": total_stop, "valid": total_valid,
            "valid_fraction": total_valid / total_stop if total_stop else None}


def measure_first_constraint(llm) -> dict:
    """The first constraint this process makes, and its first mask: one-time costs (imports, the
    mask kernel's torch.compile) a server's first constrained request pays."""
    import torch

    from spanserve.structured.params import StructuredOutputs

    grammars = llm.engine.grammars
    start = time.perf_counter()
    grammars.tokenizer()
    tokenizer_s = time.perf_counter() - start
    spec = StructuredOutputs(json={"type": "object", "properties": {"first": {"type": "integer"}}})
    start = time.perf_counter()
    constraint = grammars.constraint(spec)
    constraint_s = time.perf_counter() - start
    logits = torch.zeros(grammars.vocab_size)
    start = time.perf_counter()
    constraint.mask(logits)
    mask_s = time.perf_counter() - start
    return {"tokenizer_build_ms": tokenizer_s * 1e3, "first_constraint_ms": constraint_s * 1e3,
            "first_mask_ms": mask_s * 1e3}


def measure_compile(llm, args) -> dict:
    from spanserve.structured.grammars import Grammars
    from spanserve.structured.params import StructuredOutputs

    engine = llm.engine
    rows = []
    for i in range(args.compile_repeats):
        fresh = Grammars(engine.tokenizer, engine.grammars.vocab_size)
        start = time.perf_counter()
        fresh.tokenizer()
        tokenizer_s = time.perf_counter() - start
        spec = StructuredOutputs(json=form_schema(variant=1000 + i + int(time.time()) % 100000))
        first, cached = _compile_phases(fresh, spec), _compile_phases(fresh, spec)  # the second finds it cached
        rows.append({"tokenizer_build_ms": tokenizer_s * 1e3, "first_grammar_ms": first[0],
                     "first_constraint_ms": first[1], "first_mask_ms": first[2], "cached_grammar_ms": cached[0],
                     "cached_constraint_ms": cached[1], "cached_first_mask_ms": cached[2]})
    summary = {key: _median([r[key] for r in rows]) for key in rows[0]}
    summary["first_compile_ms"] = summary["first_grammar_ms"] + summary["first_constraint_ms"]
    summary["cached_compile_ms"] = summary["cached_grammar_ms"] + summary["cached_constraint_ms"]
    return {"properties": 50, "schema_bytes": len(json.dumps(form_schema())), "repeats": rows, **summary}


def _compile_phases(grammars, spec) -> tuple[float, float, float]:
    """ms to get the spec's grammar, a constraint from it, and the constraint's first mask."""
    import torch

    t0 = time.perf_counter()
    grammars.grammar(spec)
    t1 = time.perf_counter()
    constraint = grammars.constraint(spec)
    t2 = time.perf_counter()
    constraint.mask(torch.zeros(grammars.vocab_size))
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


def measure_ttft(llm, args) -> dict:
    from spanserve import SamplingParams

    schema = form_schema()
    llm.engine.grammars.grammar(_spec(schema))  # cached before the first turn
    messages = [{"role": "user", "content": "Fill in the form."}]
    conditions = {"none": SamplingParams(temperature=0, max_tokens=1),
                  "cached_schema": SamplingParams(temperature=0, max_tokens=1, structured_outputs={"json": schema})}
    wall: dict = {c: [] for c in conditions}
    engine_ttft: dict = {c: [] for c in conditions}
    for i in range(args.ttft_repeats + 2):  # two warm-up turns
        order = list(conditions) if i % 2 == 0 else list(conditions)[::-1]
        for c in order:
            start = time.perf_counter()
            out = llm.chat(messages, conditions[c])[0]
            seconds = time.perf_counter() - start
            if i >= 2:
                wall[c].append(seconds * 1e3)
                engine_ttft[c].append(out.metrics.ttft_s * 1e3)
    med = {c: _median(v) for c, v in wall.items()}
    eng = {c: _median(v) for c, v in engine_ttft.items()}
    return {"prompt": messages[0]["content"], "repeats": args.ttft_repeats, "wall_ms_median": med,
            "engine_ttft_ms_median": eng, "added_ms": med["cached_schema"] - med["none"],
            "engine_added_ms": eng["cached_schema"] - eng["none"], "wall_ms": wall, "engine_ttft_ms": engine_ttft}


def _spec(schema: dict):
    from spanserve.structured.params import StructuredOutputs

    return StructuredOutputs(json=schema)


def _tool_requests(engine, items: list[tuple[list[dict], list[str]]], choice: str, max_tokens: int):
    """(prompt, params, Tools) per item of (messages, offered function names)."""
    from spanserve import SamplingParams, Tools
    from spanserve.tools.conversation import chat_request

    requests = []
    for messages, names in items:
        tools = Tools([tool_prompts.tool(n) for n in names], choice=choice, parallel=False)
        prompt, params = chat_request(engine, messages, SamplingParams(temperature=0, max_tokens=max_tokens), tools)
        requests.append((prompt, params, tools))
    return requests


def _run_tools(llm, items, choice: str, max_tokens: int):
    requests = _tool_requests(llm.engine, items, choice, max_tokens)
    outs = llm.generate([r[0] for r in requests], [r[1] for r in requests])
    return [(tools.reply(o.outputs[0].text, o.outputs[0].finish_reason), o.outputs[0])
            for (_, _, tools), o in zip(requests, outs)]


def measure_tools(llm, args, log) -> dict:
    prompts = tool_prompts.PROMPTS[:args.max_tool_prompts] if args.max_tool_prompts else tool_prompts.PROMPTS
    no_tool = tool_prompts.NO_TOOL_PROMPTS[:args.max_tool_prompts] if args.max_tool_prompts \
        else tool_prompts.NO_TOOL_PROMPTS
    validators = {n: _validator(f["parameters"]) for n, f in tool_prompts.FUNCTIONS.items()}
    offer = args.functions_offered
    items = [([{"role": "user", "content": text}], tool_prompts.offered(i, fn, offer))
             for i, (text, fn, _) in enumerate(prompts)]
    result: dict = {"prompts": len(prompts), "no_tool_prompts": len(no_tool), "parallel_tool_calls": False,
                    "functions_offered_per_prompt": args.functions_offered, "max_tokens": args.tool_max_tokens,
                    "modes": {}}
    for choice in ("auto", "required"):
        start = time.perf_counter()
        replies = _run_tools(llm, items, choice, args.tool_max_tokens)
        records, counts = [], {"called": 0, "right_function": 0, "valid_arguments": 0, "right_values": 0, "text": 0}
        for (text, fn, expected), (reply, completion) in zip(prompts, replies):
            call = reply.tool_calls[0] if reply.tool_calls else None
            arguments, valid = None, False
            if call is not None:
                try:
                    arguments = json.loads(call.arguments)
                    valid = call.name in validators and validators[call.name].is_valid(arguments)
                except ValueError:
                    pass
            right_fn = call is not None and call.name == fn
            right_values = right_fn and tool_prompts.values_match(expected, arguments)
            counts["called"] += call is not None
            counts["right_function"] += right_fn
            counts["valid_arguments"] += bool(valid)
            counts["right_values"] += bool(right_values)
            counts["text"] += call is None
            records.append({"prompt": text, "expected": fn, "called": call.name if call else None,
                            "arguments": call.arguments if call else None, "valid_arguments": bool(valid),
                            "right_values": bool(right_values), "finish_reason": completion.finish_reason,
                            "text": None if call else completion.text[:300]})
        n = len(prompts)
        mode = {"called_pct": _pct(counts["called"], n), "right_function_pct": _pct(counts["right_function"], n),
                "valid_arguments_pct": _pct(counts["valid_arguments"], n),
                "right_values_pct": _pct(counts["right_values"], n),
                "answered_as_text_pct": _pct(counts["text"], n) if choice == "auto" else None,
                "seconds": time.perf_counter() - start, "records": records}
        if choice == "auto" and no_tool:
            no_items = [([{"role": "user", "content": text}], tool_prompts.offered(1000 + i, None, offer))
                        for i, text in enumerate(no_tool)]
            no_replies = _run_tools(llm, no_items, "auto", args.tool_max_tokens)
            not_called = sum(not reply.tool_calls for reply, _ in no_replies)
            mode["no_tool_correctly_not_called_pct"] = _pct(not_called, len(no_tool))
            mode["no_tool_records"] = [{"prompt": text, "called": [c.name for c in reply.tool_calls],
                                        "text": completion.text[:300]}
                                       for text, (reply, completion) in zip(no_tool, no_replies)]
        result["modes"][choice] = mode
        log(f"tools {choice}: " + ", ".join(f"{k} {v:.0f}%" for k, v in mode.items()
                                            if k.endswith("_pct") and v is not None))
    return result


# --- run ----------------------------------------------------------------------------------------

def goals(data: dict) -> dict:
    decode = data["decode"]["per_batch"]
    checks = {}
    for b, key in (("1", "decode_ratio_batch1"), ("8", "decode_ratio_batch8")):
        if b in decode:
            checks[key] = {"value": decode[b]["ratio"], "goal": f">= {GOALS[key]}",
                           "met": decode[b]["ratio"] >= GOALS[key]}
    ttft = data["ttft"]["added_ms"]
    checks["cached_ttft_added_ms"] = {"value": ttft, "goal": "< 1 ms", "met": ttft < GOALS["cached_ttft_added_ms"]}
    first = data["compile"]["first_compile_ms"]
    checks["first_compile_ms"] = {"value": first, "goal": "< 100 ms", "met": first < GOALS["first_compile_ms"]}
    valid = data["validity"]["valid_fraction"]
    checks["valid_fraction"] = {"value": valid, "goal": "1.0", "met": valid == 1.0}
    return checks


def run(args: argparse.Namespace) -> dict:
    if args.quick:
        apply_quick(args)
    threads = harness.configure_threads(args.threads)
    from spanserve import LLM

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    loadavg_before = list(os.getloadavg())
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype)
    model = model_short_name(args.model)
    data: dict = {"benchmark": "structured", "model": model, "dtype": str(llm.engine.dtype).removeprefix("torch."),
                  "quick": args.quick, "args": dict(vars(args)), "threads": threads}
    data["process_first_constraint"] = measure_first_constraint(llm)  # before anything else makes one
    data["compile"] = measure_compile(llm, args)
    data["decode"] = measure_decode(llm, args, log)
    data["ttft"] = measure_ttft(llm, args)
    data["validity"] = measure_validity(llm, args, log)
    data["tools"] = measure_tools(llm, args, log)
    data["goals"] = goals(data)
    data.update({"machine": harness.machine_info(), "machine_tag": machine_tag(), "loadavg_before": loadavg_before,
                 "loadavg_after": list(os.getloadavg()), "elapsed_s": time.perf_counter() - started})
    report(data)
    name = f"structured-{model}-{machine_tag()}" + ("-quick" if args.quick else "")
    harness.write_json(data, name=name, path=args.out)
    return data


def report(data: dict) -> None:
    model = data["model"]
    rows = [[f"batch {b}", r["free_tok_s"], r["constrained_tok_s"], r["ratio"], r["paired_ratio_median"]]
            for b, r in data["decode"]["per_batch"].items()]
    harness.print_table(["decode", "free tok/s", "constrained tok/s", "ratio", "paired ratio"], rows,
                        title=f"Decode, {data['decode']['tokens_per_request']} tokens a request, median of "
                              f"{data['decode']['repeats']} ({model}, {data['dtype']})")
    c = data["compile"]
    harness.print_table(["50-property schema", "ms"], [
        ["first compile (grammar + constraint)", c["first_compile_ms"]], ["  grammar (compile + check)",
                                                                          c["first_grammar_ms"]],
        ["  constraint (matcher)", c["first_constraint_ms"]], ["  first mask (lazy states)", c["first_mask_ms"]],
        ["cached (grammar + constraint)", c["cached_compile_ms"]], ["  cached first mask", c["cached_first_mask_ms"]],
        ["llguidance tokenizer (once per Grammars)", c["tokenizer_build_ms"]]], title="Grammar compile (median)")
    p = data["process_first_constraint"]
    t = data["ttft"]
    harness.print_table(["TTFT (max_tokens=1)", "none ms", "cached schema ms", "added ms"], [
        ["wall, median", t["wall_ms_median"]["none"], t["wall_ms_median"]["cached_schema"], t["added_ms"]],
        ["engine metric, median", t["engine_ttft_ms_median"]["none"], t["engine_ttft_ms_median"]["cached_schema"],
         t["engine_added_ms"]]], title=f"TTFT added by a cached schema ({t['repeats']} each)")
    print(f"first constraint of the process: {p['first_constraint_ms']:.0f} ms, its first mask "
          f"{p['first_mask_ms']:.0f} ms")
    v = data["validity"]
    harness.print_table(["schema", "outputs", "finished", "valid", "cut by max_tokens"], [
        [name, s["outputs"], s["finished_stop"], s["valid"], s["cut_by_max_tokens"]]
        for name, s in v["per_schema"].items()], title="Validity of constrained outputs (jsonschema_rs)")
    modes = data["tools"]["modes"]
    keys = [("called_pct", "% called"), ("right_function_pct", "% right function"),
            ("valid_arguments_pct", "% valid arguments"), ("right_values_pct", "% right values"),
            ("answered_as_text_pct", "% text"), ("no_tool_correctly_not_called_pct", "% no-tool not called")]
    harness.print_table(["tool_choice", *(label for _, label in keys)],
                        [[m, *(modes[m].get(k) for k, _ in keys)] for m in modes],
                        title=f"Tool calls: {data['tools']['prompts']} prompts, {data['tools']['no_tool_prompts']} "
                              "with no fitting tool (greedy, no parallel calls)")
    print("\ngoals:")
    for key, g in data["goals"].items():
        value = g["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {key}: {shown} (goal {g['goal']}) -> {'met' if g['met'] else 'NOT met'}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("structured", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
