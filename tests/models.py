"""Small non-Hugging-Face modules for the torch.fx path."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class ToyNet(nn.Module):
    """input projection -> blocks -> head; blocks is the layer sequence."""

    def __init__(self, d: int = 16, h: int = 32, n: int = 4, out: int = 8):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.head = nn.Linear(d, out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def toy_step_setup(microbatches: int) -> tuple[ToyNet, ToyNet, list[torch.Tensor], list[torch.Tensor]]:
    """A ToyNet, its untouched copy for the reference, and `microbatches` inputs and targets."""
    import copy

    torch.manual_seed(0)
    model = ToyNet()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 5, 16, generator=gen) for _ in range(microbatches)]
    ys = [torch.randn(2, 5, 8, generator=gen) for _ in range(microbatches)]
    return model, copy.deepcopy(model), xs, ys


class SkipNet(ToyNet):
    """The input is reused after the blocks: no single tensor crosses a cut."""

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h + x)


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: untraceable
            return x
        return -x


class BranchyNet(ToyNet):
    def __init__(self):
        super().__init__()
        self.gate = Gate()

    def forward(self, x):
        return self.head(self.gate(self.inp(x)))
