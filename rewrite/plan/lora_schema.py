"""The plan's `lora` section: low-rank adapters trained beside frozen weights (`rewrite.lora` applies them)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from .pipeline_schema import Count, Pattern, StrictModel

__all__ = ["Lora"]


class Lora(StrictModel):
    """Low-rank adaptation (LoRA, Hu et al. 2021) as PEFT computes it: each target linear layer's output gains
    `alpha / rank * B(A(dropout(x)))`, A `[rank, in]` and B `[out, rank]` trained, every other weight frozen."""

    rank: Annotated[Count, Field(description="The adapters' rank r (>= 1): A is [r, in_features], B [out_features, r].")]
    alpha: Annotated[float | None, Field(gt=0, description=(
        "The scale's numerator: adapters add alpha / rank times their product (PEFT's lora_alpha). "
        "Default: the rank (a scale of 1)."))] = None
    dropout: Annotated[float, Field(ge=0, lt=1, description=(
        "Dropout on the adapters' input while training (PEFT's lora_dropout), 0 <= p < 1. Under tensor "
        "parallelism a rank draws the mask of the whole input and uses its slice, so the ranks of a stage, "
        "seeded alike, drop what one process would."))] = 0.0
    seed: Annotated[int, Field(ge=0, strict=True, description=(
        "Fresh adapters' A is drawn from this seed and the layer's path (B starts at zero): the same on every "
        "rank and under every plan, whatever each process's random state."))] = 0
    targets: Annotated[list[Pattern] | None, Field(description=(
        "Module-path patterns of the linear layers that get adapters (`*` within one path segment). Default: "
        "every decoder layer's attention and MLP projections (q/k/v/o, gate/up/down, fused gate_up, latent "
        "attention's q_b/kv_b; shared experts' too). Routed experts are refused: adapters there are not built."
        ), min_length=1)] = None

    @property
    def scaling(self) -> float:
        """alpha / rank: what the adapters' product is multiplied by."""
        return (self.alpha if self.alpha is not None else self.rank) / self.rank
