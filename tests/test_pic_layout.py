"""pic/ on its own: span geometry, link policies, prompt parts (no model)."""

import pytest
import torch

from spanserve import InvalidRequestError, Span
from spanserve.attention import KeyRotation
from spanserve.models.rope import RotaryEmbedding
from spanserve.pic.layout import PromptLayout, validate_spans
from spanserve.pic.link import LinkPolicy
from spanserve.pic.prompt import MessageText, chat_parts, tokenize_parts

BS = 16


def layout(n, spans, policy="none", gap=0) -> PromptLayout:
    return PromptLayout(n, spans, LinkPolicy(policy, gap), BS)


def test_a_span_reaching_the_last_token_is_cut_before_it():
    lay = layout(96, [(32, 96)])
    (span,) = lay.spans
    assert (span.start, span.end, span.sub_end) == (32, 95, 95)
    assert lay.independent.nonzero()[0].tolist() == list(range(32, 95))


def test_gap_links_whole_blocks_at_the_head_of_each_span():
    lay = layout(97, [(32, 96)], "gap", 20)
    assert lay.independent.nonzero()[0].tolist() == list(range(64, 96))
    assert lay.spans[0].sub_end == 96 and lay.shadow_blocks(0) == [2, 3]


def test_a_gap_longer_than_the_span_links_all_of_it():
    lay = layout(97, [(32, 56)], "gap", 64)
    assert lay.spans[0].sub_end == 48  # only full blocks are computed alone, for other requests
    assert lay.in_context(0, 97) == list(range(97))
    assert lay.ready_limit([32]) > 97  # nothing in context waits for it


def test_full_policy_ignores_spans():
    assert not layout(97, [(32, 96)], "full").has_spans


def test_in_context_skips_the_independent_part_of_each_span():
    lay = layout(100, [(16, 40), (48, 64)], "gap", 16)  # the second span is all gap
    assert lay.in_context(0, 100) == [t for t in range(100) if not 32 <= t < 40]
    assert lay.in_context(33, 45) == [40, 41, 42, 43, 44]
    for start, end in ((0, 100), (33, 45), (35, 38), (90, 120), (50, 40)):
        assert lay.count_in_context(start, end) == len(lay.in_context(start, end))


def test_advance_counts_only_in_context_tokens():
    lay = layout(100, [(16, 48)])
    assert lay.advance(0, 16, 100) == 16
    assert lay.advance(0, 17, 100) == 49  # 16 before the span, then the first token after it
    assert lay.advance(20, 5, 100) == 53  # from inside the span
    assert lay.advance(0, 1000, 100) == 100
    assert lay.advance(0, 1000, 16) == 16  # the span is not ready: stop at its start


def test_ready_limit_is_the_first_independent_token_of_the_first_unfinished_span():
    lay = layout(100, [(16, 48), (48, 80)], "gap", 16)
    assert lay.ready_limit([16, 48]) == 32
    assert lay.ready_limit([48, 64]) == 64
    assert lay.ready_limit([48, 80]) > 100


def test_key_deltas_shift_independent_keys_by_their_span_start():
    lay = layout(100, [(32, 80)], "gap", 16)
    assert lay.key_deltas().tolist() == [0] * 48 + [32] * 32  # up to the last independent key
    assert lay.first_shifted_key() == 48
    assert layout(100, []).key_deltas() is None and layout(100, [(0, 32)]).first_shifted_key() > 100


def test_block_markers_differ_by_geometry_and_link():
    assert layout(100, []).block_marker(2) == ()
    assert layout(100, [(32, 64)]).block_marker(2) != layout(100, [(32, 48)]).block_marker(2)
    assert layout(100, [(32, 64)]).block_marker(2) != layout(100, [(32, 64)], "gap", 16).block_marker(2)
    assert layout(100, [(32, 64)]).block_marker(5) == ()


def test_local_hashes_do_not_depend_on_where_the_span_is():
    chunk = list(range(100, 132))
    at_16 = layout(64, [(16, 48)]).local_hashes([1] * 16 + chunk + [2] * 16, None)
    at_32 = layout(80, [(32, 64)]).local_hashes([3] * 32 + chunk + [2] * 16, None)
    assert [at_16[1], at_16[2]] == [at_32[2], at_32[3]]
    salted = layout(80, [(32, 64)]).local_hashes([3] * 32 + chunk + [2] * 16, "tenant")
    assert salted[2] != at_32[2]


@pytest.mark.parametrize("spans, message", [
    ([(0, 20), (20, 32)], "must start on a block boundary"),
    ([(0, 32), (16, 48)], "overlap"),
    ([(32, 32)], "non-empty"),
    ([(32, 200)], "inside the prompt"),
    ([(-16, 10)], "inside the prompt"),
    ([[1, 2, 3]], "pair of integers"),
    ("0-16", "list of"),
])
def test_bad_spans_are_rejected_with_a_clear_message(spans, message):
    with pytest.raises(InvalidRequestError, match=message):
        validate_spans(spans, 100, BS)


