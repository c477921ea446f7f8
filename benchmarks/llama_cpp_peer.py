"""llama.cpp as a peer in the benchmarks, in a process of its own.

llama-cpp-python runs its threads on OpenMP. In our process it would share torch's OpenMP runtime
(the same libgomp.so.1, loaded once), started with our wait policy: under PASSIVE its threads
sleep between its many small ops, and it decodes about 3x slower than it can (SmolLM2 Q4_1, 2
threads, on this machine: 31 tok/s passive, 100 tok/s with OpenMP's default). So the peer runs
in a child process with OpenMP's defaults (neither our wait policy nor our spin count) and times
itself there; the parent only sends token ids and reads the timings back (JSON lines over a pipe).
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def peer_gguf(model: str | None) -> tuple[Path | None, str]:
    """The GGUF a llama.cpp peer of `model` runs, or None and why it cannot run. llama-cpp-python is
    looked up, not imported: loading it here would put its OpenMP beside ours for nothing."""
    from spanserve.models.loader import gguf_file

    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama-cpp-python is not installed (pip install llama-cpp-python)"
    gguf = gguf_file(model)
    return (gguf, "") if gguf is not None else (None, "the model is not a GGUF")


class LlamaCppPeer:
    """A llama.cpp model in a child process. Every method returns timings measured in the child."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, n_batch: int = 512, prompt_lookup: int = 0):
        """prompt_lookup > 0: decode with llama-cpp-python's prompt lookup drafts of that many tokens
        (LlamaPromptLookupDecoding)."""
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        config = {"model_path": str(gguf), "n_ctx": n_ctx, "n_threads": threads, "n_batch": n_batch,
                  "prompt_lookup": prompt_lookup}
        self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(config)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)
        self.vocab_size: int = self._call("vocab_size")

    def prefill(self, ids: list[int]) -> float:
        """Seconds to evaluate `ids` from an empty cache."""
        return self._call("prefill", ids)

    def token_times(self, ids: list[int], n: int) -> list[float]:
        """[start, time of each of the first n greedy tokens] from an empty cache, in seconds."""
        return self._call("token_times", ids, n)

    def decode(self, ids: list[int], n: int) -> tuple[list[int], float]:
        """The greedy tokens after `ids` (up to n, or to EOS) and the seconds they took, reusing the
        longest prefix shared with the previous call's."""
        return self._call("decode", ids, n)

    def first_token(self, ids: list[int]) -> float:
        """Seconds to the first greedy token after `ids`, reusing the longest prefix it shares with
        the previous call's (llama.cpp keeps one sequence's KV)."""
        return self._call("first_token", ids)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)

    def _call(self, method: str, *args):
        self.proc.stdin.write(json.dumps([method, *args]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp peer process ended (exit code {self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp peer: {reply['error']}")
        return reply["result"]


def _serve(config: dict) -> None:
    """The child: answer one JSON request per line. Replies go to the original stdout; anything a
    library prints goes to stderr."""
    import llama_cpp

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    lookup = config.pop("prompt_lookup", 0)
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        config["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    llm = llama_cpp.Llama(seed=0, verbose=False, **config)

    def greedy(ids: list[int], reset: bool):
        return llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=reset)

    def prefill(ids):
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - start

    def token_times(ids, n):
        llm.reset()
        times = [time.perf_counter()]
        for _ in greedy(ids, reset=True):
            times.append(time.perf_counter())
            if len(times) > n:
                break
        return [t - times[0] for t in times]

    def first_token(ids):
        start = time.perf_counter()
        next(iter(greedy(ids, reset=True)))  # reset=True keeps the common prefix's KV
        return time.perf_counter() - start

    def decode(ids, n):
        start, tokens = time.perf_counter(), []
        for token in greedy(ids, reset=True):
            if token == llm.token_eos() or len(tokens) == n:
                break
            tokens.append(token)
        return [tokens, time.perf_counter() - start]

    methods = {"vocab_size": llm.n_vocab, "prefill": prefill, "token_times": token_times, "first_token": first_token,
               "decode": decode}
    for line in sys.stdin:
        method, *args = json.loads(line)
        try:
            reply = {"result": methods[method](*args)}
        except Exception as exc:  # reported to the parent, which raises it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
