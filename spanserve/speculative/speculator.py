"""Speculator: the drafts of the running requests for one step, and how many each request gets.

Before a step it appends each eligible decoding request's draft to its tokens, so the scheduler
plans them like any tokens (and allocates their slots); after scheduling, drafts beyond what the
step computes are dropped. After the step the drafts leave the tokens again: the engine appends
what the target accepted, one token at a time through its usual stop checks, and the KV the step
computed for the accepted drafts counts as computed. A rejected draft's KV sits beyond the
computed tokens, is never hashed into the prefix cache, and is overwritten later.

A request whose drafts keep being rejected gets fewer (down to one), and after REJECTED_STEPS
fully rejected drafts in a row none for PAUSE_STEPS steps: chat with little to copy pays little.

How long a draft is worth being: its j-th token stands only if the j-1 before it do, so with a
per-token acceptance a it brings a**j tokens on average, and it costs the step DRAFT_TOKEN_COST
of its time, worth that many of each of the step's n decoding requests' tokens: it is worth
a**j - DRAFT_TOKEN_COST * n tokens (at batch 1 and a = 0.7 a draft has seven worth making, at
batch 8 two). A step's STEP_DRAFT_BUDGET goes to the tokens worth most, of whichever requests.
A draft model drafts position j of every request in one step of its own, which costs a fraction
r of a target step, worth r * n tokens: position j is drafted while the tokens drafted there are
worth more than that together; r is the ratio of the two models' weights (a decode step reads
each weight once: Qwen2.5-Coder 0.5B over 1.5B in w8a8 is 0.38, and the 0.5B's steps measured
0.41-0.43 of the 1.5B's at batch 1 on an AMD Zen 4). A request none of whose tokens is worth
drafting drafts one, to learn whether that has changed, where a lone certain token would pay for
itself, and then none for PAUSE_STEPS steps."""

from dataclasses import dataclass

from spanserve.speculative import ngram
from spanserve.speculative.config import SpeculativeConfig

REJECTED_STEPS = 4
PAUSE_STEPS = 16
# Draft tokens checked per step, all requests together, the tokens worth most first: a CPU step
# costs about the same for a few dozen tokens as for one (weights read once), much more beyond. At
# batch 8 with 5 drafts each (48 tokens a step) free chat ran 0.81x plain (`spanserve bench
# speculative`, SmolLM2, AMD Zen 4).
STEP_DRAFT_BUDGET = 16
# What a draft token adds to a decode step's time (SmolLM2 float32, AMD Zen 4: a step of 8
# sequences took 30 ms, with 1-5 draft tokens more 36-41 ms).
DRAFT_TOKEN_COST = 0.06
ACCEPTANCE_DECAY = 0.7  # a request's recent acceptance: this much of the old, the rest the last step's


