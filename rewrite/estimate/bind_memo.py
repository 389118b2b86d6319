"""A plan search's binding steps: `BindSteps` whose results are kept by their arguments, so the many plans a
search binds to one model share what they have in common (the shards per tensor_parallel rules, the
parameters per stage set) instead of computing it per mesh, schedule or switch.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..binding.resolve import BindSteps

__all__ = ["MemoSteps"]


class MemoSteps(BindSteps):
    """`BindSteps` of one unchanged model, each step computed once per distinct arguments.

    `memo` maps (step name, *arguments) to the step's result; the model is not part of the key, so one
    `MemoSteps` serves one model, which must not change while it is in use.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.memo: dict[tuple, object] = {}

    def _once(self, name: str, step: Callable, *args):
        key = (name, *args)
        if key not in self.memo:
            self.memo[key] = step(*args)
        return self.memo[key]

    def modules(self):
        return self._once("modules", super().modules)

    def parallel(self):
        return self._once("parallel", super().parallel)

    def walker(self):
        return self._once("walker", super().walker)

    def shards(self, rules):
        return self._once("shards", super().shards, rules)

    def costs(self, tp, seq_len, bb, shards):
        return self._once("costs", super().costs, tp, seq_len, bb, shards)

    def stages(self, shape, bb, costs):
        return self._once("stages", super().stages, shape, bb, costs)

    def walk(self):
        return self._once("walk", super().walk)

    def held(self, sets, shards, experts):
        return self._once("held", super().held, sets, shards, experts)

    def totals(self):
        return self._once("totals", super().totals)
