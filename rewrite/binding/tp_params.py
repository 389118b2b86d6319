"""Bare parameters a tensor_parallel rule splits: one value per query head held by the attention module
itself, not by a linear (attention sinks, `self_attn.sinks: column`; Hugging Face's plans write `colwise`
and mark the owner `local_params`, which here needs no rule: every module already runs on its rank's own
tensors). Split along dim 0 in tp slices, in order, as the heads are by the attention's column layers,
so each rank holds its heads' values and their gradients whole: nothing is summed.

Pure; used by `tp_rules.shard_problems`.
"""

from __future__ import annotations

from torch import nn

from ..plan.styles import COLUMN_STYLES

__all__ = ["parameter_problem"]


def parameter_problem(name: str, param: nn.Parameter, style: str, tp: int, where: str,
                      styles: dict[str, str]) -> str | None:
    """Why parameter `name` cannot be split over `tp` as `style`, or None. `where` starts the message (the
    rule); `styles`: the styles the plan gives each module."""
    owner = name.rpartition(".")[0]
    if style != "column":
        return (f"{where} matches parameter {name!r}: a rule on a parameter splits its dim 0 with its heads, as "
                f"'column' (Hugging Face: colwise), not {style!r}")
    if param.dim() == 0 or param.shape[0] % tp:
        rows = param.shape[0] if param.dim() else "no"
        return f"{where} matches parameter {name!r} of {rows} rows, which mesh.tp={tp} does not divide"
    if not any(f.startswith(owner + ".") and s in COLUMN_STYLES for f, s in styles.items()):
        return (f"{where} matches parameter {name!r}, and {owner} splits no heads over tp (no column layer in it): "
                f"leave {name.rpartition('.')[2]} whole with its module")
    return None
