"""How long a collective takes: ring algorithms on an alpha-beta link, and which link a group spans.

With n ranks, a message of S bytes, per-device bandwidth beta (one direction), latency alpha
per step and the profile's collective efficiency e:

    all-reduce       2 (n - 1) alpha + 2 (n - 1) / n * S / (beta e)
    all-gather       (n - 1) alpha + (n - 1) / n * S / (beta e)     S: the gathered whole
    reduce-scatter   as all-gather                                   S: the input whole
    point-to-point   alpha + S / (beta e)
    all-to-all       (n - 1) alpha + (n - 1) / n * S / (beta e)     S: what one rank sends, in equal parts

A group whose ranks all sit on one node uses the intra-node link, else the inter-node network
(its slowest hop sets a ring's pace). Global ranks fill nodes in order: node = rank // G.

Where the profile holds times measured for a kind of collective and a group size (`collective_times`,
which `rewrite calibrate` measures on one node), `collective_s` reads those for a group on one node:
linear between the sizes measured, the smallest's time below them, the last two sizes' slope beyond.
The formulas price a ring on the point-to-point link, which misses what a transport does at middle
sizes (gloo: an all-reduce of 64 KiB over 2 ranks in 486 us, where the ring gives 128 us).
"""

from __future__ import annotations

from collections.abc import Iterable

from .hardware import Hardware, Link

__all__ = ["all_reduce_s", "all_gather_s", "all_to_all_s", "reduce_scatter_s", "p2p_s", "group_link", "groups_link",
           "collective_s", "measured_s"]


def all_reduce_s(nbytes: float, n: int, link: Link, efficiency: float) -> float:
    """Seconds for a ring all-reduce of `nbytes` over `n` ranks (0 for one rank or no bytes).

    Example:
        >>> all_reduce_s(1e9, 2, Link(bandwidth=1e9, latency=1e-3), 1.0)  # 2 x 1 ms + 1e9 / 1e9
        1.002
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / (link.bandwidth * efficiency)


def all_gather_s(nbytes: float, n: int, link: Link, efficiency: float) -> float:
    """Seconds for a ring all-gather whose gathered whole is `nbytes`, over `n` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / (link.bandwidth * efficiency)


reduce_scatter_s = all_gather_s  # the same ring, run the other way: `nbytes` is the input whole
all_to_all_s = all_gather_s  # n - 1 exchanges of 1 / n of what a rank sends: `nbytes` is that whole


def p2p_s(nbytes: float, link: Link, efficiency: float) -> float:
    """Seconds to send `nbytes` from one rank to another."""
    return link.latency + nbytes / (link.bandwidth * efficiency) if nbytes > 0 else 0.0


def group_link(hardware: Hardware, ranks: Iterable[int], gpus_per_node: int) -> Link:
    """The link a group of global ranks communicates over: intra-node when all share a node."""
    nodes = {r // gpus_per_node for r in ranks}
    return hardware.intra_node if len(nodes) <= 1 else hardware.inter_node


def groups_link(hardware: Hardware, groups: Iterable[Iterable[int]], gpus_per_node: int) -> Link:
    """The slowest link any of `groups` spans: a step waits for its slowest group."""
    crossing = any(len({r // gpus_per_node for r in g}) > 1 for g in groups)
    return hardware.inter_node if crossing else hardware.intra_node


_FORMULAS = {"sum": all_reduce_s, "all_reduce": all_reduce_s, "gather": all_gather_s, "scatter": reduce_scatter_s,
             "all_gather": all_gather_s, "reduce_scatter": reduce_scatter_s, "all_to_all": all_to_all_s}


def measured_s(curve: dict[int, float], nbytes: float) -> float:
    """Seconds for `nbytes` on a measured `curve` ({bytes: seconds}, by growing size): linear between two
    sizes, the smallest size's time below them, the last two sizes' slope beyond the largest.

    Example:
        >>> measured_s({1000: 1e-4, 2000: 3e-4}, 4000)  # 2e-7 s a byte past 2000
        0.0007
    """
    points = list(curve.items())
    if nbytes <= points[0][0]:
        return points[0][1]
    (b0, t0), (b1, t1) = points[0], points[0]
    for b1, t1 in points[1:]:
        if nbytes <= b1:
            break
        b0, t0 = b1, t1
    else:  # beyond the largest: the last segment's slope
        (b0, t0), (b1, t1) = points[-2], points[-1]
    return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)


def collective_s(hardware: Hardware, kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for a collective of `kind` (`hardware.CollectiveKind`) of `nbytes` over `n` ranks on `link`:
    the profile's measured times where it has them for `kind` and `n` and the group sits on one node
    (`link` is the profile's intra-node link), else the ring formula above.

    Example:
        >>> from rewrite.estimate.hardware import load_hardware
        >>> hw = load_hardware("h100-sxm")
        >>> collective_s(hw, "sum", 1e9, 2, hw.intra_node) == all_reduce_s(1e9, 2, hw.intra_node, hw.efficiency.collective)
        True
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    curve = hardware.collective_times.get(kind, {}).get(n) if link is hardware.intra_node else None
    if curve:
        return measured_s(curve, nbytes)
    return _FORMULAS[kind](nbytes, n, link, hardware.efficiency.collective)
