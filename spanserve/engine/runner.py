"""ModelRunner: the only place that touches tensors. Turns a scheduled batch into a flat
token batch with its cache metadata, runs the model, and samples."""

import torch

from spanserve.attention import AttentionMetadata
from spanserve.engine.sampler import Sample, sample
from spanserve.engine.scheduler import ScheduledRequest
from spanserve.models.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        cfg = model.cfg
        self.model, self.block_size, self.device = model, block_size, device
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=dtype, device=device,
        )
        model.bind_kv_cache(self.kv_cache)

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest]) -> list[Sample]:
        """Run one step; returns one Sample per request in `batch` whose `samples` is True."""
        input_ids, positions, meta, logit_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta)
        if not logit_rows:
            return []
        logits = self.model.compute_logits(hidden[logit_rows]).cpu()
        return sample(logits, [item.request for item in batch if item.samples])

    def _prepare(self, batch: list[ScheduledRequest]):
        input_ids, positions, slots, logit_rows = [], [], [], []
        query_lens, context_lens, contiguous_from = [], [], []
        max_blocks = max(len(item.request.block_table) for item in batch)
        block_tables = torch.zeros(len(batch), max_blocks, dtype=torch.long)
        for i, item in enumerate(batch):
            req, start = item.request, item.request.num_computed_tokens
            end = start + item.num_tokens
            table = [b.block_id for b in req.block_table]
            block_tables[i, : len(table)] = torch.tensor(table)
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[j // self.block_size] * self.block_size + j % self.block_size
                         for j in range(start, end))
            contiguous_from.append(table[0] if table == list(range(table[0], table[0] + len(table))) else None)
            query_lens.append(item.num_tokens)
            context_lens.append(end)
            if item.samples:
                logit_rows.append(len(input_ids) - 1)
        to = self._tensor
        meta = AttentionMetadata(
            slot_mapping=to(slots), query_lens=query_lens, context_lens=context_lens,
            block_tables=block_tables.to(self.device), context_lens_tensor=to(context_lens),
            contiguous_from=contiguous_from,
        )
        return to(input_ids), to(positions), meta, logit_rows

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
