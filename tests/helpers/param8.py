"""The engine's 8-bit (or bf16-moment) AdamW written out per parameter on plain PyTorch, as a
``torch.optim.Optimizer`` (so param groups, ``add_param_group``, lr schedulers and ``maximize``
work on it as on torch's).

Each parameter is stepped by ``reference_adam_step_8bit`` -- the torch reference the native kernel
is bit-identical to -- with its own group's hyper-parameters and step count, its master's
stochastic rounding keyed by its place in the wrapped twin's layout (``index_base``). That is the
engine's step bit for bit when every trainable parameter fills whole 256-element blocks of its
own (``aligned_bases`` checks it): then no block is shared, the engine runs the fused kernel over
each run of blocks, and a block-wise scheme treats each block alone. bf16 moments
(``reference_adam_step_bf16``) are element-wise: per parameter is the engine's step at any
alignment. fp32 compute only.
"""

from __future__ import annotations

import torch

from offload.optim.quantized import BLOCK_SIZE, blocks, reference_adam_step_8bit, reference_adam_step_bf16


def aligned_bases(model, layout) -> dict[int, int]:
    """``{id(param): its first element in the whole layout}`` for ``model`` (the wrapped twin's
    unwrapped original: same names); raises if a trainable parameter shares a block with another
    (one that ends inside a block is fine when only the chunk's zero padding follows it)."""
    base = [sum(layout.sizes[:c]) for c in range(layout.num_chunks)]
    slots = {s.name: s for s in layout.slots}
    out = {}
    for name, p in model.named_parameters():
        s = slots[name]
        end_block = -(-s.end // BLOCK_SIZE) * BLOCK_SIZE
        shared = any(o.chunk == s.chunk and o is not s and o.offset < end_block and o.end > s.offset
                     for o in layout.slots)
        if p.requires_grad and (s.offset % BLOCK_SIZE or shared):
            raise ValueError(f"{name} ({s.numel} elements at {s.offset}) shares a block")
        out[id(p)] = base[s.chunk] + s.offset
    return out


class PerParamAdamW(torch.optim.Optimizer):
    """AdamW with 8-bit (``moments="bf16"``: bf16) moments per parameter. ``bases``:
    ``aligned_bases``. ``grad_scale``: the factor the next ``step`` multiplies gradients by (a
    clip coefficient, 1 / a loss scale)."""

    def __init__(self, params, bases: dict[int, int], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, maximize=False, moments: str = "8bit"):
        self.bases = bases
        self.moments = moments
        self.grad_scale = 1.0
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    n = p.numel()
                    if self.moments == "8bit":
                        st.update(m=torch.zeros(n, dtype=torch.uint8), ma=torch.zeros(blocks(n)),
                                  v=torch.zeros(n, dtype=torch.uint8), va=torch.zeros(blocks(n)))
                    else:
                        st.update(m=torch.zeros(n, dtype=torch.bfloat16), v=torch.zeros(n, dtype=torch.bfloat16))
                    st["step"] = 0
                st["step"] += 1
                hp = dict(lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
                          weight_decay=group["weight_decay"], step=st["step"], grad_scale=self.grad_scale,
                          maximize=group["maximize"], index_base=self.bases[id(p)])
                flat, grad = p.detach().reshape(-1), p.grad.reshape(-1)
                if self.moments == "8bit":
                    master, st["m"], st["ma"], st["v"], st["va"], _ = reference_adam_step_8bit(
                        flat, grad, st["m"], st["ma"], st["v"], st["va"], **hp)
                else:
                    master, st["m"], st["v"], _ = reference_adam_step_bf16(flat, grad, st["m"], st["v"], **hp)
                p.copy_(master.view(p.shape))
        self.grad_scale = 1.0
