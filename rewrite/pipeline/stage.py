"""Stage: one rank's callable piece of a rewritten model.

A stage knows where it sits in the mesh, what it receives and sends per
microbatch, which parameters it shares with another stage, and keeps the
timeline of the last step run through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..mesh import Mesh
from ..plan.resolve import ResolvedPlan

__all__ = ["Stage", "TimelineEvent"]


@dataclass(frozen=True)
class TimelineEvent:
    """One microbatch's forward or backward on one rank (wall-clock seconds)."""

    rank: int
    stage_idx: int
    mb_idx: int
    kind: str  # "forward" or "backward"
    start: float
    end: float


@dataclass
class Stage:
    """This rank's stage of a model rewritten by `apply_plan`.

    Attributes:
        model: the user's model, rewritten in place: on this rank it holds only
            this stage's modules, at their original paths.
        module: what runs the stage (the model itself, or an fx GraphModule over its
            submodules); `stage.parameters()` are this rank's trainable parameters.
        resolved: the plan bound to the model.
        mesh: this rank's coordinates and process groups.
        tied: parameters this stage shares with another stage (tied embeddings),
            whose gradients the runner sums over `mesh.tied_group`.
        timeline: the last step's forward/backward events on this rank.

    Example:
        >>> stage = rewrite.apply_plan(model, "plans/llama-pp2.yaml")
        >>> stage.is_first, stage.is_last
        (True, False)
    """

    model: nn.Module
    module: nn.Module
    resolved: ResolvedPlan
    mesh: Mesh
    forward_fn: Callable[[torch.Tensor], torch.Tensor]
    tied: list[nn.Parameter] = field(default_factory=list)
    timeline: list[TimelineEvent] = field(default_factory=list)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Run this stage on one microbatch: model input on the first stage, else hidden states."""
        return self.forward_fn(x)

    @property
    def stage_idx(self) -> int:
        return self.mesh.pp_rank

    @property
    def num_stages(self) -> int:
        return self.mesh.pp

    @property
    def is_first(self) -> bool:
        return self.stage_idx == 0

    @property
    def is_last(self) -> bool:
        return self.stage_idx == self.num_stages - 1

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    @property
    def device(self) -> torch.device:
        param = next(self.module.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the activations this stage exchanges: its floating parameters' dtype."""
        for param in self.module.parameters():
            if param.is_floating_point():
                return param.dtype
        return torch.get_default_dtype()

    @property
    def takes_token_ids(self) -> bool:
        """True for LLaMA-family stages: the model's input is `[mb, seq]` token ids."""
        return self.resolved.backbone is not None

    @property
    def vocab_size(self) -> int | None:
        """Token ids the model's embedding accepts, `[0, vocab_size)`; None for traced models."""
        return self.model.config.vocab_size if self.takes_token_ids else None

    @property
    def num_classes(self) -> int | None:
        """Size of the output's last dimension when known before running (the LM head's vocabulary)."""
        bb = self.resolved.backbone
        return self.model.config.vocab_size if bb is not None and bb.has_head else None

    def boundary_shapes(self, input_shape: tuple[int, ...]) -> dict[str, tuple[int, ...] | None]:
        """Shapes a microbatch has entering and leaving this stage.

        Args:
            input_shape: the model input's shape for one microbatch, e.g. `(mb, seq)`.

        Returns:
            `{"input": ..., "output": ...}`; None where only running the stage tells
            (traced models: their stages announce shapes on the wire instead).
        """
        bb = self.resolved.backbone
        if bb is None:
            return {"input": tuple(input_shape) if self.is_first else None, "output": None}
        config = self.model.config
        hidden = (*input_shape, config.hidden_size)  # (mb, seq, hidden)
        out = (*input_shape, config.vocab_size) if bb.has_head else hidden
        return {
            "input": tuple(input_shape) if self.is_first else hidden,
            "output": out if self.is_last else hidden,
        }

    def __repr__(self) -> str:
        spec = self.resolved.stages[self.stage_idx]
        return (
            f"Stage({self.stage_idx}/{self.num_stages}, tp_rank={self.mesh.tp_rank}/{self.mesh.tp}, "
            f"rank={self.mesh.rank}, modules={list(spec.modules)})"
        )
