"""Checkpoints of plans with several stages per rank (looped and V placement), tied embeddings."""

from __future__ import annotations

import torch

import rewrite
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.distributed.checkpoint.test_hf_checkpoint import (
    _assemble,
    _assert_equal_to_hf,
    _assert_same_local,
    _batch,
    _hf_load,
    _local_slices,
    _reference_loss,
    _stored_names,
)
from tests.multiproc import run


ZBV = {"mesh": {"pp": 2}, "pipeline": {"schedule": "zbv", "virtual_stages": 2, "microbatches": 4}}
LOOPED = {"mesh": {"pp": 2}, "pipeline": {"schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": 4}}


def _virtual_round_trip(rank: int, ws: int, zbv_dir: str, looped_dir: str) -> dict:
    config = build_config("tiny-llama", tie_word_embeddings=True)
    stage = rewrite.apply_plan(build_model(config, seed=4), ZBV)
    # The V puts the first and the last stage, so both ends of the tied matrix, on rank 0.
    assert stage.stage_ids == ((0, 3) if rank == 0 else (1, 2)) and stage.tied == []
    ids, targets = _batch(config, seed=9)
    rewrite.run_schedule(stage, ids, targets)
    torch.optim.SGD(stage.parameters(), lr=0.5).step()
    trained = _local_slices(stage.model)
    rewrite.save_pretrained(stage, ZBV, zbv_dir)
    again = rewrite.from_pretrained(zbv_dir, ZBV)
    _assert_same_local(f"rank {rank} reloaded under zbv", trained, _local_slices(again.model))
    # Looped placement: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (the head): a tied pair across ranks.
    looped = rewrite.from_pretrained(zbv_dir, LOOPED)
    assert looped.stage_ids == ((0, 2) if rank == 0 else (1, 3)) and len(looped.tied) == 1
    rewrite.save_pretrained(looped, LOOPED, looped_dir)
    ids, targets = _batch(config, seed=10)
    next_loss = rewrite.run_schedule(looped, ids, targets).item()
    return {"trained": trained, "next_loss": next_loss}


def test_virtual_stage_plans_save_and_load(tmp_path):
    zbv_dir, looped_dir = tmp_path / "zbv", tmp_path / "looped"
    results = run(_virtual_round_trip, 2, str(zbv_dir), str(looped_dir), timeout_s=120)
    hf = _hf_load(zbv_dir)
    _assert_equal_to_hf(_assemble(results, "trained"), hf, "zbv, tied, after a step")
    _assert_equal_to_hf(dict(hf.state_dict()), _hf_load(looped_dir), "zbv -> interleaved -> save")
    stored = _stored_names(zbv_dir)
    assert "lm_head.weight" not in stored and stored.count("model.embed_tokens.weight") == 1
    reference = _reference_loss(hf, build_config("tiny-llama", tie_word_embeddings=True), seed=10)
    for r, result in enumerate(results):
        assert_close(f"rank {r} next-step loss under interleaved-1f1b", torch.tensor(result["next_loss"]), reference)
