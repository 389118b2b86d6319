"""VocabParallelEmbedding and vocab_parallel_cross_entropy against nn.Embedding and
F.cross_entropy on the full vocabulary, on 1, 2 and 4 ranks (one spawn per world size)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from rewrite.models.families import embedding_scale
from rewrite.tensor_parallel import comm
from rewrite.tensor_parallel import loss as loss_module
from rewrite.tensor_parallel.loss import vocab_parallel_cross_entropy
from rewrite.tensor_parallel.vocab import VocabParallelEmbedding
from tests.asserts import assert_close
from tests.multiproc import run

V, H = 16, 6  # V divisible by 1, 2 and 4
PAD = 13  # owned by the last rank for every world size > 1


def _count_calls(module, name: str, fn) -> int:
    """How many times `module.name` is called while `fn()` runs."""
    calls, original = [], getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(module, name, counting)
    try:
        fn()
    finally:
        setattr(module, name, original)
    return len(calls)


def _same_on_every_rank(name: str, x: torch.Tensor) -> None:
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x.contiguous())
    # equal_nan: an all-ignored batch must give nan everywhere.
    assert all(torch.equal(g, x) or (g.isnan().all() and x.isnan().all()) for g in gathered), (
        f"{name}: ranks hold different values {[g.tolist() for g in gathered]}"
    )


def _check_embedding(rank: int, ws: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=gen)
    ids = torch.tensor([[0, 3, 4, 7], [8, PAD, 12, 15], [PAD, 5, 11, 1]])  # every rank's range, padding twice
    grad_out = torch.randn(*ids.shape, H, generator=gen)
    ref = nn.Embedding(V, H, padding_idx=PAD, _weight=weight.clone())
    ref(ids).backward(grad_out)

    layer = VocabParallelEmbedding(V, H, PAD, weight)
    rows = slice(rank * V // ws, (rank + 1) * V // ws)
    tag = f"embedding(ws={ws}, rank={rank})"
    assert (layer.vocab_start, layer.vocab_end, layer.per_rank) == (rows.start, rows.stop, V // ws), tag
    assert (layer.tp_size, layer.tp_rank, layer.padding_idx) == (ws, rank, PAD), tag
    assert layer.weight.shape == (V // ws, H), tag
    assert layer.weight.untyped_storage().nbytes() == V // ws * H * 4, f"{tag}: storage holds more than the slice"
    assert_close(f"{tag} weight slice", layer.weight, weight[rows])
    full = torch.zeros(V, H)
    view = layer.shard_of("weight", full)
    assert view.data_ptr() == full[rows].data_ptr() and view.shape == (V // ws, H), f"{tag}: shard_of is not a view"
    assert f"rows [{rows.start}, {rows.stop}) on rank {rank} of {ws}" in repr(layer), repr(layer)

    y = layer(ids)
    assert_close(f"{tag} output", y, ref(ids))
    n_fwd = _count_calls(comm, "all_reduce_sum", lambda: layer(ids))
    assert n_fwd == (1 if ws > 1 else 0), f"{tag}: forward all-reduced {n_fwd} times"
    n_bwd = _count_calls(comm, "all_reduce_sum", lambda: y.backward(grad_out))
    assert n_bwd == 0, f"{tag}: backward all-reduced {n_bwd} times"
    assert_close(f"{tag} weight grad", layer.weight.grad, ref.weight.grad[rows])
    if rows.start <= PAD < rows.stop:
        assert torch.count_nonzero(layer.weight.grad[PAD - rows.start]) == 0, f"{tag}: padding row was trained"
    assert_close(f"{tag} int32 ids", layer(ids.int()), ref(ids))

    # Default init: nn.Embedding's, drawn in full, so seeded ranks slice the same matrix.
    torch.manual_seed(1)
    default_ref = nn.Embedding(V, H, padding_idx=PAD)
    torch.manual_seed(1)
    assert_close(f"{tag} default init", VocabParallelEmbedding(V, H, PAD).weight, default_ref.weight.detach()[rows])

    # from_embedding keeps the trained rows, padding_idx and a frozen weight.
    frozen = nn.Embedding(V, H, padding_idx=-3, _weight=weight.clone(), _freeze=True)
    built = VocabParallelEmbedding.from_embedding(frozen)
    assert built.padding_idx == PAD and not built.weight.requires_grad, tag
    assert_close(f"{tag} from_embedding rows", built.weight, weight[rows])
    assert_close(f"{tag} from_embedding output", built(ids), frozen(ids))
    trained = VocabParallelEmbedding.from_embedding(nn.Embedding(V, H, _weight=weight.clone()))
    assert trained.padding_idx is None and trained.weight.requires_grad, tag


def _check_loss(rank: int, ws: int, prefix: tuple[int, ...], dtype: torch.dtype) -> None:
    tag = f"loss(ws={ws}, rank={rank}, logits={prefix + (V,)}, {dtype})"
    gen = torch.Generator().manual_seed(len(prefix))
    full = (3 * torch.randn(*prefix, V, generator=gen)).to(dtype)
    targets = torch.randint(0, V, prefix, generator=gen)
    targets.view(-1)[:4] = torch.tensor([0, V - 1, -100, V // 2])  # both ends, an ignored one, a middle
    targets.view(-1)[-1] = -100
    full_ref = full.clone().requires_grad_()
    expected = F.cross_entropy(full_ref.flatten(0, -2).float(), targets.flatten(), ignore_index=-100)
    expected.backward()

    cols = slice(rank * V // ws, (rank + 1) * V // ws)
    local = full[..., cols].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, vocab_start=cols.start)
    assert loss.dtype == torch.float32 and loss.shape == (), tag
    assert_close(f"{tag} value", loss, expected)
    _same_on_every_rank(tag, loss.detach())
    n_bwd = _count_calls(loss_module, "all_gather_into", lambda: _count_calls(dist, "all_reduce", loss.backward))
    assert n_bwd == 0, f"{tag}: backward communicated {n_bwd} times"
    assert local.grad.dtype == dtype, tag
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close(f"{tag} logits grad", local.grad, full_ref.grad[..., cols], atol=tol, rtol=tol)
    for i in range(targets.numel()):
        if targets.view(-1)[i] == -100:
            assert torch.count_nonzero(local.grad.reshape(-1, V // ws)[i]) == 0, f"{tag}: ignored token {i} has a grad"

    # reduction="sum": torch's sum over the counted tokens, its gradient undivided.
    summed_ref = full.clone().requires_grad_()
    want = F.cross_entropy(summed_ref.flatten(0, -2).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    want.backward()
    summed = full[..., cols].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(summed, targets, vocab_start=cols.start, reduction="sum")
    assert_close(f"{tag} summed value", got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2)
    got.backward()
    assert_close(f"{tag} summed logits grad", summed.grad, summed_ref.grad[..., cols], atol=tol, rtol=tol)

    forward = lambda: vocab_parallel_cross_entropy(local, targets, vocab_start=cols.start)  # noqa: E731
    n_fwd = _count_calls(loss_module, "all_gather_into", forward)
    assert n_fwd == (1 if ws > 1 else 0), f"{tag}: forward gathered {n_fwd} times (each rank's lse and target logit, once)"
    assert _count_calls(dist, "all_reduce", forward) == 0, f"{tag}: forward all-reduced"


def _check_all_ignored(rank: int, ws: int) -> None:
    local = torch.randn(3, V // ws, requires_grad=True)
    loss = vocab_parallel_cross_entropy(local, torch.full((3,), -100), vocab_start=rank * V // ws)
    assert loss.isnan(), f"all-ignored loss on rank {rank} is {loss.item()}, expected nan"
    _same_on_every_rank("all-ignored loss", loss.detach())
    loss.backward()
    assert torch.count_nonzero(local.grad) == 0, "all-ignored batch: the gradient must be zero (as in torch)"
    summed = vocab_parallel_cross_entropy(local, torch.full((3,), -100), vocab_start=rank * V // ws, reduction="sum")
    assert summed.item() == 0.0, f"all-ignored sum on rank {rank} is {summed.item()}, expected 0 (torch's)"


def _check_errors(rank: int, ws: int) -> None:
    if ws > 1:
        with pytest.raises(ValueError, match=rf"num_embeddings=7 is not divisible by .* world size {ws}; .*\(1, 7\)"):
            VocabParallelEmbedding(7, H, master_weight=torch.randn(7, H))
    with pytest.raises(ValueError, match=r"master_weight has shape \(3, 3\), expected .* \[16, 6\]"):
        VocabParallelEmbedding(V, H, master_weight=torch.randn(3, 3))
    with pytest.raises(TypeError, match="master_weight must be a torch.Tensor"):
        VocabParallelEmbedding(V, H, master_weight=[[0.0] * H] * V)
    for bad in (16.0, True, "16"):
        with pytest.raises(TypeError, match="num_embeddings must be an int"):
            VocabParallelEmbedding(bad, H)
    with pytest.raises(TypeError, match="embedding_dim must be an int"):
        VocabParallelEmbedding(V, 6.0)
    with pytest.raises(ValueError, match="embedding_dim must be >= 1, got 0"):
        VocabParallelEmbedding(V, 0)
    with pytest.raises(ValueError, match=r"padding_idx=16 is outside the vocabulary; use an index in \[-16, 16\)"):
        VocabParallelEmbedding(V, H, 16)
    with pytest.raises(TypeError, match="needs an nn.Embedding, got Linear"):
        VocabParallelEmbedding.from_embedding(nn.Linear(V, H))
    with pytest.raises(ValueError, match="max_norm=1.0 is not supported"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(V, H, max_norm=1.0))
    layer = VocabParallelEmbedding(V, H)
    with pytest.raises(TypeError, match="int32/int64 token ids, got torch.float32"):
        layer(torch.zeros(2))
    with pytest.raises(ValueError, match="one parameter, 'weight'; got 'bias'"):
        layer.shard_of("bias", torch.zeros(V))
    with pytest.raises(ValueError, match=r"targets have shape \(3,\), expected logits.shape\[:-1\] = \(2,\)"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), vocab_start=0)
    with pytest.raises(TypeError, match="targets must be int32/int64"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2), vocab_start=0)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), vocab_start=0, reduction="none")
    with pytest.raises(TypeError, match="vocab_start must be an int"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), vocab_start=0.0)


def _check_subgroups(rank: int, ws: int) -> None:
    """Two tp groups of two: each layer splits and sums over its own group only."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, g_rank = groups[rank // 2], rank % 2
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(rank // 2))  # differs per group
    layer = VocabParallelEmbedding(V, H, master_weight=weight, group=group)
    assert (layer.tp_size, layer.tp_rank, layer.vocab_start) == (2, g_rank, g_rank * V // 2)
    ids = torch.arange(V).reshape(2, -1)
    assert_close("subgroup embedding", layer(ids), weight[ids])
    logits, targets = weight[:, :4].T.contiguous(), torch.tensor([0, 15, 8, -100])  # (4, V)
    cols = slice(g_rank * V // 2, (g_rank + 1) * V // 2)
    loss = vocab_parallel_cross_entropy(logits[:, cols], targets, group, vocab_start=cols.start)
    assert_close("subgroup loss", loss, F.cross_entropy(logits, targets))


def _check_scaled(rank: int, ws: int) -> None:
    """Gemma's scaled embedding split by vocabulary: its own forward's values (the scale cast to the
    weight's dtype, sqrt(3072) = 55.5 in bfloat16) and gradients."""
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding

    ids = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        whole = GemmaTextScaledWordEmbedding(V, H, PAD, embed_scale=3072**0.5).to(dtype)
        assert embedding_scale(whole) == 3072**0.5
        layer = VocabParallelEmbedding.from_embedding(whole)
        out, ref = layer(ids), whole(ids)
        assert torch.equal(out, ref), f"{dtype}: scaled lookup differs by {(out - ref).abs().max()}"
        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
        out.backward(grad)
        ref.backward(grad)
        assert_close(f"{dtype} scaled weight grad", layer.weight.grad, layer.shard_of("weight", whole.weight.grad))
    assert "scale=55.4256" in repr(layer)
    assert embedding_scale(nn.Embedding(V, H)) is None


def _contract(rank: int, ws: int) -> str:
    assert dist.get_world_size() == ws and dist.get_rank() == rank
    _check_embedding(rank, ws)
    for prefix in ((12,), (3, 5)):  # [tokens, V/tp] and [b, s, V/tp]
        for dtype in (torch.float32, torch.bfloat16):
            _check_loss(rank, ws, prefix, dtype)
    _check_all_ignored(rank, ws)
    _check_scaled(rank, ws)
    _check_errors(rank, ws)
    if ws == 4:
        _check_subgroups(rank, ws)
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_vocab_parallel_contract(world_size):
    assert run(_contract, world_size, timeout_s=60) == ["ok"] * world_size


def test_single_process_is_plain_torch():
    """Without a process group: nn.Embedding and F.cross_entropy exactly."""
    weight, ids = torch.randn(V, H), torch.tensor([[1, 15, PAD]])
    assert torch.equal(VocabParallelEmbedding(V, H, PAD, weight)(ids), F.embedding(ids, weight, PAD))
    logits, targets = torch.randn(5, V), torch.tensor([0, 3, -100, 15, 7])
    assert_close("ws=1 loss", vocab_parallel_cross_entropy(logits, targets, vocab_start=0), F.cross_entropy(logits, targets))
