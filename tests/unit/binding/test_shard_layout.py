"""`TensorSplit`: one rank's part of a whole tensor, checked against plain `chunk` over the layout."""

from __future__ import annotations

import pytest
import torch

from torch import nn

from rewrite import ColumnParallelLinear, RowParallelLinear
from rewrite.binding.shard_layout import WHOLE, ParamSplit, TensorSplit, mark_split, split_of, tensor_split
from rewrite.binding.tp_rules import ShardSpec
from rewrite.errors import InputError

FULL = torch.arange(24 * 6).reshape(24, 6)


def _by_chunk(full, dim, slices, parts, slot):
    return torch.cat([block.chunk(slices, dim)[slot] for block in full.chunk(parts, dim)], dim)


@pytest.mark.parametrize("dim,slices,parts,replicas", [(0, 4, 1, 1), (1, 2, 1, 1), (0, 2, 2, 1), (0, 2, 1, 2),
                                                       (0, 3, 2, 1), (1, 3, 1, 1)])
def test_each_rank_takes_what_chunk_over_the_layout_gives(dim, slices, parts, replicas):
    split = TensorSplit(dim, slices, parts, replicas)
    for tp_rank in range(slices * replicas):
        slot = tp_rank // replicas
        want = _by_chunk(FULL, dim, slices, parts, slot)
        got = split.take(FULL, tp_rank)
        assert torch.equal(got, want) and split.local_shape(tuple(FULL.shape)) == tuple(want.shape)
        assert split.counts_on(tp_rank) == (tp_rank % replicas == 0)
        starts = [s for s, _ in split.ranges(FULL.shape[dim], tp_rank)]
        assert starts == [p * FULL.shape[dim] // parts + slot * split.length(FULL.shape[dim]) for p in range(parts)]
    if parts == 1:
        assert split.take(FULL, 0).data_ptr() == FULL.data_ptr()  # one part: a view, no copy


def test_whole_and_the_split_a_binding_gives():
    assert WHOLE.take(FULL, 3) is FULL and not WHOLE.counts_on(0) and WHOLE.local_shape((2, 3)) == (2, 3)
    kv = ShardSpec("l.k_proj", "column", "*", 8, 4, True, (2, 8), (2,), replicas=2, tp=4)
    assert tensor_split(kv, "weight") == TensorSplit(0, 2, 1, 2) == tensor_split(kv, "bias")
    gate_up = ShardSpec("l.gate_up_proj", "packed_column", "*", 8, 16, False, (8, 8), None, tp=2)
    assert tensor_split(gate_up, "weight") == TensorSplit(0, 2, 2, 1)
    row = ShardSpec("l.o_proj", "row", "*", 8, 8, True, (8, 4), (8,), tp=2)
    assert tensor_split(row, "weight") == TensorSplit(1, 2) and tensor_split(row, "bias") == WHOLE
    assert tensor_split(row, "q_norm") == WHOLE and tensor_split(None, "weight") == WHOLE
    assert tensor_split(ShardSpec("e", "vocab", "*", 32, 8, False, (16, 8), None, tp=2), "weight") == TensorSplit(0, 2)
    assert tensor_split(ShardSpec("l.o_proj", "row", "*", 8, 8, True, (8, 8), (8,), tp=1), "weight") == WHOLE


def test_standalone_layers_know_their_split():
    column, row = ColumnParallelLinear(4, 6, True, torch.randn(6, 4)), RowParallelLinear(6, 4, True, torch.randn(4, 6))
    # One process: each holds the whole, as a layer of a plan with tp 1.
    assert column.split("weight") == column.split("bias") == row.split("weight") == row.split("bias") == WHOLE


def test_a_parameter_carries_the_split_it_was_marked_with():
    param = nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(InputError, match=r"shape \[4, 2\] carries no split: it was not placed by apply_plan"):
        split_of(param)
    record = ParamSplit(TensorSplit(0, 2), counts=True)
    mark_split(param, record)
    assert split_of(param) is record
