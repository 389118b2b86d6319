"""What `rewrite init-model` leaves beside the weights it draws: a note that they are random.

`rewrite train` fine-tunes a checkpoint's weights at a gentle learning rate; weights drawn at random
train from scratch at a higher one. The note holds the digest of the weights file it describes, so a
directory whose weights were replaced later (trained, exported over) is a checkpoint again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

__all__ = ["INIT_MARK", "write_init_mark", "random_init"]

INIT_MARK = "rewrite-init.json"
_WEIGHTS = "model.safetensors"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_init_mark(directory: Path, *, preset: str, seed: int) -> None:
    """Note in `directory` that its `model.safetensors` holds `preset`'s random weights of `seed`."""
    note = {"weights": "random", "by": "rewrite init-model", "preset": preset, "seed": seed,
            "sha256": _digest(directory / _WEIGHTS)}
    (directory / INIT_MARK).write_text(json.dumps(note, indent=1) + "\n")


def random_init(directory: Path | None) -> bool:
    """Whether `directory` holds the random weights `rewrite init-model` drew, untouched since."""
    if directory is None or not (directory / INIT_MARK).is_file() or not (directory / _WEIGHTS).is_file():
        return False
    try:
        note = json.loads((directory / INIT_MARK).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(note, dict) and note.get("weights") == "random" and note.get("sha256") == _digest(directory / _WEIGHTS)
