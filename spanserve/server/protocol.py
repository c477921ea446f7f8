"""OpenAI-compatible request bodies (pydantic), and their mapping to SamplingParams."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from spanserve.sampling import SamplingParams


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM does: OpenAI SDKs and LangChain send extras.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        optional = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                    if getattr(self, k) is not None}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, logprobs=logprobs, **optional,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def chat_messages(self) -> list[dict]:
        """Messages as the chat template wants them; text parts of a content list are joined."""
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if p.get("type", "text") == "text")
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        return out
