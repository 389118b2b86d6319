"""activation_checkpointing, 'full' and 'selective': the same loss and gradients, with the matched modules run
again in the backward."""

from __future__ import annotations

import copy

from torch.nn import functional as F

import rewrite
from rewrite.run.parity import reference_step
from rewrite.run.presets import build_config, build_model
from tests.asserts import assert_close
from tests.distributed.pipeline.test_pipeline import _batch
from tests.models import toy_step_setup
from tests.multiproc import run
from tests.reference import expected_shard

AC = {"model.layers.*": "full"}
MODES = ("full", "selective")


def _count_mlp_calls(model) -> dict:
    calls: dict[str, int] = {}
    for name, module in model.named_modules():
        if name.endswith(".mlp"):
            # A pre-hook: the recomputation stops as soon as it has what the backward needs, inside the MLP.
            module.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    return calls


def _case(rank: int, plan: dict, mode: str, m: int = 3) -> str:
    config = build_config("tiny-llama")
    model = build_model(config, seed=3)
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, {**plan, "activation_checkpointing": {"model.layers.*": mode}})
    calls = _count_mlp_calls(model)
    dp = plan.get("mesh", {}).get("dp", 1)
    ids, targets = _batch(config, m * dp)
    mine = slice(stage.dp_rank * m, (stage.dp_rank + 1) * m)
    loss = rewrite.run_schedule(stage, ids[mine], targets[mine])
    name = f"rank {rank} {mode} {plan}"
    assert_close(f"{name} loss", loss, reference_step(reference, ids, targets))
    ref = dict(reference.named_parameters())
    for pname, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        assert_close(f"{name} {pname}.grad", grad, expected_shard(model, pname, ref[pname].grad))
    # Every decoder layer this rank holds ran its forward twice per microbatch: once, then again in the backward.
    assert calls and all(n == 2 * m for n in calls.values()), (name, calls)
    return f"{float(loss):.6f}"


def _every(rank: int, ws: int) -> list[str]:
    tp = rewrite.load_plan("plans/llama-tp2.yaml").tensor_parallel
    out = [_case(rank, plan, mode) for mode in MODES for plan in (
        {"mesh": {"tp": 2}, "tensor_parallel": tp},
        {"mesh": {"tp": 2}, "tensor_parallel": tp, "sequence_parallel": True},
        {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 3}},
        {"mesh": {"pp": 2}, "pipeline": {"schedule": "zbv", "virtual_stages": 2, "microbatches": 3}},
        {"mesh": {"pp": 2}, "pipeline": {"schedule": "zero-bubble", "microbatches": 3}},
        {"mesh": {"dp": 2}, "data_parallel": {"sharding": "full"}},
        {"mesh": {"dp": 2}, "data_parallel": {"sharding": "replicate"}},
    )]
    # A traced module: its blocks recomputed under a pipeline split by torch.fx.
    model, reference, xs, ys = toy_step_setup(3)
    plan = {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 3},
            "activation_checkpointing": {"blocks.*": "full"}}
    stage = rewrite.apply_plan(model, plan)
    loss = rewrite.run_schedule(stage, xs, ys, loss_fn=F.mse_loss)
    ref_loss = sum(F.mse_loss(reference(x), y) / 3 for x, y in zip(xs, ys))
    ref_loss.backward()
    assert_close("fx loss", loss, ref_loss.detach())
    ref = dict(reference.named_parameters())
    for pname, param in stage.module.named_parameters():
        assert_close(f"fx {pname}.grad", param.grad, ref[pname].grad)
    return out + [f"{float(loss):.6f}"]


def test_recomputed_layers_give_the_same_step_under_tp_pp_dp_and_every_schedule():
    first, second = run(_every, 2, timeout_s=240)
    assert first == second


def test_a_pattern_that_matches_nothing_is_refused():
    import pytest

    with pytest.raises(rewrite.PlanError, match=r"activation_checkpointing\['model.layer.\*'\] matches no module"):
        rewrite.resolve({"activation_checkpointing": {"model.layer.*": "full"}}, build_model("tiny-llama", device="meta"))
    with pytest.raises(rewrite.PlanError, match=r"activation_checkpointing\['model.layers.\*'\]: Input should be 'full' or "
                       r"'selective' \(found 'partial'\)"):
        rewrite.load_plan({"activation_checkpointing": {"model.layers.*": "partial"}})
    with pytest.raises(rewrite.PlanError, match=r"activation_checkpointing\['model.layers.1'\] makes model.layers.1 "
                       r"'selective', but 'model.layers.\*' makes it 'full': give each module one mode"):
        rewrite.resolve({"activation_checkpointing": {"model.layers.*": "full", "model.layers.1": "selective"}},
                        build_model("tiny-llama", device="meta"))
    from rewrite.run.show.report import format_plan

    text = format_plan(rewrite.resolve({"activation_checkpointing": AC}, build_model("tiny-llama", device="meta")))
    assert "Activation checkpointing: 4 modules keep only their inputs and run their forward again in the backward " \
        "(model.layers.0-3)" in " ".join(text.split())  # layers alike in one name; prose wraps at 100 columns


def test_every_kth_matched_module_and_its_refusals():
    import pytest

    from rewrite.estimate.activations import rank_activations
    from rewrite.estimate.search_space import checkpointed

    meta = build_model("tiny-llama", device="meta")
    for every, picked in ((1, [0, 1, 2, 3]), (2, [0, 2]), (3, [0, 3]), (5, [0])):
        resolved = rewrite.resolve({"activation_checkpointing": {"model.layers.*": {"mode": "full", "every": every}}}, meta)
        assert resolved.recomputed == tuple(f"model.layers.{i}" for i in picked) and not resolved.selective
    both = rewrite.resolve({"activation_checkpointing": {"model.layers.*": {"mode": "selective", "every": 2}}}, meta)
    assert both.selective == both.recomputed == ("model.layers.0", "model.layers.2")
    # every: 2 is the search's 'every other layer', written its own way: the same estimate.
    patterns, layers = checkpointed(rewrite.resolve({}, meta), "every other layer")
    mine = rewrite.resolve({"activation_checkpointing": {"model.layers.*": {"every": 2}}}, meta)
    assert layers == mine.recomputed
    assert rank_activations(rewrite.resolve({"activation_checkpointing": patterns}, meta), meta) == \
        rank_activations(mine, meta)
    bad = [
        ("partial", r"\['model.layers.\*'\]: Input should be 'full' or 'selective' \(found 'partial'\)"),
        (3, r"\['model.layers.\*'\]: Input should be 'full' or 'selective' \(found 3\)"),
        ({"every": 0}, r"\['model.layers.\*'\].every: Input should be greater than or equal to 1 \(found 0\)"),
        ({"evry": 2}, r"\['model.layers.\*'\].evry: unknown key 'evry'; did you mean 'every'\?"),
        ({"mode": "x"}, r"\['model.layers.\*'\].mode: Input should be 'full' or 'selective' \(found 'x'\)"),
    ]
    for value, message in bad:  # one line each, at the value's own place
        with pytest.raises(rewrite.PlanError, match=r"plan: 1 problem\n  activation_checkpointing" + message + "$"):
            rewrite.load_plan({"activation_checkpointing": {"model.layers.*": value}})
