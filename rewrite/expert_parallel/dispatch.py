"""A fused experts module split over ep: each (token, choice) row goes to its expert's rank and back.

On a rank holding experts `[a, a + n)` of `E` (`n = E / ep`), the module's own forward is the family's
math for those experts (rows, local expert ids, routing weights). A layer's call
`experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])` then becomes:

    rows      = hidden repeated per choice, sorted by expert        (T k, H) and (T k,) weights
    counts    = rows per expert, exchanged                           -> rows per (source, local expert)
    received  = all-to-all(rows | weights)                           (R, H + 1), sources in rank order
    out       = own_forward(received, local ids [R, 1], weights [R, 1])     (R, H)
    back      = all-to-all(out), rows in the order they were sent    (T k, H)
    result    = back unsorted, summed over the k choices             (T, H)

Identity experts (LongCat-Flash) keep their rows here: each comes back as itself times its weight, and
only routed rows travel; routed experts may lie on their ranks out of order (`ExpertSpec.slots`), so rows
are sorted by slot (rank, then row on it), not by expert id.

Dropless (no capacity). Rows and weights travel in one exchange, in their common dtype (a wider weight
keeps its bits; rows widened and narrowed back are exact): one exchange each way per layer, in the same
order on every rank. When ep borrows tp ranks, each tp rank sends only its chunk of the tokens
(`TokenSplit`).

Experts that take every token (`models.experts.EVERY_TOKEN_EXPERTS`, Llama 4) are called on `[E T, H]`,
expert e's rows at `e T`, already weighted: each rank gets the blocks of its experts (`[n T, H]`) from
every rank, runs them side by side, and sends each back (`EveryTokenMixin`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..binding.experts import ExpertSpec
from ..models.experts import paired_choices
from ..tensor_parallel.comm import _Adjoint, all_to_all, group_rank, group_size
from ..tensor_parallel.sequence import gather_from_sequence, scatter_to_sequence, sequence_chunk

__all__ = ["ExpertShard", "ExpertParallelMixin", "EveryTokenMixin", "ShardedExperts", "TokenSplit", "exchange_counts",
           "exchange_rows"]

# Both exchanges are `all_to_all_single` over the expert-parallel group. Every rank of the group calls each
# one, rows or none, so none waits alone.


def exchange_counts(per_expert: torch.Tensor, ep: int, group: ProcessGroup) -> torch.Tensor:
    """Rows this rank receives, `[ep, E / ep]`: from source rank `s` for local expert `e`, given the rows
    it sends to each of the `E` experts (`per_expert`, int64, experts of rank `r` at `[r * E / ep, ...)`)."""
    received = torch.empty_like(per_expert)
    all_to_all(received, per_expert.contiguous(), group)
    return received.view(ep, -1)


def _all_to_all(rows: torch.Tensor, send: list[int], receive: list[int], group: ProcessGroup) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    all_to_all(out, rows.contiguous(), group, receive, send)
    return out


def exchange_rows(rows: torch.Tensor, send: list[int], receive: list[int], group: ProcessGroup) -> torch.Tensor:
    """Rows `[sum(send), ...]`, the first `send[0]` to rank 0 of `group` and so on, exchanged for
    `[sum(receive), ...]` (those from rank 0 first); differentiable: the backward is the same exchange with
    the splits reversed."""
    return _Adjoint.apply(rows, _all_to_all, (send, receive, group), _all_to_all, (receive, send, group))


@dataclass(frozen=True)
class TokenSplit:
    """This tp rank's chunk of `tokens` rows (along dim -2) of its `group`, when ep borrows tp ranks.

    The tp ranks of a replica then hold the same tokens (`plan.ranks.expert_groups`). Each keeps its chunk
    (`c = ceil(T / tp)` rows, the last chunks shorter or empty) and sends only those to their experts; the
    chunks' outputs are all-gathered over tp. The backward mirrors it: each rank keeps its chunk of the
    (replicated) output gradient, and the gradients of the chunks' tokens and routing weights are
    all-gathered, so every tp rank sees every token's gradient and the experts' gradients hold each token once.
    """

    group: ProcessGroup
    tokens: int

    @staticmethod
    def over(group: ProcessGroup | None, tokens: int) -> TokenSplit | None:
        """The split of `tokens` rows over `group`; None when there is nothing to split (no group, or no row)."""
        if group is None or tokens == 0 or group_size(group) == 1:
            return None
        return TokenSplit(group, tokens)

    chunk = property(lambda self: sequence_chunk(self.tokens, group_size(self.group)))
    start = property(lambda self: min(group_rank(self.group) * self.chunk, self.tokens))
    count = property(lambda self: min(self.chunk, self.tokens - self.start),
                     doc="Rows this rank keeps (the last ranks may keep fewer, or none).")

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `x` (..., T, d): (..., count, d). Differentiable: the backward all-gathers."""
        if not x.is_floating_point():
            return x.narrow(-2, self.start, self.count)
        return scatter_to_sequence(x, self.group).narrow(-2, 0, self.count)

    def join(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (..., count, d) gathered in order: (..., T, d). The backward keeps this rank's."""
        x = F.pad(x, (0, 0, 0, self.chunk - self.count))
        return gather_from_sequence(x, self.group, length=self.tokens, grad="split")


@dataclass(frozen=True)
class ExpertShard:
    """A rank's share of one experts module (`spec`: `local` of its `total` routed experts, slice `ep_rank`
    of each tensor's blocks), its expert-parallel group, and its tp group (tp > 1: the tokens are shared
    out over it, `TokenSplit`)."""

    spec: ExpertSpec
    ep_rank: int
    group: ProcessGroup
    cast: torch.dtype | None = None  # the dtype the experts compute in, when not their parameters'
    tp_group: ProcessGroup | None = None

    total = property(lambda self: self.spec.num_experts)
    ep = property(lambda self: self.spec.ep)
    local = property(lambda self: self.spec.local)
    first = property(lambda self: self.spec.split_of("").ranges(self.total, self.ep_rank)[0][0],
                     doc="The first row this rank holds of each block.")

    def slots(self, experts: torch.Tensor) -> torch.Tensor:
        """Each routed expert id's slot (`ExpertSpec.slots`): itself unless the experts are read in blocks."""
        if self.spec.block == self.total:
            return experts
        return torch.tensor(self.spec.slots, device=experts.device)[experts]


class ShardedExperts:
    """What every experts module split over ep has: its share, and its share of a whole tensor."""

    expert_shard: ExpertShard

    def shard_of(self, leaf: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of the module's whole tensor `full` (named `leaf`)."""
        return self.expert_shard.spec.split_of(leaf).take(full, self.expert_shard.ep_rank)

    def _cast(self) -> ShardedExperts:
        """What the family's forward runs on: this module, or with `ExpertShard.cast` a shallow copy holding its
        floating parameters cast to that dtype by autograd (gradients reach the parameters in their own dtype)."""
        dtype = self.expert_shard.cast
        if dtype is None:
            return self
        stand_in = copy.copy(self)
        stand_in.__dict__["_parameters"] = {
            name: p.to(dtype) if p is not None and p.is_floating_point() else p for name, p in self._parameters.items()}
        return stand_in


class EveryTokenMixin(ShardedExperts):
    """Put in front of an every-token experts module's class (Llama 4): blocks of rows to their experts' ranks."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        shard = self.expert_shard
        hidden = hidden_states.shape[-1]
        blocks = hidden_states.reshape(shard.total, -1, hidden)  # (E, T, H): expert e's rows
        split = TokenSplit.over(shard.tp_group, blocks.shape[1])
        if split is None:
            return self._dispatched(blocks, *args, **kwargs)
        out = self._dispatched(split.take(blocks), *args, **kwargs).view(shard.total, split.count, hidden)
        return split.join(out).view(-1, hidden)

    @torch.compiler.disable  # a compiled block is split here on purpose (`ExpertParallelMixin._dispatched`)
    def _dispatched(self, blocks: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Blocks (E, T, H) to their experts' ranks and back: (E T, H)."""
        shard = self.expert_shard
        hidden, tokens = blocks.shape[-1], blocks.shape[1]
        mine = exchange_counts(torch.full((shard.ep,), tokens, dtype=torch.int64), shard.ep, shard.group)
        theirs = mine.reshape(-1).tolist()  # T of each rank of the group
        send = [shard.local * tokens] * shard.ep
        receive = [shard.local * t for t in theirs]
        got = exchange_rows(blocks.reshape(-1, hidden), send, receive, shard.group)  # (sum n T_r, H), by source
        side_by_side = torch.cat([b.view(shard.local, t, hidden) for b, t in zip(got.split(receive), theirs)], dim=1)
        # The family's forward (the class after the mixin's), on this module or its cast stand-in.
        own = super(EveryTokenMixin, self._cast()).forward
        out = own(side_by_side.reshape(-1, hidden), *args, **kwargs).view(shard.local, -1, hidden)
        back = torch.cat([b.reshape(-1, hidden) for b in out.split(theirs, dim=1)])  # by destination
        return exchange_rows(back, receive, send, shard.group).view(shard.ep * shard.local * tokens, hidden)


class ExpertParallelMixin(ShardedExperts):
    """Put in front of a fused experts module's class: its forward sends rows to their experts' ranks."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *args, **kwargs):
        tokens = top_k_index.shape[0]
        hidden_states = hidden_states.reshape(tokens, hidden_states.shape[-1])
        split = TokenSplit.over(self.expert_shard.tp_group, tokens)
        if split is None:
            return self._dispatched(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        mine = [split.take(t) for t in (hidden_states, top_k_index, top_k_weights)]
        return split.join(self._dispatched(*mine, *args, **kwargs))

    # Under torch.compile a block is split here on purpose: how many rows each rank receives is known only after
    # the count exchange (sizes that depend on the routing), so the exchange and the experts run eagerly between
    # the block's graph before (attention, router) and after (the residual) (`rewrite.compiled`).
    @torch.compiler.disable
    def _dispatched(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    *args, **kwargs) -> torch.Tensor:
        """Each (token, choice) row to its expert's rank and back, summed over the choices: (T, H)."""
        shard = self.expert_shard
        tokens, k = top_k_index.shape
        hidden = hidden_states.shape[-1]
        experts, weights = top_k_index.reshape(-1), top_k_weights.reshape(-1, 1)
        kept = (experts >= shard.total).nonzero().squeeze(1) if shard.spec.identity else None  # identity rows
        routed = experts if kept is None else (experts < shard.total).nonzero().squeeze(1)
        slots = shard.slots(experts if kept is None else experts[routed])
        order = torch.argsort(slots, stable=True)  # rows grouped by slot, so by rank
        per_expert = torch.bincount(slots, minlength=shard.total)
        if kept is not None:
            order = routed[order]  # of the (T k) rows
        received = exchange_counts(per_expert, shard.ep, shard.group)  # (ep, local)
        send = per_expert.view(shard.ep, -1).sum(1).tolist()
        receive = received.sum(1).tolist()
        dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        rows = torch.cat([hidden_states[order // k].to(dtype), weights[order].to(dtype)], dim=1)
        got = exchange_rows(rows, send, receive, shard.group)  # (R, H + 1)
        local_ids = torch.repeat_interleave(
            torch.arange(shard.local, device=got.device).repeat(shard.ep), received.reshape(-1).to(got.device))
        out = self._own_experts(got[:, :hidden].to(hidden_states.dtype), local_ids.unsqueeze(1),
                                got[:, hidden:].to(top_k_weights.dtype), *args, **kwargs)
        back = exchange_rows(out, receive, send, shard.group)  # (routed rows, H), in `order`
        unsorted = back.new_empty(tokens * k, back.shape[-1]).index_copy(0, order, back)
        if kept is not None:  # an identity expert's output: the row itself, weighted
            unsorted = unsorted.index_copy(0, kept, (hidden_states[kept // k] * weights[kept]).to(back.dtype))
        return unsorted.view(tokens, k, back.shape[-1]).sum(dim=1).to(hidden_states.dtype)

    def _own_experts(self, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The family's forward over this rank's experts. With no row: zeros that still reach every parameter
        (a gradient of 0, as on one process, not missing) and the empty rows, so the backward runs the
        exchanges' backwards here as on the ranks that got rows."""
        if rows.shape[0]:  # the family's forward (the class after the mixin's), on this module or its cast stand-in
            own = super(ExpertParallelMixin, self._cast()).forward
            return own(rows, *paired_choices(self, ids, weights), *args, **kwargs)
        touch = (sum(p.sum() for p in self.parameters() if p.requires_grad) + rows.sum() + weights.sum()) * 0
        return rows.new_zeros(0, rows.shape[-1]) + touch