@dataclass
class _Drafting:
    k: int  # drafts it gets next, at most
    acceptance: float = 0.5  # of its recent draft tokens whose predecessors stood, the fraction that stood (decayed)
    rejected_in_a_row: int = 0
    paused: int = 0  # steps left without drafts
    num_real: int = 0  # its tokens before this step's draft
    drafted: int = 0  # this step's draft, after scheduling


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft_model=None):
        """`draft_model`: a DraftModel for method draft_model; ngram drafts by prompt lookup."""
        self.config, self.draft_model = config, draft_model
        self.draft_cost = draft_model.relative_cost if draft_model is not None else 0.0  # r (module note)
        self.state: dict[object, _Drafting] = {}  # request -> its drafting (dropped when it ends)
        self.num_drafted = 0  # totals since start: acceptance = num_accepted / num_drafted
        self.num_accepted = 0
        self.acceptance = 0.5  # per-token, over all requests (decayed): a new request's first guess

    def draft(self, running: list) -> None:
        """Append a draft to each decoding request that may have one."""
        counts = self._counts([req for req in running if _eligible(req)])
        drafting = list(counts)
        for req, tokens in zip(drafting, self._propose([req.token_ids for req in drafting], list(counts.values()))):
            if tokens and req.constraint is not None:  # what the grammar would refuse is no draft
                tokens = tokens[:req.constraint.allowed_prefix(tokens)]
            req.token_ids.extend(tokens)
            self.state[req].drafted = len(tokens)

    def _counts(self, decoding: list) -> dict:
        """How many tokens each request not paused drafts this step (module note)."""
        n = len(decoding)
        token_cost, position_cost = DRAFT_TOKEN_COST * n, self.draft_cost * n
        counts, rooms, worths = {}, {}, []  # worths: (what the j-th token of a request is worth, j, request)
        for req in decoding:
            state = self._state(req)
            state.num_real, state.drafted = req.num_tokens, 0
            if state.paused:
                state.paused -= 1
                continue
            counts[req] = 0
            rooms[req] = min(req.params.max_tokens - req.num_output_tokens, req.max_total_tokens - req.num_tokens) - 1
            worths += [(state.acceptance ** j - token_cost, j, req) for j in range(1, min(state.k, rooms[req]) + 1)]
        worths.sort(key=lambda w: (-w[0], w[1]))  # (a request's tokens in order: their worth falls with j)
        chosen = [w for w in worths[:STEP_DRAFT_BUDGET] if w[0] > 0]
        positions = {}  # a draft model's: the worth of the tokens drafted at each
        for worth, j, _ in chosen:
            positions[j] = positions.get(j, 0) + worth
        last = 0  # the positions worth a draft model's step: all of them for prompt lookup
        while last + 1 in positions and (self.draft_model is None or positions[last + 1] > position_cost):
            last += 1
        for _, j, req in chosen:
            counts[req] = max(counts[req], min(j, last))
        probe = 1 - token_cost > position_cost  # a lone token that surely stands pays its share and its position
        # (a request worth drafting for whom the budget left nothing waits its turn)
        waiting = {req for worth, _, req in worths if worth > 0} - {req for _, _, req in chosen}
        for req in [req for req, count in counts.items() if not count and req not in waiting]:
            counts[req], self.state[req].paused = int(probe and rooms[req] > 0), PAUSE_STEPS
        return counts

    def _state(self, req) -> _Drafting:
        """A request's drafting; a new one starts from the acceptance of the requests before it."""
        state = self.state.get(req)
        if state is None:
            state = self.state[req] = _Drafting(self.config.num_speculative_tokens, self.acceptance)
        return state

    def _propose(self, contexts: list[list[int]], counts: list[int]) -> list[list[int]]:
        if self.draft_model is not None:
            return self.draft_model.propose(contexts, counts)
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        return [ngram.propose(context, count, low, high) for context, count in zip(contexts, counts)]

    def fit(self, batch: list) -> None:
        """Keep of each draft what this step computes; a request not in the step loses its draft
        (a preempted one too: its tokens are recomputed from its real ones)."""
        scheduled = {item.request: item for item in batch}
        for req, state in self.state.items():
            if not state.drafted:
                continue
            item = scheduled.get(req)
            keep = max(0, min(state.drafted, item.end - state.num_real)) if item is not None else 0
            del req.token_ids[state.num_real + keep:]
            state.drafted = keep
            if item is not None:
                item.drafts = keep

    def withdraw(self, batch: list) -> None:
        """Take the drafts out of the tokens after the step, before the scheduler counts it: each
        drafting request's step ends at its real tokens (its item keeps `drafts`, how many it checked)."""
        for item in batch:
            if item.drafts:
                state = self.state[item.request]
                del item.request.token_ids[state.num_real:]
                item.end = state.num_real

    def accepted(self, req, drafted: int, num_accepted: int, kv) -> None:
        """After the engine appended the accepted tokens: the drafts' KV that the target kept
        counts as computed (and its full blocks enter the prefix cache); the next draft's size."""
        self.num_drafted += drafted
        self.num_accepted += num_accepted
        state = self.state.get(req)
        if state is None or req.is_finished:  # it ended on one of them: nothing more to count
            return
        req.num_computed_tokens = state.num_real + num_accepted
        kv.cache_computed_blocks(req)
        state.drafted = 0
        # the tokens that stood, out of those and the one rejected (if one was): per-token acceptance
        observed = num_accepted / (num_accepted + (num_accepted < drafted))
        state.acceptance = ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * observed
        self.acceptance = ACCEPTANCE_DECAY * self.acceptance + (1 - ACCEPTANCE_DECAY) * observed
        if num_accepted == drafted:
            state.k, state.rejected_in_a_row = min(self.config.num_speculative_tokens, state.k + 1), 0
            return
        state.k = max(1, num_accepted + 1)
        state.rejected_in_a_row = state.rejected_in_a_row + 1 if num_accepted == 0 else 0
        if state.rejected_in_a_row >= REJECTED_STEPS:
            state.paused, state.rejected_in_a_row = PAUSE_STEPS, 0

    def forget(self, req) -> None:
        self.state.pop(req, None)


def _eligible(req) -> bool:
    """Decoding, with a grammar that is not done. Penalties, min_tokens and a grammar the check
    follows row by row (sampler.verify); drafts end where the grammar would refuse; a sparse
    flow picks for each row as for its own decode step (sparse/decode.py)."""
    return (not req.is_prefilling and not req.is_finished and not req.prefill_only
            and req.num_computed_tokens == req.num_tokens - 1
            and (req.constraint is None or not req.constraint.done))
