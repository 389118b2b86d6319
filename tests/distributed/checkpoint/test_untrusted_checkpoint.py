"""A training checkpoint from elsewhere runs no code: a crafted `.metadata` or a crafted object in a
checkpoint is refused on every rank, naming the file, and the code it carries never runs."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

import rewrite
import rewrite.checkpoint.training_state as training_state
from rewrite.checkpoint.safe_reader import read_metadata
from rewrite.run.presets import build_model
from tests.multiproc import run


class Payload:
    """Unpickled by a trusting reader, it runs `touch marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _refusal(fn) -> str:
    try:
        fn()
    except rewrite.CheckpointError as refused:
        return str(refused)
    return "not refused"


def _stage():
    stage = rewrite.apply_plan(build_model("tiny-llama"), "plans/llama-pp2.yaml")
    return stage, torch.optim.AdamW(stage.parameters())


def _crafted(rank: int, ws: int, tmp: Path) -> dict:
    got = {}
    stage, optimizer = _stage()
    good = rewrite.save_training_state(tmp / "good", stage, optimizer, extra={"step": 1})
    # What the safe reader reads is what torch's own reader reads.
    mine, torchs = read_metadata(good / ".metadata"), FileSystemReader(good).read_metadata()
    got["same metadata"] = (mine.state_dict_metadata == torchs.state_dict_metadata
                            and mine.storage_data == torchs.storage_data)
    # A crafted .metadata: the real one, carrying a payload.
    if rank == 0:
        shutil.copytree(tmp / "good", tmp / "meta")
        (tmp / "meta" / "step-00000001" / ".metadata").write_bytes(pickle.dumps(torchs.__class__(
            state_dict_metadata=torchs.state_dict_metadata, planner_data=Payload(tmp / "marker-meta"),
            storage_data=torchs.storage_data)))
    dist.barrier()
    got["metadata"] = _refusal(lambda: rewrite.load_training_state(tmp / "meta", *_stage()))
    got["export"] = _refusal(lambda: rewrite.export_checkpoint(tmp / "meta", tmp / f"hf-{rank}"))
    # A crafted object: a writer that does not check what it writes (here ours, its check turned off).
    checks = training_state.plain_data_problems
    training_state.plain_data_problems = lambda objects: []
    try:
        rewrite.save_training_state(tmp / "object", stage, optimizer,
                                    extra={"step": 1, "note": Payload(tmp / "marker-object")})
    finally:
        training_state.plain_data_problems = checks
    got["object"] = _refusal(lambda: rewrite.load_training_state(tmp / "object", *_stage()))
    # Our own writer refuses what could not be read back safely, before writing anything.
    try:
        rewrite.save_training_state(tmp / "good", stage, optimizer, extra={"step": 2, "fn": Payload(tmp / "m")})
        got["save"] = "not refused"
    except rewrite.InputError as refused:
        got["save"] = str(refused)
    got["saved"] = sorted(p.name for p in (tmp / "good").glob("step-*"))
    # And the good checkpoint still loads.
    got["good"] = rewrite.load_training_state(tmp / "good", *_stage())
    dist.barrier()
    got["markers"] = sorted(p.name for p in tmp.glob("marker-*"))
    return got


def test_crafted_checkpoints_are_refused_and_run_nothing(tmp_path):
    first, second = run(_crafted, 2, tmp_path, timeout_s=180)
    assert {k: v for k, v in first.items() if k != "export"} == {k: v for k, v in second.items() if k != "export"}
    assert first["markers"] == [], "a payload ran"
    assert first["same metadata"] is True
    meta = tmp_path / "meta" / "step-00000001" / ".metadata"
    assert f"{meta}: refers to posix.system, which is not part of a checkpoint's metadata; nothing of it was run" \
        in first["metadata"], first["metadata"]
    assert "load only checkpoints you or your team wrote" in first["metadata"]
    assert f"{meta}: refers to posix.system" in first["export"] and f"{meta}: refers to posix.system" in second["export"]
    assert f"{tmp_path / 'object' / 'step-00000001'}: its 'extra' is not plain data" in first["object"], first["object"]
    assert "nothing of it was run" in first["object"]
    assert "extra: not plain data" in first["save"], first["save"]
    assert first["saved"] == ["step-00000001"]
    assert first["good"] == {"step": 1}
