"""Checkpoint boundaries found from the engine's own hooks, whatever checkpoint implementation saved them.

Under ``activation_offload="cpu"`` exactly the inputs of the checkpointed layers are parked — with
``torch.utils.checkpoint`` reentrant and not, with a checkpoint built the way torch 2.11 builds its
non-reentrant one (inputs saved by an autograd Function of another name, the layer run under hooks of
its own) and with a reentrant one under another name, on a model of plain modules (its layers hooked
themselves, or only their children) and on a Hugging Face model with gradient checkpointing. What
else autograd saves (the lm_head input, the logits, every tensor of an unchecked model) stays on the
device, and gradients and training equal the same run without offload bit for bit. A step that
parks nothing says so.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from tests.helpers.hf_models import tiny_llama

VOCAB, HIDDEN, LAYERS, BATCH, SEQ, STEPS = 32, 16, 3, 2, 8, 2


# ---- checkpoint implementations -------------------------------------------------------------------
class _KeepInputs(torch.autograd.Function):
    """torch 2.11's ``_NoopSaveInputs`` under another name: an empty output whose node saves the
    inputs, for the checkpoint to read back when it recomputes."""

    @staticmethod
    def forward(*args):
        return torch.empty((0,))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*[t for t in inputs if isinstance(t, torch.Tensor)])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("the saver is not on any gradient path")


def checkpoint_like_torch_2_11(fn, *args):
    """Non-reentrant checkpointing built as torch 2.11 builds it: the inputs saved through the
    hooks in force by ``_KeepInputs``, the function run under hooks of its own that keep only an
    index, and recomputed (in full) at the first unpack, under hooks that collect what it saves."""
    saver = _KeepInputs.apply(torch.empty((0,), requires_grad=True), *args)
    recomputed: list[torch.Tensor] = []

    def pack(_t):
        pack.count += 1
        return pack.count - 1
    pack.count = 0

    def unpack(i):
        if not recomputed:
            inputs = saver.grad_fn.saved_tensors[1:]
            with torch.autograd.graph.saved_tensors_hooks(lambda t: recomputed.append(t.detach()), lambda _: None):
                with torch.enable_grad():
                    fn(*inputs)
        return recomputed[i]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(*args)


class _RunWithoutGrad(torch.autograd.Function):
    """Reentrant checkpointing (torch's ``CheckpointFunction``) under another name."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        torch.autograd.backward(out, grads)
        return (None, *[t.grad for t in inputs])


CHECKPOINTS = {
    "torch-non-reentrant": lambda fn, x: checkpoint(fn, x, use_reentrant=False),
    "torch-reentrant": lambda fn, x: checkpoint(fn, x, use_reentrant=True),
    "like-torch-2.11": checkpoint_like_torch_2_11,
    "reentrant-renamed": lambda fn, x: _RunWithoutGrad.apply(fn, x),
}


# ---- models ------------------------------------------------------------------------------------------
class Block(nn.Module):
    """A residual MLP block; ``own``: it owns a parameter itself (then its own hooks run inside the
    checkpoint around its children's), else only its children are hooked."""

    def __init__(self, own: bool):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.gain = nn.Parameter(torch.ones(HIDDEN)) if own else None

    def forward(self, x):
        h = self.down(torch.tanh(self.up(self.norm(x))))
        return x + (h * self.gain if self.gain is not None else h)


class Stack(nn.Module):
    def __init__(self, ckpt=None, own=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(own) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.ckpt = ckpt

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = self.ckpt(block, x) if self.ckpt is not None else block(x)
        return self.head(x)


def stack_loss(model, ids):
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), ids.reshape(-1))


def hf_loss(model, ids):
    return model(ids, labels=ids).loss


def hf_model(reentrant: bool):
    model = tiny_llama()
    kwargs = {"use_reentrant": reentrant}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def batches(vocab):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def train(model, loss_fn, mode, vocab=VOCAB, **kw):
    """Losses, the first step's Adam first moments (``(1 - beta1) * grad``: the gradients), the
    final state dict and each step's activation statistics."""
    cfg = offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=65536, activation_offload=mode, **kw)
    model = offload.wrap(model, cfg)
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, stats, moments = [], [], None
    try:
        for ids in batches(vocab):
            loss = loss_fn(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if moments is None:
                moments = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
            losses.append(loss.item())
            stats.append(model.offload_stats()["activations"])
        return losses, moments, model.state_dict(), stats
    finally:
        model.offload_engine.close()


def assert_identical(got, want):
    (lg, mg, sg, _), (lw, mw, sw, _) = got, want
    assert lg == lw
    assert mg.keys() == mw.keys() and len(mg) > 0
    for k in mw:
        assert torch.equal(mg[k], mw[k]), f"gradient of parameter {k}"
    for k in sw:
        assert torch.equal(sg[k], sw[k]), k


@pytest.mark.parametrize("own", [False, True], ids=["children-hooked", "layer-hooked"])
@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_checkpointed_layer_inputs_are_parked_and_nothing_else(kind, own):
    want = train(Stack(CHECKPOINTS[kind], own), stack_loss, "none")
    got = train(Stack(CHECKPOINTS[kind], own), stack_loss, "cpu")
    assert_identical(got, want)
    layer_input = BATCH * SEQ * HIDDEN * 4
    for acts in got[3]:
        # each block's input, once down and once up; not the lm_head input, not the logits
        assert acts["boundaries"] == acts["parked"] == LAYERS, kind
        assert acts["bytes"]["device->cpu"] == acts["bytes"]["cpu->device"] == LAYERS * layer_input
        assert acts["kept_on_device_bytes"] == 0 and acts["live"] == 0 and not acts["nothing_parked"]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hf_gradient_checkpointing_parks_the_decoder_layers_inputs(reentrant):
    pytest.importorskip("transformers")
    want = train(hf_model(reentrant), hf_loss, "none", vocab=128)
    got = train(hf_model(reentrant), hf_loss, "cpu", vocab=128)
    assert_identical(got, want)
    cfg = tiny_llama().config
    for acts in got[3]:
        assert acts["parked"] == cfg.num_hidden_layers
        assert acts["bytes"]["device->cpu"] == cfg.num_hidden_layers * BATCH * SEQ * cfg.hidden_size * 4


def test_activation_min_bytes_still_parks_saved_tensors_without_checkpointing():
    want = train(Stack(), stack_loss, "none")
    got = train(Stack(), stack_loss, "cpu", activation_min_bytes=BATCH * SEQ * HIDDEN * 4)
    assert_identical(got, want)
    acts = got[3][-1]
    assert acts["boundaries"] == 0 and acts["parked"] > LAYERS and not acts["nothing_parked"]


def test_a_step_that_parks_nothing_says_so_once():
    """Offload asked for, no checkpointing: the statistics say nothing was parked, and one warning
    names what to check."""
    model = offload.wrap(Stack(), offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=65536,
                                                        activation_offload="cpu"))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    try:
        for step, ids in enumerate(batches(VOCAB)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                stack_loss(model, ids).backward()
                opt.step()
                opt.zero_grad()
            said = [str(w.message) for w in caught if "parked nothing" in str(w.message)]
            assert len(said) == (1 if step == 0 else 0)
            if said:
                assert "torch.utils.checkpoint" in said[0] and "activation_min_bytes" in said[0]
            acts = model.offload_stats()["activations"]
            assert acts["nothing_parked"] and acts["parked"] == 0 and acts["boundaries"] == 0
            assert acts["bytes"]["device->cpu"] == 0
    finally:
        model.offload_engine.close()
