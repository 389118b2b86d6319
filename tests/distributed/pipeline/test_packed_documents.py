"""Packed documents: microbatches that carry `position_ids` (restarting at 0 where a document
starts) train as one process running the model's own forward with the same positions: every
stage masks the documents off each other, at tp (with sequence, vocabulary and loss
parallelism), pp under several schedules, dp under each sharding, with activation
checkpointing, on LLaMA and on a sliding-window family. Bad positions are refused on every rank."""

from __future__ import annotations

import copy

import pytest
import torch

import rewrite
from tests.asserts import assert_close
from tests.families import TINY, tiny_family_model
from tests.multiproc import run
from tests.reference import assert_replica_step

SEQ = 12
# Three rows of documents: lengths 5 + 4 + 3, 12, 2 + 10; a fourth row starts mid-document.
ROWS = [[5, 4, 3], [12], [2, 10], [7, 5]]


def _batch(rows: int, seed: int = 4):
    """`rows` packed rows: ids, positions restarting per document, and labels with a masked prompt."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (rows, SEQ), generator=gen)
    positions = torch.stack([torch.cat([torch.arange(n) for n in ROWS[r % len(ROWS)]]) for r in range(rows)])
    positions[3::4, :7] += 9  # a document continued from the window before: it need not start at 0
    labels = ids.clone()
    labels[0, :2] = -100  # a chat's prompt: not trained on
    return ids, positions, labels


def _plans(model) -> dict[str, dict]:
    tp = rewrite.plan_from_hf(model, tp=2).tensor_parallel
    recompute = {"model.layers.*": "full"}
    return {
        "tp2 x pp2 1f1b sp vocab loss, recompute": {
            "mesh": {"tp": 2, "pp": 2}, "tensor_parallel": {**tp, "lm_head": "column"}, "sequence_parallel": True,
            "loss_parallel": True, "activation_checkpointing": recompute,
            "pipeline": {"schedule": "1f1b", "microbatches": 2}},
        "dp2 x pp2 zbv full": {
            "mesh": {"dp": 2, "pp": 2}, "data_parallel": {"sharding": "full"},
            "pipeline": {"schedule": "zbv", "virtual_stages": 2, "microbatches": 2}},
        "dp2 x tp2 replicate, recompute": {
            "mesh": {"dp": 2, "tp": 2}, "tensor_parallel": tp, "data_parallel": {"sharding": "replicate"},
            "activation_checkpointing": recompute, "pipeline": {"schedule": "afab", "microbatches": 2}},
        "pp4 1f1b": {"mesh": {"pp": 4}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
    }


def _layouts(rank: int, world: int, family: str, overrides: dict) -> list[str]:
    out = []
    for name, plan in _plans(tiny_family_model(family, **overrides)).items():
        model = tiny_family_model(family, **overrides)
        reference = copy.deepcopy(model)
        stage = rewrite.apply_plan(model, plan)
        ids, positions, labels = _batch(2 * stage.dp * 2)
        inputs, targets = rewrite.microbatches(ids, 2 * stage.dp, position_ids=positions, labels=labels)
        loss = assert_replica_step(stage, model, reference, inputs, targets, f"{family} {name} rank {rank}")
        out.append(f"{name}: {float(loss):.5f}")
    return out


def _packing_matters(family: str, overrides: dict) -> None:
    """On one process: the packed rows' logits differ from the same ids unpacked, and a document's
    logits equal those of the document run alone (the model's forward is the oracle: check it masks)."""
    model = tiny_family_model(family, **overrides)
    ids, positions, _ = _batch(3)
    packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    alone = model(input_ids=ids[:1, 5:9], use_cache=False).logits  # row 0's second document
    assert_close(f"{family} a packed document alone", packed[:1, 5:9], alone)
    assert float((packed - model(input_ids=ids, use_cache=False).logits).abs().max().detach()) > 1e-3


def _refusals(rank: int, world: int) -> list[str]:
    """Bad positions are refused on every rank alike, before any transfer."""
    model = tiny_family_model("llama")
    stage = rewrite.apply_plan(model, {"mesh": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}})
    ids, positions, labels = _batch(4)
    inputs, targets = rewrite.microbatches(ids, 2, position_ids=positions, dp=2, dp_rank=stage.dp_rank)
    messages = []

    def refused(inputs, targets=targets) -> str:
        with pytest.raises(ValueError) as err:
            rewrite.run_schedule(stage, inputs, targets)
        messages.append(str(err.value))
        return str(err.value)

    if stage.pp_rank == 1:  # later stages read their own copy's positions: a different copy is caught
        other = [dict(x, position_ids=x["position_ids"].flip(-1)) for x in inputs]
        assert "were given different position_ids" in refused(other)
    else:
        assert "were given different position_ids" in refused(inputs)
    bad = [dict(x) for x in inputs]
    bad[1]["position_ids"] = bad[1]["position_ids"] - 20
    assert "position_ids'] holds -" in refused(bad) and "rank" in messages[-1]
    short = [dict(x, position_ids=x["position_ids"][:, :5]) for x in inputs]
    assert "one integer position per token" in refused(short)
    wrong = [{"input_ids": x["input_ids"], "positions": x["position_ids"]} for x in inputs]
    assert "has keys ['input_ids', 'positions']" in refused(wrong)
    loss = rewrite.run_schedule(stage, inputs, targets)  # the good microbatches still run after refusals
    return [f"{float(loss):.4f}", *messages]


def test_packed_documents_train_as_one_process_at_every_layout():
    results = run(_layouts, 4, "llama", {}, timeout_s=300)
    print(results[0])


def test_a_sliding_window_family_packs_documents_at_every_layout():
    _packing_matters("mistral", {"sliding_window": 6})
    results = run(_layouts, 4, "mistral", {"sliding_window": 6}, timeout_s=300)
    print(results[0])


def test_bad_positions_are_refused_on_every_rank():
    _packing_matters("llama", {})
    results = run(_refusals, 4, timeout_s=120)
    assert len({r[0] for r in results}) == 1  # the step loss, the same on every rank
    print("\n".join(results[0][1:]))
    for r in results:
        assert r[1:] == results[0][1:], "every rank raises the same message"


def _hybrid_refused(rank: int, world: int) -> str:
    model = tiny_family_model("qwen3_5_text")
    stage = rewrite.apply_plan(model, {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}})
    ids, positions, _ = _batch(2)
    inputs, targets = rewrite.microbatches(ids, 2, position_ids=positions)
    with pytest.raises(ValueError) as err:
        rewrite.run_schedule(stage, inputs, targets)
    plain, targets = rewrite.microbatches(ids, 2)
    rewrite.run_schedule(stage, plain, targets)  # one document a row still trains
    return str(err.value)


def test_a_family_whose_forward_lets_documents_meet_is_refused_packed_documents():
    messages = run(_hybrid_refused, 2, timeout_s=120)
    assert messages[0] == messages[1]
    assert "carry position_ids (packed documents), which Qwen3_5ForCausalLM cannot take" in messages[0], messages[0]
    assert "lets one packed document reach the next" in messages[0]
