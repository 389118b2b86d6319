"""The loss is token-weighted, the same under every plan: a step's loss and every gradient equal the
model's own forward with `labels` over the whole global batch in one process (Hugging Face's mean
over every trained token), however the plan cuts that batch into microbatches, replicas and cp
shards, with rows that train very different numbers of tokens. A user loss keeps its per-microbatch
mean unless declared with `returns_token_sums`; a batch with nothing to train and ranks of a last
stage holding other targets are refused on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

import rewrite
from tests.asserts import assert_close
from tests.families import TINY, tiny_family_model
from tests.multiproc import run
from tests.reference import assert_grads_match

SEQ, ROWS = 16, 4


def _batch():
    """4 packed rows whose trained tokens differ widely: a long prompt, none, one document, three."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY["vocab_size"], (ROWS, SEQ), generator=gen)
    lengths = ([5, 11], [16], [3, 9, 4], [8, 8])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    labels = ids.clone()
    labels[0, :14] = -100  # almost all prompt
    labels[2, 3:10] = -100  # the second document's prompt
    return ids, positions, labels


def _own_loss(model, ids, positions, targets: list[torch.Tensor]) -> torch.Tensor:
    """The model's own forward over the whole batch with Hugging Face's labels (unshifted: position t + 1
    holds what position t predicts), its loss backpropagated."""
    shifted = torch.cat(targets)
    labels = torch.full_like(shifted, -100)
    labels[:, 1:] = shifted[:, :-1]  # the last target is always -100: nothing is lost
    loss = model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach()


def _plans(model) -> dict[str, dict]:
    tp = rewrite.plan_from_hf(model, tp=2).tensor_parallel
    return {
        "tp2 x pp2 1f1b, 4 x 1": {"mesh": {"tp": 2, "pp": 2}, "tensor_parallel": tp,
                                  "pipeline": {"schedule": "1f1b", "microbatches": 4}},
        "cp2 x tp2 vocab and loss parallel, 2 x 2": {
            "mesh": {"cp": 2, "tp": 2}, "tensor_parallel": {**tp, "lm_head": "column"}, "loss_parallel": True,
            "pipeline": {"microbatches": 2}},
        "dp2 x pp2 full, 2 x 1 a replica": {"mesh": {"dp": 2, "pp": 2}, "data_parallel": {"sharding": "full"},
                                             "pipeline": {"microbatches": 2}},
        "dp2 x tp2 replicate, 1 x 2 a replica": {"mesh": {"dp": 2, "tp": 2}, "tensor_parallel": tp,
                                                  "data_parallel": {"sharding": "replicate"},
                                                  "pipeline": {"microbatches": 1}},
    }


@rewrite.returns_token_sums
def _summed(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum")


def _mean(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _step(plan: dict, loss_fn=None):
    """(stage, model, reference, this replica's inputs and targets, the global ones)."""
    model = tiny_family_model("llama")
    reference = copy.deepcopy(model)
    stage = rewrite.apply_plan(model, plan)
    ids, positions, labels = _batch()
    n = stage.resolved.plan.pipeline.microbatches
    inputs, targets = rewrite.microbatches(ids, n * stage.dp, position_ids=positions, labels=labels)
    mine = slice(stage.dp_rank * n, (stage.dp_rank + 1) * n)
    return stage, model, reference, inputs[mine], targets[mine], targets


def _every_plan(rank: int, world: int) -> list[str]:
    out = []
    ids, positions, _ = _batch()
    for name, plan in _plans(tiny_family_model("llama")).items():
        for loss_fn in (None, _summed):
            stage, model, reference, inputs, targets, every = _step(plan, loss_fn)
            loss = rewrite.run_schedule(stage, inputs, targets, loss_fn=loss_fn)
            tag = f"{name}, {'default' if loss_fn is None else 'declared sums'}, rank {rank}"
            assert_close(f"{tag} loss", loss, _own_loss(reference, ids, positions, every))
            assert_grads_match(model, reference, prefix=f"{tag} ")
            out.append(f"{tag}: {float(loss):.6f}")
    # An undeclared user loss keeps its meaning: the mean of the microbatches' means.
    name = "tp2 x pp2 1f1b, 4 x 1"
    stage, model, reference, inputs, targets, _ = _step(_plans(model)[name], _mean)
    loss = rewrite.run_schedule(stage, inputs, targets, loss_fn=_mean)
    means = [_mean(reference(**x, use_cache=False).logits, y) for x, y in zip(inputs, targets)]
    (torch.stack(means).mean()).backward()
    assert_close(f"{name}, undeclared mean, rank {rank} loss", loss, torch.stack(means).mean().detach())
    token_mean = _own_loss(copy.deepcopy(reference), ids, positions, targets)
    assert abs(float(loss) - float(token_mean)) > 1e-2, "this batch tells the two normalisations apart"
    assert_grads_match(model, reference, prefix=f"{name}, undeclared mean, rank {rank} ")
    return out


def _refusals(rank: int, world: int) -> list[str]:
    model = tiny_family_model("llama")
    stage = rewrite.apply_plan(model, _plans(model)["tp2 x pp2 1f1b, 4 x 1"])
    ids, positions, labels = _batch()
    inputs, targets = rewrite.microbatches(ids, 4, position_ids=positions, labels=labels)
    messages = []
    nothing = [torch.full_like(t, -100) for t in targets]
    with pytest.raises(ValueError) as err:
        rewrite.run_schedule(stage, inputs, nothing)
    messages.append(str(err.value))
    assert "trains no token" in messages[-1], messages[-1]
    if stage.mesh.tp_rank == 1:  # one tp rank of the last stage holds other targets than its peer
        targets = [t.clone() for t in targets]
        targets[1][0, 0] = -100
    with pytest.raises(ValueError) as err:
        rewrite.run_schedule(stage, inputs, targets)
    messages.append(str(err.value))
    assert "different numbers of trained tokens" in messages[-1] and "ranks 2, 3" in messages[-1], messages[-1]
    return messages


def test_every_plan_trains_the_token_mean_of_the_global_batch():
    print("\n".join(run(_every_plan, 4, timeout_s=400)[0]))


def test_an_empty_batch_and_disagreeing_targets_are_refused_on_every_rank():
    results = run(_refusals, 4, timeout_s=240)
    assert all(r == results[0] for r in results), results
    print("\n".join(results[0]))
