"""Tensor-parallel collectives as autograd Functions (Megatron's f and g operators), and the all-gather and
reduce-scatter along dim 0 that sequence and context parallelism build on.

Each Function pairs a forward collective with its adjoint in backward, so a rewritten model is
differentiated by plain autograd (the only hooks are the gradient sums of whole parameters, `partial_grads`).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..lent import lend
from ..torch_internals import traced_all_gather, traced_all_reduce, traced_reduce_scatter

__all__ = ["all_reduce_sum", "all_gather_into", "reduce_scatter_into", "all_to_all", "traced", "loopback", "group_rank",
           "group_size", "copy_to_parallel", "reduce_from_parallel", "gather_from_parallel", "scatter_to_parallel", "SharedInputCopy"]


def _no_group(group: ProcessGroup | None) -> bool:
    """Whether torch.distributed is not initialised (then `group` must be None)."""
    if dist.is_available() and dist.is_initialized():
        return False
    if group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialised")
    return True


def group_size(group: ProcessGroup | None = None) -> int:
    """World size of `group` (default group when None); 1 without a process group."""
    return 1 if _no_group(group) else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in `group` (default group when None); 0 without a process group."""
    if _no_group(group):
        return 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the given process group; build each "
                         "layer with a group that contains the calling rank")
    return rank


def swaps(x: torch.Tensor, group: ProcessGroup | None) -> bool:
    """Whether collectives on `x` over `group` go by pairwise P2P swaps (CPU, gloo, a power-of-two group)."""
    size = group_size(group)
    return x.device.type == "cpu" and not size & (size - 1) and dist.get_backend(group) == "gloo"


_LOOPBACK: list | None = None  # inside `loopback`: the bytes of each exchange not made
_SWAPS_TOO = True  # inside `loopback`: the swaps looped back too, not the experts' all-to-alls alone


@contextmanager
def loopback(swaps: bool = True):
    """Within it the pairwise swaps and the experts' all-to-alls move nothing: each rank receives its own tensor,
    so the results are wrong and no rank waits for another. What a step's layers cost without their
    collectives, for timing (`rewrite calibrate`); yields the list of the bytes each exchange would have sent.
    `swaps` False: the all-to-alls alone, the swaps made."""
    global _LOOPBACK, _SWAPS_TOO
    outer = _LOOPBACK, _SWAPS_TOO
    _LOOPBACK, _SWAPS_TOO = [], swaps
    try:
        yield _LOOPBACK
    finally:
        _LOOPBACK, _SWAPS_TOO = outer


def swap(send: torch.Tensor, recv: torch.Tensor, peer: int, group: ProcessGroup | None) -> None:
    """Send `send` to group rank `peer` while receiving its tensor into `recv`."""
    if _LOOPBACK is not None and _SWAPS_TOO:
        _LOOPBACK.append(send.numel() * send.element_size())
        recv.copy_(send)
        return
    peer = dist.get_global_rank(group, peer) if group is not None else peer
    ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def all_to_all(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None) -> None:
    """`dist.all_to_all_single`: `x`'s rows in `in_splits` to the ranks of `group` in order, theirs into `out`.
    Inside `loopback`, `out` is `x` (a rank that sends each rank what it would receive from it: the same rows)."""
    if _LOOPBACK is None:
        return dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    _LOOPBACK.append(x.numel() * x.element_size())
    out.copy_(x)


def traced() -> bool:
    """Whether torch.compile is tracing the caller: collectives then go through torch's functional
    collectives, which dynamo and inductor put in the graph (the P2P swaps below would break it)."""
    return torch.compiler.is_compiling()


