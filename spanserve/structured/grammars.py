"""Grammars: the compiled grammars of one tokenizer, cached by their source, and Constraint: one
request's place in its grammar, which masks its logits before each token and follows the token
sampled."""

import re
import threading
from collections import OrderedDict

import numpy as np
import torch

from spanserve.structured.params import InvalidGrammarError, StructuredOutputs
from spanserve.structured.schema import closed

MAX_CACHED = 256  # grammars kept, the least recently used dropped first
# JSON without free whitespace between its tokens: a model may otherwise run on in blank space and
# never close the object within max_tokens (seen on a small model)
COMPACT_JSON = {"whitespace_flexible": False}


class Grammars:
    """llguidance over a Hugging Face tokenizer, for a model of `vocab_size` logits."""

    def __init__(self, tokenizer, vocab_size: int):
        self._hf, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None
        # StructuredOutputs.key() -> its compiled grammar: a matcher never advanced, which each
        # request copies (a copy costs ~0.05 ms; compiling again, 4-140 ms on a 50-property schema)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def grammar(self, spec: StructuredOutputs):
        """The compiled grammar of `spec` (an llguidance matcher at its start, never advanced;
        InvalidGrammarError, naming the problem, if the library cannot compile it); cached by its
        source."""
        import llguidance

        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            text = _grammar_text(spec)
        except ValueError as exc:
            raise InvalidGrammarError(f"structured_outputs: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer())
        if error:
            raise InvalidGrammarError(f"structured_outputs: {error.splitlines()[0][:500]}")
        compiled = llguidance.LLMatcher(self.tokenizer(), text)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return compiled

    def constraint(self, spec: StructuredOutputs) -> "Constraint":
        return Constraint(self.grammar(spec).deep_copy(), self.vocab_size)

    def warm(self) -> None:
        """Build what the first constrained request would otherwise wait for: the library's view of
        the vocabulary and its token tables, which its first mask fills (0.5 s and 2 s for SmolLM2's
        49k tokens, 4 s and 5 s for Qwen2.5's 152k, `spanserve bench structured`, AMD Zen 4)."""
        self.constraint(StructuredOutputs(json_object=True)).mask(torch.zeros(self.vocab_size))

    def tokenizer(self):
        """llguidance's view of the tokenizer (built once: a few hundred ms)."""
        import llguidance.hf

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size)
            return self._tokenizer


def _grammar_text(spec: StructuredOutputs) -> str:
    from llguidance import LLMatcher

    if spec.json is not None:
        return LLMatcher.grammar_from_json_schema(closed(spec.json), overrides=COMPACT_JSON)
    if spec.json_object:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=COMPACT_JSON)
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in spec.choice))
    return LLMatcher.grammar_from_lark(spec.grammar)


class Constraint:
    """One request's place in its grammar: the tokens it may sample next, and the token it did.

    Masks are the library's bitmasks (bit t of the mask allows token t: bit t % 32 of little-endian
    word t // 32), unpacked here: llguidance.torch's apply kernel is a torch.compile'd function that
    took 3.5-16 ms a call on this CPU (and seconds to compile at first use), the unpacking 0.3 ms."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of the tokens the grammar does not allow next to -inf (in place, one row)."""
        self._masked(logits.view(1, -1), self._bitmasks([]))

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (a draft) the grammar allows in a row from here."""
        return self.matcher.validate_tokens(tokens)

    def mask_rows(self, logits: torch.Tensor, draft: list[int]) -> None:
        """Mask row i of `logits` as the grammar would after the first i tokens of `draft` (which
        it allows): the rows a speculative step checks. The grammar ends where it started."""
        self._masked(logits, self._bitmasks(draft))

    def _bitmasks(self, draft: list[int]) -> torch.Tensor:
        """[len(draft) + 1, words] int32: what the grammar allows now and after each draft token."""
        bitmask = torch.empty(len(draft) + 1, -(-self.vocab_size // 32), dtype=torch.int32)
        for i in range(len(draft) + 1):
            row = bitmask[i]
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if i < len(draft):
                self.matcher.consume_token(draft[i])
        if draft:
            self.matcher.rollback(len(draft))
        return bitmask

    def _masked(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        # numpy: no torch thread team to wake for a row of 49-152k flags (under load a two-thread
        # torch op here took 30-40 ms, numpy 0.3)
        forbidden = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :logits.shape[-1]] == 0
        if logits.device.type == "cpu":
            logits.numpy()[forbidden] = -np.inf
        else:
            logits.masked_fill_(torch.from_numpy(forbidden).to(logits.device), float("-inf"))

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing may follow (but the end of the sequence)."""
        return self.matcher.is_stopped()
