"""`rewrite.microbatches`: a replica's rows of the global batch, cut into microbatches, with next-token targets."""

from __future__ import annotations

import pytest
import torch

import rewrite
from rewrite.pipeline.runner import causal_lm_loss


def _ids(batch: int = 8, seq: int = 5) -> torch.Tensor:
    return torch.arange(batch * seq).view(batch, seq)  # every token distinct: rows are recognisable


def test_shapes_and_the_shift():
    inputs, targets = rewrite.microbatches(_ids(), 4)
    assert len(inputs) == len(targets) == 4
    assert all(x.shape == (2, 5) for x in inputs + targets)
    assert torch.equal(torch.cat(inputs), _ids())
    whole = torch.cat(targets)
    assert whole.dtype == torch.long
    assert torch.equal(whole[:, :-1], _ids()[:, 1:])  # position t predicts token t + 1
    assert (whole[:, -1] == -100).all()


def test_targets_give_next_token_prediction():
    ids = torch.tensor([[3, 1, 2]])
    (x,), (y,) = rewrite.microbatches(ids, 1)
    logits = torch.full((1, 3, 4), -30.0)
    logits[0, 0, 1] = logits[0, 1, 2] = 30.0  # predicts 1 after 3, 2 after 1; the last position is ignored
    assert float(causal_lm_loss(logits, y)) < 1e-6
    assert torch.equal(x, ids)


@pytest.mark.parametrize(("dp", "n"), [(1, 1), (2, 2), (4, 1), (8, 1), (2, 4)])
def test_replicas_cover_the_batch_exactly_once(dp, n):
    ids = _ids()
    seen = []
    for d in range(dp):
        inputs, targets = rewrite.microbatches(ids, n, dp_rank=d, dp=dp)
        assert len(inputs) == n and all(x.shape == (8 // dp // n, 5) for x in inputs)
        mine = torch.cat(inputs)
        assert torch.equal(mine, ids[d * 8 // dp : (d + 1) * 8 // dp])  # contiguous rows, in replica order
        assert torch.equal(torch.cat(targets)[:, :-1], mine[:, 1:])
        seen.append(mine)
    assert torch.equal(torch.cat(seen), ids)


def test_refusals_name_the_sizes_that_work():
    with pytest.raises(ValueError, match=r"6 rows, which dp=4 replicas cannot share evenly; use a multiple of 4 rows \(e.g. 4 or 8\)"):
        rewrite.microbatches(_ids(6), 1, dp=4)
    with pytest.raises(ValueError, match=r"each replica gets 4 rows \(8 / dp=2\), which 3 microbatches cannot split evenly; "
                       r"use n in \[1, 2, 4\] or a global batch of 6 or 12 rows"):
        rewrite.microbatches(_ids(), 3, dp=2)
    with pytest.raises(ValueError, match=r"dp_rank=2 is outside \[0, 2\)"):
        rewrite.microbatches(_ids(), 1, dp_rank=2, dp=2)
    with pytest.raises(ValueError, match=r"must be \[batch, seq\], got shape \[5\]"):
        rewrite.microbatches(torch.arange(5), 1)
    with pytest.raises(ValueError, match="the global batch is empty"):
        rewrite.microbatches(torch.zeros(0, 5, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="n=0 and dp=1 must both be >= 1"):
        rewrite.microbatches(_ids(), 0)
    with pytest.raises(TypeError, match="integer token ids, got a torch.float32 tensor"):
        rewrite.microbatches(_ids().float(), 1)


def test_packed_documents_carry_positions_and_predict_nothing_across_documents():
    ids = _ids(4, 6)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5], [0, 0, 1, 0, 1, 2], [3, 4, 5, 0, 1, 2]])
    inputs, targets = rewrite.microbatches(ids, 2, dp_rank=1, dp=2, position_ids=positions)
    assert len(inputs) == 2 and all(sorted(x) == ["input_ids", "position_ids"] for x in inputs)
    assert torch.equal(inputs[0]["input_ids"], ids[2:3]) and torch.equal(inputs[1]["position_ids"], positions[3:])
    # Row 2: documents [0], [1, 2], [3, 4, 5]; row 3: a document's tail (positions 3..5), then one of 3.
    assert targets[0].tolist() == [[-100, 14, -100, 16, 17, -100]]
    assert targets[1].tolist() == [[19, 20, -100, 22, 23, -100]]
    whole, _ = rewrite.microbatches(ids, 1, position_ids=positions)
    assert torch.equal(whole[0]["position_ids"], positions)


def test_labels_mask_what_is_not_trained_and_shift_like_ids():
    ids = _ids(2, 5)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt: not predicted
    (_,), (y,) = rewrite.microbatches(ids, 1, labels=labels)
    assert y.tolist() == [[-100, -100, 3, 4, -100], [6, 7, 8, 9, -100]]
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]])
    (_,), (y,) = rewrite.microbatches(ids, 1, labels=labels, position_ids=positions)
    assert y.tolist() == [[-100, -100, 3, 4, -100], [6, -100, 8, 9, -100]]


def test_refusals_of_positions_and_labels():
    ids = _ids(2, 5)
    with pytest.raises(ValueError, match=r"position_ids is \[2, 4\] but ids are \[2, 5\]: one per token"):
        rewrite.microbatches(ids, 1, position_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="negative position"):
        rewrite.microbatches(ids, 1, position_ids=torch.full((2, 5), -1))
    with pytest.raises(TypeError, match="labels must be a tensor of integer labels, got a torch.float32 tensor"):
        rewrite.microbatches(ids, 1, labels=ids.float())
