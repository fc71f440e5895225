"""A module whose output the loss does not use still sees its backward: the wrapped model's outputs
pass through one autograd node, which hands the unused ones a None gradient, and autograd then runs
the module's backward hooks and its parameters' post-accumulate hooks with no gradient. Its chunks
used to stay pinned until backward ended (nothing arrived to release them): BART's whole encoder,
when LayerDrop dropped every decoder layer (the encoder's output then reaches the loss by no path),
and the smallest budget ran out."""

from __future__ import annotations

import copy

import torch
from torch import nn

import offload
from tests.helpers.trajectory import assert_run_within_drift, float64_twin, train_in_lockstep

WIDTH, VOCAB = 32, 64


class TwoHeads(nn.Module):
    """Returns (logits, aux): the loss uses the logits only, as a seq2seq loss ignores the
    encoder's last hidden state it also returns. ``probe`` runs once both branches' backwards are done."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.side = nn.Linear(WIDTH, 2 * WIDTH)
        self.side_out = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.probe = None

    def forward(self, ids):
        x = self.embed(ids)
        if self.probe is not None and x.requires_grad:
            x.register_hook(self.probe)
        return self.head(x), self.side_out(torch.tanh(self.side(x)))


def loss_of(model, ids):
    logits, _ = model(ids)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1))


def test_a_module_whose_output_the_loss_does_not_use_lets_go_of_its_chunks_in_backward():
    torch.manual_seed(0)
    ref = TwoHeads()
    model = offload.wrap(copy.deepcopy(ref), offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=2048))
    engine = model.offload_engine
    side = {engine.layout.slot(n).chunk for n in ("side.weight", "side_out.weight")}
    pinned_at_the_end = []
    model.probe = lambda g: pinned_at_the_end.append(set(engine.pins.pinned_chunks()))
    exact = float64_twin(ref)
    runs = [(model, offload.AdamW(model.parameters(), lr=1e-2))]
    runs += [(m, torch.optim.AdamW(m.parameters(), lr=1e-2)) for m in (ref, exact)]
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = train_in_lockstep(runs, [ids] * 3, loss_of)
    assert len(pinned_at_the_end) == 3
    assert all(not (pinned & side) for pinned in pinned_at_the_end), pinned_at_the_end
    assert_run_within_drift((model, losses[0]), (ref, losses[1]), (exact, losses[2]))
    engine.close()
