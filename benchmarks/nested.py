"""Judge/generator benchmark: the judge's time to first token with span queries vs plain chat.

F generators write candidates (fan-out F, inner temperature T); a judge reads all of them.
- span query: g(cross(system, plus(g(gen_1), ..., g(gen_F)), question)) through the span
  query optimizer and executor: each candidate is a span whose KV (the generator's prompt and
  output) is already cached when the judge starts;
- plain: the same generators as one batch of chat requests, then the judge as a chat request
  with the candidates' text pasted in (prefix caching on, as vLLM would run it).
Two latencies of the judge, each the median of --repeats runs from an empty cache:
- TTFT, measured by the engine from the judge's arrival;
- ready: from the last candidate's last token to the judge's first token. For span queries this
  also counts what runs between them: completing each candidate's last, partial block (so the
  judge reuses every block of it). It is what a caller waits for once the candidates are written.

Tasks (--task): "emails", the span query paper's example (short job application emails, up to
--max-tokens, 128 by default), and "slogans" (one-paragraph slogans; the model stops after 25-64
tokens, so the judge's prompt stays short).

    spanserve bench nested [--task emails|slogans] [--fanouts 1,4,8] [--temperatures 0,0.5] [--quick]
"""

import argparse
import statistics
import sys

from benchmarks import harness
from spanserve.pic.link import POLICIES

TASKS = {
    "emails": {
        "system": "You are a hiring manager. You judge job application emails.",
        "question": "Which of the emails above is the most convincing? Quote its first sentence.",
        "prompt": "Write a short job application email for the position of {} at a small company.",
        "topics": ["junior accountant", "bakery assistant", "museum guide", "bicycle mechanic", "librarian",
                   "ferry deckhand", "dental receptionist", "gardener", "tea house manager", "ski instructor",
                   "pottery teacher", "bookshop clerk"],
        "max_tokens": 128,
    },
    "slogans": {
        "system": "You are a strict judge of advertising slogans.",
        "question": "Which of the slogans above is the most original? Quote it.",
        "prompt": "Write a catchy one-paragraph slogan for {}.",
        "topics": ["a bakery", "a bicycle shop", "a library", "a dentist", "a ferry line", "a bookshop", "a gym",
                   "a flower market", "a museum", "a tea house", "a ski school", "a pottery studio"],
        "max_tokens": 64,
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--task", default="emails", choices=list(TASKS), help="what the generators write")
    parser.add_argument("--fanouts", default="1,4,8")
    parser.add_argument("--temperatures", default="0,0.5")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per candidate (default: the task's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--link-policy", default="auto", choices=["auto", *POLICIES],
                        help="the engine's default span policy (auto: comb where a plug-in ships for the model)")
    parser.add_argument("--quick", action="store_true", help="fan-out 1 and 2, 16-token candidates, one repeat")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/nested.json)")


def generator_prompt(task: dict, i: int) -> str:
    return task["prompt"].format(task["topics"][i % len(task["topics"])])


def span_query(task: dict, fanout: int, temperature: float, max_tokens: int, seed: int):
    from spanserve.spans.ir import cross, g, plus, system, user

    candidates = [g(user(generator_prompt(task, i)), max_tokens=max_tokens, temperature=temperature, seed=seed + i)
                  for i in range(fanout)]
    return g(cross(system(task["system"]), plus(*candidates), user(task["question"])), max_tokens=1)


def run_span_query(llm, task, fanout, temperature, max_tokens, seed) -> dict:
    result = llm.run_query(span_query(task, fanout, temperature, max_tokens, seed))
    judge, inner = result.calls[-1], result.calls[:-1]
    return {"judge_ttft_s": judge.ttft_s, "judge_ready_s": judge.ready_s, "judge_prompt_tokens": judge.prompt_tokens,
            "judge_cached_tokens": judge.cached_tokens,
            "candidate_tokens": statistics.mean(c.generated_tokens for c in inner)}


def run_plain(llm, task, fanout, temperature, max_tokens, seed) -> dict:
    from spanserve import SamplingParams

    conversations = [[{"role": "user", "content": generator_prompt(task, i)}] for i in range(fanout)]
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i) for i in range(fanout)]
    outs = llm.chat(conversations, params)
    candidates = [out.outputs[0].text for out in outs]
    content = "\n\n".join(f"Candidate {i + 1}: {text}" for i, text in enumerate(candidates))
    judge = llm.chat([{"role": "system", "content": task["system"]},
                      {"role": "user", "content": f"{content}\n\n{task['question']}"}],
                     SamplingParams(temperature=0, max_tokens=1))[0]
    ready = max(out.metrics.finish_time for out in outs)
    return {"judge_ttft_s": judge.metrics.ttft_s, "judge_ready_s": judge.metrics.first_token_time - ready,
            "judge_prompt_tokens": len(judge.prompt_token_ids),
            "judge_cached_tokens": judge.num_cached_tokens,
            "candidate_tokens": statistics.mean(len(out.outputs[0].token_ids) for out in outs)}


