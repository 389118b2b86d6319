"""Will a training checkpoint fit? Its size, counted before anything is written, against the free
space of each file system the ranks write to: the distinct boxes of the ranks that see it (DCP
writes a replicated box once), plus a margin for metadata and small objects.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from ..plan.wording import format_bytes
from .pieces import Piece

__all__ = ["SpaceView", "space_view", "space_needs", "space_problems"]

MARGIN = 64 << 10  # bytes per rank: its part of .metadata's header, config, scheduler, RNG states
PER_BOX = 256  # bytes of .metadata per box written
SLACK = 1.02  # file-system blocks and pickling overhead on top of the tensors' bytes


@dataclass(frozen=True)
class SpaceView:
    """What one rank will write and where: its file system (host, device) and the space free on it."""

    where: tuple[str, int]
    free: int
    boxes: frozenset[tuple[str, tuple[int, ...], int]]  # (key, offsets, bytes) of every box it holds


def space_view(directory: Path, state: dict) -> SpaceView:
    """This rank's view: the boxes of `state`'s pieces and the free space where `directory` lives."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the directory is made by the save: its file system is its parent's
    boxes = frozenset((key, tuple(offsets), tensor.nbytes) for key, value in state.items() if isinstance(value, Piece)
                      for tensor, offsets in value.boxes())
    return SpaceView((socket.gethostname(), os.stat(existing).st_dev), shutil.disk_usage(existing).free, boxes)


def space_needs(views: list[SpaceView]) -> dict[tuple[str, int], tuple[int, int]]:
    """(bytes a checkpoint needs, bytes free) on each file system the ranks write to."""
    needs = {}
    for where in dict.fromkeys(v.where for v in views):
        mine = [v for v in views if v.where == where]
        boxes = frozenset().union(*(v.boxes for v in mine))
        tensors = int(sum(b for _, _, b in boxes) * SLACK)
        needs[where] = (tensors + PER_BOX * len(boxes) + MARGIN * len(mine), min(v.free for v in mine))
    return needs


def space_problems(needs: dict[tuple[str, int], tuple[int, int]], directory: Path) -> list[str]:
    """One problem per file system a checkpoint would not fit on (the same on every rank)."""
    hosts = {host for host, _ in needs}
    return [
        f"{directory}{f' on {host}' if len(hosts) > 1 else ''}: a checkpoint needs about {format_bytes(need)}, and "
        f"its file system has {format_bytes(free)} free; free some space, keep fewer checkpoints (`keep`), "
        "or save elsewhere. Nothing was written"
        for (host, _), (need, free) in needs.items() if need > free
    ]
