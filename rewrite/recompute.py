"""Activation checkpointing: matched modules keep only their inputs and run their forward again in the
backward (torch's non-reentrant `torch.utils.checkpoint`, so under split backwards B recomputes, W reuses).

The module's `forward` is wrapped in place, so hooks on the module (FSDP2's gathers, the tests'
counters) stay outside the checkpointed region and run once per call.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from .binding.resolve import ResolvedPlan

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: nn.Module, resolved: ResolvedPlan) -> list[str]:
    """Wrap the forward of every module of `model` the plan's rules matched; returns their paths."""
    done = []
    for path in resolved.recomputed:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue  # carved away: another pipeline rank holds it
        module.forward = _checkpointed(module.forward)
        done.append(path)
    return done


def _checkpointed(forward):
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run.__wrapped__ = forward
    return run
