"""Sequence-parallel collectives against single-process maths, on 1, 2 and 4 ranks.

Sequence lengths include ones the group does not divide (7 at tp 2 and 4, 5 at tp 4
where the last rank holds padding only, 1 at tp 4) and batches b > 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rewrite.tensor_parallel.layers import RowParallelLinear
from rewrite.tensor_parallel.sequence import (
    gather_from_sequence,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    sequence_chunk,
)
from tests.asserts import assert_close
from tests.collectives import CountCollectives
from tests.multiproc import run

H = 3
SHAPES = [(1, 8), (2, 8), (1, 7), (3, 7), (2, 5), (1, 1), (2, 1)]  # (b, s)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _chunk_of(x: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    """Reference: rows [rank*c, (rank+1)*c) of x (b, s, h) zero padded to tp*c rows."""
    c = sequence_chunk(x.shape[1], ws)
    return F.pad(x, (0, 0, 0, ws * c - x.shape[1]))[:, rank * c : (rank + 1) * c]


def _check_scatter_gather(rank: int, ws: int, b: int, s: int) -> None:
    tag = f"ws={ws} b={b} s={s}"
    c = sequence_chunk(s, ws)
    x = _randn(b, s, H, seed=s + 10 * b).requires_grad_()  # replicated
    shard = scatter_to_sequence(x)
    assert_close(f"{tag} scatter value", shard, _chunk_of(x.detach(), rank, ws))
    pad_rows = max(0, min(c, (rank + 1) * c - s))
    assert torch.count_nonzero(shard[:, c - pad_rows :]) == 0, f"{tag}: padding rows must be zero"
    if ws > 1:  # a copy: a view would keep the whole replicated x alive
        assert shard.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), tag
    # Each rank's loss reads only its shard: dL/dx = the ranks' shard grads, concatenated.
    grads = [_randn(b, c, H, seed=100 + r) for r in range(ws)]
    shard.backward(grads[rank])
    assert_close(f"{tag} scatter input grad", x.grad, torch.cat(grads, 1)[:, :s])

    # Round trip, and the untrimmed gather keeps the zero padding.
    assert_close(f"{tag} round trip", gather_from_sequence(scatter_to_sequence(x), length=s), x)
    full = gather_from_sequence(scatter_to_sequence(x))
    assert_close(f"{tag} untrimmed gather", full, F.pad(x, (0, 0, 0, ws * c - s)))

    # gather's backward, grad="reduce_scatter": this rank's chunk of the summed grads.
    parts = [_randn(b, s, H, seed=200 + r) for r in range(ws)]
    leaf = _chunk_of(x.detach(), rank, ws).clone().requires_grad_()
    y = gather_from_sequence(leaf, length=s)
    assert_close(f"{tag} gather value", y, x)
    y.backward(parts[rank])
    assert_close(f"{tag} gather grad (reduce_scatter)", leaf.grad, _chunk_of(sum(parts), rank, ws))
    # grad="split": this rank's chunk of its own grad, no communication.
    leaf.grad = None
    gather_from_sequence(leaf, length=s, grad="split").backward(parts[rank])
    assert_close(f"{tag} gather grad (split)", leaf.grad, _chunk_of(parts[rank], rank, ws))


def _check_reduce_scatter(rank: int, ws: int, b: int, s: int) -> None:
    tag = f"ws={ws} b={b} s={s}"
    c = sequence_chunk(s, ws)
    xs = [_randn(b, s, H, seed=300 + r) for r in range(ws)]  # each rank's partial sum
    x = xs[rank].clone().requires_grad_()
    y = reduce_scatter_to_sequence(x)
    assert_close(f"{tag} reduce_scatter value", y, _chunk_of(sum(xs), rank, ws))
    grads = [_randn(b, c, H, seed=400 + r) for r in range(ws)]
    y.backward(grads[rank])
    assert_close(f"{tag} reduce_scatter input grad", x.grad, torch.cat(grads, 1)[:, :s])


def _check_megatron_mlp(rank: int, ws: int, b: int, s: int) -> None:
    """shard -> gather -> column (A_r) -> relu -> row (B_r) -> reduce_scatter, vs one process."""
    tag = f"mlp ws={ws} b={b} s={s}"
    f = 4 * ws
    x, a, w = _randn(b, s, H, seed=1), _randn(H, f, seed=2), _randn(f, H, seed=3)
    g = _randn(b, s, H, seed=4)
    x_ref, a_ref, w_ref = (t.clone().requires_grad_() for t in (x, a, w))
    y_ref = torch.relu(x_ref @ a_ref) @ w_ref
    (y_ref * g).sum().backward()

    cols = slice(rank * f // ws, (rank + 1) * f // ws)
    shard = _chunk_of(x, rank, ws).clone().requires_grad_()
    a_r, w_r = a[:, cols].clone().requires_grad_(), w[cols].clone().requires_grad_()
    y = reduce_scatter_to_sequence(torch.relu(gather_from_sequence(shard, length=s) @ a_r) @ w_r)
    assert_close(f"{tag} output", y, _chunk_of(y_ref.detach(), rank, ws))
    (y * _chunk_of(g, rank, ws)).sum().backward()
    assert_close(f"{tag} shard grad", shard.grad, _chunk_of(x_ref.grad, rank, ws))
    assert_close(f"{tag} A grad", a_r.grad, a_ref.grad[:, cols])
    assert_close(f"{tag} B grad", w_r.grad, w_ref.grad[cols])


def _check_row_bias(rank: int, ws: int, b: int, s: int) -> None:
    """A RowParallelLinear with a bias under sequence parallelism: each rank adds it to its own
    tokens only, so its gradient is summed over the group (else each rank holds a part of it)."""
    tag = f"row bias ws={ws} b={b} s={s}"
    f = 2 * ws
    x, w, bias, g = _randn(b, s, f, seed=5), _randn(H, f, seed=6), _randn(H, seed=7), _randn(b, s, H, seed=8)
    w_ref, bias_ref = w.clone().requires_grad_(), bias.clone().requires_grad_()
    (F.linear(x, w_ref, bias_ref) * g).sum().backward()
    row = RowParallelLinear(f, H, bias=True, master_weight=w, sequence_parallel=True)
    with torch.no_grad():
        row.bias.copy_(bias)
    cols = slice(rank * f // ws, (rank + 1) * f // ws)
    y = row(x[..., cols])  # (b, ceil(s / ws), H): this rank's tokens
    c = sequence_chunk(s, ws)
    keep = max(0, min(c, s - rank * c))  # the padding rows' output is dropped by the final gather
    ref = _chunk_of(F.linear(x, w, bias), rank, ws)
    assert_close(f"{tag} output", y[:, :keep], ref[:, :keep])
    (y * _chunk_of(g, rank, ws)).sum().backward()
    assert_close(f"{tag} bias grad", row.bias.grad, bias_ref.grad)
    assert_close(f"{tag} weight grad", row.weight.grad, w_ref.grad[:, cols])


def _check_errors(ws: int) -> None:
    for s in (1, 5, 7, 8):
        c = sequence_chunk(s, ws)
        shard = torch.zeros(2, c, H)
        for ok in (ws * c - ws + 1, ws * c):  # the whole range ceil(length / ws) == c allows
            assert gather_from_sequence(shard, length=ok).shape == (2, ok, H)
        for bad in (ws * c + 1, ws * c - ws, -1):
            with pytest.raises(ValueError, match=rf"length={bad} does not fit chunks of c={c}"):
                gather_from_sequence(shard, length=bad)
    with pytest.raises(ValueError, match="grad='sum' is not one of"):
        gather_from_sequence(torch.zeros(1, 2, H), grad="sum")
    for fn in (scatter_to_sequence, gather_from_sequence, reduce_scatter_to_sequence):
        with pytest.raises(ValueError, match=r"got shape \(4,\)"):
            fn(torch.zeros(4))


def _comm_counts(fn) -> dict[str, int]:
    with CountCollectives() as seen:
        fn()
    return seen.made()


def _check_comm_counts(ws: int) -> None:
    """One collective per call forward, at most one backward, never an all-reduce."""
    gather, rs = ({"sequence_all_gather": 1}, {"sequence_reduce_scatter": 1}) if ws > 1 else ({}, {})
    x = torch.randn(2, 7, H, requires_grad=True)
    seen = {}

    def step(name, make, expected_fwd, expected_bwd):
        out = []
        seen[name + " fwd"] = (_comm_counts(lambda: out.append(make())), expected_fwd)
        seen[name + " bwd"] = (_comm_counts(lambda: out[0].sum().backward()), expected_bwd)

    c = sequence_chunk(7, ws)
    step("scatter", lambda: scatter_to_sequence(x), {}, gather)
    step("gather", lambda: gather_from_sequence(torch.randn(2, c, H, requires_grad=True), length=7), gather, rs)
    split = lambda: gather_from_sequence(torch.randn(2, c, H, requires_grad=True), length=7, grad="split")  # noqa: E731
    step("gather(split)", split, gather, {})
    step("reduce_scatter", lambda: reduce_scatter_to_sequence(x * 1), rs, gather)
    wrong = {k: v for k, v in seen.items() if v[0] != v[1]}
    assert not wrong, f"ws={ws}: collectives (seen, expected): {wrong}"


def _contract(rank: int, ws: int) -> str:
    for b, s in SHAPES:
        _check_scatter_gather(rank, ws, b, s)
        _check_reduce_scatter(rank, ws, b, s)
        _check_megatron_mlp(rank, ws, b, s)
        _check_row_bias(rank, ws, b, s)
    _check_errors(ws)
    _check_comm_counts(ws)
    return "ok"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sequence_parallel_contract(world_size):
    assert run(_contract, world_size, timeout_s=60) == ["ok"] * world_size


def test_sequence_chunk():
    assert [sequence_chunk(n, 4) for n in (0, 1, 4, 5, 7, 8)] == [0, 1, 1, 2, 2, 2]
    assert sequence_chunk(7, 2) == 4 and sequence_chunk(7, 1) == 7
    for bad in ((-1, 2), (3, 0)):
        with pytest.raises(ValueError, match="sequence_chunk needs"):
            sequence_chunk(*bad)


def test_no_process_group_is_identity():
    x = torch.randn(2, 7, H)
    assert scatter_to_sequence(x) is x and reduce_scatter_to_sequence(x) is x
    assert gather_from_sequence(x, length=7) is x
    with pytest.raises(ValueError, match="length=6 does not fit chunks of c=7 rows on 1 ranks"):
        gather_from_sequence(x, length=6)
