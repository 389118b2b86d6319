"""Pipeline balance: warn when one stage or rank carries far more than its share, and name the cuts that fix it.

Pure: it reads a resolved plan and its model (a meta-device model will do); no process group.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from fractions import Fraction

from torch import nn

from ..binding.cuts import balanced_split, best_split
from ..binding.params import held_parameters
from ..binding.resolve import ResolvedPlan

__all__ = ["THRESHOLD", "balance_warnings"]

# The most loaded stage (or rank) may hold this many times the mean before we warn: a stage
# one layer heavier than its neighbours in a 4-stage split of 16 layers is 1.25x.
THRESHOLD = 1.25


def balance_warnings(resolved: ResolvedPlan, model: nn.Module, *, threshold: float = THRESHOLD) -> list[str]:
    """Warnings for a pipeline whose most loaded stage holds more than `threshold` x the mean.

    Two measures, at most one warning each:
      parameters   what each rank holds after tensor-parallel sharding, a parameter shared by
                   two of its modules once. With pipeline.virtual_stages > 1 they are summed
                   per pp rank (a rank keeps all its stages' weights, gradients and optimizer
                   state), else counted per stage (one stage per rank).
      compute      estimated training FLOPs per stage (`ResolvedPlan.costs`; LLaMA-family
                   models only), per stage even with virtual stages: every microbatch waits
                   for the slowest stage of the pipeline.
    A warning gives the numbers and the cut points that clear both measures when one of
    the balanced splits does (the layer-count default, `cut_points: auto`, or a split by
    parameters), else the split most even on that measure, as a line to paste.

    Args:
        resolved: `resolve(plan, model)`.
        model: the model it was resolved against (not changed).
        threshold: the ratio of the most loaded to the mean above which to warn (> 1).

    Returns:
        One line per unbalanced measure; empty for one stage or a balanced split.

    Raises:
        ValueError: threshold is not above 1.

    Example:
        >>> skewed = {"mesh": {"pp": 2}, "pipeline": {"cut_points": ["model.layers.2"]}}
        >>> print(balance_warnings(resolve(skewed, llama_3_1_8b), llama_3_1_8b)[0])  # doctest: +ELLIPSIS
        parameters: stage 1 holds 1.76x the mean (7.07 B of 8.03 B over 2 stages, mean 4.02 B, ...) with
        cut_points ["model.layers.2"] (layers per stage 2, 30); fix: pipeline.cut_points: ["model.layers.17"]
        (what cut_points: auto picks; layers per stage 17, 15; most loaded: 1.05x the mean parameters, ...)
    """
    if not threshold > 1:
        raise ValueError(
            f"balance_warnings: threshold={threshold!r}; the most loaded stage over the mean is never below 1, "
            f"so the threshold must be above 1 (e.g. {THRESHOLD})"
        )
    if resolved.num_stages == 1:
        return []
    if resolved.kind != "hf" or resolved.backbone is None:
        return _traced_warnings(resolved, model, Fraction(threshold))
    return _Split(resolved, model, Fraction(threshold)).warnings()


def held_count(model: nn.Module, modules: Iterable[str], shards: Iterable = ()) -> int:
    """Elements of `held_parameters`: what a rank holds for `modules`."""
    return sum(p.numel for p in held_parameters(model, modules, shards))


def _peak(values: Sequence[int], threshold: Fraction) -> tuple[int, Fraction] | None:
    """(index, ratio to the mean) of the largest value when it exceeds threshold x the mean."""
    if not sum(values):
        return None
    top = max(range(len(values)), key=values.__getitem__)
    ratio = _ratio(values)
    return (top, ratio) if ratio > threshold else None


def _count(n: int) -> str:
    """Parameters for a sentence: '6.74 B', '135 M', '36,992'."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} B"
    if n >= 10**6:
        return f"{n / 1e6:.3g} M"
    return f"{n:,}"


