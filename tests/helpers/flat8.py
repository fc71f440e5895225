"""The engine's 8-bit Adam, written out on plain PyTorch: a model's parameters packed into the
engine's flat chunks (its layout), each chunk stepped by ``reference_adam_step_8bit`` -- the
torch reference of the scheme that the native kernel is bit-identical to -- with the master's
stochastic rounding keyed by each element's place in the whole layout, as the engine keys it."""

from __future__ import annotations

import torch

from offload.optim.quantized import BLOCK_SIZE, blocks, reference_adam_step_8bit, reference_adam_step_bf16


class Flat8Adam:
    """AdamW with 8-bit moments over ``model``'s parameters laid out as ``layout`` (the wrapped
    twin's ``engine.chunks.layout``; ``initial``: the fp32 values the master starts from, by
    name, when ``model`` was cast to a narrower dtype). ``master``: torch.float32 or torch.bfloat16; ``model``
    computes in its own dtype (its parameters are rewritten from the master after each step)."""

    def __init__(self, model, layout, master: torch.dtype, *, lr: float, weight_decay: float,
                 betas=(0.9, 0.999), eps=1e-8, initial: dict | None = None, moments: str = "8bit"):
        self.params = dict(model.named_parameters())
        initial = initial if initial is not None else {n: p.detach() for n, p in self.params.items()}
        self.layout = layout
        self.hp = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self.base = [sum(layout.sizes[:c]) for c in range(layout.num_chunks)]
        self.state = {}
        for c in layout.trainable_chunks:
            n = layout.sizes[c]
            flat = torch.zeros(n, dtype=torch.float32)
            for s in self._slots(c):
                flat[s.offset:s.end] = initial[s.name].reshape(-1).float()
            zeros = torch.zeros(blocks(n, BLOCK_SIZE))
            self.state[c] = [flat.to(master), torch.zeros(n, dtype=torch.uint8), zeros.clone(),
                             torch.zeros(n, dtype=torch.uint8), zeros.clone()]
        self.steps = 0
        self.moments = moments      # "8bit", or "bf16" / "fp32" (the 16-bit kernel's reference)
        if moments != "8bit":
            dtype = torch.bfloat16 if moments == "bf16" else torch.float32
            for st in self.state.values():
                st[1], st[3] = (torch.zeros(st[0].numel(), dtype=dtype) for _ in range(2))

    def _slots(self, c):
        return [s for s in self.layout.slots if s.chunk == c]

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        for c, (master, m, ma, v, va) in self.state.items():
            dtype = next(iter(self.params.values())).dtype
            grad = torch.zeros(self.layout.sizes[c], dtype=dtype)
            for s in self._slots(c):
                g = self.params[s.name].grad
                if g is not None:
                    grad[s.offset:s.end] = g.reshape(-1)
            if self.moments == "8bit":
                new = reference_adam_step_8bit(master, grad, m, ma, v, va, step=self.steps, out_dtype=dtype,
                                               seed=0, index_base=self.base[c], **self.hp)
                self.state[c], out = list(new[:5]), new[5]
            else:
                p2, m2, v2, out = reference_adam_step_bf16(master, grad, m, v, step=self.steps, out_dtype=dtype,
                                                           seed=0, index_base=self.base[c], **self.hp)
                self.state[c] = [p2, m2, ma, v2, va]
            for s in self._slots(c):
                self.params[s.name].copy_(out[s.offset:s.end].view(s.shape))

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
