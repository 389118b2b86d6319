"""The Column/Row parallel linear contract, against a single nn.Linear, on 1, 2 and 4 ranks."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rewrite import ColumnParallelLinear, RowParallelLinear
from rewrite.tensor_parallel import comm
from tests.asserts import assert_close
from tests.multiproc import run

IN, OUT = 12, 24  # divisible by 1, 2, 3 and 4


def _reference(weight: torch.Tensor, bias: bool) -> nn.Linear:
    ref = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    with torch.no_grad():
        ref.weight.copy_(weight)
        if bias:
            ref.bias.zero_()
    return ref


def _shared_data(shape_prefix: tuple[int, ...], features: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(OUT, IN, generator=gen)
    x = torch.randn(*shape_prefix, features, generator=gen)
    grad_out = torch.randn(*shape_prefix, OUT, generator=gen)
    return weight, x, grad_out


def _check_column(rank: int, ws: int, bias: bool, prefix: tuple[int, ...]) -> None:
    tag = f"column(ws={ws}, bias={bias}, x={prefix + (IN,)})"
    weight, x, grad_out = _shared_data(prefix, IN, seed=len(prefix) + 10 * bias)
    ref = _reference(weight, bias)
    x_ref = x.clone().requires_grad_()
    ref(x_ref).backward(grad_out)

    layer = ColumnParallelLinear(IN, OUT, bias, weight)
    rows = slice(rank * OUT // ws, (rank + 1) * OUT // ws)
    assert layer.weight.shape == (OUT // ws, IN), tag
    assert_close(f"{tag} weight slice", layer.weight, weight[rows])
    if bias:
        assert layer.bias.shape == (OUT // ws,), tag
        assert torch.count_nonzero(layer.bias) == 0, f"{tag}: bias must start at zero"
    else:
        assert layer.bias is None, tag
    x_tp = x.clone().requires_grad_()
    y = layer(x_tp)
    assert_close(f"{tag} output", y, ref(x))
    y.backward(grad_out)
    assert_close(f"{tag} input grad", x_tp.grad, x_ref.grad)
    assert_close(f"{tag} weight grad", layer.weight.grad, ref.weight.grad[rows])
    if bias:
        assert_close(f"{tag} bias grad", layer.bias.grad, ref.bias.grad[rows])


def _check_row(rank: int, ws: int, bias: bool, prefix: tuple[int, ...]) -> None:
    tag = f"row(ws={ws}, bias={bias}, x={prefix + (IN,)})"
    weight, x, grad_out = _shared_data(prefix, IN, seed=100 + len(prefix) + 10 * bias)
    ref = _reference(weight, bias)
    x_ref = x.clone().requires_grad_()
    ref(x_ref).backward(grad_out)

    layer = RowParallelLinear(IN, OUT, bias, weight)
    cols = slice(rank * IN // ws, (rank + 1) * IN // ws)
    assert layer.weight.shape == (OUT, IN // ws), tag
    assert_close(f"{tag} weight slice", layer.weight, weight[:, cols])
    if bias:
        assert layer.bias.shape == (OUT,), tag
        assert torch.count_nonzero(layer.bias) == 0, f"{tag}: bias must start at zero"
    else:
        assert layer.bias is None, tag
    x_slice = x[..., cols].clone().requires_grad_()  # forward() gets its pre-scattered slice
    y = layer(x_slice)
    assert_close(f"{tag} output", y, ref(x))
    y.backward(grad_out)
    assert_close(f"{tag} input grad", x_slice.grad, x_ref.grad[..., cols])
    assert_close(f"{tag} weight grad", layer.weight.grad, ref.weight.grad[:, cols])
    if bias:
        assert_close(f"{tag} bias grad", layer.bias.grad, ref.bias.grad)


def _check_megatron_pair(rank: int, ws: int) -> None:
    """column(gather_output=False) -> row: the MLP pattern, one collective each way."""
    gen = torch.Generator().manual_seed(7)
    up, down = nn.Linear(IN, OUT), nn.Linear(OUT, IN)
    with torch.no_grad():
        for p in (*up.parameters(), *down.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(3, 4, IN, generator=gen)
    x_ref = x.clone().requires_grad_()
    down(torch.relu(up(x_ref))).sum().backward()

    col = ColumnParallelLinear.from_linear(up, gather_output=False)
    row = RowParallelLinear.from_linear(down)
    x_tp = x.clone().requires_grad_()
    y = row(torch.relu(col(x_tp)))  # (3, 4, OUT / ws) between the two
    assert_close("pair output", y, down(torch.relu(up(x))))
    y.sum().backward()
    rows = slice(rank * OUT // ws, (rank + 1) * OUT // ws)
    assert_close("pair input grad", x_tp.grad, x_ref.grad)
    assert_close("pair up.weight grad", col.weight.grad, up.weight.grad[rows])
    assert_close("pair up.bias grad (trained bias kept)", col.bias.grad, up.bias.grad[rows])
    assert_close("pair up.bias value", col.bias, up.bias[rows])
    assert_close("pair down.weight grad", row.weight.grad, down.weight.grad[:, rows])
    assert_close("pair down.bias value", row.bias, down.bias)
    assert_close("pair down.bias grad", row.bias.grad, down.bias.grad)

    # Row splitting a full input itself.
    split_row = RowParallelLinear.from_linear(down, input_is_parallel=False)
    h = torch.randn(2, OUT, generator=gen, requires_grad=True)
    h_ref = h.detach().clone().requires_grad_()
    split_row(h).sum().backward()
    down(h_ref).sum().backward()
    assert_close("row(input_is_parallel=False) input grad", h.grad, h_ref.grad)


def _check_errors(rank: int, ws: int) -> None:
    if ws > 1:
        bad = 6 if ws == 4 else 7
        with pytest.raises(ValueError, match=rf"out_features={bad} is not divisible by .* world size {ws}"):
            ColumnParallelLinear(IN, bad, False, torch.randn(bad, IN))
        bad_in = bad
        with pytest.raises(ValueError, match=rf"in_features={bad_in} is not divisible by .* world size {ws}"):
            RowParallelLinear(bad_in, OUT, False, torch.randn(OUT, bad_in))
        row = RowParallelLinear(IN, OUT, False, torch.randn(OUT, IN))
        with pytest.raises(ValueError, match="input_is_parallel=False"):
            row(torch.randn(2, IN))
    with pytest.raises(ValueError, match=r"master_weight has shape \(3, 3\)"):
        ColumnParallelLinear(IN, OUT, True, torch.randn(3, 3))


def _count_all_reduces(fn) -> int:
    calls = []
    original = comm.all_reduce_sum

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    comm.all_reduce_sum = counting
    try:
        fn()
    finally:
        comm.all_reduce_sum = original
    return len(calls)


def _check_shared_input_copy(rank: int, ws: int) -> None:
    """Column layers sharing one input copy all-reduce its gradient once."""
    gen = torch.Generator().manual_seed(3)
    shared = comm.SharedInputCopy()
    a = ColumnParallelLinear(IN, OUT, True, torch.randn(OUT, IN, generator=gen), gather_output=False)
    a.input_copy = shared
    b = ColumnParallelLinear.from_linear(nn.Linear(IN, OUT), gather_output=False, input_copy=shared)
    x = torch.randn(2, IN, generator=gen, requires_grad=True)
    loss = (a(x) * b(x)).sum()
    expected = 1 if ws > 1 else 0
    assert _count_all_reduces(loss.backward) == expected, "shared input copy must all-reduce once"
    # Once its owner forgets it (apply_plan: when the block's forward returns), the cache keeps nothing alive.
    probe = weakref.ref(x)
    shared.forget()
    del loss, x
    assert probe() is None, "the shared input copy keeps its input alive after forget()"


def _check_sum(rank: int, ws: int) -> None:
    """all_reduce_sum: the exact sum within rounding, and the same bits on every rank."""
    parts = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(ws)]
    total = comm.all_reduce_sum(parts[rank].clone())
    assert_close("sum", total, torch.stack(parts).sum(0))
    gathered = [torch.empty_like(total) for _ in range(ws)]
    dist.all_gather(gathered, total)
    assert all(torch.equal(g, total) for g in gathered), "ranks hold different bits of the same sum"


def _contract(rank: int, ws: int) -> str:
    assert dist.get_world_size() == ws and dist.get_rank() == rank
    for bias in (True, False):
        for prefix in ((5,), (2, 3)):  # [b, in] and [b, s, in]
            _check_column(rank, ws, bias, prefix)
            _check_row(rank, ws, bias, prefix)
    _check_megatron_pair(rank, ws)
    _check_errors(rank, ws)
    _check_shared_input_copy(rank, ws)
    _check_sum(rank, ws)
    return "ok"


# 3 ranks: the sums take torch.distributed.all_reduce instead of the P2P exchange.
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parallel_linear_contract(world_size):
    assert run(_contract, world_size) == ["ok"] * world_size


def _explicit_group(rank: int, ws: int) -> tuple[int, int]:
    # Two groups of two: the layer takes size and rank from its group, not the world.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    weight = torch.arange(OUT * IN, dtype=torch.float32).reshape(OUT, IN)
    layer = ColumnParallelLinear(IN, OUT, False, weight, group=group)
    assert_close("group slice", layer.weight, weight[(rank % 2) * OUT // 2 : (rank % 2 + 1) * OUT // 2])
    x = torch.randn(2, IN)
    assert_close("group output", layer(x), x @ weight.T)
    return layer.tp_size, layer.tp_rank


def test_layers_follow_their_group():
    assert run(_explicit_group, 4) == [(2, 0), (2, 1), (2, 0), (2, 1)]


def _replicated(rank: int, ws: int) -> str:
    # Two slices on four ranks: ranks 0, 1 hold rows [0, OUT/2), ranks 2, 3 the rest (kv heads past their count).
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(OUT, IN, generator=gen), torch.randn(OUT, generator=gen)
    x = torch.randn(3, IN, generator=gen)
    upstream = [torch.randn(3, OUT // 2, generator=gen) for _ in range(ws)]  # each rank's own share of dL/dy
    linear = nn.Linear(IN, OUT)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    layer = ColumnParallelLinear.from_linear(linear, gather_output=False, replicas=2, replica_group=groups[rank // 2])
    rows = slice(rank // 2 * OUT // 2, (rank // 2 + 1) * OUT // 2)
    assert (layer.slot, layer.per_rank) == (rank // 2, OUT // 2)
    assert_close("replicated slice", layer.weight, weight[rows])
    x_tp = x.clone().requires_grad_()
    y = layer(x_tp)
    assert_close("replicated output", y, x @ weight[rows].T + bias[rows])
    y.backward(upstream[rank])
    mine = upstream[rank // 2 * 2] + upstream[rank // 2 * 2 + 1]  # both holders' shares, summed over the pair
    assert_close("replicated weight grad", layer.weight.grad, mine.T @ x)
    assert_close("replicated bias grad", layer.bias.grad, mine.sum(0))
    full = sum(upstream[r] @ weight[r // 2 * OUT // 2 : (r // 2 + 1) * OUT // 2] for r in range(ws))
    assert_close("replicated input grad", x_tp.grad, full)  # every rank's share, summed over tp once
    bad = [
        (dict(replicas=2, replica_group=groups[rank // 2]), "needs gather_output=False"),
        (dict(gather_output=False, replicas=2), "needs a replica_group of 2 ranks, got none"),
        (dict(gather_output=False, replicas=4, replica_group=groups[rank // 2]), "replica_group of 4 ranks, got a group of 2"),
        (dict(gather_output=False, replicas=3, replica_group=groups[rank // 2]), "replica_group of 3"),
        (dict(gather_output=False, replicas=0), "replicas must be an int >= 1"),
    ]
    for options, words in bad:
        with pytest.raises(ValueError, match=words):
            ColumnParallelLinear(IN, OUT, True, weight, **options)
    return "ok"


def test_replicated_column_slices_sum_their_gradients_over_their_holders():
    assert run(_replicated, 4) == ["ok"] * 4
