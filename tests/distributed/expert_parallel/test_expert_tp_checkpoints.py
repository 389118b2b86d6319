"""Checkpoints of a run with each expert split over tp: a tp 2 x dp 2 stage of Qwen3-MoE trained two steps
saves a Hugging Face checkpoint that plain transformers loads as exactly the stage's weights (each expert's
slices from every tp rank), and a training state that loads under ep 2 (dp 4, split by expert), tp 4 and
tp 2 x pp 2 as exactly those weights, with the loss of one process on them; `from_pretrained` reads the
saved (one tensor per expert and projection) and a fused checkpoint under tp 2 x dp 2 and tp 4 alike, each
rank reading its slices."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

import rewrite
from tests.families import tiny_moe_model
from tests.multiproc import run
from tests.distributed.expert_parallel.resume import batch, matches, resumes, saved_weights, train_and_save


def _plan(name: str, model) -> dict:
    if name == "dp4 ep2":
        return {"mesh": {"dp": 4, "ep": 2}, "tensor_parallel": {"model.layers.*.mlp.experts": "expert_parallel"},
                "pipeline": {"microbatches": 2}}
    mesh = {"tp2 x dp2": {"tp": 2, "dp": 2}, "tp4": {"tp": 4}, "tp2 x pp2": {"tp": 2, "pp": 2}}[name]
    plan = rewrite.plan_from_hf(model, microbatches=2, **mesh).model_dump()
    assert plan["tensor_parallel"]["model.layers.*.mlp.experts"] == "expert_tensor_parallel"
    return plan


def _checkpoints(rank: int, world: int, root: str) -> list[str]:
    stage, weights = train_and_save(root, _plan("tp2 x dp2", tiny_moe_model("qwen3_moe")))
    if rank == 0:  # the same weights in the in-memory layout: one fused tensor per experts module
        Path(f"{root}/fused").mkdir()
        save_file({n: t.detach().contiguous() for n, t in weights.items()}, f"{root}/fused/model.safetensors",
                  metadata={"format": "pt"})
        stage.model.config.save_pretrained(f"{root}/fused")
    return resumes(root, ("dp4 ep2", "tp4", "tp2 x pp2"), _plan, batch(7))


def _loads(rank: int, world: int, root: str) -> list[str]:
    weights, out = saved_weights(root), []
    for source in ("hf", "fused"):
        for name in ("tp2 x dp2", "tp4"):
            plan = _plan(name, tiny_moe_model("qwen3_moe"))
            loaded = rewrite.from_pretrained(f"{root}/{source}", plan)
            matches(f"from_pretrained of the {source} checkpoint under {name}", loaded.model, weights)
            out.append(f"{source} {name}: gate_up_proj {tuple(loaded.model.model.layers[0].mlp.experts.gate_up_proj.shape)}")
    return out


def test_checkpoints_with_each_expert_split_over_tp(tmp_path):
    print(run(_checkpoints, 4, str(tmp_path), timeout_s=300)[0])
    print(run(_loads, 4, str(tmp_path), timeout_s=300)[0])