def test_a_selecting_policy_links_the_chosen_tokens_after_its_probe():
    lay = PromptLayout(100, [(16, 64)], LinkPolicy("blend", blend_ratio=0.1), BS)
    assert lay.awaiting_selection and lay.ready_limit([64]) == 16
    assert lay.shadow_blocks(0) == [1, 2, 3] and lay.span_of_block(2) is None
    lay.link_tokens([20, 50])
    assert not lay.awaiting_selection and lay.shadow_blocks(0) == [1, 3]
    assert lay.span_of_block(2) == 0
    assert lay.in_context(0, 100) == [*range(16), 20, 50, *range(64, 100)]
    assert lay.ready_limit([40]) == 16 and lay.ready_limit([64]) > 100
    lay.reset_selection()
    assert lay.awaiting_selection and lay.in_context(0, 100) == [*range(16), *range(64, 100)]


def test_bad_link_policies_are_rejected():
    with pytest.raises(InvalidRequestError, match="link_policy"):
        LinkPolicy("blend-ish")
    with pytest.raises(InvalidRequestError, match="gap_length"):
        LinkPolicy("gap", -1)
    with pytest.raises(InvalidRequestError, match="blend_ratio"):
        LinkPolicy("blend", blend_ratio=1.5)


class FakeTokenizer:
    """One token per character; a template that wraps each message in brackets."""

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        """"<s>" is its special token 2, unless special tokens are split (then it is three characters)."""
        ids = [1] if add_special_tokens else []
        while text:
            if text.startswith("<s>") and not split_special_tokens:
                ids, text = ids + [2], text[3:]
            else:
                ids, text = ids + [ord(text[0])], text[1:]
        return ids

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + "<assistant>"


def test_parts_are_padded_so_each_span_fills_whole_blocks():
    ids, spans = tokenize_parts(FakeTokenizer(), ["ab", Span("x" * 20), Span("y" * 5), "?"], BS, pad_id=0)
    assert spans == [(16, 48), (48, 64)]
    assert ids[:3] == [1, ord("a"), ord("b")] and ids[3:16] == [0] * 13
    assert ids[16:36] == [ord("x")] * 20 and ids[36:48] == [0] * 12
    assert ids[48:53] == [ord("y")] * 5 and ids[64:] == [ord("?")]


def test_chat_parts_keep_spans_inside_the_template():
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [Span("doc1"), {"type": "text", "text": "doc2", "span": True}, "q?"]}]
    expected = ["<system>", MessageText("s"), "</><user>", Span("doc1"), Span("doc2"), MessageText("q?"),
                "</><assistant>"]
    assert chat_parts(FakeTokenizer(), messages) == expected


def test_special_tokens_typed_in_a_message_stay_text_but_the_template_keeps_its_own():
    tokenizer = FakeTokenizer()
    parts = chat_parts(tokenizer, [{"role": "user", "content": [Span("a<s>"), "b<s>"]}])
    ids, _ = tokenize_parts(tokenizer, ["<s>", *parts], BS, pad_id=0, add_special_tokens=False)
    assert ids.count(2) == 1  # the template's own (here the leading "<s>" part), none from the message
    assert tokenize_parts(tokenizer, ["x", Span("a<s>")], BS, pad_id=0)[0].count(2) == 1  # a plain prompt parses it


def test_an_empty_span_is_rejected():
    with pytest.raises(InvalidRequestError):
        Span("")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_rotation_moves_keys_to_their_new_position_in_their_own_dtype(dtype):
    """Rotating keys computed at p by delta equals computing them at p + delta (to the
    precision of the keys' dtype); keys past the rotation's length stay as they are."""
    rope = RotaryEmbedding(64, 512, 10000.0, {})
    raw = torch.randn(40, 3, 64)
    at = torch.arange(40)
    _, stored = rope(at, raw, raw)
    deltas = torch.tensor([100] * 20 + [-7] * 10)
    sign = deltas.sign().unsqueeze(-1).float()
    rotation = KeyRotation.from_angles(rope.cos[deltas.abs()], sign * rope.sin[deltas.abs()], 3)
    moved = rotation.apply(stored.to(dtype))
    assert moved.dtype == dtype
    _, expected = rope(at + torch.cat([deltas, torch.zeros(10, dtype=torch.long)]), raw, raw)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (moved.float() - expected).abs().max() < tolerance * expected.abs().max()
    assert torch.equal(moved[30:], stored[30:].to(dtype))
    in_place = rotation.rotate_(stored.to(dtype).transpose(0, 1).contiguous(), head_major=True)
    assert torch.equal(in_place.transpose(0, 1), moved)
