"""A checkpoint that cannot fit is refused before anything is written; one whose writing fails (a
file-size limit here, a full disk alike) is removed; either way `latest` still names the last good
one, every rank raises the same `CheckpointWriteError`, and the next save works."""

from __future__ import annotations

import contextlib
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import rewrite
from rewrite.checkpoint import space
from rewrite.checkpoint.training_state import latest_checkpoint
from rewrite.run.presets import build_model
from tests.distributed.run.test_demo import torchrun
from tests.multiproc import run


@contextlib.contextmanager
def _file_size_limit(limit: int):
    """Writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored, as a full disk fails with ENOSPC)."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)


def _failed(fn) -> str:
    try:
        fn()
    except rewrite.CheckpointWriteError as failed:
        assert isinstance(failed, OSError)
        return str(failed)
    return "not refused"


def _saves(rank: int, ws: int, tmp: Path) -> dict:
    stage = rewrite.apply_plan(build_model("tiny-llama"), "plans/llama-pp2.yaml")
    optimizer = torch.optim.AdamW(stage.parameters())
    ckpt = tmp / "ckpt"
    rewrite.save_training_state(ckpt, stage, optimizer, extra={"step": 1})
    got = {}
    with _file_size_limit(100_000):  # each rank's tensors file is ~1 MiB
        got["write"] = _failed(lambda: rewrite.save_training_state(ckpt, stage, optimizer, extra={"step": 2}))
    dist.barrier()
    got["after write"] = (latest_checkpoint(ckpt)[0], sorted(p.name for p in ckpt.iterdir()))
    real = space.shutil.disk_usage
    if rank == 1:  # one rank's view is enough: the file system is shared, the least free space counts
        space.shutil.disk_usage = lambda path: real(path)._replace(free=500_000)
    try:
        got["space"] = _failed(lambda: rewrite.save_training_state(ckpt, stage, optimizer, extra={"step": 2}))
    finally:
        space.shutil.disk_usage = real
    got["after space"] = (latest_checkpoint(ckpt)[0], sorted(p.name for p in ckpt.iterdir()))
    rewrite.save_training_state(ckpt, stage, optimizer, extra={"step": 2}, keep=1)
    got["then"] = (latest_checkpoint(ckpt)[0], sorted(p.name for p in ckpt.iterdir()))
    return got


def test_failed_and_oversized_saves_leave_the_last_checkpoint(tmp_path):
    first, second = run(_saves, 2, tmp_path, timeout_s=180)
    assert first == second, "every rank raises the same"
    ckpt = tmp_path / "ckpt"
    assert first["write"].startswith(f"save_training_state('{ckpt}'): writing step-00000002 (about "), first["write"]
    said = first["write"].split("failed: rank ", 1)[-1]
    assert said[3:].startswith(("OSError: [Errno 27] File too large", "RuntimeError: [enforce fail")), first["write"]
    assert f"the partial {ckpt / 'step-00000002'} was removed, {ckpt / 'step-00000001'} is still the latest " \
           "checkpoint" in first["write"]
    assert first["after write"] == (1, ["latest", "step-00000001"])
    assert f"{ckpt}: a checkpoint needs about " in first["space"] and "its file system has 488.3 KiB free" in first["space"]
    assert first["space"].endswith("Nothing was written")
    assert first["after space"] == (1, ["latest", "step-00000001"])
    assert first["then"] == (2, ["latest", "step-00000002"])


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    path.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}); the file-size-limit test "
                    "covers a failed write")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.parametrize("on_save_error", ["stop", "continue"])
def test_train_on_a_small_disk_stops_or_trains_on(tmp_path, on_save_error):
    with _tmpfs(tmp_path / "disk", "3m") as disk:  # one checkpoint of the tiny model (~2.2 MB) fits, two do not
        done = torchrun(2, "train", "plans/llama-pp2.yaml", "--steps", "3", "--seq-len", "16", "--batch-size", "2",
                        "--ckpt", str(disk / "ckpt"), "--save-every", "1", "--out", str(tmp_path / "out"),
                        "--no-parity", "--no-progress", "--on-save-error", on_save_error, timeout_s=200)
        said = done.stdout + done.stderr
        steps = sorted(p.name for p in (disk / "ckpt").glob("step-*"))
        latest = latest_checkpoint(disk / "ckpt")
    assert steps == ["step-00000001"] and latest[0] == 1, said[-3000:]
    assert f"{disk / 'ckpt'}: a checkpoint needs about " in said and "Nothing was written" in said
    assert "keep fewer checkpoints (--keep)" in said
    if on_save_error == "stop":
        assert done.returncode == 1, said[-3000:]
        assert said.count("rewrite train stopped at step 2: the training state was not saved: ") == 1, said[-3000:]
        assert "--on-save-error continue trains on without it" in said
    else:
        assert done.returncode == 0, said[-3000:]
        assert said.count("warning: step 2's training state was not saved, training on (--on-save-error continue)") == 1
        assert "warning: step 3's training state was not saved" in said
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
