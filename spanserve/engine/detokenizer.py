"""Incremental detokenization and stop-string matching for one output sequence."""

from spanserve.sampling import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.num_output_tokens = 0
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    def add(self, token_id: int) -> str | None:
        """Append a token; return the stop string it completed, if any (text is cut there)."""
        self.tokens.append(token_id)
        self.num_output_tokens += 1
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self.tokens[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        if self.num_output_tokens <= self.params.min_tokens:
            return None  # as in vLLM, no stop string can end the output before min_tokens
        return self._check_stop(len(delta))

    def _check_stop(self, delta_len: int) -> str | None:
        if not self._max_stop_len:
            return None
        search_from = max(0, len(self.text) - delta_len - self._max_stop_len + 1)
        for stop in self.params.stop:
            idx = self.text.find(stop, search_from)
            if idx != -1:
                keep = idx + len(stop) if self.params.include_stop_str_in_output else idx
                self.text = self.text[:keep]
                return stop
        return None
