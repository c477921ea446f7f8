"""How a session's regions read to the model: one user turn holding the data, then a question.

    [system message][user header] data data ... [Question:][question][user footer][generation prompt]
    \\____________ region 0 ___________/\\_ region 1 _/ \\________________ region 2 _________________/

Region 0 is padded to whole blocks (with the engine's span pad token, a newline), so the data
starts on a block boundary and eviction drops whole blocks of data only. Text typed by users
(data, questions) is tokenized with control tokens kept plain, as chat messages are.
"""

from functools import cached_property

from spanserve.spans.tokenize import ChatFormat


class SessionFormat:
    def __init__(self, tokenizer, block_size: int, pad_token_id: int):
        self.tokenizer, self.block_size, self.pad = tokenizer, block_size, pad_token_id
        self.chat = ChatFormat(tokenizer) if tokenizer.chat_template else None

    def frozen(self, system: str) -> list[int]:
        """Region 0: the instructions and the opening of the user turn, padded to whole blocks."""
        if self.chat:
            tokens = (self.chat.bos + self.chat.message("system", system) + self.chat.header("user")
                      + self.text("Data:\n"))
        else:
            tokens = self.tokenizer.encode("", add_special_tokens=True) + self.text(f"{system}\n\nData:\n")
        return tokens + [self.pad] * (-len(tokens) % self.block_size)

    def data(self, text: str) -> list[int]:
        return self.text(text)

    @cached_property
    def question_header(self) -> list[int]:
        """What every question starts with, computed after the data by each ingest."""
        return self.text("\n\nQuestion:")

    @cached_property
    def answer_opening(self) -> list[int]:
        """The ready position (sessions/ready.py): the data closed as a user turn that asks
        nothing, and the answer opened."""
        if self.chat:
            return self.chat.footer("user") + self.chat.generation_prompt
        return self.text("\nAnswer:")

    def question(self, text: str) -> list[int]:
        """The rest of region 2's prompt: the question closes the user turn and opens the answer."""
        if self.chat:
            return self.text(f" {text}") + self.chat.footer("user") + self.chat.generation_prompt
        return self.text(f" {text}\nAnswer:")

    def text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
