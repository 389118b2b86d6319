"""What LoRA does not do yet, said in one place by every entry point that refuses it."""

from __future__ import annotations

__all__ = ["lora_not_built"]


def lora_not_built(plan, what: str) -> str:
    """`plan` (a ParallelPlan with `lora`) asks for `what`, which is not built for adapters."""
    return (f"{plan.source}: {plan.where('lora')}lora: {what} is not built yet for LoRA adapters (apply_plan, "
            "run_schedule and clip_grad_norm_ train them; docs/lora.md says what comes next)")
