"""A run's checkpoint directory: `step-N` directories and the `latest` file naming the newest complete one."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..errors import CheckpointError
from .swap import fsync

__all__ = ["LATEST", "step_dir", "saved_steps", "latest_checkpoint", "point_latest", "prune"]

LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d{8,})$")


def step_dir(directory: Path, step: int) -> Path:
    """Where step `step`'s checkpoint lives under a run's checkpoint directory."""
    return directory / f"step-{step:08d}"


def saved_steps(directory: str | Path) -> list[int]:
    """The steps with a complete checkpoint (a `step-N` directory holding .metadata) under `directory`, in order."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m[1]) for p in directory.iterdir() if (m := STEP_DIR.match(p.name)) and (p / ".metadata").is_file())


def latest_checkpoint(directory: str | Path) -> tuple[int, Path] | None:
    """(step, path) of the newest complete checkpoint under `directory`, or None when there is none.

    Raises:
        ValueError: `latest` names a checkpoint that is not there (a damaged directory).
    """
    directory = Path(directory)
    try:
        name = (directory / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    match = STEP_DIR.match(name)
    path = directory / name
    if match is None or not (path / ".metadata").is_file():
        raise CheckpointError(f"{directory / LATEST} names {name!r}, which is not a complete checkpoint in "
                              f"{directory}; point it at a step-* directory holding a .metadata file, or delete it "
                              "to start over")
    return int(match[1]), path


def point_latest(directory: Path, path: Path) -> None:
    """Make `directory/latest` name `path`, atomically and durably (written aside, renamed, synced)."""
    tmp = directory / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(path.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST)
    fsync(directory)


def prune(directory: Path, step: int, keep: int) -> None:
    """Delete checkpoints older than the `keep` newest (never a newer, unfinished one)."""
    steps = sorted(int(m[1]) for p in directory.iterdir() if (m := STEP_DIR.match(p.name)) and int(m[1]) <= step)
    for old in steps[:-keep]:
        shutil.rmtree(step_dir(directory, old), ignore_errors=True)
