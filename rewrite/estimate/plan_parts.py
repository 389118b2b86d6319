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
from .layer_activations import SELECTIVE
from ..binding.resolve import ResolvedPlan

__all__ = ["activation_problem", "selective_problem", "Styles", "shard_styles", "block_splits", "layer_kinds",
           "loss_sharded", "recomputed_parts"]


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

    @cached_property
    def splits(self) -> dict[str, dict[str, bool]]:
        """`<layers>.<i>` -> `block_splits` of that layer, each found once."""
        return {}

    @cached_property
    def kinds(self) -> dict[tuple, list]:
        """(layer indices, recomputed modules) -> `layer_kinds` of the plans binding them with these styles."""
        return {}


_KEPT: dict[int, tuple[tuple, tuple, Styles]] = {}  # id(shards) -> (shards, experts, their Styles)


def shard_styles(resolved: ResolvedPlan) -> Styles:
    """fqn -> style of every module the plan splits over tp (empty at tp 1: nothing is split): the
    linears, and the fused experts modules each expert of which it splits (`expert_tensor_parallel`).
    One `Styles` per binding: the variants a search derives from it share its shards."""
    if resolved.tp == 1:
        return Styles()
    kept = _KEPT.get(id(resolved.shards))
    if kept is not None and kept[0] is resolved.shards and kept[1] is resolved.experts:
        return kept[2]
    styles = Styles({**{s.fqn: s.style for s in resolved.shards},
                     **{e.fqn: TP_STYLE for e in resolved.experts if e.tp > 1}})
    if len(_KEPT) >= 512:  # a search binds a few hundred meshes and switches; keep the memory bounded
        _KEPT.clear()
    _KEPT[id(resolved.shards)] = (resolved.shards, resolved.experts, styles)
    return styles


def block_splits(styles: dict[str, str], layer: str) -> dict[str, bool]:
    """Whether a LLaMA-shaped layer's attention and MLP are split over tp: their splitter's output is
    (`models.blocks`; a mixture of experts' MLP: its experts split over tp), and whether a mixture of
    experts' shared experts are (a column inside a child of its MLP)."""
    styles = styles if isinstance(styles, Styles) else Styles(styles)
    if layer not in styles.splits:
        styles.splits[layer] = _block_splits(styles, layer)
    return styles.splits[layer]


def _block_splits(styles: Styles, layer: str) -> dict[str, bool]:
    under = styles.by_layer.get(layer, [])
    inner = f"{MLP.layer_part}."
    split = {b.layer_part for b in (ATTENTION, LATENT_ATTENTION, MLP, PACKED_MLP)
             if styles.get(f"{layer}.{b.layer_part}.{b.splitter}") in SPLIT_OUTPUT_STYLES}
    return {
        "attention_split": ATTENTION.layer_part in split,
        "mlp_split": MLP.layer_part in split or any(s == TP_STYLE for _, s in under),
        "shared_split": any(s in COLUMN_STYLES and rest.startswith(inner) and "." in rest[len(inner):]
                            for rest, s in under),
    }


def layer_kinds(resolved: ResolvedPlan, styles: Styles) -> list[list[tuple[int, dict[str, bool], frozenset[str]]]]:
    """Per stage, per decoder layer in order: (its index, `block_splits`, its checkpointed parts as
    `recomputed_parts` gives them). Found once per stage split and checkpointing of a binding's styles:
    a search reads them for every candidate."""
    key = (resolved.layer_indices, resolved.recomputed, resolved.selective)
    if key not in styles.kinds:
        bb, recomputed = resolved.backbone, recomputed_parts(resolved)
        styles.kinds[key] = [[(i, block_splits(styles, bb.layer(i)), frozenset(recomputed.get(i, ()))) for i in layers]
                             for layers in resolved.layer_indices]
    return styles.kinds[key]


def loss_sharded(resolved: ResolvedPlan, styles: dict[str, str]) -> bool:
    """Whether the runner's loss works on vocabulary shards: loss_parallel with the head a column."""
    head = resolved.backbone.head
    return resolved.plan.loss_parallel and head is not None and styles.get(head) == "column"


def recomputed_parts(resolved: ResolvedPlan) -> dict[int, set[str]]:
    """Per decoder layer index: {""} when the layer is checkpointed whole, else its checkpointed parts
    (`LAYER_PARTS`), each prefixed `SELECTIVE` where checkpointed 'selective'; layers with none are left out."""
    bb, found, selective = resolved.backbone, {}, set(resolved.selective)
    prefix = bb.layers + "."
    for fqn in resolved.recomputed:
        if not fqn.startswith(prefix):
            continue
        index, _, part = fqn[len(prefix):].partition(".")
        if index.isdigit() and (not part or part in LAYER_PARTS):
            found.setdefault(int(index), set()).add(SELECTIVE + part if fqn in selective else part)
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
    if resolved.selective:
        return selective_problem(model, cp=resolved.plan.mesh.cp)
    return None


def selective_problem(model: nn.Module, *, cp: int = 1) -> str | None:
    """Why the activations of layers checkpointed 'selective' are not estimated for `model` (at `cp` context-
    parallel ranks), or None: the estimate counts the products of q/k/v/o and gate/up/down projections
    (`layer_activations.selective_products`), with one attention kernel a call."""
    from ..models.hf_decoder import find_backbone

    layer = model.get_submodule(find_backbone(model).layer(0))
    want = {ATTENTION.layer_part: (*ATTENTION.inputs, ATTENTION.output), MLP.layer_part: (*MLP.inputs, MLP.output)}
    missing = [f"{part}.{name}" for part, names in want.items() for name in names
               if not isinstance(getattr(getattr(layer, part, None), name, None), nn.Linear)]
    extra = [f"{part}.{name}" for part in want for name, sub in getattr(layer, part)._modules.items()
             if isinstance(sub, nn.Linear) and name not in want[part]]
    why = (f"its layers have no linear {', '.join(missing)}" if missing else
           f"its layers also project in {', '.join(extra)}" if extra else
           "context parallelism runs the attention kernel once per chunk" if cp > 1 else None)
    return (f"activations under 'selective' checkpointing are estimated for layers of q/k/v/o and gate/up/down "
            f"projections alone; {type(model).__name__}: {why}") if why else None


