"""The styles a `tensor_parallel` rule may name, and the Hugging Face names accepted for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

from .files import short
from .patterns import closest

__all__ = ["STYLES", "STYLE_ALIASES", "NEEDS_NO_RULE", "COLUMN_STYLES", "SPLIT_OUTPUT_STYLES", "WHOLE_STYLES", "Style", "StyleInfo", "STYLE_INFO", "packed_parts"]


@dataclass(frozen=True)
class StyleInfo:
    """What a style does to its module, as data every reader (rules, layers, checkpoints) looks up."""

    what: str  # one line for users (`rewrite show`, the plan schema)
    layer: Literal["column", "row", "vocab", "whole", "experts"]  # Column/RowParallelLinear, VocabParallelEmbedding, kept
    output_sharded: bool = False  # its output stays split over tp: a `row` layer must read it
    input_sharded: bool = False  # it reads an input already split over tp (a `column` layer's output)
    gathers_output: bool = False  # its output is all-gathered back whole
    parts: int = 1  # equal parts packed side by side along the output features (gate and up: 2)


STYLE_INFO: dict[str, StyleInfo] = {
    "column": StyleInfo("output features split; output stays sharded, to feed a `row` layer", "column",
                        output_sharded=True),
    "row": StyleInfo("input features split; input arrives sharded, partial outputs are summed", "row",
                     input_sharded=True),
    "column_gather": StyleInfo("output features split; output all-gathered (the standalone layer's default)",
                               "column", gathers_output=True),
    "packed_column": StyleInfo(
        "output features are two equal parts side by side (a fused gate_up_proj): each part split, a rank keeps "
        "its slice of both in order; output stays sharded, to feed a `row` layer", "column", output_sharded=True,
        parts=2),
    "row_split": StyleInfo("input features split; the layer splits a full input itself, outputs summed", "row"),
    "vocab": StyleInfo("nn.Embedding rows (the vocabulary) split: each rank embeds the ids in its range, "
                       "zeros elsewhere, and one all-reduce sums the result", "vocab"),
    "grad_allreduce": StyleInfo("any module kept whole whose input is sharded (e.g. per-head q/k norms): "
                                "its parameter gradients are summed over the tensor-parallel group", "whole"),
    "mla_kv_a": StyleInfo(
        "multi-head latent attention's kv_a_proj_with_mqa (DeepSeek), kept whole: the last qk_rope_head_dim "
        "features of its output (the rotary key every head shares) reach the heads split over tp directly, so "
        "their gradient is summed over the group; the latent part's comes whole through kv_b_proj", "whole"),
    "expert_parallel": StyleInfo("a fused experts module (a mixture of experts) split by expert over mesh.ep, not tp: "
                                 "each rank holds E / ep experts and tokens reach them by all-to-all", "experts"),
    "expert_tensor_parallel": StyleInfo(
        "a fused experts module (a mixture of experts) with each expert split over tp as a dense MLP is: every rank "
        "holds every expert's slice of the intermediate features (gate_up_proj packed column, down_proj row, along "
        "the dims the family's own tp plan names), runs the tokens through it, and the partial outputs are summed",
        "experts"),
}
STYLES: dict[str, str] = {name: info.what for name, info in STYLE_INFO.items()}

# Hugging Face transformers' tensor-parallel style names, and the style each means here.
STYLE_ALIASES: dict[str, str] = {
    "colwise": "column", "local_colwise": "column", "rowwise": "row", "local_rowwise": "row", "rowwise_rep": "row",
    "colwise_gather_output": "column_gather", "colwise_rep": "column_gather", "rowwise_split_input": "row_split",
    "replicated_with_grad_allreduce": "grad_allreduce", "mla_kv_a_proj": "mla_kv_a", "embedding_rowwise": "vocab",
    "packed_colwise": "packed_column", "ep_dispatch_experts": "expert_parallel",
    "moe_tp_experts": "expert_tensor_parallel",
}

# Hugging Face styles that say how its DTensor layers run, and why a plan here needs no rule for them.
NEEDS_NO_RULE: dict[str, str] = {
    "local_params": "every module here already runs on its rank's own tensors: remove the rule (a rule "
                    "splitting the module's parameters with its heads, such as 'self_attn.sinks': column, stays)",
}

# The styles that split output features (ColumnParallelLinear).
COLUMN_STYLES = tuple(name for name, info in STYLE_INFO.items() if info.layer == "column")
# The styles whose output stays split over tp, for a `row` layer to read: they split a block through its middle.
SPLIT_OUTPUT_STYLES = tuple(name for name, info in STYLE_INFO.items() if info.output_sharded)
# The styles that keep their module whole on every tp rank.
WHOLE_STYLES = tuple(name for name, info in STYLE_INFO.items() if info.layer == "whole")


def packed_parts(style: str | None) -> int:
    """Equal parts packed side by side along the output features (gate and up: 2); 1 when not packed."""
    return STYLE_INFO[style].parts if style in STYLE_INFO else 1


def _style(value: Any) -> Any:
    """Map HF aliases onto our style names; reject unknown names with a suggestion."""
    if not isinstance(value, str):
        return value  # the Literal check reports the type
    if value in STYLES or value in STYLE_ALIASES:
        return STYLE_ALIASES.get(value, value)
    if value in NEEDS_NO_RULE:
        raise ValueError(f"style {short(value)} is not needed: {NEEDS_NO_RULE[value]}")
    hint = closest(value, [*STYLES, *STYLE_ALIASES])
    raise ValueError(f"unknown style {short(value)}: use one of {', '.join(STYLES)} "
                     f"(Hugging Face names {', '.join(STYLE_ALIASES)} are accepted too){hint}")


Style = Annotated[
    Literal[tuple(STYLES)],
    BeforeValidator(_style, json_schema_input_type=Literal[tuple([*STYLES, *STYLE_ALIASES])]),
]
