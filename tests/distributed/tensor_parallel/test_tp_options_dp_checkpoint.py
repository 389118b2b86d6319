"""Vocabulary, loss and sequence parallelism with data parallelism and through checkpoints.

dp 2 x tp 2: one step and AdamW equal one process on the global batch. tp 2 x pp 2 (tied):
saved as a plain Hugging Face checkpoint that transformers loads, and read back into the
plan with every option on to give the reference's loss.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import rewrite
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.distributed.tensor_parallel.test_tp_options import _batch, _plan
from tests.multiproc import run
from tests.reference import assert_replica_step, expected_shard


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _dp2_tp2(sharding: str) -> str:
    config = build_config("tiny-llama", tie_word_embeddings=True)
    model = build_model(config, seed=6)
    reference = copy.deepcopy(model)
    plan = {**_plan(2, 1, "all"), "mesh": {"dp": 2, "tp": 2}, "data_parallel": {"sharding": sharding}}
    stage = rewrite.apply_plan(model, plan)
    ids, targets = _batch(config.vocab_size, 2)  # three microbatches per replica
    ids, targets = ids + [x.flip(0) for x in ids], targets + [t.flip(0) for t in targets]
    name = f"dp2 x tp2 {sharding}"
    loss = assert_replica_step(stage, model, reference, ids, targets, name)  # three microbatches a replica
    # One AdamW step, compared across plans: sound because eps = 1e-3 is far above the gradients'
    # rounding. The first step is lr * g / (|g| + eps), of slope at most lr / eps = 10 in g, so the
    # gradients' reduction-order noise (~1e-7 here) moves the weights by ~1e-6 at most, inside 1e-5;
    # with the default eps = 1e-8 a gradient near eps would turn 1e-9 of noise into ~lr.
    torch.optim.AdamW(stage.parameters(), lr=1e-2, eps=1e-3).step()
    torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-3).step()
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for pname, param in model.named_parameters():
        assert_close(f"{name} {pname} after AdamW", _whole(param.detach()), expected_shard(model, pname, ref[pname].detach()))
    return f"{float(loss):.6f}"


def _checkpoint(rank: int, directory: Path) -> str:
    config = build_config("tiny-llama", tie_word_embeddings=True)
    model = build_model(config, seed=7)
    reference = copy.deepcopy(model)
    plan = _plan(2, 2, "all")
    stage = rewrite.apply_plan(model, plan)
    rewrite.save_pretrained(stage, plan, directory)
    torch.distributed.barrier()
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(str(directory))
    for name, param in reference.state_dict().items():
        assert torch.equal(saved.state_dict()[name], param), f"{name} differs after save + transformers load"
    reloaded = rewrite.from_pretrained(directory, plan)
    ids, targets = _batch(config.vocab_size, 2)
    loss = rewrite.run_schedule(reloaded, ids, targets)
    assert_close("reloaded loss", loss, reference_step(reference, ids, targets))
    return f"{float(loss):.6f}"


def _every(rank: int, ws: int, directory: str) -> list[str]:
    return [_dp2_tp2("full"), _dp2_tp2("replicate"), _checkpoint(rank, Path(directory))]


def test_with_data_parallelism_and_through_a_checkpoint(tmp_path):
    per_rank = run(_every, 4, str(tmp_path / "ckpt"), timeout_s=300)
    assert all(losses[:2] == per_rank[0][:2] for losses in per_rank), per_rank