def _group(group: ProcessGroup | None) -> ProcessGroup:
    return dist.group.WORLD if group is None else group


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum a contiguous `x` over `group`, in place (traced: into a new tensor); every rank ends with identical bits.

    On CPU with gloo and a power-of-two group, the sum is done by recursive doubling over P2P:
    log2(p) rounds in which partners swap their partial sums and add. On 2 cores this costs about
    a fifth of gloo's ring all_reduce for a tp layer's [mb, seq, hidden] activations (see bench/).
    IEEE addition is commutative, so both partners of a round compute the same bits, and so does
    every rank at the end. Elsewhere (NCCL, other group sizes) it is `dist.all_reduce`.
    """
    size = group_size(group)
    if size == 1:
        return x
    if traced():
        return traced_all_reduce(x, _group(group))
    if not swaps(x, group):
        dist.all_reduce(x, group=group)
        return x
    rank, partner_sum, step = group_rank(group), torch.empty_like(x), 1
    while step < size:
        swap(x, partner_sum, rank ^ step, group)
        x.add_(partner_sum)
        step *= 2
    return x


def _by_torch(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None, traced_op, torch_op) -> bool:
    """Whether torch's own collective filled `out` from `x` along dim 0: the functional one (`traced_op`) while
    traced, `torch_op` off the swap path; False leaves it to the swaps."""
    if traced():
        out.copy_(traced_op(x, 0, _group(group)))
    elif not swaps(x, group):
        torch_op(out, x, group=group)
    else:
        return False
    return True


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """`out` (p * n, ...) receives every rank's contiguous `x` (n, ...), in rank order; returns `out`.

    On CPU with gloo and a power-of-two group, gloo's all-gather is a ring and its reduce-scatter a whole
    all-reduce keeping a slice; here both take log2(p) rounds of P2P swaps (recursive doubling for the
    gather, halving for `reduce_scatter_into`), as `all_reduce_sum` does: at tp = 2, one swap of half the
    tensor. Elsewhere torch's `all_gather_single` / `reduce_scatter_single`.
    """
    if _by_torch(out, x, group, traced_all_gather, dist.all_gather_single):
        return out
    size, rank = group_size(group), group_rank(group)
    blocks = out.view(size, *x.shape)  # (p, n, ...): block r is rank r's x
    blocks[rank].copy_(x)
    step = 1
    while step < size:  # after the round of `step`, each rank holds the 2 * step blocks around it
        peer = rank ^ step
        mine, theirs = rank // step * step, peer // step * step
        swap(blocks[mine : mine + step], blocks[theirs : theirs + step], peer, group)
        step *= 2
    return out


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """`out` (n, ...) becomes block `rank` of the sum over ranks of the contiguous `x` (p * n, ...).

    On the swap path `x` is used as scratch space (callers pass a private buffer).
    """
    if _by_torch(out, x, group, traced_reduce_scatter, dist.reduce_scatter_single):
        return out
    size, rank = group_size(group), group_rank(group)
    blocks = x.view(size, *out.shape)  # (p, n, ...): this rank's partial sum of every block
    lo, span = 0, size
    while span > 1:  # keep the half of [lo, lo + span) holding `rank`; send the other half away
        half = span // 2
        peer = rank ^ half
        low = rank < lo + half
        keep = slice(lo, lo + half) if low else slice(lo + half, lo + span)
        give = slice(lo + half, lo + span) if low else slice(lo, lo + half)
        received = torch.empty_like(blocks[keep])
        swap(blocks[give], received, peer, group)
        blocks[keep].add_(received)
        lo, span = keep.start, half
    return out.copy_(blocks[rank])


def _split_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    size, rank = group_size(group), group_rank(group)
    if x.shape[-1] % size:
        raise ValueError(f"cannot split the last dimension ({x.shape[-1]}) of a tensor of shape {tuple(x.shape)} "
                         f"evenly across {size} ranks")
    return x.chunk(size, dim=-1)[rank].contiguous()


def _gather_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if traced():
        return traced_all_gather(x.contiguous(), x.dim() - 1, _group(group))
    dense = x.contiguous()
    parts = [torch.empty_like(dense) for _ in range(group_size(group))]
    dist.all_gather(parts, dense, group=group)
    lend(*parts, *([dense] if dense is not x else []))
    return torch.cat(parts, dim=-1)


class _Adjoint(torch.autograd.Function):
    """A collective and its adjoint: forward `fwd(x, *f_args)`, backward `bwd(grad, *b_args)` (module-level
    functions, looked up by the caller at each call: benches patch them)."""

    @staticmethod
    def forward(ctx, x, fwd, f_args, bwd, b_args):
        ctx.bwd, ctx.b_args = bwd, b_args
        return fwd(x, *f_args)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, *ctx.b_args), None, None, None, None


def _alias(x: torch.Tensor) -> torch.Tensor:
    return x.view_as(x)


def _summed_copy(grad: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    # Autograd may hand the same grad tensor to several consumers (e.g. both branches of a
    # residual add): reduce a private (dense, as collectives need) copy, never in place.
    return all_reduce_sum(grad.clone(memory_format=torch.contiguous_format), group)


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward. Sums row layers' partial outputs."""

    @staticmethod
    def forward(ctx, x, group, inplace):
        # Row layers pass their private matmul output: reducing it in place saves a
        # copy of (..., out) per layer. Anything else is reduced on a copy.
        if inplace and not traced() and x.is_contiguous() and x._base is None and not (x.is_leaf and x.requires_grad):
            ctx.mark_dirty(x)
        else:
            x = x.clone(memory_format=torch.contiguous_format)
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_to_parallel(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Megatron's f: identity forward; all-reduce of the input gradient in backward. Column layers read a
    replicated X; each rank's dL/dX is only the partial sum dL/dY_i W_i, so the full gradient is their sum
    over ranks. A no-op for a group of one."""
    return x if group_size(group) == 1 else _Adjoint.apply(x, _alias, (), _summed_copy, (group,))


def reduce_from_parallel(x: torch.Tensor, group: ProcessGroup | None = None, *, inplace: bool = False) -> torch.Tensor:
    """Megatron's g: sum over the group; with `inplace=True` a contiguous intermediate is reduced in its
    own memory. A no-op for a group of one."""
    return x if group_size(group) == 1 else _ReduceFromParallel.apply(x, group, inplace)


def gather_from_parallel(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """All-gather along the last dimension (`(..., n/p)` -> `(..., n)`); backward keeps this rank's slice."""
    return x if group_size(group) == 1 else _Adjoint.apply(x, _gather_last, (group,), _split_last, (group,))


def scatter_to_parallel(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """This rank's slice of the last dimension (`(..., n)` -> `(..., n/p)`); backward all-gathers the gradient."""
    return x if group_size(group) == 1 else _Adjoint.apply(x, _split_last, (group,), _gather_last, (group,))


class SharedInputCopy:
    """Applies f once per input tensor for every column layer that shares this object.

    Attention's q/k/v (and the MLP's gate/up) read the same activation. One f per layer would
    all-reduce that activation's gradient three times in backward; sharing f lets autograd sum the
    local partial gradients first, so the block costs a single all-reduce, as in Megatron's fused
    QKV. The cache is keyed on the input's identity and version, so it never hands out a stale
    value. The cached copy is a view that keeps the input (and its graph) alive: whoever owns the
    block calls `forget()` when its forward returns (`apply_tensor_parallel` does).
    """

    def __init__(self, group: ProcessGroup | None = None):
        self.group = group
        self.forget()

    def forget(self) -> None:
        """Drop the cached copy (and with it the input it keeps alive)."""
        self._src, self._out, self._version = None, None, -1  # weakref to the input, its copy, its version

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Without a gradient to reduce, f is the identity: nothing to share.
        if not (torch.is_grad_enabled() and x.requires_grad) or group_size(self.group) == 1:
            return x
        src = self._src() if self._src is not None else None
        # Traced, the version is not read (dynamo cannot guard on it); the graph orders any in-place change.
        if src is x and self._out is not None and (traced() or x._version == self._version):
            return self._out
        out = copy_to_parallel(x, self.group)
        self._src, self._out, self._version = weakref.ref(x), out, x._version
        return out
