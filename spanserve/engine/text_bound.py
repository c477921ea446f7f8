"""A text's fewest possible tokens, from its length alone: a text too long for a limit is refused
before it is tokenized. Tokenizing megabytes takes seconds of a shared thread and memory that the
process keeps (heap.py); no token covers more characters than the longest entry of the
vocabulary (byte-level and SentencePiece entries spell each byte or character once), so a text
of n characters is at least n / that many tokens."""

import weakref

from spanserve.errors import PromptTooLongError

_longest: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()


def chars_per_token(tokenizer) -> int:
    """The most characters one token of `tokenizer` can stand for (its vocabulary's longest entry)."""
    if tokenizer not in _longest:
        _longest[tokenizer] = max(1, max(map(len, tokenizer.get_vocab()), default=1))
    return _longest[tokenizer]


def fewest_tokens(num_chars: int, tokenizer) -> int:
    return -(-num_chars // chars_per_token(tokenizer))


def refuse_beyond(num_chars: int, limit: int, tokenizer) -> None:
    """PromptTooLongError, without tokenizing, for a prompt of `num_chars` characters that cannot
    be `limit` tokens or fewer."""
    fewest = fewest_tokens(num_chars, tokenizer)
    if fewest > limit:
        raise PromptTooLongError(fewest, limit + 1, f"{num_chars} characters, so at least")
