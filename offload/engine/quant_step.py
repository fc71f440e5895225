"""Adam over one chunk piece whose moments are 8-bit (``offload.optim.quantized``'s scheme).

The runs of parameters updated together (``ChunkAdam.runs``) need not start or end on a block
of 256 elements, but a block's codes share one scale: a block is dequantised, updated and
quantised as a whole. So the runs are grouped into *clusters*, the blocks they touch, joined
where two runs touch one block:

* the common case -- one run whose blocks hold nothing else than its parameters and zero
  padding (all parameters of a chunk have gradients and one set of hyper-parameters) -- goes
  to the fused native kernel over its whole blocks (padding is zeros in every kind, which Adam
  maps to zeros);
* otherwise (a parameter without a gradient, or two param groups, sharing a block) the blocks
  are dequantised to fp32 once, each run's exp_avg held to Adam's bound as the fused kernel holds
  it (``bound_moment``), each run is updated by the fp32 kernel, and the blocks are
  quantised again. A parameter without a gradient that shares a block then keeps its values up
  to the block's new scale (its codes are rounded again), as a block-wise scheme must.

A bf16 master is rounded stochastically, bits keyed by (``SR_SEED``, step, element index in the
whole layout): ``index_base`` is the piece's first element there, so one process and N ranks
round alike.
"""

from __future__ import annotations

import functools

import torch

from ..optim.kernel import adam_step
from ..optim.quantized import BLOCK_SIZE, adam_step_8bit, bound_moment, dequantize, quantize
from .precision import SR_SEED


@functools.cache
def zero_code(signed: bool) -> int:
    """The code zero quantises to: what a fresh moment chunk holds, so that its blocks no update
    touched (padding) read the same codes as a quantised chunk of zeros (``load_state_dict``)."""
    return int(quantize(torch.zeros(BLOCK_SIZE), signed)[0][0])


def clusters(runs, n: int) -> list[tuple[int, int, list]]:
    """``(a, b, runs)``: the runs grouped by the whole blocks ``[a, b)`` they touch (``n``: the
    piece's elements, a whole number of blocks); runs sharing a block share a cluster."""
    out: list[list] = []
    for run in runs:
        a = run[0] // BLOCK_SIZE * BLOCK_SIZE
        b = min(-(-run[1] // BLOCK_SIZE) * BLOCK_SIZE, n)
        if out and a < out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
            out[-1][2].append(run)
        else:
            out.append([a, b, [run]])
    return [(a, b, rs) for a, b, rs in out]


def _alone(a: int, b: int, run, members) -> bool:
    """Whether blocks ``[a, b)`` hold no parameter outside ``run`` (only its own and padding)."""
    start, end = run[0], run[1]
    return all(e <= a or s >= b or (s >= start and e <= end) for _, s, e in members)


def update_8bit(master: torch.Tensor, grad: torch.Tensor, states, out: torch.Tensor | None, runs, members, *,
                index_base: int, grad_scale: float, threads: int | None) -> None:
    """One Adam step of ``runs`` ((start, end, hyper, step), offsets in the piece) over a piece:
    ``master`` fp32 or bf16 (the parameters themselves when ``out`` is None), ``grad``,
    ``states`` = (exp_avg codes, exp_avg_sq codes, exp_avg absmax, exp_avg_sq absmax) and
    ``out`` the compute-precision parameters; ``members``: (param, start, end) of the piece."""
    m, v, m_abs, v_abs = states
    n = master.numel()
    for a, b, group in clusters(runs, n):
        ba, bb = a // BLOCK_SIZE, b // BLOCK_SIZE
        if len(group) == 1 and _alone(a, b, group[0], members):
            _, _, h, step = group[0]
            adam_step_8bit(master[a:b], grad[a:b], m[a:b], m_abs[ba:bb], v[a:b], v_abs[ba:bb], lr=h.lr,
                           beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay, step=step,
                           decoupled=h.decoupled, grad_scale=grad_scale, maximize=h.maximize,
                           out=None if out is None else out[a:b], seed=SR_SEED, index_base=index_base + a,
                           threads=threads)
            continue
        m32 = dequantize(m[a:b], m_abs[ba:bb], True)
        v32 = dequantize(v[a:b], v_abs[ba:bb], False)
        for start, end, h, _ in group:      # the fused kernel's bound, by each run's betas
            s, e = start - a, end - a
            m32[s:e] = bound_moment(m32[s:e], v32[s:e], h.beta1, h.beta2)
        for start, end, h, step in group:
            s, e = start - a, end - a
            # A bf16 master is rounded with the bits the fused kernel would give it (same hash).
            adam_step(master[start:end], grad[start:end], m32[s:e], v32[s:e], lr=h.lr, beta1=h.beta1,
                      beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay, step=step, decoupled=h.decoupled,
                      grad_scale=grad_scale, maximize=h.maximize, threads=threads, seed=SR_SEED,
                      index_base=index_base + start)
            if out is not None:
                out[start:end].copy_(master[start:end])
        codes, absmax = quantize(m32, True, threads=threads)
        m[a:b], m_abs[ba:bb] = codes, absmax
        codes, absmax = quantize(v32, False, threads=threads)
        v[a:b], v_abs[ba:bb] = codes, absmax
