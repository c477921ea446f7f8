"""Picking a sparse question's blocks: block_topk's C picks against its torch path, in one process.

A session holds --context tokens of the session benchmark's price bars; the same questions are
asked over a block_topk flow (sparse_prefill, --budget tokens), the picks made in turn by the C
kernel (kernels/csrc/block_pick.c) and by the torch path (forward_indexer over the fields read out,
SPANSERVE_CPU_KERNELS without `sparse`), --rounds rounds of every question, alternating. Reported:
the median question latency, the median time spent picking (every layer's SparseStep.restrict),
and how many answers the two agree on (the picks are the same, so all of them should).

    spanserve bench sparse_pick [--model M] [--quantization w8a8] [--context 7600] [--budget 1024]
"""

import argparse
import statistics
import sys
import time

from benchmarks import harness
from benchmarks.session import QUESTIONS, SYSTEM, bars

PATHS = ("c", "torch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--quantization", default=None, help="our engine's weights: int8, int4 or w8a8")
    parser.add_argument("--context", type=int, default=7600, help="data tokens in the session")
    parser.add_argument("--budget", type=int, default=1024, help="tokens the flow attends to")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sparse_pick.json)")


def run(args: argparse.Namespace) -> dict:
    harness.configure_threads()
    from spanserve import LLM, SamplingParams
    from spanserve.kernels import cpu_kernel
    from spanserve.sparse.decode import SparseStep

    llm = LLM(model=args.model, kv_cache_memory_gb=3.0, quantization=args.quantization)
    fmt = llm.engine.sessions.format
    per_row = statistics.mean(len(fmt.data(r)) for r in bars(50, seed=1))
    session = llm.create_session(SYSTEM)
    session.append("".join(bars(int(args.context / per_row))))
    session.wait()
    params = SamplingParams(temperature=0, max_tokens=1, sparse="block_topk", sparse_budget=args.budget,
                            sparse_prefill=True)
    if cpu_kernel.load("sparse") is None:
        raise SystemExit("the C picks are not available here (no compiler, or SPANSERVE_CPU_KERNELS leaves them out)")
    allowed = {"c": set(cpu_kernel.KERNELS), "torch": set(cpu_kernel.KERNELS) - {"sparse"}}
    picking, restrict = [0.0], SparseStep.restrict

    def timed_restrict(self, *a):
        start = time.perf_counter()
        try:
            return restrict(self, *a)
        finally:
            picking[0] += time.perf_counter() - start

    latency: dict[str, list[float]] = {p: [] for p in PATHS}
    picks: dict[str, list[float]] = {p: [] for p in PATHS}
    answers: dict[str, list[str]] = {p: [] for p in PATHS}
    SparseStep.restrict = timed_restrict
    try:
        for _ in range(args.rounds + 1):  # the first round warms both paths and is not kept
            for path in PATHS:
                with cpu_kernel.only_kernels(allowed[path]):
                    for question in QUESTIONS:
                        picking[0], start = 0.0, time.perf_counter()
                        answers[path].append(session.query(question + " ", params).text)
                        latency[path].append(time.perf_counter() - start)
                        picks[path].append(picking[0])
    finally:
        SparseStep.restrict = restrict
    kept = slice(len(QUESTIONS), None)
    row = {p: {"question_ms": statistics.median(latency[p][kept]) * 1000,
               "picking_ms": statistics.median(picks[p][kept]) * 1000} for p in PATHS}
    same = sum(a == b for a, b in zip(answers["c"][kept], answers["torch"][kept]))
    result = {"benchmark": "sparse_pick", "model": args.model or "SmolLM2-135M-Instruct",
              "quantization": args.quantization, "context_tokens": session.info()["num_tokens"],
              "budget": args.budget, "rounds": args.rounds, "paths": row,
              "same_answers": same, "questions": len(answers["c"][kept]), "machine": harness.machine_info()}
    harness.print_table(["picks", "question ms (median)", "picking ms (median)"],
                        [[p, f"{row[p]['question_ms']:.1f}", f"{row[p]['picking_ms']:.1f}"] for p in PATHS],
                        title=f"sparse question at {args.context} tokens, budget {args.budget}; "
                              f"same answers {same} of {result['questions']}")
    harness.write_json(result, path=args.out or harness.result_path("sparse_pick"))
    return result


def main(argv: list[str] | None = None) -> int:
    return harness.cli_main("sparse_pick", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
