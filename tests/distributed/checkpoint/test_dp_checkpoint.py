"""Checkpoints under data parallelism: one standard checkpoint written once from any dp x pp x tp,
loaded back as each rank's FSDP2 share, and under other plans."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import rewrite
import rewrite.checkpoint.hf_save as hf_save
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.distributed.checkpoint.test_hf_checkpoint import (
    _assemble,
    _assert_equal_to_hf,
    _batch,
    _hf_load,
    _local_slices,
    _reference_loss,
    _stored_names,
)
from tests.multiproc import run
from tests.reference import assert_counted_once

TP_RULES = rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel
MICROBATCHES = 4  # the global batch: each of dp replicas runs MICROBATCHES // dp of them
# 257 = 129 + 128 = 65 + 65 + 65 + 62: embedding and head rows split unevenly over dp (FSDP2 pads them).
VOCAB = 257


def _plan(dp: int = 1, pp: int = 1, tp: int = 1, sharding: str = "full") -> dict:
    return {
        "mesh": {"dp": dp, "pp": pp, "tp": tp},
        "tensor_parallel": TP_RULES if tp > 1 else {},
        "pipeline": {"microbatches": MICROBATCHES // dp},
        "data_parallel": {"sharding": sharding},
    }


def _name(plan: dict) -> str:
    mesh = " x ".join(f"{k}{v}" for k, v in plan["mesh"].items() if v > 1)
    return f"{mesh} {plan['data_parallel']['sharding']}" if plan["mesh"]["dp"] > 1 else mesh


def _step(stage, config, seed: int) -> float:
    """One training step on this replica's part of the global batch; the loss of the whole batch."""
    ids, targets = _batch(config, seed, microbatches=MICROBATCHES)
    n = MICROBATCHES // stage.dp
    mine = slice(stage.dp_rank * n, (stage.dp_rank + 1) * n)
    loss = rewrite.run_schedule(stage, ids[mine], targets[mine])
    torch.optim.SGD(stage.parameters(), lr=0.5).step()
    return loss.item()


def _whole_slices(model) -> dict:
    """Every tensor's tp slice, its dp shards gathered (collective over dp, in state-dict order)."""
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t, dim, start)
            for n, (t, dim, start) in _local_slices(model).items()}


def _shards(model) -> dict[str, tuple[torch.Tensor, str]]:
    """What this rank holds of each tensor: its local shard, and how it is placed over dp."""
    out = {}
    for name, t in model.state_dict().items():
        placed = str(t.placements) if isinstance(t, DTensor) else "plain"
        out[name] = ((t.to_local() if isinstance(t, DTensor) else t).detach().clone(), placed)
    return out


def _assert_same_shards(what: str, before: dict, after: dict) -> None:
    assert before.keys() == after.keys(), f"{what}: tensors differ: {sorted(before.keys() ^ after.keys())}"
    for name, (t, placed) in before.items():
        u, uplaced = after[name]
        assert (placed, t.shape, t.dtype) == (uplaced, u.shape, u.dtype), f"{what}: {name}: {placed} {uplaced}"
        assert torch.equal(t, u), f"{what}: {name}'s local shard changed"


def _save_counting_writes(stage, plan: dict, directory: str) -> list[str]:
    """save_pretrained, returning the safetensors files this rank wrote."""
    written, save_file = [], hf_save.save_file

    def counting(tensors, path, *args, **kwargs):
        written.append(Path(path).name)
        return save_file(tensors, path, *args, **kwargs)

    hf_save.save_file = counting
    try:
        rewrite.save_pretrained(stage, plan, directory)
    finally:
        hf_save.save_file = save_file
    return written


def _tied_copy(stage) -> torch.Tensor | None:
    """This rank's end of the tied embedding, whole over dp (collective over dp), if it holds one."""
    return stage.tied[0].detach().full_tensor() if stage.tied else None


def _round_trip(rank: int, case: dict, directory: str) -> dict:
    """Train a step under `case['plan']`, save, reload under the same plan and under `case['other']`."""
    config = build_config("tiny-llama", vocab_size=VOCAB, tie_word_embeddings=case["tied"])
    plan, other = case["plan"], case["other"]
    stage = rewrite.apply_plan(build_model(config, seed=3), plan)
    _step(stage, config, seed=5)
    trained, held = _whole_slices(stage.model), _shards(stage.model)
    out = {"trained": trained, "writes": _save_counting_writes(stage, plan, directory), "dp_rank": stage.dp_rank}
    same = rewrite.from_pretrained(directory, plan)
    assert_counted_once(f"rank {rank} reloaded under {_name(plan)}", same, build_model(config, seed=3))
    _assert_same_shards(f"rank {rank} reloaded under {_name(plan)}", held, _shards(same.model))
    if case["tied"] and plan["mesh"]["pp"] > 1:
        names = {id(p): n for n, p in same.model.named_parameters()}
        assert len(same.tied) == 1 and id(same.tied[0]) in names, "the tied end must be the model's parameter"
        out["same_loss"] = _step(same, config, seed=6)
        out["tied_after_step"] = _tied_copy(same)  # both ends must still be equal
    if case.get("bf16"):  # cast on load: every local shard holds the saved values in bf16
        cast = {n: (t.to(torch.bfloat16), placed) for n, (t, placed) in held.items()}
        half = rewrite.from_pretrained(directory, plan, dtype=torch.bfloat16)
        _assert_same_shards(f"rank {rank} reloaded in bf16 under {_name(plan)}", cast, _shards(half.model))
    moved = rewrite.from_pretrained(directory, other)
    assert_counted_once(f"rank {rank} reloaded under {_name(other)}", moved, build_model(config, seed=3))
    out["other_loss"] = _step(moved, config, seed=6)
    return out


