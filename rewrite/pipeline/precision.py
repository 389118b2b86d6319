"""Mixed precision: float32 master weights, computed in a lower dtype (bfloat16).

One recipe, two mechanisms, as torchtitan does. Where data parallelism shards the
parameters (`full`, `grad_op`), FSDP2's `MixedPrecisionPolicy(param_dtype=compute,
reduce_dtype=float32)` gathers the weights in the compute dtype and reduces gradients in
float32; everything then computes in it, activations crossing stages included. Elsewhere
(dp = 1, `replicate`) the runner runs each forward under `torch.autocast`: matmuls in the
compute dtype, the residual stream and reductions in float32. Either way the weights,
their gradients and AdamW's state stay float32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Precision", "precision_for"]


@dataclass(frozen=True)
class Precision:
    """How a stage computes in `dtype` over parameters kept in `master`."""

    dtype: torch.dtype  # the compute dtype
    master: torch.dtype  # the parameters' (and gradients', optimizer state's) dtype
    by: Literal["fsdp", "autocast"]  # FSDP2's mixed precision policy casts, or the runner's autocast

    def forward_context(self, device: torch.device):
        """What a stage's forward runs under: autocast, or nothing (FSDP2 already cast the weights)."""
        if self.by == "autocast":
            return torch.autocast(device.type, dtype=self.dtype)
        return contextlib.nullcontext()


def precision_for(compute: torch.dtype | None, master: torch.dtype, *, shards: bool) -> Precision | None:
    """The recipe for computing in `compute` over `master` parameters; None when they are one dtype.

    `shards`: data parallelism shards the parameters (FSDP2 `full` or `grad_op`, dp > 1).

    Raises:
        ValueError: `compute` is not a floating dtype, or wider than `master` (a float32
            computation over bfloat16 weights would only pretend to be more precise).
    """
    if compute is None or compute == master:
        return None
    if not isinstance(compute, torch.dtype) or not compute.is_floating_point:
        raise ValueError(f"compute_dtype {compute!r}: use a floating torch dtype, e.g. torch.bfloat16")
    if torch.finfo(compute).bits > torch.finfo(master).bits:
        raise ValueError(
            f"compute_dtype {compute} is wider than the parameters' {master}: build the model in {compute} "
            f"(float32 master weights), or leave compute_dtype out"
        )
    return Precision(compute, master, "fsdp" if shards else "autocast")
