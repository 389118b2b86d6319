"""What a tensor-parallel block holds besides its column and row layers: bare parameters a rule splits, and
modules kept whole (their gradients summed over tp, or a refusal). Pure; used by `tp_rules.shard_problems`.

A bare parameter (attention sinks, `self_attn.sinks: column`: one value per query head, in the attention module
itself) is split along dim 0 as the heads are, so each rank holds its heads' values and their gradients whole.
"""

from __future__ import annotations

from torch import nn

from ..models.blocks import ATTENTION, LATENT_ATTENTION, SPLITTERS
from ..plan.patterns import general_path
from ..plan.styles import COLUMN_STYLES, SPLIT_OUTPUT_STYLES
from .latent_attention import is_latent_attention

__all__ = ["parameter_problem", "kept_whole"]


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


def kept_whole(modules: dict[str, nn.Module], styles: dict[str, str]) -> tuple[list[str], list[str]]:
    """Modules with parameters kept whole inside a block whose features are split, and problems with them.

    Qwen3's per-head q_norm / k_norm, Apertus's xIELU alpha_p / alpha_n: each rank runs them whole on its own
    heads or intermediate features, so their gradients are partial sums: they get grad_allreduce. A parameter
    as wide as the split features would see 1/tp of them, and one held by the block itself cannot be routed
    alone: both are refused. MLA's latent projections and norms run before the split and are left alone.
    """
    found, problems = [], []
    for fqn, style in styles.items():
        parent, _, leaf = fqn.rpartition(".")
        if leaf not in SPLITTERS or style not in SPLIT_OUTPUT_STYLES:
            continue
        own, width = SPLITTERS[leaf].members, modules[fqn].out_features
        if is_latent_attention(modules[parent]):
            own = (*own, *LATENT_ATTENTION.whole)
        for name, param in modules[parent].named_parameters(recurse=False):
            if f"{parent}.{name}" in styles:  # split with the heads by its own rule
                continue
            problems.append(
                f"{parent}.{name} is a parameter of {parent} itself, kept whole while its {width} features are "
                f"split over tp: its gradient would be partial; leave {parent} unsharded"
                + (f", or, if it holds one value per head (attention sinks), split it with them: "
                   f"tensor_parallel['{general_path(parent)}.{name}']: column" if SPLITTERS[leaf] is ATTENTION else "")
            )
        for name, child in modules[parent].named_modules():
            path = f"{parent}.{name}"
            params = dict(child.named_parameters(recurse=False))
            if not name or name.split(".")[0] in own or not params or styles.get(path):
                continue
            wide = [f"{n} {list(p.shape)}" for n, p in params.items() if width in p.shape]
            if wide:
                problems.append(f"{path} is kept whole inside {parent}, whose {width} features are split over tp, but "
                                f"{', '.join(wide)} spans them: each rank would see 1/tp of them; leave {parent} "
                                "unsharded")
            else:
                found.append(path)
    return found, problems