def run(args) -> dict:
    harness.configure_threads()
    from spanserve import LLM

    fanouts = [1, 2] if args.quick else [int(x) for x in args.fanouts.split(",")]
    temperatures = [float(x) for x in args.temperatures.split(",")]
    task = TASKS[args.task]
    max_tokens, repeats = (16, 1) if args.quick else (args.max_tokens or task["max_tokens"], args.repeats)
    llm = LLM(model=args.model, dtype=args.dtype, link_policy=args.link_policy)
    rows, results = [], []
    for fanout in fanouts:
        for temperature in temperatures:
            runs = {"span query": [], "plain": []}
            for r in range(repeats):  # modes take turns so load changes hit both alike
                for mode, fn in (("span query", run_span_query), ("plain", run_plain)):
                    llm.engine.kv.pool.reset_cache()
                    runs[mode].append(fn(llm, task, fanout, temperature, max_tokens, seed=100 * r))
            entry = {"fanout": fanout, "temperature": temperature, "runs": runs}
            for mode in runs:
                entry[mode] = {k: statistics.median(x[k] for x in runs[mode]) for k in runs[mode][0]}
            span, plain = entry["span query"], entry["plain"]
            entry["speedup"] = plain["judge_ttft_s"] / span["judge_ttft_s"]
            entry["speedup_from_ready"] = plain["judge_ready_s"] / span["judge_ready_s"]
            results.append(entry)
            rows.append([fanout, temperature, round(plain["candidate_tokens"]),
                         plain["judge_prompt_tokens"], plain["judge_ttft_s"] * 1000,
                         span["judge_ttft_s"] * 1000, f"{span['judge_cached_tokens']}/{span['judge_prompt_tokens']}",
                         f"{entry['speedup']:.1f}x", plain["judge_ready_s"] * 1000, span["judge_ready_s"] * 1000,
                         f"{entry['speedup_from_ready']:.1f}x"])
    headers = ["fan-out", "temp", "candidate tok", "judge prompt", "plain TTFT ms", "span query TTFT ms",
               "span cached/prompt", "speedup", "plain ready ms", "span query ready ms", "speedup"]
    harness.print_table(headers, rows, title=f"Judge TTFT, {args.task}, {max_tokens}-token candidates, median of runs "
                       "(goal: >= 8x at fan-out 8, temp 0.5)")
    print("TTFT: from the judge's arrival. ready: from the last candidate's last token to the judge's first token, "
          "which for span queries also counts completing the candidates' last blocks")
    data = {"benchmark": "nested", "args": vars(args), "machine": harness.machine_info(), "results": results}
    out = harness.write_json(data, "nested", args.out)
    if not args.quick:
        labels = [f"F={e['fanout']} T={e['temperature']}" for e in results]
        series = {mode: [e[mode]["judge_ttft_s"] * 1000 for e in results] for mode in ("plain", "span query")}
        png = out.with_suffix(".png")
        harness.bar_chart(png, "Judge TTFT (ms)", labels, series, "ms", log_scale=True)
    return data


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("nested", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
