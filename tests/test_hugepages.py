"""hugepages: a model's weights moved onto 2 MB-aligned memory advised for huge pages, without
changing a value, a tie or a view."""

import torch
from torch import nn

from spanserve import hugepages


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight  # tied, as small models tie their LM head
        self.proj = nn.Linear(64, 64).to(torch.bfloat16)
        self.register_buffer("table", torch.randn(40, 32))
        self.register_buffer("right", self.table[:, 16:])  # a view of another buffer's storage
        self.register_buffer("codes", torch.randint(-128, 127, (1000,), dtype=torch.int8))

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.proj(x.bfloat16()).float()), self.right.sum() + self.codes.float().sum()


def test_gathered_weights_keep_their_values_ties_and_views():
    torch.manual_seed(0)
    model, ids = _Tied(), torch.arange(10)
    with torch.no_grad():
        before = model(ids)
    old = {name: t.data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    copies = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    moved = hugepages.gather_weights(model, chunk=1 << 14)  # several allocations
    assert sum(storages.values()) <= moved < sum(storages.values()) + 64 * len(storages)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.data_ptr() != old[name], name
        assert torch.equal(t, copies[name]) and t.dtype == copies[name].dtype, name
    assert model.head.weight is model.embed.weight
    assert model.right.untyped_storage().data_ptr() == model.table.untyped_storage().data_ptr()
    assert model.right.data_ptr() == model.table.data_ptr() + 16 * 4
    with torch.no_grad():
        after = model(ids)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with torch.no_grad():  # still one weight under two names
        model.embed.weight[0, 0] = 5.0
    assert model.head.weight[0, 0] == 5.0


def test_one_allocation_starts_on_a_page_boundary():
    model = nn.Linear(512, 1024)
    hugepages.gather_weights(model)
    assert model.weight.data_ptr() % hugepages.PAGE == 0
    assert model.bias.data_ptr() == model.weight.data_ptr() + model.weight.nbytes


def test_an_engine_on_the_cpu_holds_its_weights_there(tiny_llama_path):
    from spanserve import LLM

    llm = LLM(model=str(tiny_llama_path), num_blocks=64, enforce_eager=True)
    runner = llm.engine.runner
    first = next(runner.model.parameters())
    assert all(t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for t in runner.model.parameters())  # a tiny model fits one allocation
