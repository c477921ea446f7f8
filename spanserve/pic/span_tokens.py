"""Token ids of span texts seen lately: a document is tokenized once, not at every prompt it is in.

RAG prompts carry the same documents again and again; tokenizing a 16-document prompt costs
several milliseconds of a warm span prompt's time to first token. The memo is keyed by the text
and how special tokens are added and read, bounded by the tokens it holds (least recently used
go first), and safe to share between threads. In a cluster the ingress, which tokenizes a request
to route it (through one memo for all its texts), hands its spans' ids to the replica (`add`), so
a new document is tokenized once there too.
"""

import threading
from array import array
from collections import OrderedDict

MAX_TOKENS = 1 << 21  # 8 MiB of ids


class SpanTokens:
    def __init__(self, tokenizer, max_tokens: int = MAX_TOKENS):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self._ids: OrderedDict[tuple[str, bool, bool], array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        """The tokenizer's ids of `text`."""
        key = (text, add_special_tokens, split_special_tokens)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                return ids.tolist()
        tokens = self.tokenizer.encode(text, add_special_tokens=add_special_tokens,
                                       split_special_tokens=split_special_tokens)
        self._remember(key, tokens)
        return tokens

    def add(self, entries: list[tuple[str, bool, list[int]]]) -> None:
        """Ids of (text, split_special_tokens) computed elsewhere with the same tokenizer, no special
        tokens added (the cluster's ingress)."""
        for text, split, tokens in entries:
            key = (text, False, bool(split))
            with self._lock:
                held = self._ids.get(key) is not None
                if held:  # (a replica is handed a document's ids with every request that holds it)
                    self._ids.move_to_end(key)
            if not held:
                self._remember(key, tokens)

    def __len__(self) -> int:
        return len(self._ids)

    def _remember(self, key: tuple[str, bool, bool], tokens: list[int]) -> None:
        if len(tokens) > self.max_tokens:
            return
        with self._lock:
            old = self._ids.pop(key, None)
            self._tokens += len(tokens) - (len(old) if old is not None else 0)
            self._ids[key] = array("i", tokens)
            while self._tokens > self.max_tokens:
                self._tokens -= len(self._ids.popitem(last=False)[1])
