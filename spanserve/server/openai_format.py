"""RequestOutputs -> OpenAI response bodies and stream chunks."""

import time
from collections.abc import AsyncIterator

from spanserve.errors import InvalidRequestError, InvalidSpanError
from spanserve.outputs import RequestOutput
from spanserve.pic.prompt import Span
from spanserve.tools import Tools
from spanserve.tools.stream import ToolStream


def completion_prompts(prompt, spans, engine) -> list[tuple[str | None, dict]]:
    """Normalize OpenAI's four prompt forms, and our list of parts, to (text, engine prompt) pairs."""
    if spans is not None and not (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        raise InvalidSpanError("spans go with a single token-id prompt; mark text spans with prompt parts")
    if isinstance(prompt, list) and any(not isinstance(p, (str, int, list)) for p in prompt):
        parts = [p if isinstance(p, str) else Span(p.text) if p.span else p.text for p in prompt]
        if any(isinstance(p, Span) for p in parts):
            return [(None, _token_prompt(engine.tokenize(parts)))]
        prompt = "".join(parts)
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        return [(None, {"prompt_token_ids": list(prompt), "spans": spans or []})]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty")
    return [(p, {"prompt_token_ids": engine.tokenize(p).token_ids}) if isinstance(p, str)
            else (None, {"prompt_token_ids": list(p)}) for p in prompt]


def _token_prompt(tokenized) -> dict:
    return {"prompt_token_ids": tokenized.token_ids, "spans": [list(s) for s in tokenized.spans]}


def usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict], offset: int = 0) -> dict:
    tokens = [_token_text(tokenizer, t) for t in token_ids]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs)],
        "top_logprobs": [{_token_text(tokenizer, k): v for k, v in lp.items()} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict], top_n: int) -> dict:
    def entry(token_id, logprob):
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for t, lp in zip(token_ids, logprobs):
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in top]})
    return {"content": content}


def _prompt_text(text: str | None, ids: list[int], tokenizer) -> str:
    return text if text is not None else tokenizer.decode(ids)


def completion_response(results, body, model: str, tokenizer, response_id: str) -> dict:
    choices, finals = [], []
    for p_idx, ((text, ids, _), final) in enumerate(results):
        finals.append(final)
        for c in final.outputs:
            prefix = _prompt_text(text, ids, tokenizer) if body.echo else ""
            choices.append({
                "index": p_idx * body.n + c.index, "text": prefix + c.text, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": completion_logprobs(tokenizer, c.token_ids, c.logprobs, len(prefix))
                if body.logprobs is not None else None,
            })
    return {"id": response_id, "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage(finals)}


def chat_response(final: RequestOutput, body, model: str, tokenizer, response_id: str,
                  tools: Tools | None = None) -> dict:
    choices = []
    for c in final.outputs:
        message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if tools is not None:
            reply = tools.reply(c.text, c.finish_reason)
            message["content"], finish_reason = reply.content, reply.finish_reason
            if reply.tool_calls:
                message["tool_calls"] = [call.openai() for call in reply.tool_calls]
        choices.append({
            "index": c.index, "message": message, "finish_reason": finish_reason, "stop_reason": c.stop_reason,
            "logprobs": chat_logprobs(tokenizer, c.token_ids, c.logprobs, body.top_logprobs or 0)
            if body.logprobs else None,
        })
    return {"id": response_id, "object": "chat.completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage([final])}


class _Deltas:
    """Turns cumulative outputs into per-choice deltas (text offset, text, tokens, logprobs).

    Until a choice finishes, the last len(longest stop string) - 1 characters are held back: they
    may be the start of a stop string, which the engine cuts from the text once it is complete.
    """

    def __init__(self, stop: str | list[str] | None = None):
        stops = [stop] if isinstance(stop, str) else stop or []
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text_len: dict[int, int] = {}
        self.token_len: dict[int, int] = {}

    def of(self, out: RequestOutput):
        for c in out.outputs:
            t0, k0 = self.text_len.get(c.index, 0), self.token_len.get(c.index, 0)
            if t0 == -1:
                continue  # already sent its final chunk
            text = c.text if c.finish_reason is not None else c.text[:max(t0, len(c.text) - self.hold)]
            if len(text) == t0 and len(c.token_ids) == k0 and c.finish_reason is None:
                continue
            self.text_len[c.index], self.token_len[c.index] = len(text), len(c.token_ids)
            if c.finish_reason is not None:
                self.text_len[c.index] = -1
            yield c, t0, text[t0:], c.token_ids[k0:], (c.logprobs or [])[k0:]


async def stream_completion(runs, body, model: str, tokenizer, chunk_id: str) -> AsyncIterator[dict]:
    created = int(time.time())
    finals = []
    for p_idx, (text, ids, run) in enumerate(runs):  # prompts are streamed one after another
        deltas, final = _Deltas(body.stop), None
        if body.echo:
            for i in range(body.n):
                yield _completion_chunk(chunk_id, created, model, p_idx * body.n + i,
                                        _prompt_text(text, ids, tokenizer), None, None)
        async for out in run:
            final = out
            for c, offset, delta, new_ids, new_lps in deltas.of(out):
                lps = completion_logprobs(tokenizer, new_ids, new_lps, offset) if body.logprobs is not None else None
                yield _completion_chunk(chunk_id, created, model, p_idx * body.n + c.index, delta,
                                        c.finish_reason, lps)
        finals.append(final)
    if body.stream_options and body.stream_options.include_usage:
        yield {"id": chunk_id, "object": "text_completion", "created": created, "model": model,
               "choices": [], "usage": usage(finals)}


def _completion_chunk(chunk_id, created, model, index, text, finish_reason, logprobs) -> dict:
    return {"id": chunk_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


class _Replies:
    """The chat deltas of each choice's new text: content, or content and tool calls (tools/stream.py)."""

    def __init__(self, tools: Tools | None):
        self.tools, self.texts, self.streams = tools, {}, {}

    def of(self, c, delta: str) -> tuple[list[dict], str | None]:
        if self.tools is None:
            return ([{"content": delta}] if delta else []), c.finish_reason
        text = self.texts[c.index] = self.texts.get(c.index, "") + delta
        stream = self.streams.setdefault(c.index, ToolStream(self.tools))
        pieces = stream.feed(text)
        if c.finish_reason is None:
            return pieces, None
        rest, finish_reason = stream.end(text, c.finish_reason)
        return pieces + rest, finish_reason


async def stream_chat(run, body, model: str, tokenizer, chunk_id: str,
                      tools: Tools | None = None) -> AsyncIterator[dict]:
    created = int(time.time())

    def chunk(choices, **extra):
        return {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, **extra}

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(body.n)])
    deltas, final = _Deltas(body.stop), None
    replies = _Replies(tools)
    async for out in run:
        final = out
        for c, _, delta, new_ids, new_lps in deltas.of(out):
            lps = chat_logprobs(tokenizer, new_ids, new_lps, body.top_logprobs or 0) if body.logprobs else None
            pieces, finish_reason = replies.of(c, delta)
            for k, piece in enumerate(pieces or [{}]):
                last = k == len(pieces) - 1 or not pieces
                yield chunk([{"index": c.index, "delta": piece, "logprobs": lps if k == 0 else None,
                              "finish_reason": finish_reason if last else None}])
    if body.stream_options and body.stream_options.include_usage:
        yield chunk([], usage=usage([final]))
