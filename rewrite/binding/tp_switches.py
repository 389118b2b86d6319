"""Checks of `loss_parallel` and `sequence_parallel`: how tensor parallelism runs, not what it shards. Pure."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..models.experts import experts_problem
from ..models.hf_decoder import Backbone
from ..plan.schema import ParallelPlan
from ..plan.patterns import match_pattern
from .tp_rules import ShardSpec
from ..plan.wording import collapse_repeats

__all__ = ["option_problems", "sequence_blocks"]


def _split_kinds(module: nn.Module, at: str, styles: Mapping[str, str]) -> set[str]:
    found = (styles.get(f"{at}.{sub}") for sub, _ in module.named_modules() if sub)
    return {"column" if style == "packed_column" else style for style in found if style in ("column", "packed_column", "row")}


def sequence_blocks(
    layer: nn.Module, path: str, styles: Mapping[str, str]
) -> tuple[dict[str, set[str]], dict[str, str], dict[str, str]]:
    """A decoder layer's children as sequence parallelism sees them: (blocks, others, moe), by their paths.

    Blocks: children holding linears the plan splits, with the styles found in them ('column', 'row'); their
    input is gathered to the whole sequence, their row layers scatter it again. Moe (path -> its fused experts
    module's path): a child holding one runs on the rank's part of the sequence, token by token; the children
    inside it holding split linears (shared experts) are blocks. Others (path -> what it is): parameters that
    would see only a part of the sequence outside any block (children with weights that are not norms, the
    layer's own parameters). Norms, dropouts and parameterless children run on the rank's part as they are.
    """
    blocks: dict[str, set[str]] = {}
    moe: dict[str, str] = {}
    others = {f"{path}.{n}": "a parameter of the layer itself" for n, _ in layer.named_parameters(recurse=False)}
    for name, child in layer.named_children():
        at = f"{path}.{name}"
        experts = next((f"{at}.{sub}" for sub, m in child.named_modules() if sub and experts_problem(m) is None), None)
        kinds = _split_kinds(child, at, styles)
        if experts is not None:
            moe[at] = experts
            for sub, inner in child.named_children():
                if f"{at}.{sub}" != experts and (found := _split_kinds(inner, f"{at}.{sub}", styles)):
                    blocks[f"{at}.{sub}"] = found
        elif kinds:
            blocks[at] = kinds
        elif any(True for _ in child.parameters()) and "norm" not in type(child).__name__.lower():
            others[at] = type(child).__name__
    return blocks, others, moe


def option_problems(plan: ParallelPlan, model: nn.Module, bb: Backbone | None, shards: list[ShardSpec]) -> list[str]:
    """Every problem with `loss_parallel` / `sequence_parallel` for this model and these shards."""
    styles = {s.fqn: s.style for s in shards}
    name = type(model).__name__
    problems, loss_at = [], plan.where("loss_parallel")
    head = styles.get(bb.head) if bb is not None and bb.head else None
    if plan.loss_parallel:
        if bb is None or not bb.head:
            problems.append(f"{loss_at}loss_parallel: true needs an LM head the module walker knows (a Hugging Face "
                            f"LLaMA-family ...ForCausalLM); {name} has none: remove loss_parallel")
        elif head != "column":
            problems.append(f"{loss_at}loss_parallel: true needs tensor_parallel['{bb.head}']: column (vocabulary "
                            f"shards of the logits), found {head or 'unsharded'}; add that rule or remove "
                            "loss_parallel")
    elif head == "column":
        rule = next((p for p in plan.tensor_parallel if match_pattern(p, bb.head)), None)
        at = plan.where("tensor_parallel", rule) if rule else ""
        problems.append(f"{at}tensor_parallel: {bb.head} as 'column' leaves the model's logits sharded over tp; set "
                        "loss_parallel: true (cross-entropy on the shards) or shard it as 'column_gather' (full "
                        "logits)")
    if plan.sequence_parallel:
        problems += _sequence_problems(plan, model, bb, styles)
    return problems


def _sequence_problems(plan: ParallelPlan, model: nn.Module, bb: Backbone | None, styles: dict[str, str]) -> list[str]:
    if bb is None:
        return [f"{plan.where('sequence_parallel')}sequence_parallel: true works with Hugging Face LLaMA-family models "
                f"(the module walker); {type(model).__name__} is split by torch.fx: remove sequence_parallel"]
    problems, at = [], plan.where("sequence_parallel")
    if bb.norm_first:
        problems.append(f"{at}sequence_parallel: true gathers the sequence at {bb.norm}, which "
                        f"{type(model).__name__} also runs before its first layer: remove sequence_parallel")
    for i in range(bb.num_layers):
        layer = bb.layer(i)
        blocks, others, moe = sequence_blocks(model.get_submodule(layer), layer, styles)
        if not blocks and not moe:
            problems.append(f"{at}sequence_parallel: true needs the blocks of {layer} sharded (column in, row out): "
                            "between its blocks a rank holds only its part of the sequence")
        for block, kinds in blocks.items():
            if kinds != {"column", "row"}:
                problems.append(f"{at}sequence_parallel: true needs {block} sharded column in and row out (it gathers "
                                "the sequence before its column layers and scatters it after its row layer); found "
                                f"{' and '.join(sorted(kinds))} only")
        for other, what in others.items():
            problems.append(f"{at}sequence_parallel: true runs {other} ({what}) on this rank's part of the sequence, "
                            "and only norms may run so: shard it (column in, row out) or remove sequence_parallel")
    ends = [bb.norm] + ([bb.head] if bb.head else [])
    for pattern in plan.activation_checkpointing:
        for end in ends:
            if match_pattern(pattern, end):
                problems.append(
                    f"{plan.where('activation_checkpointing', pattern)}activation_checkpointing[{pattern!r}] "
                    f"matches {end}, which gathers the sequence back "
                    "under sequence_parallel and cannot be recomputed; checkpoint the decoder layers instead"
                )
    return collapse_repeats(problems)
