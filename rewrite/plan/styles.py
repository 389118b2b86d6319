"""The styles a `tensor_parallel` rule may name, and the Hugging Face names accepted for them."""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

from .files import short

__all__ = ["STYLES", "STYLE_ALIASES", "COLUMN_STYLES", "Style", "packed_parts"]

STYLES: dict[str, str] = {
    "column": "output features split; output stays sharded, to feed a `row` layer",
    "row": "input features split; input arrives sharded, partial outputs are summed",
    "column_gather": "output features split; output all-gathered (the standalone layer's default)",
    "packed_column": "output features are two equal parts side by side (a fused gate_up_proj): each part "
    "split, a rank keeps its slice of both in order; output stays sharded, to feed a `row` layer",
    "row_split": "input features split; the layer splits a full input itself, outputs summed",
    "vocab": "nn.Embedding rows (the vocabulary) split: each rank embeds the ids in its range, "
    "zeros elsewhere, and one all-reduce sums the result",
    "grad_allreduce": "any module kept whole whose input is sharded (e.g. per-head q/k norms): "
    "its parameter gradients are summed over the tensor-parallel group",
}

# Hugging Face transformers' tensor-parallel style names, and the style each means here.
STYLE_ALIASES: dict[str, str] = {
    "colwise": "column",
    "local_colwise": "column",
    "rowwise": "row",
    "local_rowwise": "row",
    "rowwise_rep": "row",
    "colwise_gather_output": "column_gather",
    "colwise_rep": "column_gather",
    "rowwise_split_input": "row_split",
    "replicated_with_grad_allreduce": "grad_allreduce",
    "embedding_rowwise": "vocab",
    "packed_colwise": "packed_column",
}

# The styles that split output features, and how many equal parts a style's output packs.
COLUMN_STYLES = ("column", "column_gather", "packed_column")
_PACKED = {"packed_column": 2}


def packed_parts(style: str | None) -> int:
    """Equal parts packed side by side along the output features (gate and up: 2); 1 when not packed."""
    return _PACKED.get(style, 1)

def _style(value: Any) -> Any:
    """Map HF aliases onto our style names; reject unknown names with a suggestion."""
    if not isinstance(value, str):
        return value  # the Literal check reports the type
    if value in STYLES:
        return value
    if value in STYLE_ALIASES:
        return STYLE_ALIASES[value]
    known = [*STYLES, *STYLE_ALIASES]
    close = difflib.get_close_matches(value, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown style {short(value)}: use one of {', '.join(STYLES)} "
        f"(Hugging Face names {', '.join(STYLE_ALIASES)} are accepted too){hint}"
    )


Style = Annotated[
    Literal[tuple(STYLES)],
    BeforeValidator(_style, json_schema_input_type=Literal[tuple([*STYLES, *STYLE_ALIASES])]),
]
