"""Checks of the plan switches that change how tensor parallelism runs, not what it shards:
`loss_parallel` and `sequence_parallel`. Pure; used by `resolve`.
"""

from __future__ import annotations

from torch import nn

from ..models.hf_llama import Backbone
from .schema import ParallelPlan
from .tp_rules import ShardSpec, collapse_repeats, match_pattern

__all__ = ["option_problems"]


def option_problems(plan: ParallelPlan, model: nn.Module, bb: Backbone | None, shards: list[ShardSpec]) -> list[str]:
    """Every problem with `loss_parallel` / `sequence_parallel` for this model and these shards."""
    styles = {s.fqn: s.style for s in shards}
    name = type(model).__name__
    problems, loss_at = [], plan.where("loss_parallel")
    head = styles.get(bb.head) if bb is not None and bb.head else None
    if plan.loss_parallel:
        if bb is None or not bb.head:
            problems.append(
                f"{loss_at}loss_parallel: true needs an LM head the module walker knows (a Hugging Face LLaMA-family "
                f"...ForCausalLM); {name} has none: remove loss_parallel"
            )
        elif head != "column":
            problems.append(
                f"{loss_at}loss_parallel: true needs tensor_parallel['{bb.head}']: column (vocabulary shards of the "
                f"logits), found {head or 'unsharded'}; add that rule or remove loss_parallel"
            )
    elif head == "column":
        rule = next((p for p in plan.tensor_parallel if match_pattern(p, bb.head)), None)
        at = plan.where("tensor_parallel", rule) if rule else ""
        problems.append(
            f"{at}tensor_parallel: {bb.head} as 'column' leaves the model's logits sharded over tp; set "
            "loss_parallel: true (cross-entropy on the shards) or shard it as 'column_gather' (full logits)"
        )
    if plan.sequence_parallel:
        problems += _sequence_problems(plan, model, bb, styles)
    return problems


def _sequence_problems(plan: ParallelPlan, model: nn.Module, bb: Backbone | None, styles: dict[str, str]) -> list[str]:
    if bb is None:
        return [
            f"{plan.where('sequence_parallel')}sequence_parallel: true works with Hugging Face LLaMA-family models "
            "(the module walker); "
            f"{type(model).__name__} is split by torch.fx: remove sequence_parallel"
        ]
    problems, at = [], plan.where("sequence_parallel")
    if bb.norm_first:
        problems.append(
            f"{at}sequence_parallel: true gathers the sequence at {bb.path('norm')}, which "
            f"{type(model).__name__} also runs before its first layer: remove sequence_parallel"
        )
    for i in range(bb.num_layers):
        layer = bb.layer(i)
        for block, first in (("self_attn", "q_proj"), ("mlp", "gate_proj")):
            if styles.get(f"{layer}.{block}.{first}") != "column":
                problems.append(
                    f"{at}sequence_parallel: true needs {layer}.{block} sharded (column in, row out): between "
                    "its blocks a rank holds only its part of the sequence"
                )
    ends = [bb.path("norm")] + ([bb.head] if bb.head else [])
    for pattern in plan.activation_checkpointing:
        for end in ends:
            if match_pattern(pattern, end):
                problems.append(
                    f"{plan.where('activation_checkpointing', pattern)}activation_checkpointing[{pattern!r}] "
                    f"matches {end}, which gathers the sequence back "
                    "under sequence_parallel and cannot be recomputed; checkpoint the decoder layers instead"
                )
    return collapse_repeats(problems)
