"""A module called several times in one forward (one layer at every depth, as ALBERT does) or owning
a parameter tied to another module's (an LM head tied to the embedding) gets its gradients only
after its first use's backward, the last in backward. Its backward pins used to wait for them, so
every shared chunk stayed on the device between the uses' backwards; each use now lets its own pin
go when its backward reaches the use's inputs (the gradients are still summed over the uses)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import offload
from tests.helpers.trajectory import assert_run_within_drift, float64_twin, train_in_lockstep

WIDTH, VOCAB = 32, 64


class Looped(nn.Module):
    """One block applied three times, a head tied to the embedding; ``probe`` sees the gradient
    between the block's uses."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.probe = None

    def forward(self, ids):
        x = self.embed(ids)
        for i in range(3):
            x = x + self.down(torch.tanh(self.up(x)))
            if self.probe is not None and i < 2 and x.requires_grad:
                x.register_hook(self.probe)
        return self.head(x)


def loss_of(model, ids):
    return nn.functional.cross_entropy(model(ids).reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1))


def test_a_block_called_at_every_depth_is_let_go_between_its_uses_and_still_trains_as_torch():
    torch.manual_seed(0)
    ref = Looped()
    model = offload.wrap(copy.deepcopy(ref), offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=2048))
    engine = model.offload_engine
    shared = {engine.layout.slot(n).chunk for n in ("up.weight", "down.weight", "embed.weight")}
    assert len(shared) == 3
    pinned_between_uses = []
    model.probe = lambda g: pinned_between_uses.append(set(engine.pins.pinned_chunks()))
    exact = float64_twin(ref)
    runs = [(m, torch.optim.AdamW(m.parameters(), lr=1e-2)) for m in (ref, exact)]
    runs.insert(0, (model, offload.AdamW(model.parameters(), lr=1e-2)))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = train_in_lockstep(runs, [ids] * 3, loss_of)
    assert len(pinned_between_uses) == 6
    assert all(not (pinned & shared) for pinned in pinned_between_uses), pinned_between_uses
    assert_run_within_drift((model, losses[0]), (ref, losses[1]), (exact, losses[2]))
    engine.close()
