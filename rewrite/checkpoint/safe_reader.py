"""Reading a training checkpoint runs no code from it.

torch.distributed.checkpoint reads its `.metadata` with `pickle.load`, which calls whatever the
file names: a checkpoint from elsewhere could run anything on `--resume`. `SafeReader` unpickles
it admitting only what DCP's metadata is made of (its dataclasses, torch sizes, dtypes, layouts,
paths), refusing anything else; tensors and our own objects are read with `weights_only=True`
(`pieces.PieceLoadPlanner`).
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import CheckpointError
from .pieces import PieceLoadPlanner

__all__ = ["SafeReader", "read_metadata", "load_pieces"]

# (module, name) pairs a DCP .metadata file may name; checked against torch 2.13's writer.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ADMITTED = {
    (_DCP_METADATA, name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout from its name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.path}: refers to {module}.{name}, which is not part of a checkpoint's metadata; nothing of it "
            "was run. A training checkpoint's .metadata names only torch.distributed.checkpoint's own types: this "
            "file was altered or made by something else; load only checkpoints you or your team wrote"
        )


def read_metadata(path: str | Path) -> Metadata:
    """The DCP `Metadata` of the checkpoint file `path` (a `.metadata`), read without running code.

    Raises:
        CheckpointError: the file names anything but DCP's metadata types, or holds no `Metadata`.
    """
    path = Path(path)
    with open(path, "rb") as file:
        try:
            metadata = _MetadataUnpickler(file, path).load()
        except CheckpointError:
            raise
        except Exception as exc:  # truncated, not a pickle, ...
            raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc}); the checkpoint is damaged") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not a checkpoint's metadata")
    return metadata


class SafeReader(FileSystemReader):
    """torch's `FileSystemReader`, with the metadata read by `read_metadata` (no code run)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as torch's own reader does
        return metadata


def load_pieces(state: dict, path: Path, *, no_dist: bool = False) -> None:
    """`dcp.load` of `state` (pieces and objects) from the checkpoint `path`, running no code of it.

    Collective unless `no_dist`. A refusal on any rank is raised on every rank as that `CheckpointError`,
    not as DCP's report of every rank's traceback.
    """
    try:
        with warnings.catch_warnings():
            if no_dist:  # DCP warns that it runs without a process group: that is the point here
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeReader(path), planner=PieceLoadPlanner(path), no_dist=no_dist)
    except CheckpointException as failed:
        refused = [exc for exc, _ in failed.failures.values() if isinstance(exc, CheckpointError)]
        if refused:
            raise refused[0] from None
        raise
