"""A training state refuses to load into another model of the same shapes (a LLaMA's into a Mistral),
on every rank and naming both, unless asked to; a state written before the mark loads as before."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

import rewrite
from rewrite.checkpoint.model_mark import MARK_FILE
from rewrite.checkpoint.training_state import load_training_state, save_training_state
from rewrite.run.byte_data import TrainConfigError
from rewrite.run.tiny_model import make_tiny_checkpoint
from rewrite.run.train import TrainConfig, train
from tests.families import tiny_family_model
from tests.multiproc import run
from tests.paths import ROOT

PLAN = {"mesh": {"pp": 2}, "pipeline": {"microbatches": 2}}


def _stage(family: str, seed: int, **overrides):
    stage = rewrite.apply_plan(tiny_family_model(family, seed=seed, **overrides), PLAN)
    return stage, torch.optim.AdamW(stage.parameters(), lr=1e-3)


def _resumes(rank: int, world: int, ckpt: str) -> str:
    stage, optimizer = _stage("llama", 0)
    save_training_state(ckpt, stage, optimizer, extra={"step": 1})
    mistral, optimizer = _stage("mistral", 1, sliding_window=None)
    with pytest.raises(rewrite.CheckpointError) as refused:
        load_training_state(ckpt, mistral, optimizer)
    message = str(refused.value)
    assert "LlamaForCausalLM (llama) -> MistralForCausalLM (mistral)" in message and "allow_other_model" in message
    assert load_training_state(ckpt, mistral, optimizer, allow_other_model=True) == {"step": 1}  # on purpose
    for mine, saved in zip(mistral.parameters(), stage.parameters()):
        assert torch.equal(mine.detach(), saved.detach())
    if rank == 0:  # a state written before marks existed
        (sorted(Path(ckpt).glob("step-*"))[-1] / MARK_FILE).unlink()
    torch.distributed.barrier()
    again, optimizer = _stage("mistral", 1, sliding_window=None)
    assert load_training_state(ckpt, again, optimizer) == {"step": 1}
    return message


def test_a_state_refuses_another_model_on_every_rank(tmp_path):
    messages = run(_resumes, 2, str(tmp_path / "ckpt"), timeout_s=180)
    assert messages[0] == messages[1], messages
    print(messages[0])


def _train_resumes(rank: int, world: int, tmp: str) -> str:
    tmp = Path(tmp)

    def config(model: str, steps: int, **extra) -> TrainConfig:
        return TrainConfig(str(ROOT / "plans/llama-pp2.yaml"), model=str(tmp / model), steps=steps, batch_size=1,
                           seq_len=16, progress=False, parity=False, out_dir=str(tmp / "out"), ckpt=str(tmp / "ckpt"),
                           resume=True, **extra)

    train(config("llama", 1))
    with pytest.raises(TrainConfigError) as refused:
        train(config("mistral", 2))
    assert "--allow-other-model" in str(refused.value) and "MistralForCausalLM (mistral)" in str(refused.value)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert len(train(config("mistral", 2, allow_other_model=True))["losses"]) == 1  # step 2, on purpose
    if rank == 0:  # rank 0 says it
        assert "warning: --allow-other-model:" in said.getvalue() and "LlamaForCausalLM (llama)" in said.getvalue()
    return str(refused.value)


def test_rewrite_train_refuses_to_resume_another_model_unless_told(tmp_path):
    make_tiny_checkpoint(tmp_path / "llama")
    shutil.copytree(tmp_path / "llama", tmp_path / "mistral")  # the same tensors, read as a Mistral
    config = json.loads((tmp_path / "mistral" / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    (tmp_path / "mistral" / "config.json").write_text(json.dumps(config))
    messages = run(_train_resumes, 2, str(tmp_path), timeout_s=240)
    assert messages[0] == messages[1], messages