def _flops(n: int) -> str:
    for unit, scale in (("PFLOP", 10**15), ("TFLOP", 10**12), ("GFLOP", 10**9), ("MFLOP", 10**6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:,} FLOP"


class _Split:
    """Both measures of a LLaMA-family plan for any layer split, and the candidate fixes."""

    def __init__(self, resolved: ResolvedPlan, model: nn.Module, threshold: Fraction):
        self.r, self.model, self.threshold = resolved, model, threshold
        self.bb = resolved.backbone
        self.sizes = [len(ls) for ls in resolved.layer_indices]
        self.n, self.stages = sum(self.sizes), len(self.sizes)
        self.per_rank = resolved.plan.pipeline.virtual_stages > 1

    def params(self, sizes: Sequence[int]) -> list[int]:
        """Per rank (virtual stages) or per stage: parameters held after sharding."""
        starts = [sum(sizes[:s]) for s in range(len(sizes))]
        mods = [
            self.bb.stage_modules(list(range(a, a + k)), first=s == 0, last=s == len(sizes) - 1)
            for s, (a, k) in enumerate(zip(starts, sizes))
        ]
        if not self.per_rank:
            return [held_count(self.model, m, self.r.shards) for m in mods]
        return [
            held_count(self.model, [m for s in self.r.rank_stages(rank) for m in mods[s]], self.r.shards)
            for rank in range(self.r.pp)
        ]

    def compute(self, sizes: Sequence[int]) -> list[int] | None:
        return self.r.costs.stage_costs(sizes) if self.r.costs is not None else None

    def clear(self, sizes: Sequence[int]) -> bool:
        flops = self.compute(sizes)
        return _peak(self.params(sizes), self.threshold) is None and (
            flops is None or _peak(flops, self.threshold) is None
        )

    def by_params(self) -> list[int]:
        """The split whose most loaded stage holds the fewest parameters (per stage)."""
        weights = [held_count(self.model, [self.bb.layer(i)], self.r.shards) for i in range(self.n)]
        first = self.bb.stage_modules([], first=True, last=False)
        last = self.bb.stage_modules([], first=False, last=True)
        weights[0] += held_count(self.model, first, self.r.shards)
        weights[-1] += held_count(self.model, last, self.r.shards)
        return best_split(weights, self.stages)

    def candidates(self) -> list[tuple[str, list[int]]]:
        """(what picks it, layers per stage) of each balanced split, most preferred first."""
        out = []
        if self.r.costs is not None:
            out.append(("what cut_points: auto picks", best_split(self.r.costs.folded(), self.stages)))
        out.append(("what omitting cut_points picks", balanced_split(self.n, self.stages)))
        out.append(("balanced by parameters per stage", self.by_params()))
        return out

    def describe(self, sizes: Sequence[int], how: str) -> str:
        """A split as a line to paste, with what its most loaded stage or rank would hold."""
        cuts = ", ".join(f'"{self.bb.layer(sum(sizes[:s]))}"' for s in range(1, len(sizes)))
        ratios = [f"{float(_ratio(self.params(sizes))):.2f}x the mean parameters"]
        flops = self.compute(sizes)
        if flops is not None:
            ratios.append(f"{float(_ratio(flops)):.2f}x the compute")
        return f"pipeline.cut_points: [{cuts}] ({how}; {_sizes_text(sizes)}; most loaded: {', '.join(ratios)})"

    def fix(self, measure: str) -> str:
        found = self.candidates()
        for how, sizes in found:
            if list(sizes) != self.sizes and self.clear(sizes):
                return self.describe(sizes, how)
        # None clears both measures: the split most even on this one.
        how, sizes = found[-1] if measure == "parameters" or self.r.costs is None else found[0]
        if list(sizes) == self.sizes:
            return (
                f"none of the balanced splits of {self.n} layers into {self.stages} stages is more even; "
                "change mesh.pp or pipeline.virtual_stages"
            )
        return f"the most even on {measure}: {self.describe(sizes, how)}"

    def _unit(self, index: int) -> str:
        if not self.per_rank:
            return f"stage {index}"
        held = ", ".join(str(s) for s in self.r.rank_stages(index))
        return f"pp rank {index} (stages {held})"

    def _now(self) -> str:
        cuts = self.r.plan.pipeline.cut_points
        return f"with {_written(cuts)} ({_sizes_text(self.sizes)})"

    def warnings(self) -> list[str]:
        out = []
        params = self.params(self.sizes)
        hit = _peak(params, self.threshold)
        if hit:
            top, ratio = hit
            total, count = sum(params), len(params)
            over = f"{count} pp ranks, summed over each rank's virtual stages" if self.per_rank else f"{count} stages"
            out.append(
                f"parameters: {self._unit(top)} holds {float(ratio):.2f}x the mean ({_count(params[top])} of "
                f"{_count(total)} over {over}, mean {_count(total // count)}, per rank after tensor parallelism; "
                f"more than {float(self.threshold):g}x) {self._now()}; fix: {self.fix('parameters')}"
            )
        flops = self.compute(self.sizes)
        hit = _peak(flops, self.threshold) if flops is not None else None
        if hit:
            top, ratio = hit
            total, count = sum(flops), len(flops)
            out.append(
                f"compute: stage {top} holds {float(ratio):.2f}x the mean estimated training FLOPs "
                f"({_flops(flops[top])} of {_flops(total)} per {self.r.costs.seq_len}-token sequence over "
                f"{count} stages, per rank after tensor parallelism; more than {float(self.threshold):g}x) "
                f"{self._now()}; fix: {self.fix('compute')}"
            )
        return out


def _written(cuts) -> str:
    """The plan's pipeline.cut_points as the user wrote them."""
    if cuts is None:
        return "cut_points omitted"
    return "cut_points: auto" if cuts == "auto" else f"cut_points {json.dumps(list(cuts))}"


def _sizes_text(sizes: Sequence[int]) -> str:
    return "layers per stage " + ", ".join(str(k) for k in sizes)


def _ratio(values: Sequence[int]) -> Fraction:
    """The largest value over the mean."""
    return Fraction(max(values) * len(values), sum(values)) if sum(values) else Fraction(1)


def _traced_warnings(resolved: ResolvedPlan, model: nn.Module, threshold: Fraction) -> list[str]:
    """A torch.fx-split model: parameters only (its modules have no compute estimate)."""
    per_rank = resolved.plan.pipeline.virtual_stages > 1
    if per_rank:
        params = [held_count(model, resolved.rank_modules(r), resolved.shards) for r in range(resolved.pp)]
    else:
        params = [held_count(model, s.modules, resolved.shards) for s in resolved.stages]
    hit = _peak(params, threshold)
    if not hit:
        return []
    top, ratio = hit
    unit = f"pp rank {top} (stages {', '.join(map(str, resolved.rank_stages(top)))})" if per_rank else f"stage {top}"
    over = f"{len(params)} pp ranks, summed over each rank's virtual stages" if per_rank else f"{len(params)} stages"
    fix = (
        "omit pipeline.cut_points for a split by layer count, or move the cuts"
        if resolved.plan.pipeline.cut_points is not None
        else "list pipeline.cut_points by hand (a split by layer count is what omitting them gives)"
    )
    return [
        f"parameters: {unit} holds {float(ratio):.2f}x the mean ({_count(params[top])} of "
        f"{_count(sum(params))} over {over}, mean {_count(sum(params) // len(params))}, per rank after tensor "
        f"parallelism; more than {float(threshold):g}x) with {_written(resolved.plan.pipeline.cut_points)} "
        f"(stages start at {', '.join(resolved.cut_points)}); fix: {fix}"
    ]
