"""`read_metadata` reads DCP's metadata types and nothing else, without running what a file names."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata,
)

from rewrite.checkpoint.safe_reader import read_metadata
from rewrite.errors import CheckpointError


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _metadata(**kw) -> Metadata:
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4, 2]),
                                   [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))])
    return Metadata({"model/w": tensor, "extra": BytesStorageMetadata()}, storage_meta=StorageMeta(Path("/x")), **kw)


def test_reads_what_dcp_writes(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(_metadata(storage_data={MetadataIndex("model/w", torch.Size([0, 0])): "x"})))
    got = read_metadata(path)
    assert got.state_dict_metadata == _metadata().state_dict_metadata
    assert got.state_dict_metadata["model/w"].properties.dtype is torch.bfloat16


@pytest.mark.parametrize("made, said", [
    (lambda m: pickle.dumps(_metadata(planner_data=_Payload(m))), "refers to posix.system, which is not part of"),
    (lambda m: pickle.dumps(_Payload(m)), "refers to posix.system"),
    (lambda m: pickle.dumps({"a": 1}), "holds a dict, not a checkpoint's metadata"),
    (lambda m: b"\x80\x04not a pickle", "unreadable"),
    (lambda m: pickle.dumps(_metadata())[:40], "unreadable"),
])
def test_refuses_anything_else_and_runs_nothing(tmp_path, made, said):
    marker, path = tmp_path / "marker", tmp_path / ".metadata"
    path.write_bytes(made(marker))
    with pytest.raises(CheckpointError, match=said) as refused:
        read_metadata(path)
    assert str(refused.value).startswith(f"{path}: ")
    assert not marker.exists(), "the payload ran"
