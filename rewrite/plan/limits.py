"""What reading one plan file may cost: a regular file of at most 1 MiB whose YAML holds at most 10,000
values once aliases are followed, nested at most 32 deep (a plan is a few KiB, a few hundred values)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "MAX_PLAN_BYTES", "MAX_PLAN_VALUES", "MAX_PLAN_DEPTH", "read_plan_bytes", "expansion_problem", "too_many_values",
    "too_deep",
]

MAX_PLAN_BYTES = 1 << 20  # 1 MiB: a thousand times the largest shipped plan
MAX_PLAN_VALUES = 10_000  # scalars, lists and mappings, an alias counted each time it is used
MAX_PLAN_DEPTH = 32  # lists and mappings inside each other; the YAML scanner slows with depth

_KINDS = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a named pipe (FIFO)", stat.S_ISCHR: "a character device",
          stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}
# Opening a FIFO for reading waits for a writer; non-blocking, the open returns at once and
# the fstat below refuses it. On a regular file the flag changes nothing.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def read_plan_bytes(path: Path) -> bytes:
    """The bytes of a plan file, refusing anything but a regular file of at most 1 MiB.

    Raises:
        OSError: the file cannot be stat'ed, opened or read.
        ValueError: the path is not a regular file, or is over the cap; the message says
            what was found and what to do.
    """
    _refuse_file(path, os.stat(path))  # before opening: never open a FIFO or device
    with os.fdopen(os.open(path, _OPEN_FLAGS), "rb") as file:
        _refuse_file(path, os.fstat(file.fileno()))  # the path may have been replaced since the stat
        raw = file.read(MAX_PLAN_BYTES + 1)  # one byte past the cap: a file that grew after the stat is caught
    if len(raw) > MAX_PLAN_BYTES:
        raise ValueError(_size_problem(f"at least {len(raw):,}"))
    return raw


def _refuse_file(path: Path, info: os.stat_result) -> None:
    """ValueError unless `info` is of a regular file of at most MAX_PLAN_BYTES."""
    kind = next((name for test, name in _KINDS.items() if test(info.st_mode)), None)
    if kind is None and not stat.S_ISREG(info.st_mode):
        kind = "not a regular file"
    if kind is not None:
        real = os.path.realpath(path)
        what = f"links to {real}, which is {kind}" if real != os.path.abspath(path) else f"is {kind}"
        raise ValueError(f"{what}: a plan must be a regular file (at most 1 MiB); give the path of the plan file itself")
    if info.st_size > MAX_PLAN_BYTES:
        raise ValueError(_size_problem(f"{info.st_size:,}"))


def _size_problem(size: str) -> str:
    return (f"the file is {size} bytes, over the {MAX_PLAN_BYTES:,}-byte (1 MiB) cap on plan files; "
            "a plan is a few KiB of YAML or JSON: check that the path names the plan")


def expansion_problem(root: Any) -> str | None:
    """Why a composed YAML node tree is too costly to build, or None. Aliases share one node, so the tree is
    small even when its data is not (nine lists of nine aliases to the list before: 387,420,489 values from
    300 bytes). Counts each node once per use, visiting each distinct node once: linear in the file."""
    if root is None:
        return None
    sizes: dict[int, int] = {}  # id(node) -> values it expands to, never past the limit
    open_nodes: set[int] = set()  # nodes whose children are still being counted
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            open_nodes.discard(id(node))
            size = 1 + sum(sizes[id(child)] for child in _children(node))
            if size > MAX_PLAN_VALUES:
                # Children finish first, so this is the smallest value past the limit.
                return too_many_values(node.start_mark, "this value holds")
            sizes[id(node)] = size
        elif id(node) in open_nodes:
            mark = node.start_mark
            return (f"line {mark.line + 1}, column {mark.column + 1}: this value contains an alias to itself, "
                    "which makes it endless; plans are finite data: remove the alias")
        elif id(node) not in sizes:
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    return None


def too_many_values(mark: Any, what: str) -> str:
    """The message for a document past MAX_PLAN_VALUES, at the YAML mark where it went past."""
    return (f"line {mark.line + 1}, column {mark.column + 1}: {what} more than {MAX_PLAN_VALUES:,} "
            "values (scalars, lists and mappings; an alias counts in full each time it is used); "
            "a plan holds a few hundred: check the file is the plan, and alias only small parts")


def too_deep(mark: Any) -> str:
    """The message for a value nested past MAX_PLAN_DEPTH, at its YAML mark."""
    return (f"line {mark.line + 1}, column {mark.column + 1}: this value is nested more than {MAX_PLAN_DEPTH} "
            "lists or mappings deep; a plan nests three (the plan, pipeline, cut_points)")


def _children(node: Any) -> list[Any]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []

