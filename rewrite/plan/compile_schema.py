"""The plan's `compile` section: torch.compile on every repeated block (`rewrite.compiled` applies it)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .pipeline_schema import StrictModel

__all__ = ["Compile"]


class Compile(StrictModel):
    """Each decoder layer, the embedding and the head compiled on their own (torchtitan's per-block compile):
    one graph per block, collectives inside it traced as torch's functional collectives, hooks (FSDP2's
    gathers) left outside. `compile: true` takes every default."""

    backend: Annotated[Literal["inductor", "aot_eager", "eager"], Field(description=(
        "torch.compile's backend: 'inductor' generates fused kernels (the one that is faster); 'aot_eager' "
        "traces forward and backward but runs torch's own kernels, 'eager' traces the forward only: both "
        "to tell a compiler problem from a model problem."))] = "inductor"
    mode: Annotated[Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"], Field(
        description="inductor's mode (torch.compile's `mode`): 'reduce-overhead' adds CUDA graphs on a GPU."
        )] = "default"
    dynamic: Annotated[bool | None, Field(strict=True, description=(
        "Shapes in the graphs: None (default) compiles a block for the shapes of its first call and, when a "
        "later call differs (another sequence length), once more with those sizes symbolic, so a block "
        "compiles at most twice whatever the data; false one static graph per distinct shape (up to torch's "
        "recompile limit, then eager); true symbolic from the start."))] = None
