"""Attention heads and tp: which tp values split whole heads, how many ranks hold each kv head, and the tp
sizes a plan's rules fit as a whole (so every line of a refusal names the same sizes).
"""

from __future__ import annotations

from itertools import islice

from torch import nn

from ..models.blocks import ATTENTION
from ..models.tiny_clone import config_value
from ..plan.styles import COLUMN_STYLES, packed_parts
from ..plan.wording import MOST_RANKS, common_divisors, either, plural

__all__ = ["head_counts", "kv_replicas", "replicated_tps", "head_problems", "is_split_kv", "kv_replicas_of",
           "kv_groups_problems", "fitting_tps"]

_MOST = 8  # tp values named in a message
_SPLIT_HEAD = f"({', '.join(ATTENTION.members)} would split a head)"


def head_counts(config, k_features: int | None = None) -> tuple[int, int] | None:
    """(query heads, key/value heads) of an attention config; None without `num_attention_heads`. With
    `k_features` (the k projection's output size) the kv heads are `k_features / head_dim`, whatever the
    config says (GPT-J keeps a head per query head and ignores `num_key_value_heads`)."""
    heads = config_value(config, "num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = config_value(config, "num_key_value_heads")
    kv = kv if isinstance(kv, int) and kv >= 1 else heads
    head_dim = config_value(config, "head_dim")
    if not isinstance(head_dim, int) or head_dim < 1:
        hidden = config_value(config, "hidden_size")
        head_dim = hidden // heads if isinstance(hidden, int) and hidden % heads == 0 else None
    if k_features and head_dim and k_features % head_dim == 0:
        kv = k_features // head_dim
    return heads, kv


def kv_replicas(heads: int, kv: int, tp: int) -> int:
    """Ranks holding each key/value head at `tp`: `tp / kv` neighbours (those whose query heads read it, rank `i`
    holding kv head `i // (tp / kv)`) when tp passes the kv heads and splits whole query heads, else 1 (tp dividing
    the kv heads, or no whole split at all).

        >>> kv_replicas(8, 2, 4), kv_replicas(8, 1, 2), kv_replicas(8, 4, 4), kv_replicas(9, 3, 2)
        (2, 2, 1, 1)
    """
    return tp // kv if heads % tp == 0 and kv < tp and tp % kv == 0 else 1


def replicated_tps(heads: int, kv: int, most: int = _MOST) -> list[int]:
    """The tp values past the kv heads that still split whole heads: multiples of `kv` dividing `heads`.

        >>> replicated_tps(64, 8), replicated_tps(9, 3), replicated_tps(8, 8)
        ([16, 32, 64], [9], [])
    """
    return [t for t in common_divisors(heads, most=MOST_RANKS) if t > kv and t % kv == 0][:most]


def head_problems(config, tp: int, tp_at: str, k_features: int | None = None) -> list[str]:
    """Why tp cannot split `config`'s attention into whole heads: one message naming every tp that can."""
    counts = head_counts(config, k_features)
    if counts is None:
        return []
    heads, kv = counts
    if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0):
        return []
    plain = common_divisors(heads, kv)
    if kv == heads:
        return [
            f"{tp_at}mesh.tp={tp} does not divide num_attention_heads={heads} {_SPLIT_HEAD}; "
            f"tp must divide {plural(heads, 'attention head')}: tp {either(plain)}; set "
            "mesh.tp to " + (f"{plain[0]}" if len(plain) == 1 else "one of them") + ", or leave the attention unsharded"
        ]
    kv_off = kv % tp and tp % kv
    if heads % tp:
        found = f"does not divide num_attention_heads={heads}" + (f" nor num_key_value_heads={kv}" if kv_off else "")
    else:
        found = f"neither divides num_key_value_heads={kv} nor is a multiple of it"
    replicated = replicated_tps(heads, kv)
    past = f"tp {either(replicated)}" if replicated else f"none divides {heads}"
    return [f"{tp_at}mesh.tp={tp} {found} {_SPLIT_HEAD}; tp must divide the {heads} attention heads and either divide "
            f"the {plural(kv, 'kv head')} (tp {either(plain)}) or be a multiple of {'it' if kv == 1 else 'them'}, each "
            f"kv head then replicated on tp / {kv} ranks ({past}); set mesh.tp to one of these, or leave the attention "
            "unsharded"]


def is_split_kv(fqn: str, styles: dict[str, str]) -> bool:
    """Whether `fqn` is a k/v projection split as a column beside its q projection split alike (whole kv heads)."""
    parent, _, leaf = fqn.rpartition(".")
    return leaf in ATTENTION.kv and styles.get(fqn) == styles.get(f"{parent}.{ATTENTION.splitter}") == "column"


def kv_replicas_of(model: nn.Module, modules: dict[str, nn.Module], fqn: str, tp: int) -> int:
    """Ranks holding each kv head of the attention `fqn` (a k/v projection) belongs to."""
    k_proj = modules.get(f"{fqn.rpartition('.')[0]}.{ATTENTION.kv[0]}")
    counts = head_counts(getattr(model, "config", None), getattr(k_proj, "out_features", None))
    return kv_replicas(*counts, tp) if counts else 1


def kv_groups_problems(model: nn.Module, parent: str, counts: tuple[int, int] | None, tp: int, tp_at: str) -> list[str]:
    """With kv heads replicated, the attention must read its query heads per kv head from `num_key_value_groups`."""
    if counts is None:
        return []
    heads, kv = counts
    if kv_replicas(heads, kv, tp) == 1 or isinstance(getattr(model.get_submodule(parent), "num_key_value_groups", None), int):
        return []
    return [f"{tp_at}mesh.tp={tp} holds each of the {kv} kv heads on tp / {kv} ranks, so each rank's attention reads "
            f"{heads // tp} query heads per kv head; {type(model.get_submodule(parent)).__name__} keeps no "
            f"num_key_value_groups to tell it so: use tp {either(common_divisors(heads, kv))}"]


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

    def fits(t: int) -> bool:
        return (all(size % (parts * (t // kv_replicas_of(model, modules, kv, t) if kv else t)) == 0
                    for size, parts, kv in rules)
                and not (config is not None and any(head_problems(config, t, "", k) for k in k_features)))

    return list(islice(filter(fits, range(1, min([MOST_RANKS] + [size for size, _, _ in rules]) + 1)), most)) or [1]
