"""Never save a diverged run: the tensors a training state would write, checked for nan and inf."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..errors import InputError
from ..pipeline.stage import Stage
from ..plan.wording import first_few

__all__ = ["NonFiniteState", "nonfinite_problems"]


class NonFiniteState(InputError):
    """The state to save holds nan or inf (a diverged run): nothing was written, the latest checkpoint
    stays the latest. Raised on every rank alike."""


def nonfinite_problems(stage: Stage, optimizer: torch.optim.Optimizer) -> list[str]:
    """This rank's parameters and optimizer-state tensors holding nan or inf, as one problem (or none); local."""
    bad = [name for name, p in stage.model.named_parameters() if not _finite(p)]
    names = {id(p): name for name, p in stage.model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not _finite(value):
                bad.append(f"the optimizer's {key} of {names.get(id(param), 'a parameter')}")
    if not bad:
        return []
    return [
        f"{first_few(bad)} hold nan or inf: the run has diverged, and its state is not saved "
        "(the latest checkpoint stays the latest); resume from it with a lower learning rate or gradient clipping"
    ]


def _finite(t: torch.Tensor) -> bool:
    local = t.to_local() if isinstance(t, DTensor) else t
    return bool(torch.isfinite(local.detach()).all())
