"""Bytes per element of the optimizer's state by its precision (issue 29): what a chunk of master
weights and of each Adam moment costs in RAM, on NVMe and in traffic.

* Moments (``exp_avg``, ``exp_avg_sq``): "fp32" 4 B each, "bf16" 2 B, "8bit" block-wise dynamic
  quantisation (Dettmers et al. 2022, as bitsandbytes' AdamW8bit): a uint8 code per element and
  one fp32 absmax per block of ``QUANT_BLOCK`` elements, 1 + 4/256 B. The scales are a kind of
  their own, ``scales`` (2 x 4/256 B), held in host memory throughout as the engine holds them
  (``offload.engine.precision``): never on NVMe, never in its traffic.
* Master: "fp32" 4 B — none when the compute dtype is fp32 (the parameters are the master);
  "bf16" 2 B (stochastic rounding) — none when the compute dtype is bf16 (the compute parameters
  are the master: one chunk, read and rewritten by the update).

The defaults (fp32, fp32) give the engine's exact fp32 Adam: the same bytes as before this choice.
"""

from __future__ import annotations

from ..errors import ConfigError

STATE_PRECISIONS = ("fp32", "bf16", "8bit")
MASTER_PRECISIONS = ("fp32", "bf16")
QUANT_BLOCK = 256
"""Elements per quantisation block (``offload.optim.quantized.BLOCK_SIZE``; not imported: that
module loads the native library, and a plan for another box must not need it)."""
SCALE_BYTES = 4
"""One fp32 absmax per block per moment."""


def moment_bytes(state: str) -> float:
    """Bytes per element of one Adam moment in precision ``state`` (8-bit: the code and its share of
    the block's scale)."""
    if state == "fp32":
        return 4
    if state == "bf16":
        return 2
    if state == "8bit":
        return 1 + SCALE_BYTES / QUANT_BLOCK
    raise ConfigError("optimizer_state", state, f"must be one of {', '.join(STATE_PRECISIONS)}")


def master_bytes(master: str, dtype: str) -> int:
    """Bytes per element of the master weights kept beside the compute parameters (0 when the
    parameters, in compute dtype ``dtype``, are the master already)."""
    if master == "fp32":
        return 0 if dtype == "fp32" else 4
    if master == "bf16":
        if dtype == "fp32":
            raise ConfigError("master", master, "a bf16 master under fp32 compute: the fp32 parameters are the "
                                                "master already (use --dtype bf16, or master fp32)")
        return 0 if dtype == "bf16" else 2
    raise ConfigError("master", master, f"must be one of {', '.join(MASTER_PRECISIONS)}")


def state_per_elem(dtype: str, dtype_bytes: int, state: str, master: str) -> dict:
    """Bytes per element of each kind of chunk: {"params", "grads", "master", "exp_avg",
    "exp_avg_sq"}, and for 8-bit moments "scales" (the codes' kinds then count 1 B each); gradients
    stay fp32: the engine accumulates and reduces them in fp32."""
    m = moment_bytes(state)
    out = {"params": dtype_bytes, "grads": 4, "master": master_bytes(master, dtype)}
    if state != "8bit":
        return {**out, "exp_avg": m, "exp_avg_sq": m}
    return {**out, "exp_avg": 1, "exp_avg_sq": 1, "scales": 2 * (m - 1)}


def describe(state: str, master: str) -> str:
    """The choice in words, for reports: "8-bit moments, fp32 master"."""
    moments = {"fp32": "fp32 moments", "bf16": "bf16 moments", "8bit": "8-bit moments (256-element blocks)"}[state]
    return f"{moments}, {master} master"
