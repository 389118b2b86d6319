"""A checkpoint's size on each file system, counted before writing: distinct boxes once, ranks grouped."""

from __future__ import annotations

from pathlib import Path

from rewrite.checkpoint.space import MARGIN, PER_BOX, SLACK, SpaceView, space_needs, space_problems

MIB = 1 << 20


def _view(where, free, *boxes) -> SpaceView:
    return SpaceView(where, free, frozenset(boxes))


def test_replicated_boxes_count_once_and_hosts_apart():
    a, b = ("h1", 1), ("h2", 7)
    shared = ("model/w", (0, 0), 4 * MIB)  # held by both ranks of h1 (a replicated tensor): written once
    views = [_view(a, 100 * MIB, shared, ("model/x", (0,), MIB)),
             _view(a, 90 * MIB, shared, ("model/x", (8,), MIB)),
             _view(b, 3 * MIB, ("model/w", (0, 0), 4 * MIB))]
    needs = space_needs(views)
    assert needs[a] == (int(6 * MIB * SLACK) + 3 * PER_BOX + 2 * MARGIN, 90 * MIB)  # the least free space counts
    assert needs[b] == (int(4 * MIB * SLACK) + PER_BOX + MARGIN, 3 * MIB)
    problems = space_problems(needs, Path("/ckpt"))
    assert problems == ["/ckpt on h2: a checkpoint needs about 4.1 MiB, and its file system has 3.0 MiB free; free "
                        "some space, keep fewer checkpoints (`keep`), or save elsewhere. Nothing was written"]


def test_one_host_is_not_named():
    needs = space_needs([_view(("h", 1), MIB, ("w", (0,), 2 * MIB))])
    assert space_problems(needs, Path("c"))[0].startswith("c: a checkpoint needs about 2.1 MiB")
    assert space_problems(space_needs([_view(("h", 1), 10 * MIB, ("w", (0,), 2 * MIB))]), Path("c")) == []
