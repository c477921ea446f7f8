"""Sampler: logits of the requests that need a token this step -> tokens (+ logprobs)."""

from dataclasses import dataclass

import torch

from spanserve.engine.request import Request


@dataclass
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # the N most likely tokens


def sample(logits: torch.Tensor, requests: list[Request]) -> list[Sample]:
    """logits: [B, vocab] float32, row i belongs to requests[i]."""
    want_logprobs = any(r.params.logprobs is not None for r in requests)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    logits = logits.clone()
    for row, req in enumerate(requests):
        _apply_penalties(logits[row], req)
        _suppress_eos_before_min_tokens(logits[row], req)
        if req.constraint is not None:  # after the rest: what the grammar forbids stays forbidden
            req.constraint.mask(logits[row])
    token_ids = _choose_tokens(logits, requests)
    samples = [Sample(t) for t in token_ids.tolist()]
    if raw_logprobs is not None:
        for row, (req, s) in enumerate(zip(requests, samples)):
            if req.params.logprobs is not None:
                _add_logprobs(s, raw_logprobs[row], req.params.logprobs)
    return samples


def _add_logprobs(s: Sample, logprobs: torch.Tensor, top_n: int) -> None:
    """The sampled token's logprob and the `top_n` most likely tokens', from one row of log-softmax."""
    s.logprob = logprobs[s.token_id].item()
    top = logprobs.topk(top_n) if top_n else None
    s.top_logprobs = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))


def verify(logits: torch.Tensor, req: Request, drafts: list[int]) -> list[Sample]:
    """The tokens the target writes at a drafting request's len(drafts) + 1 positions (a row of
    `logits` each): the drafts it accepts, then one of its own. Greedy: a draft stands while it is
    the row's argmax. Sampled: the draft d of a row whose distribution is p stands with probability
    p(d); otherwise the row's token is drawn from p without d. Once every draft stands, the last
    row draws one more. For drafts of one token each (probability 1) this is speculative sampling
    (Leviathan et al. 2023, Chen et al. 2023): every token follows the target's distribution, drawn
    with the request's own generator (a seeded request stays reproducible). Penalties, min_tokens
    and a grammar apply to each row as they stand after the drafts before it."""
    raw, logits, base = logits, logits.clone(), req.num_tokens - len(drafts)
    for row in range(len(logits)):  # each row as sample() would process it after the drafts before it
        _apply_penalties(logits[row], req, base + row)
        _suppress_eos_before_min_tokens(logits[row], req, base + row)
    if req.constraint is not None:
        req.constraint.mask_rows(logits, drafts)
    if req.params.greedy:
        chosen = argmax_rows(logits).tolist()
        n = next((i for i, (c, d) in enumerate(zip(chosen, drafts)) if c != d), len(drafts))
        tokens = chosen[:n + 1]
    else:
        probs, tokens = _filtered_probs(logits, [req] * len(logits)), []
        for row, draft in enumerate(drafts):
            if torch.rand(1, generator=req.generator).item() < probs[row, draft].item():
                tokens.append(draft)
                continue
            probs[row, draft] = 0.0
            tokens.append(_draw(probs[row], req.generator))
            break
        else:
            tokens.append(_draw(probs[len(drafts)], req.generator))
    samples = [Sample(t) for t in tokens]
    if req.params.logprobs is not None:  # the model's own, before a grammar's mask (as sample() gives them)
        logprobs = torch.log_softmax(raw[:len(tokens)], dim=-1)
        for row, s in enumerate(samples):
            _add_logprobs(s, logprobs[row], req.params.logprobs)
    return samples


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn with probability proportional to `probs` (one row, unnormalized)."""
    return int(_draw_rows(probs.unsqueeze(0), [generator])[0])


def _draw_rows(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """A token per row of `probs` [B, vocab] (unnormalized), drawn with probability proportional to
    it: where one uniform number from the row's own generator falls in the row's cumulative sum
    (a seeded request stays reproducible whatever shares its batch). One number a row: an
    exponential race drew one per vocabulary entry, 0.9 ms a row for a 49k vocabulary on CPU, a
    fifth of a SmolLM2 decode step at batch 8."""
    cdf = probs.double().cumsum(-1)
    uniform = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators]).to(probs.device)
    chosen = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    # (a zero-probability token is never the first whose sum passes the number; rounding at the top
    # of the last row's mass can pass them all: its last possible token then)
    over = chosen >= probs.shape[-1]
    if over.any():
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
        chosen = torch.where(over, last, chosen)
    return chosen


def _apply_penalties(logits: torch.Tensor, req: Request, end: int | None = None) -> None:
    """Penalties on the next token after the request's first `end` tokens (all of them by default)."""
    p = req.params
    if not p.uses_penalties:
        return
    tokens = req.token_ids[:end]
    if p.repetition_penalty != 1.0:  # over prompt and output, as in HF/vLLM
        seen = torch.tensor(sorted(set(tokens)), dtype=torch.long)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    output = tokens[req.num_prompt_tokens:]
    if output and (p.presence_penalty or p.frequency_penalty):  # over the output only, as in OpenAI
        counts = torch.bincount(torch.tensor(output), minlength=logits.numel()).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _suppress_eos_before_min_tokens(logits: torch.Tensor, req: Request, end: int | None = None) -> None:
    """No end of the sequence after the first `end` tokens (all by default) before min_tokens."""
    if (end if end is not None else req.num_tokens) - req.num_prompt_tokens < req.params.min_tokens:
        for token_id in [*req.eos_token_ids, *req.params.stop_token_ids]:
            logits[token_id] = float("-inf")


def _choose_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    greedy = torch.tensor([r.params.greedy for r in requests])
    chosen = argmax_rows(logits)
    if greedy.all():
        return chosen
    sampled = _draw_rows(_filtered_probs(logits, requests), [req.generator for req in requests])
    return torch.where(greedy, chosen, sampled)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first of equal maxima (a NaN counts as the maximum), as torch's. In
    numpy: torch 2.13's CPU argmax took 260-440 us over 8 rows of 49,152 logits, numpy's 36, a tenth
    of a decode step's host work."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1))


def _filtered_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature or 1.0 for r in requests]).unsqueeze(1)
    # Shifted by the row's maximum first: a tiny temperature then sends logits to -inf, never to
    # +inf (whose softmax is NaN); the distribution is the same.
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temps
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    if any(top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([r.params.min_p for r in requests]).unsqueeze(1)
    if (min_p > 0).any():
        probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([k if k > 0 else vocab for k in top_k]).unsqueeze(1)
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    p = torch.tensor(top_p).unsqueeze(1)
    # Drop a token once the ones before it already reach top_p (the first always stays).
    drop |= (cumulative - sorted_logits.softmax(dim=-1)) >= p
    drop[:, 0] = False  # rounding must not drop the most likely token too (a tiny top_p)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
