"""What the estimates read of a resolved plan: whether its layers are LLaMA-shaped, which blocks tp
splits, the loss, the checkpointed layers.

Shared by the activation estimate (`activations`) and the step-time model (`stage_time`).
"""

from __future__ import annotations

import re
from functools import cached_property

from torch import nn

from ..binding.experts import TP_STYLE
from ..models.blocks import ATTENTION, LATENT_ATTENTION, LAYER_PARTS, MLP, PACKED_MLP
from ..plan.styles import COLUMN_STYLES, SPLIT_OUTPUT_STYLES
from ..binding.resolve import ResolvedPlan

__all__ = ["activation_problem", "Styles", "shard_styles", "block_splits", "loss_sharded", "recomputed_parts"]


_INDEX = re.compile(r"(?:^|\.)\d+(?=\.)")


class Styles(dict):
    """fqn -> style of the modules a plan splits over tp, with the entries under each decoder layer found
    once: an estimate reads every layer of every candidate plan."""

    @cached_property
    def by_layer(self) -> dict[str, list[tuple[str, str]]]:
        """`<layers>.<i>` -> (the rest of the fqn, style) of each entry under it."""
        found: dict[str, list[tuple[str, str]]] = {}
        for fqn, style in self.items():
            for index in _INDEX.finditer(fqn):  # a layer's path ends in its index
                found.setdefault(fqn[:index.end()], []).append((fqn[index.end() + 1:], style))
        return found


def shard_styles(resolved: ResolvedPlan) -> Styles:
    """fqn -> style of every module the plan splits over tp (empty at tp 1: nothing is split): the
    linears, and the fused experts modules each expert of which it splits (`expert_tensor_parallel`)."""
    if resolved.tp == 1:
        return Styles()
    return Styles({**{s.fqn: s.style for s in resolved.shards}, **{e.fqn: TP_STYLE for e in resolved.experts if e.tp > 1}})


def block_splits(styles: dict[str, str], layer: str) -> dict[str, bool]:
    """Whether a LLaMA-shaped layer's attention and MLP are split over tp: their splitter's output is
    (`models.blocks`; a mixture of experts' MLP: its experts split over tp), and whether a mixture of
    experts' shared experts are (a column inside a child of its MLP)."""
    under = (styles if isinstance(styles, Styles) else Styles(styles)).by_layer.get(layer, [])
    inner = f"{MLP.layer_part}."
    split = {b.layer_part for b in (ATTENTION, LATENT_ATTENTION, MLP, PACKED_MLP)
             if styles.get(f"{layer}.{b.layer_part}.{b.splitter}") in SPLIT_OUTPUT_STYLES}
    return {
        "attention_split": ATTENTION.layer_part in split,
        "mlp_split": MLP.layer_part in split or any(s == TP_STYLE for _, s in under),
        "shared_split": any(s in COLUMN_STYLES and rest.startswith(inner) and "." in rest[len(inner):]
                            for rest, s in under),
    }


def loss_sharded(resolved: ResolvedPlan, styles: dict[str, str]) -> bool:
    """Whether the runner's loss works on vocabulary shards: loss_parallel with the head a column."""
    head = resolved.backbone.head
    return resolved.plan.loss_parallel and head is not None and styles.get(head) == "column"


def recomputed_parts(resolved: ResolvedPlan) -> dict[int, set[str]]:
    """Per decoder layer index: {""} when the layer is checkpointed whole, else its checkpointed parts
    (`LAYER_PARTS`); layers with none are left out."""
    bb, found = resolved.backbone, {}
    prefix = bb.layers + "."
    for fqn in resolved.recomputed:
        if not fqn.startswith(prefix):
            continue
        index, _, part = fqn[len(prefix):].partition(".")
        if index.isdigit() and (not part or part in LAYER_PARTS):
            found.setdefault(int(index), set()).add(part)
    return found


def activation_problem(resolved: ResolvedPlan, model: nn.Module) -> str | None:
    """Why `rank_activations` cannot estimate this plan's activations, or None when it can.

    The model above is of LLaMA-shaped layers: `self_attn` and `mlp` between two norms.
    Other layouts (GPT-NeoX's `attention`, GPT-J's `attn` beside its MLP) are not estimated.
    """
    bb = resolved.backbone
    if resolved.kind != "hf" or bb is None:
        return (
            f"activations are estimated for Hugging Face LLaMA-family models (the module walker); "
            f"{resolved.model_name} is split by torch.fx"
        )
    layer = model.get_submodule(bb.layer(0))
    if not all(isinstance(getattr(layer, b.layer_part, None), nn.Module) for b in (ATTENTION, MLP)):
        return (
            f"activations are estimated for LLaMA-shaped layers (self_attn, then mlp); {type(layer).__name__} "
            f"holds {', '.join(layer._modules)}"
        )
    return None
