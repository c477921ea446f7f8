"""DraftModel: a smaller model of the same tokenizer that drafts by greedy decoding (vLLM's
draft_model method; Qwen2.5-Coder-0.5B for Qwen2.5-Coder-1.5B). It is an engine of its own: each
step's drafts are requests on it whose prompts are the drafting requests' tokens, so its prefix
cache keeps their context between steps and only the tokens since the last draft are computed.
A greedy draft is one token with probability 1 at each position: the target's check
(sampler.verify) keeps the target's distribution under sampling."""

from pathlib import Path

from spanserve.sampling import SamplingParams
from spanserve.speculative.config import SpeculativeConfigError


class DraftModel:
    def __init__(self, engine, target_tokenizer, relative_cost: float):
        """`engine`: the draft's LLMEngine, built by the target's. `relative_cost`: what a draft
        decode step costs as a fraction of a target step, the ratio of their weights (a decode step
        reads each weight once): the speculator drafts a token only where that is worth paying."""
        if engine.tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise SpeculativeConfigError(f"the draft model {engine.model_path.name} has another tokenizer than the "
                                         f"target: its tokens would mean other text")
        self.engine, self.relative_cost = engine, relative_cost

    def propose(self, contexts: list[list[int]], counts: list[int]) -> list[list[int]]:
        """Up to counts[i] greedy tokens after each context, all drafted in one batch."""
        ids = [self.engine.add_request({"prompt_token_ids": context}, SamplingParams(
            temperature=0, max_tokens=count, ignore_eos=True)) for context, count in zip(contexts, counts) if count]
        drafted: dict[str, list[int]] = {}
        while len(drafted) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    drafted[out.request_id] = out.outputs[0].token_ids
            for request_id in self.engine.take_failed():  # a draft that failed drafts nothing
                drafted[request_id] = []
        it = iter(ids)
        return [drafted[next(it)] if count else [] for count in counts]


def check_room(path: Path, bytes_per_weight: int, device: str) -> None:
    """A clear error where the draft's weights cannot fit beside the target (never a silent
    fallback to no speculation)."""
    need = sum(f.stat().st_size for f in path.glob("*.safetensors")) * bytes_per_weight // 4  # stored as float32
    free = _free_bytes(device)
    if free is not None and need > free:
        raise SpeculativeConfigError(f"the draft model {path.name} needs about {need / 2**30:.1f} GiB for its "
                                     f"weights and {free / 2**30:.1f} GiB are free beside the target")


def _free_bytes(device: str) -> int | None:
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    line = next((ln for ln in meminfo.splitlines() if ln.startswith("MemAvailable:")), None)
    return int(line.split()[1]) * 1024 if line else None


def weight_bytes(model) -> int:
    """The bytes of a model's parameters and buffers (quantized and packed weights are buffers): what
    a decode step reads, roughly, counted alike for the draft and the target, whose ratio is used."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
