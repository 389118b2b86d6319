"""Context-parallel attention, the model's own layers unchanged: each of cp ranks runs the model's
forward on its two chunks of the sequence with the attention function swapped through transformers'
`AttentionInterface`; the gathered logits, the loss (the ranks' token sums over the whole sequence's
count) and the gradients summed over the ranks equal one process running the whole sequence, at cp 2
and cp 4, causal, with packed documents crossing the chunk boundaries, and with a sliding window."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import rewrite
from rewrite.context_parallel.attention import NAME, register, sequence_shard
from rewrite.context_parallel.shard import gathered_order, held, length_problem, shard_sequence
from rewrite.errors import InputError
from tests.asserts import assert_close
from tests.families import TINY, tiny_family_model
from tests.multiproc import run

SEQ = 16
CASES = [("llama", {}, False), ("llama", {}, True), ("mistral", {"sliding_window": 5}, True)]


def _data(packed: bool):
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, TINY["vocab_size"], (2, SEQ), generator=gen)
    positions = None
    if packed:  # documents of 3, 6, 7 and 9, 7 tokens: boundaries inside the chunks of every cp
        positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ([3, 6, 7], [9, 7])])
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    (x,), (y,) = rewrite.microbatches(ids, 1, position_ids=positions, labels=labels)
    return ids, positions, y


def _one(cp: int, rank: int, group, family: str, overrides: dict, packed: bool) -> str:
    model = tiny_family_model(family, **overrides)
    reference = copy.deepcopy(model)
    model.set_attn_implementation(NAME)
    ids, positions, targets = _data(packed)
    whole_positions = positions if packed else torch.arange(SEQ).expand(2, SEQ)
    shard = sequence_shard(group, cp, rank, SEQ, device="cpu", position_ids=positions)
    logits = model(input_ids=shard_sequence(ids, cp, rank), position_ids=shard_sequence(whole_positions, cp, rank),
                   sequence_shard=shard, use_cache=False).logits  # (2, SEQ / cp, vocab)
    mine = shard_sequence(targets, cp, rank)
    counted = int((targets != -100).sum())  # the whole sequence's: every rank holds its targets
    loss = F.cross_entropy(logits.flatten(0, 1), mine.flatten(), ignore_index=-100, reduction="sum") / counted
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    for param in model.parameters():
        dist.all_reduce(param.grad, group=group)  # the ranks' shares of each gradient
    parts = [torch.empty_like(logits) for _ in range(cp)]
    dist.all_gather(parts, logits.detach().contiguous(), group=group)
    gathered = torch.cat(parts, dim=1).index_select(1, gathered_order(SEQ, cp))  # token order

    expected = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
    expected_loss = F.cross_entropy(expected.flatten(0, 1), targets.flatten(), ignore_index=-100)
    expected_loss.backward()
    tag = f"{family} cp {cp} rank {rank} packed={packed}"
    assert_close(f"{tag} logits", gathered, expected.detach())
    assert_close(f"{tag} loss", total, expected_loss.detach())
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert_close(f"{tag} {name}.grad", param.grad, ref[name].grad)
    return f"{tag}: {float(total):.5f}"


def _cases(rank: int, world: int) -> list[str]:
    register()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # cp 2, twice over
    out = []
    for family, overrides, packed in CASES:
        out.append(_one(2, rank % 2, pairs[rank // 2], family, overrides, packed))
        out.append(_one(4, rank, dist.group.WORLD, family, overrides, packed))
    return out


def test_context_parallel_attention_equals_one_process():
    results = run(_cases, 4, timeout_s=240)
    print("\n".join(results[0]))


def test_sequence_shards_balance_the_causal_mask_and_name_the_lengths_that_work():
    assert held(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert held(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 4):
        every = torch.cat([held(32, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(32))  # each token held once
        work = [int((held(32, cp, r) + 1).sum()) for r in range(cp)]  # keys a causal query attends to
        assert len(set(work)) == 1, work  # the same on every rank
        x = torch.arange(64).view(2, 32)
        assert torch.equal(torch.cat([shard_sequence(x, cp, r) for r in range(cp)], 1).index_select(
            1, gathered_order(32, cp)), x)
    assert length_problem(30, 2) == ("a sequence of 30 tokens does not split into 2 x cp = 4 equal chunks (cp ranks "
                                     "hold two each, balanced for the causal mask); use a length that 4 divides, "
                                     "e.g. 28 or 32")
    with pytest.raises(InputError, match="use a length that 8 divides, e.g. 8"):
        shard_sequence(torch.zeros(1, 6), 4, 0)
