"""Checkpoints in transformers' on-disk layout (hub checkpoints, transformers' own saves): a family's
renamed tensors and its experts stored one tensor per expert and projection are read by
`from_pretrained` as transformers reads them, each rank reading only its experts; `save_pretrained`
writes that layout (the same keys as transformers' own save) whenever it reads it back; a family whose
on-disk layout needs a conversion not read is refused by name, and saved in the in-memory layout."""

from __future__ import annotations

import torch
from safetensors import safe_open

import rewrite
from tests.families import tiny_family_model, tiny_moe_model
from tests.multiproc import run
from tests.reference import assert_shares_of

# A family of each kind of conversion: experts merged and concatenated (Qwen3-MoE), with a renamed block
# (Mixtral), with identity experts' rows (LongCat), merged alone under a renamed base (Nemotron-H), renamings
# alone (GraniteMoE, a dense EXAONE); HY-V3 renames its router's correction bias (a buffer).
READ = [("qwen3_moe", tiny_moe_model), ("mixtral", tiny_moe_model), ("longcat_flash", tiny_moe_model),
        ("nemotron_h", tiny_moe_model), ("granitemoe", tiny_moe_model), ("hy_v3", tiny_moe_model),
        ("exaone", tiny_family_model)]
NOT_READ = ("lara_mini", tiny_moe_model)  # its linear attention's in_proj is split in four on load


def _keys(directory: str) -> set[str]:
    with safe_open(f"{directory}/model.safetensors", framework="pt") as f:
        return set(f.keys())


def _one_process(rank: int, world: int, root: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    out = []
    for family, make in READ:
        hf, ours = f"{root}/{family}/hf", f"{root}/{family}/ours"
        make(family).save_pretrained(hf)  # transformers' own: the on-disk layout
        reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        assert_shares_of(f"{family}: transformers' save read", rewrite.from_pretrained(hf, {}).model, reference)
        rewrite.save_pretrained(rewrite.apply_plan(make(family), {}), {}, ours)
        assert _keys(ours) == _keys(hf), f"{family}: rewrite's save writes other keys than transformers'"
        assert_shares_of(f"{family}: rewrite's save read", rewrite.from_pretrained(ours, {}).model, reference)
        out.append(family)
    family, make = NOT_READ
    make(family).save_pretrained(f"{root}/{family}/hf")
    try:
        rewrite.from_pretrained(f"{root}/{family}/hf", {})
    except ValueError as exc:
        assert "are stored in transformers' on-disk layout, made by Split(dim=0)" in str(exc), str(exc)
        assert "is not in the checkpoint" not in str(exc), str(exc)  # each said once
        assert "save it with rewrite.save_pretrained on one process" in str(exc), str(exc)
    else:
        raise AssertionError(f"{family}: a layout that is not read was read")
    ours = f"{root}/{family}/ours"
    rewrite.save_pretrained(rewrite.apply_plan(make(family), {}), {}, ours)
    reference = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float32)
    assert_shares_of(f"{family}: in-memory layout", rewrite.from_pretrained(ours, {}).model, reference)
    return out


def _experts_by_rank(rank: int, world: int, root: str) -> str:
    """The Qwen3-MoE checkpoint transformers wrote, read under dp 2 ep 2: each rank its two experts."""
    from transformers import AutoModelForCausalLM

    plan = {"mesh": {"dp": 2, "ep": 2}, "tensor_parallel": {"model.layers.*.mlp.experts": "expert_parallel"}}
    stage = rewrite.from_pretrained(f"{root}/qwen3_moe/hf", plan)
    assert_shares_of(f"rank {rank} under dp2 ep2", stage.model,
                     AutoModelForCausalLM.from_pretrained(f"{root}/qwen3_moe/hf", dtype=torch.float32))
    return f"rank {rank}: {stage.model.model.layers[0].mlp.experts.gate_up_proj.shape[0]} experts"


def test_transformers_on_disk_layout_is_read_and_written(tmp_path):
    print(run(_one_process, 1, str(tmp_path), timeout_s=240)[0])
    print(run(_experts_by_rank, 2, str(tmp_path), timeout_s=120))
