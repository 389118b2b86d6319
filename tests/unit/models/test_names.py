"""Tied weights: one tensor at two paths, named one way for the tp rules, checkpoints and dp."""

from __future__ import annotations

from torch import nn

from rewrite.models.names import canonical_names, first_names, tied_modules


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_weight_has_one_first_path():
    model = _Tied()
    assert canonical_names(model) == {"embed.weight": "embed.weight", "mid.weight": "mid.weight",
                                      "mid.bias": "mid.bias", "head.weight": "embed.weight"}
    assert first_names(model)[id(model.head.weight)] == "embed.weight"
    assert len(first_names(model)) == 3
    assert tied_modules(model) == {"head": "embed.weight"}
    assert tied_modules(nn.Linear(2, 2)) == {}
