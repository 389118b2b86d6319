"""A style's properties are data (`STYLE_INFO`): the layer it becomes, the weight dim it splits,
what it does to its input and output, its packed parts; every reader looks them up."""

from __future__ import annotations

import pytest

from rewrite.binding.shard_layout import split_dim
from rewrite.plan.styles import COLUMN_STYLES, STYLE_ALIASES, STYLE_INFO, STYLES, packed_parts

# The documented layout (docs/layers.md), written out: (weight dim, bias dim) split per style.
SPLITS = {"column": (0, 0), "column_gather": (0, 0), "packed_column": (0, 0), "row": (1, None),
          "row_split": (1, None), "vocab": (0, None), "grad_allreduce": (None, None), "mla_kv_a": (None, None),
          # fused experts: split by expert over ep, or each expert's features over tp, as ExpertSpec.split_of says
          "expert_parallel": (None, None), "expert_tensor_parallel": (None, None)}


@pytest.mark.parametrize("style", list(STYLES))
def test_each_style_splits_what_the_layout_says(style):
    assert (split_dim(style, "weight"), split_dim(style, "bias")) == SPLITS[style]
    assert split_dim(style, "q_norm_weight") is None
    assert STYLES[style] == STYLE_INFO[style].what


def test_the_properties_readers_use():
    assert COLUMN_STYLES == ("column", "column_gather", "packed_column")
    assert [s for s, i in STYLE_INFO.items() if i.output_sharded] == ["column", "packed_column"]
    assert [s for s, i in STYLE_INFO.items() if i.input_sharded] == ["row"]  # row_split splits its input itself
    assert [s for s, i in STYLE_INFO.items() if i.gathers_output] == ["column_gather"]
    assert {s: packed_parts(s) for s in STYLES if packed_parts(s) > 1} == {"packed_column": 2}
    assert packed_parts(None) == 1
    assert set(STYLE_ALIASES.values()) <= set(STYLES)
