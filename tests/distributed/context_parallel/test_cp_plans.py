"""mesh.cp in a plan: each rank holds seq / cp tokens of every microbatch, and a step equals one
process running the whole microbatches (loss and every gradient, fp32, 1e-5): cp 4; cp 2 with tp 2
(sequence, vocabulary and loss parallelism, activation checkpointing); with pp 2 under 1f1b and
zbv; with dp 2 under full and replicate; packed documents and masked labels throughout, and a
sliding-window family. Refusals come on every rank before any transfer."""

from __future__ import annotations

import copy

import pytest
import torch

import rewrite
from tests.asserts import assert_close
from tests.families import TINY, tiny_family_model
from tests.multiproc import run
from tests.reference import assert_counted_once, assert_replica_step

SEQ = 16
RECOMPUTE = {"model.layers.*": "full"}


def _batch(rows: int):
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, TINY["vocab_size"], (rows, SEQ), generator=gen)
    lengths = ([5, 11], [16], [3, 9, 4], [8, 8])
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths[r % 4]]) for r in range(rows)])
    labels = ids.clone()
    labels[0, :6] = -100  # a prompt
    return ids, positions, labels


def _plans(model) -> dict[str, dict]:
    tp = rewrite.plan_from_hf(model, tp=2).tensor_parallel
    return {
        "cp4": {"mesh": {"cp": 4}, "pipeline": {"schedule": "afab", "microbatches": 2}},
        "cp2 x tp2 sp vocab loss, recompute": {
            "mesh": {"cp": 2, "tp": 2}, "tensor_parallel": {**tp, "lm_head": "column"}, "sequence_parallel": True,
            "loss_parallel": True, "activation_checkpointing": RECOMPUTE,
            "pipeline": {"schedule": "1f1b", "microbatches": 2}},
        "pp2 x cp2 1f1b": {"mesh": {"pp": 2, "cp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
        "pp2 x cp2 zbv": {"mesh": {"pp": 2, "cp": 2},
                          "pipeline": {"schedule": "zbv", "virtual_stages": 2, "microbatches": 2}},
        "dp2 x cp2 full, recompute": {"mesh": {"dp": 2, "cp": 2}, "data_parallel": {"sharding": "full"},
                                      "activation_checkpointing": RECOMPUTE,
                                      "pipeline": {"schedule": "afab", "microbatches": 2}},
        "dp2 x cp2 replicate": {"mesh": {"dp": 2, "cp": 2}, "data_parallel": {"sharding": "replicate"},
                                "pipeline": {"schedule": "afab", "microbatches": 2}},
        "dp2 x cp2 grad_op 1f1b": {"mesh": {"dp": 2, "cp": 2}, "data_parallel": {"sharding": "grad_op"},
                                   "pipeline": {"schedule": "1f1b", "microbatches": 2}},
        "cp2 x tp2": {"mesh": {"cp": 2, "tp": 2}, "tensor_parallel": tp, "pipeline": {"microbatches": 2}},
    }


def _layouts(rank: int, world: int, family: str, overrides: dict, names: list[str]) -> list[str]:
    out = []
    for name in names:
        plan = _plans(tiny_family_model(family, **overrides))[name]
        model = tiny_family_model(family, **overrides)
        reference = copy.deepcopy(model)
        stage = rewrite.apply_plan(model, plan)
        ids, positions, labels = _batch(2 * stage.dp * 2)
        inputs, targets = rewrite.microbatches(ids, 2 * stage.dp, position_ids=positions, labels=labels)
        tag = f"{family} {name} rank {rank}"
        loss = assert_replica_step(stage, model, reference, inputs, targets, tag)
        total = rewrite.clip_grad_norm_(stage, None)  # each gradient counted once over dp x cp
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
        assert_close(f"{tag} gradient norm", total, norm)
        assert_counted_once(tag, stage, reference)
        out.append(f"{name}: {float(loss):.5f}, kv heads held by {stage.mesh.kv_replicas} tp ranks each")
    return out


@pytest.mark.parametrize("names", [["cp4", "cp2 x tp2 sp vocab loss, recompute"],
                                   ["pp2 x cp2 1f1b", "pp2 x cp2 zbv"],
                                   ["dp2 x cp2 full, recompute", "dp2 x cp2 replicate"]])
def test_context_parallel_steps_equal_one_process(names):
    print(run(_layouts, 4, "llama", {}, names, timeout_s=300)[0])


def test_kv_heads_replicated_past_tp_and_grad_op_under_context_parallelism():
    # One kv head at tp 2: both tp ranks hold it (kv replication) while cp gathers it over the sequence.
    results = run(_layouts, 4, "llama", {"num_key_value_heads": 1}, ["cp2 x tp2"], timeout_s=300)[0]
    assert "kv heads held by 2 tp ranks each" in results[0], results
    print(run(_layouts, 4, "llama", {}, ["dp2 x cp2 grad_op 1f1b"], timeout_s=300)[0])


def test_a_sliding_window_family_under_context_parallelism():
    print(run(_layouts, 4, "mistral", {"sliding_window": 6}, ["cp2 x tp2 sp vocab loss, recompute"], timeout_s=300)[0])


def _refusals(rank: int, world: int) -> list[str]:
    messages = []

    def refused(call) -> str:
        with pytest.raises(ValueError) as err:
            call()
        messages.append(str(err.value))
        return messages[-1]

    soft = tiny_family_model("gemma2")  # attention logits soft-capped: not what cp's attention computes
    assert "does not take softcap" in refused(lambda: rewrite.apply_plan(soft, {"mesh": {"cp": 4}}))
    model = tiny_family_model("llama")
    stage = rewrite.apply_plan(model, {"mesh": {"cp": 2, "tp": 2}, "tensor_parallel": rewrite.plan_from_hf(
        model, tp=2).tensor_parallel, "pipeline": {"microbatches": 1}})
    assert (stage.mesh.cp, stage.mesh.replicas) == (2, 2)
    ids = torch.randint(0, TINY["vocab_size"], (2, 14))
    inputs, targets = rewrite.microbatches(ids, 1)
    assert "use a length that 4 divides, e.g. 12 or 16" in refused(lambda: rewrite.run_schedule(stage, inputs, targets))
    ids, positions, labels = _batch(2)
    inputs, targets = rewrite.microbatches(ids, 1, position_ids=positions, labels=labels)
    assert "@rewrite.returns_token_sums" in refused(
        lambda: rewrite.run_schedule(stage, inputs, targets, loss_fn=torch.nn.functional.cross_entropy))
    loss = rewrite.run_schedule(stage, inputs, targets)  # after every refusal, a step still runs
    return [f"{float(loss):.5f}", *messages]


def test_refusals_come_on_every_rank():
    results = run(_refusals, 4, timeout_s=240)
    for r in results:
        assert r == results[0], "every rank refuses alike"
    print("\n".join(results[0][1:]))
