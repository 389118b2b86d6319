"""Attention heads and tp: which tp values split whole heads, and how many ranks hold each kv head.

Query heads always split tp ways. Key/value heads split tp ways when tp divides them; when
tp passes them instead (a multiple of the kv heads that still divides the query heads),
each kv head is held whole by `tp / kv` neighbouring ranks, the ranks whose query heads
read it: rank `i` holds kv head `i // (tp / kv)`. Pure: plan/ knows no process group.
"""

from __future__ import annotations

from .wording import common_divisors, either, plural

__all__ = ["head_counts", "kv_replicas", "replicated_tps", "head_problems"]

_MOST = 8  # tp values named in a message


def head_counts(config) -> tuple[int, int] | None:
    """(query heads, key/value heads) of an attention config; None without `num_attention_heads`."""
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = getattr(config, "num_key_value_heads", None)
    return heads, kv if isinstance(kv, int) and kv >= 1 else heads


def kv_replicas(heads: int, kv: int, tp: int) -> int:
    """Ranks holding each key/value head at `tp`: `tp / kv` when tp passes the kv heads, else 1.

    Replication applies when `heads % tp == 0`, `kv < tp` and `tp % kv == 0`; anything else
    (tp dividing the kv heads, or no whole split at all) gives 1.

        >>> kv_replicas(8, 2, 4), kv_replicas(8, 1, 2), kv_replicas(8, 4, 4), kv_replicas(9, 3, 2)
        (2, 2, 1, 1)
    """
    if heads % tp == 0 and kv < tp and tp % kv == 0:
        return tp // kv
    return 1


def replicated_tps(heads: int, kv: int, most: int = _MOST) -> list[int]:
    """The tp values past the kv heads that still split whole heads: multiples of `kv` dividing `heads`.

        >>> replicated_tps(64, 8), replicated_tps(9, 3), replicated_tps(8, 8)
        ([16, 32, 64], [9], [])
    """
    return [t for t in common_divisors(heads, most=4096) if t > kv and t % kv == 0][:most]


def head_problems(config, tp: int, tp_at: str) -> list[str]:
    """Why tp cannot split `config`'s attention into whole heads: one message naming every tp that can."""
    counts = head_counts(config)
    if counts is None:
        return []
    heads, kv = counts
    if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0):
        return []
    plain = common_divisors(heads, kv)
    if kv == heads:
        return [
            f"{tp_at}mesh.tp={tp} does not divide num_attention_heads={heads} (q_proj, k_proj, v_proj, o_proj "
            f"would split a head); tp must divide {plural(heads, 'attention head')}: tp {either(plain)}; set "
            "mesh.tp to " + (f"{plain[0]}" if len(plain) == 1 else "one of them") + ", or leave the attention unsharded"
        ]
    kv_off = kv % tp and tp % kv
    if heads % tp:
        found = f"does not divide num_attention_heads={heads}" + (f" nor num_key_value_heads={kv}" if kv_off else "")
    else:
        found = f"neither divides num_key_value_heads={kv} nor is a multiple of it"
    replicated = replicated_tps(heads, kv)
    past = f"tp {either(replicated)}" if replicated else f"none divides {heads}"
    return [
        f"{tp_at}mesh.tp={tp} {found} (q_proj, k_proj, v_proj, o_proj would split a head); tp must divide the "
        f"{heads} attention heads and either divide the {plural(kv, 'kv head')} (tp {either(plain)}) or be a multiple "
        f"of {'it' if kv == 1 else 'them'}, each kv head then replicated on tp / {kv} ranks ({past}); set mesh.tp to "
        "one of these, or leave the attention unsharded"
    ]
