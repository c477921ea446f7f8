"""Prompt lookup (vLLM's ngram method, llama.cpp's lookup decoding): the tokens that followed the
last time the context's final n tokens appeared in it. Answers that quote their documents, code
edits and extraction copy long runs of their context: drafts from it cost nothing to make."""

import numpy as np


def propose(token_ids: list[int], k: int, low: int, high: int) -> list[int]:
    """Up to `k` tokens: what followed the most recent earlier occurrence of the longest suffix of
    `token_ids` of length between `low` and `high` that occurs earlier; [] if none does."""
    if k < 1 or len(token_ids) <= low:
        return []
    context = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(high, len(context) - 1), low - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        starts = np.flatnonzero((windows == context[-n:]).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n  # the token after the most recent match
            return context[follow:follow + k].tolist()
    return []
