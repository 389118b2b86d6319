"""Byte-level training text for `rewrite train`: token id = byte (vocab 256), random windows."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import RewriteError

__all__ = ["TrainConfigError", "default_data_path", "load_bytes", "sample_batch"]


class TrainConfigError(RewriteError, ValueError):
    """A setting `train` cannot use. Every rank raises the same one, before any collective."""


def default_data_path() -> Path:
    """`data/alice29.txt` in the working directory, else beside this package's source tree."""
    if Path("data/alice29.txt").is_file():
        return Path("data/alice29.txt")
    path = Path(__file__).resolve().parents[2] / "data" / "alice29.txt"  # rewrite/run/byte_data.py
    if path.is_file():
        return path
    raise TrainConfigError(
        "no text to train on: data/alice29.txt is neither in the working directory nor beside the "
        "rewrite package; pass --data FILE (any text file, read as bytes)"
    )


def load_bytes(path: str | Path) -> torch.Tensor:
    """The file's bytes as token ids, shape `(n,)`, int64 in 0..255."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise TrainConfigError(f"cannot read the training text {str(path)!r}: {exc.strerror or exc}; pass --data FILE") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def sample_batch(
    tokens: torch.Tensor, *, microbatches: int, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random windows: input `tokens[i:i+seq]`, target `tokens[i+1:i+seq+1]`.

    Returns `microbatches` inputs and targets, each `(batch_size, seq_len)`. The same
    generator state gives the same batch on every rank.
    """
    starts = torch.randint(0, len(tokens) - seq_len, (microbatches, batch_size), generator=generator)
    offsets = torch.arange(seq_len + 1)  # (seq + 1,)
    windows = tokens[starts.unsqueeze(-1) + offsets]  # (m, b, seq + 1)
    return list(windows[..., :-1].unbind(0)), list(windows[..., 1:].unbind(0))
