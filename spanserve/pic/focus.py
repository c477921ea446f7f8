"""Which span blocks a focus probe recomputes in context, given the question's attention to each.

The probe (engine/runner.py focus_weights) scores every key by the attention the question's last
tokens give it. With `focus_tokens`, the blocks around the peaks are recomputed: each peak block
with the blocks just before and after it in its span, peaks taken by score until the budget is
spent. A lone peak block is not enough. On Qwen2.5-0.5B (16 documents, 30 questions, seed 12)
the question's attention peaked on the answer's block or next to it, and recomputing that block
plus the three next-highest ones kept 60% of answers, while the peak with its neighbours, 48
tokens in all, kept 93% (spans off: 93-100%): a fact runs across a block edge (the name before,
the value after), and the tokens after a value are what a copying head reads next.
"""

import numpy as np

# Blocks around each peak, relative to it, in the order a budget takes them: the block after a
# peak mattered more than the one before (30 questions as above: peak and next 93%, peak and
# previous 60% with the next peak's pair)
WINDOW = (0, 1, -1)


def focus_blocks(scores: np.ndarray, span_of_block: np.ndarray, budget: int) -> list[int]:
    """Up to `budget` block indices: windows around the highest-scoring blocks, best first.
    scores[b]: block b's attention; span_of_block[b]: its span, -1 for a block outside every span
    (never picked, and a window does not cross into another span)."""
    picked: list[int] = []
    taken = np.zeros(len(scores), dtype=bool)
    for peak in np.argsort(-scores, kind="stable"):
        if len(picked) >= budget or scores[peak] <= 0:
            break
        for b in peak + np.array(WINDOW):
            if (0 <= b < len(scores) and not taken[b] and span_of_block[peak] >= 0
                    and span_of_block[b] == span_of_block[peak] and len(picked) < budget):
                taken[b] = True
                picked.append(int(b))
    return picked
