"""The span-token memo: a document tokenized once, the same ids as the tokenizer's, bounded."""

import threading

import pytest
from transformers import AutoTokenizer

from spanserve import LLM, SamplingParams, Span
from spanserve.cluster.keys import HashContext
from spanserve.pic.prompt import tokenize_parts
from spanserve.pic.span_tokens import SpanTokens


class CountingTokenizer:
    """One token per character, counting the texts it encodes."""

    def __init__(self):
        self.calls = []

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        self.calls.append(text)
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_a_span_is_tokenized_once_and_comes_back_the_same():
    tokenizer = CountingTokenizer()
    memo = SpanTokens(tokenizer)
    parts = ["q", Span("document"), "?"]
    first = tokenize_parts(tokenizer, parts, 4, 0, span_tokens=memo)
    second = tokenize_parts(tokenizer, ["other ", Span("document"), "!"], 4, 0, span_tokens=memo)
    assert tokenizer.calls.count("document") == 1
    assert first == tokenize_parts(CountingTokenizer(), parts, 4, 0)  # as without the memo
    assert second[0][second[1][0][0]:second[1][0][1]] == first[0][first[1][0][0]:first[1][0][1]]


def test_how_special_tokens_go_is_part_of_the_key_and_a_callers_list_is_its_own():
    memo = SpanTokens(CountingTokenizer())
    ids = memo.encode("abc")
    ids.append(0)  # a caller extending the list must not change the memo
    assert memo.encode("abc") == [97, 98, 99]
    memo.encode("abc", split_special_tokens=True)
    assert memo.encode("abc", add_special_tokens=True) == [1, 97, 98, 99]
    assert len(memo) == 3


def test_the_memo_keeps_at_most_its_tokens_dropping_the_least_recent():
    tokenizer = CountingTokenizer()
    memo = SpanTokens(tokenizer, max_tokens=10)
    memo.encode("aaaa")
    memo.encode("bbbb")
    memo.encode("aaaa")  # now the most recent
    memo.encode("cccc")  # 12 tokens: "bbbb" goes
    tokenizer.calls.clear()
    memo.encode("aaaa"), memo.encode("cccc"), memo.encode("bbbb")
    assert tokenizer.calls == ["bbbb"]
    memo.encode("x" * 11)  # larger than the memo: tokenized, not kept
    assert len(memo) <= 3


def test_ids_handed_in_are_used_as_the_tokenizers():
    tokenizer = CountingTokenizer()
    memo = SpanTokens(tokenizer)
    memo.add([("doc", False, [7, 8, 9])])
    assert memo.encode("doc") == [7, 8, 9] and tokenizer.calls == []


def test_threads_sharing_the_memo_get_the_tokenizers_ids():
    memo = SpanTokens(CountingTokenizer(), max_tokens=50)
    texts = [f"text {i}" * 3 for i in range(40)]
    errors = []

    def work():
        try:
            for text in texts * 5:
                assert memo.encode(text) == [ord(c) for c in text]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_the_engine_tokenizes_a_document_once_with_the_same_prompt_and_answer(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), num_blocks=64)
    engine, calls = llm.engine, []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, **kw: calls.append(text) or encode(text, **kw)
    doc = "The harbour master counted forty ships at dawn. " * 3
    params = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate([["Read.\n", Span(doc), "Ships?"]], params)[0]
    second = llm.generate([["Read.\n", Span(doc), "Ships?"]], params)[0]
    assert calls.count(doc) == 1
    assert first.prompt_token_ids == second.prompt_token_ids
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_an_ingress_tokenizer_unlike_the_engines_is_refused(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ctx = HashContext(16, 0, None, (), True, tuple(tokenizer.encode("x", add_special_tokens=False)))
    with pytest.raises(ValueError, match="tokenizer"):
        ctx.check(tokenizer)
    from spanserve.cluster.keys import PROBE

    HashContext(16, 0, None, (), True, tuple(tokenizer.encode(PROBE, add_special_tokens=False))).check(tokenizer)