def _cases(rank: int, ws: int, root: str, cases: dict) -> dict:
    results = {name: _round_trip(rank, case, f"{root}/{name}") for name, case in cases.items()}
    if ws == 2:
        results["errors"] = _refusals(rank, f"{root}/refused")
    return results


def _refusals(rank: int, directory: str) -> list[str]:
    config = build_config("tiny-llama")
    stage = rewrite.apply_plan(build_model(config, seed=3), _plan(dp=2))
    messages = []
    for model in (stage, stage.model):
        try:
            rewrite.save_pretrained(model, _plan(tp=2), directory)
        except ValueError as exc:
            messages.append(str(exc))
    assert not Path(directory).exists(), "a refused save wrote something"
    return messages


def _check(name: str, case: dict, results: list[dict], directory: Path) -> None:
    """The checkpoint of `case` (every rank's results): written once, what was trained, loadable everywhere."""
    plan = case["plan"]
    pp, tp = plan["mesh"]["pp"], plan["mesh"]["tp"]
    shard_files = ["model.safetensors"] if pp == 1 else [f"model-0000{s + 1}-of-0000{pp}.safetensors" for s in range(pp)]
    index = ["model.safetensors.index.json"] if pp > 1 else []
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["config.json", "generation_config.json", *shard_files, *index]), name
    # Only replica 0 writes: each stage's file once, by its tp_rank 0.
    writers = {r: res["writes"] for r, res in enumerate(results) if res["writes"]}
    assert sorted(f for files in writers.values() for f in files) == shard_files, (name, writers)
    assert all(results[r]["dp_rank"] == 0 and r % tp == 0 for r in writers), (name, sorted(writers))
    stored = _stored_names(directory)
    assert len(stored) == len(set(stored)), f"{name}: a tensor is stored twice"
    if index:
        weight_map = json.loads((directory / index[0]).read_text())["weight_map"]
        assert sorted(weight_map) == sorted(stored), name
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"], name
    hf = _hf_load(directory)
    config = build_config("tiny-llama", vocab_size=VOCAB, tie_word_embeddings=case["tied"])
    if case["tied"]:
        assert "lm_head.weight" not in stored and hf.lm_head.weight is hf.model.embed_tokens.weight, name
    _assert_equal_to_hf(_assemble(results, "trained"), hf, f"{name} after a training step")
    # The next step, from what was saved, equals one process loaded from the same checkpoint.
    reference = _reference_loss(hf, config, seed=6)
    for r, res in enumerate(results):
        assert_close(f"{name}: rank {r}'s next-step loss under {_name(case['other'])}",
                     torch.tensor(res["other_loss"]), reference)
        if "same_loss" in res:
            assert_close(f"{name}: rank {r}'s next-step loss reloaded under {_name(plan)}",
                         torch.tensor(res["same_loss"]), reference)
    ends = [res["tied_after_step"] for res in results if res.get("tied_after_step") is not None]
    if "same_loss" in results[0] and case["tied"]:
        assert len(ends) == len(results) and all(torch.equal(e, ends[0]) for e in ends), \
            f"{name}: the tied embedding's two ends differ after a step from the reloaded checkpoint"


DP2 = {
    # name: the plan trained and saved, the plan also loaded under, tied embeddings, also loaded cast to bf16
    "full": {"plan": _plan(dp=2), "other": _plan(tp=2), "tied": True},
    "grad_op": {"plan": _plan(dp=2, sharding="grad_op"), "other": _plan(dp=2, sharding="replicate"), "tied": False,
                "bf16": True},
    "replicate": {"plan": _plan(dp=2, sharding="replicate"), "other": _plan(dp=2, sharding="full"), "tied": False},
}


def test_dp2_every_sharding_saves_once_and_loads_its_shards(tmp_path):
    per_rank = run(_cases, 2, str(tmp_path), DP2, timeout_s=120)
    for name, case in DP2.items():
        _check(name, case, [res[name] for res in per_rank], tmp_path / name)
    for r, res in enumerate(per_rank):
        stage_error, model_error = res["errors"]
        assert "the stage was built with mesh dp=2 x pp=1 x tp=1, the plan says pp=1 x tp=2" in stage_error, r
        assert ("the plan has mesh.dp=1, but 39 parameters are split over data-parallel ranks, e.g. "
                "model.embed_tokens.weight: a DTensor over 2 ranks") in model_error, (r, model_error)
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name], "a temporary directory was left behind"


WITH_TP_PP = {
    "dp2xtp2": {"plan": _plan(dp=2, tp=2), "other": _plan(dp=4), "tied": False},
    "dp2xpp2-tied": {"plan": _plan(dp=2, pp=2), "other": _plan(dp=2, tp=2, sharding="replicate"), "tied": True},
}


def test_dp2_with_tp2_and_with_pp2_tied_save_once_and_load_under_other_plans(tmp_path):
    per_rank = run(_cases, 4, str(tmp_path), WITH_TP_PP, timeout_s=180)
    for name, case in WITH_TP_PP.items():
        _check(name, case, [res[name] for res in per_rank], tmp_path / name)
