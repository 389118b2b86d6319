"""The tp sizes a plan's tensor_parallel rules fit as a whole: what a refusal about one module's size
suggests, so that every line of a message names the same sizes as the heads' line."""

from __future__ import annotations

from torch import nn

from ..models.blocks import ATTENTION
from .heads import head_problems, is_split_kv, kv_replicas_of
from ..plan.styles import COLUMN_STYLES, packed_parts
from ..plan.wording import MOST_RANKS

__all__ = ["fitting_tps"]


def fitting_tps(model: nn.Module, modules: dict[str, nn.Module], chosen: dict[str, str], *, most: int = 8) -> list[int]:
    """The smallest `most` tp sizes at which every module in `chosen` (fqn -> style) splits evenly
    and, where q_proj is split, the attention keeps whole heads (kv heads divided or replicated).

        >>> fitting_tps(llama_1b, modules, {"model.layers.0.self_attn.q_proj": "column", ...})
        [1, 2, 4, 8, 16, 32]
    """
    rules = []  # (size, parts, fqn when its slices depend on kv replication)
    for fqn, style in chosen.items():
        module = modules[fqn]
        if style == "vocab":
            rules.append((module.num_embeddings, 1, None))
        elif style in COLUMN_STYLES:
            rules.append((module.out_features, packed_parts(style), fqn if is_split_kv(fqn, chosen) else None))
        elif style == "row":
            rules.append((module.in_features, 1, None))
    config = getattr(model, "config", None)
    k_features = {getattr(modules.get(f"{fqn.rpartition('.')[0]}.{ATTENTION.kv[0]}"), "out_features", None)
                  for fqn, style in chosen.items() if fqn.endswith(f".{ATTENTION.splitter}") and style == "column"}
    found = []
    for t in range(1, min([MOST_RANKS] + [size for size, _, _ in rules]) + 1):
        if all(size % (parts * (t // kv_replicas_of(model, modules, kv, t) if kv else t)) == 0 for size, parts, kv in rules) \
                and not (config is not None and any(head_problems(config, t, "", k) for k in k_features)):
            found.append(t)
            if len(found) == most:
                break
    return found or [1]
