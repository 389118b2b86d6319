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
"""

from __future__ import annotations

from collections.abc import Iterable

from .hardware import Hardware, Link

__all__ = ["all_reduce_s", "all_gather_s", "all_to_all_s", "reduce_scatter_s", "p2p_s", "group_link", "groups_link"]


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
