"""Where a pipeline is cut: layers per stage, even by count or balanced by a cost per layer."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_split", "best_split"]


def balanced_split(num_layers: int, pp: int) -> list[int]:
    """Layers per stage, differing by at most one; the first `num_layers % pp` stages get the extra.

    The last stage also runs the norm and the (often large) LM head, so the
    remainder goes to the front.
    """
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def _fewest_stages(weights: Sequence[int], bound: int) -> int:
    """Stages needed when each holds as many layers as fit under `bound` (each weight fits)."""
    stages, load = 1, 0
    for w in weights:
        if load + w > bound:
            stages, load = stages + 1, 0
        load += w
    return stages


def best_split(weights: Sequence[int], pp: int) -> list[int]:
    """Layers per stage: `pp` contiguous non-empty stages whose most loaded is lightest.

    Exact. Of the splits with the lightest most loaded stage, the one whose next most
    loaded stage is lightest, and so on; of those still equal, the one giving the earliest
    stages the most layers. Equal weights give `balanced_split`.

    Args:
        weights: non-negative integer cost per layer, in order (see `Costs.folded`).
        pp: the number of stages, 1 <= pp <= len(weights).

    Example:
        >>> best_split([1, 1, 1, 1, 1, 3], 2)
        [4, 2]
    """
    n = len(weights)
    if not 1 <= pp <= n:
        raise ValueError(f"best_split: {pp} stages for {n} layers; need 1 <= pp <= {n}")
    # The lightest bound that pp stages can meet: binary search with the greedy packing.
    low, high = max(weights), sum(weights)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if _fewest_stages(weights, mid) <= pp else (mid + 1, high)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[j]: (stage costs sorted heaviest first, minus the stage sizes) of the best split of
    # the first j layers into k stages. Adding the same stage to two splits keeps their order,
    # so the best split of j layers extends a best split of fewer.
    best: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {0: ((), ())}
    for k in range(1, pp + 1):
        step = {}
        for j in range(k, n - (pp - k) + 1):  # leave every later stage a layer
            for i in range(j - 1, k - 2, -1):  # the k-th stage holds layers i .. j-1
                cost = prefix[j] - prefix[i]
                if cost > low:
                    break  # only heavier further back
                if i in best:
                    loads, sizes = best[i]
                    key = (tuple(sorted((*loads, cost), reverse=True)), (*sizes, i - j))
                    if j not in step or key < step[j]:
                        step[j] = key
        best = step
    return [-size for size in best[n][1]]
