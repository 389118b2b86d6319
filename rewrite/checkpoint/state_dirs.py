"""A run's checkpoint directory: `step-N` directories and the `latest` file naming the newest complete one."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..errors import CheckpointError
from .swap import fsync

__all__ = ["LATEST", "step_dir", "saved_steps", "latest_checkpoint", "checkpoint_path", "point_latest", "prune"]

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


def checkpoint_path(checkpoint: str | Path, step: int | None = None) -> Path:
    """The `step-N` directory meant by `checkpoint`: a run's directory (its latest, or `step`) or a step's own.

    Raises:
        ValueError: nothing complete there, with what was found.
    """
    checkpoint = Path(checkpoint)
    if step is not None:
        path = step_dir(checkpoint, step)
        if not (path / ".metadata").is_file():
            steps = saved_steps(checkpoint)
            raise CheckpointError(f"{checkpoint} has no complete checkpoint of step {step}; "
                                  + (f"its saved steps: {', '.join(map(str, steps))} (`step=N`, or leave `step` out "
                                     f"for the latest, {steps[-1]})" if steps else "it holds no saved step"))
        return path
    if (checkpoint / ".metadata").is_file():
        return checkpoint
    if (found := latest_checkpoint(checkpoint)) is None:
        raise CheckpointError(f"no checkpoint in {checkpoint} (neither a `{LATEST}` file nor a .metadata file); pass "
                              "the checkpoint directory of a run that saved one, or start fresh")
    return found[1]


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
